"""A run id longer than a file name may be (issue 33, item 11): 250 characters were accepted at
start, then every segment write failed ("File name too long") with a warning about free space, and
`info` said the store held no data. Now it is refused where the run starts: `perfscope run` (its
--run-id, or PERFSCOPE_RUN_ID the job would read) exits 2 in one line before the job runs;
profile() says so in one warning and the training loop goes on unrecorded."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import perfscope
from perfscope import PerfscopeWarning
from perfscope.store.schema import MAX_RUN_ID_BYTES, run_id_size_problem
from perfscope.store.writer import StoreWriter

LONG = "c" * 250


def test_the_bound_is_in_bytes() -> None:
    assert run_id_size_problem("c" * MAX_RUN_ID_BYTES) == ""
    assert "201 bytes long" in run_id_size_problem("c" * 199 + "é")  # 200 characters, 201 bytes
    with pytest.raises(ValueError, match="250 bytes long"):
        StoreWriter("unused", LONG)


def test_profile_refuses_it_at_start_and_the_loop_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "store"
    done = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(root, poll_hz=0, run_id=LONG) as prof:
            for _ in prof.steps(range(5)):
                done += 1
    texts = [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]
    assert len(texts) == 1 and "250 bytes long" in texts[0] and "at most 200 bytes" in texts[0], texts
    assert "\n" not in texts[0] and "free space" not in texts[0].lower()
    assert done == 5 and not prof.recording
    assert not list(root.glob("*/run_id=*"))  # nothing half-written


@pytest.mark.parametrize("how", ["flag", "env"])
def test_perfscope_run_refuses_it_before_the_job_starts(tmp_path: Path, how: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PERFSCOPE_RUN_ID"}
    args = ["--run-id", LONG] if how == "flag" else []
    if how == "env":
        env["PERFSCOPE_RUN_ID"] = LONG
    res = subprocess.run(
        [sys.executable, "-m", "perfscope", "run", "--store", "S", *args, "--", "touch", "started"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    flag = "--run-id" if how == "flag" else "PERFSCOPE_RUN_ID"
    assert lines[0].startswith(f"perfscope run: error: {flag}: run id ") and "250 bytes long" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no job ran, no store folder was made
