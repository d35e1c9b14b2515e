"""`perfscope demo --quick` end to end: a real DDP job spawned at two world sizes and two batch sizes
writes a store that opens and answers queries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perfscope import open_store
from perfscope.demo import plan

pytest.importorskip("torch")


def test_demo_quick_writes_a_readable_store(tmp_path: Path) -> None:
    store = tmp_path / "demo store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "perfscope", "demo", str(store), "--quick"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"perfscope analyze {store}" in proc.stdout and f"perfscope dashboard {store}" in proc.stdout
    assert "run 4: world size 2, batch 32/rank" in proc.stderr  # the progress bar, on stderr
    quick = plan(quick=True)
    with open_store(store) as s:
        runs = s.query(
            "SELECT r.*, (SELECT count(*) FROM steps t WHERE t.run_id = r.run_id) AS step_rows, "
            "(SELECT count(*) FROM metrics m WHERE m.run_id = r.run_id AND m.name = 'loss') AS losses, "
            "(SELECT count(*) FROM comm c WHERE c.run_id = r.run_id) AS collectives "
            "FROM runs r ORDER BY batch_size_per_rank, world_size"
        ).to_pylist()
    assert [(r["world_size"], r["batch_size_per_rank"]) for r in runs] == [
        (w, b) for b in quick.batch_sizes for w in quick.world_sizes
    ]
    for r in runs:
        assert r["experiment"] == "demo-cpu" and r["backend"] == "gloo" and r["scaling_mode"] == "weak"
        assert f"({os.cpu_count()} cores)" in r["cluster"] and r["model"] == "demo-cnn"
        assert r["ended_ns"] is not None and r["flops_per_step"] > 0 and r["grad_bytes"] > 0
        assert r["global_batch_size"] == r["world_size"] * r["batch_size_per_rank"]
        assert r["step_rows"] == r["losses"] == r["world_size"] * quick.steps
        assert r["collectives"] >= r["step_rows"]  # DDP's buckets, also at world size 1
