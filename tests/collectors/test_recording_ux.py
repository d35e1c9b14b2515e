"""Recording as a new user writes it: `with prof.step():`, a forgotten prof.step(), one clean warning."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import perfscope
from perfscope.collectors import profiler
from perfscope.errors import PerfscopeWarning
from perfscope.store.open import open_store

ROOT = Path(__file__).resolve().parents[2]
GAP_S = 0.02


def _steps(store: Path) -> list[dict[str, object]]:
    with open_store(store) as st:
        return st.query("SELECT step, step_ns, forward_ns, data_ns FROM steps ORDER BY step").to_pylist()


def test_with_step_block_makes_each_block_one_step(tmp_path: Path) -> None:
    with perfscope.profile(tmp_path, poll_hz=0, batch_size=8) as prof:
        time.sleep(GAP_S)  # before the loop: no step
        for _ in range(4):
            with prof.step(), prof.phase("forward"):
                time.sleep(0.002)
            time.sleep(GAP_S)  # waiting for the next batch: counts in the next step
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(int(s["forward_ns"]) >= 2_000_000 for s in steps)  # type: ignore[call-overload]
    assert int(steps[0]["step_ns"]) < GAP_S * 1e9  # type: ignore[call-overload]
    assert all(int(s["step_ns"]) >= GAP_S * 1e9 for s in steps[1:])  # type: ignore[call-overload]


def test_an_exception_in_a_step_block_fails_that_step_only(tmp_path: Path) -> None:
    with pytest.raises(KeyError), perfscope.profile(tmp_path, poll_hz=0) as prof:
        for i in range(3):
            with prof.step(), prof.phase("forward"):
                if i == 2:
                    raise KeyError("user bug")
    assert [s["step"] for s in _steps(tmp_path)] == [0, 1]
    with open_store(tmp_path) as st:
        errs = st.query("SELECT step, error FROM spans WHERE error IS NOT NULL").to_pylist()
    assert errs == [{"step": 2, "error": "KeyError"}]


def test_plain_step_calls_end_a_step_each(tmp_path: Path) -> None:
    with perfscope.profile(tmp_path, poll_hz=0) as prof:
        for _ in range(3):
            with prof.phase("forward"):
                pass
            assert prof.step() is not None  # returns the block object, usable or ignorable
    assert [s["step"] for s in _steps(tmp_path)] == [0, 1, 2]


def test_forgotten_step_warns_once_while_the_job_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(profiler, "NO_STEP_WARN_S", 0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(tmp_path, poll_hz=0) as prof:
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:  # phases, never a step
                with prof.phase("forward"):
                    time.sleep(0.005)
            assert prof.recording  # a warning, never an exception or a stop
            warned_before_close = [w for w in caught if "without a step ending" in str(w.message)]
    assert len(warned_before_close) == 1
    assert issubclass(warned_before_close[0].category, PerfscopeWarning)
    assert "prof.step()" in str(warned_before_close[0].message)
    with open_store(tmp_path, allow_empty=True) as st:
        kinds = st.query("SELECT kind FROM events").column(0).to_pylist()
    assert kinds.count("no_step") == 1


def test_a_long_step_in_prof_steps_is_no_forgotten_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(profiler, "NO_STEP_WARN_S", 0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(tmp_path, poll_hz=0) as prof:
            for _ in prof.steps(range(2)):
                for _ in range(3):
                    with prof.phase("forward"):
                        time.sleep(0.01)
    assert not [w for w in caught if "without a step ending" in str(w.message)]
    assert [s["step"] for s in _steps(tmp_path)] == [0, 1]


def test_nvml_missing_is_one_clean_line_on_stderr() -> None:
    """The warning a CPU machine prints at start: one line, no source line of perfscope under it."""
    script = (
        "import sys, warnings\n"
        "from perfscope.collectors.faults import Faults\n"
        "from perfscope.collectors.nvml import open_gpus\n"
        "sys.modules['pynvml'] = None  # NVML absent, as on this CPU machine\n"
        "open_gpus(Faults(0))\n"
        "open_gpus(Faults(1))  # a second run in the process: shown once\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "NVML is not available" in lines[0] and "faults.report" not in done.stderr


def test_plain_step_calls_with_nothing_recorded_still_end_steps(tmp_path: Path) -> None:
    """Steps whose phases were not recorded (a loop without phases) are steps all the same."""
    with perfscope.profile(tmp_path, poll_hz=0) as prof:
        for i in range(3):
            time.sleep(GAP_S)
            if i == 1:
                with prof.phase("forward"):
                    pass
            prof.step()
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(int(s["step_ns"]) >= GAP_S * 1e9 for s in steps)  # type: ignore[call-overload]
    assert int(steps[1]["forward_ns"]) > 0 and int(steps[0]["forward_ns"]) == 0  # type: ignore[call-overload]
