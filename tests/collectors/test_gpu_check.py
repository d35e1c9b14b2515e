"""benchmarks/gpu_check.py, the check made for the first GPU: here (no GPU) it says so, skips every
check and still writes valid JSON; its parts that need no GPU (the NVTX reader over a real SQLite
file, the job's source, the verdict when torch cannot use a GPU that is there) are checked too."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_every_check_is_skipped_and_said(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hides a GPU where there is one
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU: every check skipped" in out.stderr
    summary = json.loads(out.stdout)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] == "skipped" and summary["gpu"] is None
    names = [c["name"] for c in summary["checks"]]
    assert names == [
        "pytest-gpu",
        "kineto-vs-perfscope",
        "cuda-events-vs-host",
        "nvml",
        "device-memory",
        "nvtx-nsys",
    ]
    assert all(c["verdict"] == "skipped" and "no CUDA GPU" in c["detail"] for c in summary["checks"])
    # a plain verdict per check on the terminal
    assert sum(line.startswith("SKIPPED ") for line in out.stderr.splitlines()) == len(names)


def test_a_gpu_torch_cannot_use_fails_the_check_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    gc = _module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # GPU/NVML: the one fake allowed
    monkeypatch.setattr(gc, "gpu_seen", lambda: "NVIDIA H100 80GB HBM3")
    assert gc.main([]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["verdict"] == "fail" and summary["gpu"] == "NVIDIA H100 80GB HBM3"
    assert "install a CUDA build of torch" in captured.err
    assert all(c["verdict"] == "skipped" for c in summary["checks"])


def test_the_training_job_is_valid_python() -> None:
    gc = _module()
    compile(gc.job_source(), "job.py", "exec")  # never run here: at least it parses


def _nsys_export(path: Path) -> None:
    """A minimal Nsight Systems SQLite export: the tables and columns the check reads."""
    con = sqlite3.connect(path)
    con.executescript(
        """
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT,
                                  globalTid INTEGER, domainId INTEGER, textId INTEGER);
        """
    )
    pid_a, pid_b = 100 << 24, 200 << 24
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "forward"), (2, "backward")])
    rows = [
        (0, None, 75, "perfscope", pid_a + 1, 1, None),  # domain 1 of process 100 is perfscope
        (0, None, 75, "other", pid_b + 1, 1, None),  # domain 1 of process 200 is another one
        (1, 5, 60, "step", pid_a + 2, 1, None),  # start-end range, its text inline
        (1, 2, 59, None, pid_a + 1, 1, 1),  # push-pop range, a registered string
        (2, 3, 59, None, pid_a + 1, 1, 2),
        (1, 3, 59, "optimizer", pid_b + 1, 1, None),  # same domain id, other process: not perfscope
    ]
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()


def test_nvtx_ranges_are_read_per_process_domain(tmp_path: Path) -> None:
    gc = _module()
    export = tmp_path / "trace.sqlite"
    _nsys_export(export)
    domains, names = gc.nvtx_names(export)
    assert domains == {"perfscope", "other"}
    assert names == {"step", "forward", "backward"}  # "optimizer" is the other domain's


def test_agreement_is_relative_with_a_floor() -> None:
    gc = _module()
    assert gc.agree(104.9, 100.0, 0) and not gc.agree(105.1, 100.0, 0)
    assert gc.agree(40_000, 0, gc.NCCL_FLOOR_NS)  # one rank's NCCL: microseconds, both near 0
    assert not gc.agree(10_000_000, 9_000_000, gc.PHASE_FLOOR_NS)


def test_the_summary_stays_strict_json() -> None:
    gc = _module()
    figures = {"worst": gc.rel(5.0, 0.0), "nested": [float("nan"), 1.5, {"x": float("-inf")}]}
    assert json.loads(json.dumps(gc.finite(figures), allow_nan=False)) == {
        "worst": None,
        "nested": [None, 1.5, {"x": None}],
    }
