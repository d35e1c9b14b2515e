"""Silently wrong data made loud (issue 10, item 7): two runs under one run id, and impossible step
durations, are data-quality findings; the impossible rows stay out of the statistics."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from storegen import MS, T0_NS, make_run

from perfscope import open_store
from perfscope.analysis import run_analysis


def _kinds(root: Path) -> dict[str, list[str]]:
    with open_store(root) as store:
        rows = run_analysis("quality", store).to_pylist()
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["kind"], []).append(r["run_id"])
    return out


def _summary(root: Path) -> dict[str, dict[str, object]]:
    with open_store(root) as store:
        return {r["run_id"]: r for r in run_analysis("run_summary", store).to_pylist()}


def test_negative_and_null_step_times_are_named_and_left_out(tmp_path: Path) -> None:
    make_run(tmp_path, "clean", steps=40)
    # one step's forward phase far below zero makes the step time negative; another has no step time
    make_run(
        tmp_path,
        "broken",
        steps=40,
        phase_fn=lambda r, s: {"forward": -1000 * MS} if s == 20 else {"forward": None} if s == 30 else {},
    )
    kinds = _kinds(tmp_path)
    assert kinds.get("impossible_durations") == ["broken"]
    summary = _summary(tmp_path)
    clean, broken = summary["clean"], summary["broken"]
    # the broken run's statistics are those of its valid steps: positive, and close to the clean run's
    for key in ("step_ns", "step_median_ns", "throughput_samples_per_s"):
        value, reference = broken[key], clean[key]
        assert isinstance(value, float | int) and isinstance(reference, float | int)
        assert value > 0 and value == pytest.approx(reference, rel=0.1)


def test_two_runs_under_one_run_id_are_named(tmp_path: Path) -> None:
    make_run(tmp_path, "a", steps=30)
    make_run(tmp_path, "b", steps=30, start_ns=T0_NS + 3600 * 10**9)
    assert "shared_run_id" not in _kinds(tmp_path)
    # the second run's files land in the first one's partitions, as two jobs given one id would write
    for part in tmp_path.glob("*/run_id=b"):
        dest = part.parent / "run_id=a"
        dest.mkdir(exist_ok=True)
        for f in part.glob("*.parquet"):
            shutil.move(f, dest / f"other-{f.name}")
        part.rmdir()
    assert _kinds(tmp_path).get("shared_run_id") == ["a"]
