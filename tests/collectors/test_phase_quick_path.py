"""The hot path's one comparison (Timeline.deadline) stands for four checks: recording, host timing
without NVTX, a step open, not past the long-step warning. Each case where one of them fails takes
the slow path and records the same rows."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

import perfscope
from perfscope.store.open import open_store


def _record(store: Path, *, slow: bool, nested: bool = True) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = perfscope.profile(store, experiment="quick", batch_size=4, poll_hz=0)
        early = prof.phase("forward")  # made before the profile records
        with prof:
            tl = prof._timeline
            if slow:  # as under NVTX or CUDA timing: every phase through Timeline.enter/exit
                tl.quick = False
                tl.refresh_deadline()
            for i, _ in enumerate(prof.steps(range(20))):
                with early:
                    if nested:
                        with prof.phase("attention"):
                            pass
                with prof.phase("backward"):
                    pass
                prof.log(loss=1.0 / (i + 1), tokens=i)
            run_id = prof.run_id
        assert run_id is not None
        # closed: the same phase objects record nothing and never raise
        with early, prof.phase("backward"):
            pass
        prof.log(loss=0.0)
        return run_id


def _rows(store: Path, run_id: str) -> dict[str, list[Any]]:
    s = open_store(store)
    q = {
        "steps": "SELECT step, samples, forward_ns > 0 AS f, backward_ns > 0 AS b, data_ns >= 0 AS d "
        "FROM steps WHERE run_id = $1 ORDER BY step",
        "spans": "SELECT step, name, parent, depth FROM spans WHERE run_id = $1 "
        "ORDER BY step, start_ns, depth",
        "metrics": "SELECT step, name, value FROM metrics WHERE run_id = $1 ORDER BY step, name",
    }
    return {k: s.query(sql, [run_id]).to_pylist() for k, sql in q.items()}


def test_the_quick_path_records_what_the_slow_path_does(tmp_path: Path) -> None:
    quick = _rows(tmp_path / "q", _record(tmp_path / "q", slow=False))
    slow = _rows(tmp_path / "s", _record(tmp_path / "s", slow=True))
    assert quick == slow
    assert len(quick["steps"]) == 20 and all(r["f"] and r["b"] and r["samples"] == 4 for r in quick["steps"])
    # a phase made before the start records once the profile does; nested spans keep their parent
    names = {(r["name"], r["parent"], r["depth"]) for r in quick["spans"]}
    assert {
        ("forward", None, 0),
        ("attention", "forward", 1),
        ("backward", None, 0),
        ("data", None, 0),
    } <= names
    assert len(quick["metrics"]) == 40


@pytest.mark.parametrize("what", ["close", "error"])
def test_no_phase_records_once_recording_stopped(
    tmp_path: Path, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("perfscope.errors._seen", set())  # its one warning is not the next test's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with perfscope.profile(tmp_path, experiment="quick", batch_size=4, poll_hz=0) as prof:
            tl = prof._timeline
            fwd = prof.phase("forward")
            with fwd:
                pass
            prof.step()
            with fwd:
                pass
            prof.step()
            assert tl.deadline >= 0
            if what == "error":
                prof._internal_error(RuntimeError("a bug of ours"))
            else:
                prof.close()
            assert tl.deadline == -1
            spans = list(tl.cur.spans) if tl.cur is not None else []
            held = tl.held_steps()
            for _ in range(3):
                with fwd:
                    pass
                prof.log(loss=1.0)
            assert (list(tl.cur.spans) if tl.cur is not None else []) == spans
            assert tl.held_steps() == held
