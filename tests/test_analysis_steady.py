"""Steady state, step time (max over ranks), the additive phase breakdown and per-rank numbers."""

from __future__ import annotations

import pytest
from storegen import MS, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.store import open_store


def _slow_warmup(rank: int, step: int) -> dict[str, float]:
    return {"forward": 50 * MS} if step < 10 else {}


@pytest.fixture
def store_path(tmp_path):
    make_run(tmp_path, "r40", world_size=1, steps=40, phase_fn=_slow_warmup)
    make_run(tmp_path, "r400", world_size=1, steps=400, phase_fn=_slow_warmup)
    make_run(tmp_path, "r8", world_size=1, steps=8)
    make_run(
        tmp_path,
        "r2",
        world_size=2,
        steps=40,
        phase_fn=lambda rank, step: {"forward": 12 * MS} if rank == 1 else {},
    )
    return tmp_path


def _by_run(store, name, sel=None):
    return {r["run_id"]: r for r in run_analysis(name, store, sel).to_pylist()}


def test_warmup_drops_max_of_10_and_5_percent(store_path):
    with open_store(store_path) as store:
        runs = _by_run(store, "run_summary")
    assert (runs["r40"]["warmup_steps"], runs["r40"]["steady_steps"]) == (10, 30)
    assert (runs["r400"]["warmup_steps"], runs["r400"]["steady_steps"]) == (20, 380)
    # the slow warm-up steps (50 ms forward) are gone: the steady median is the 35 ms step
    assert runs["r40"]["step_ns"] == pytest.approx(35 * MS)
    assert runs["r400"]["step_ns"] == pytest.approx(35 * MS)


def test_short_run_falls_back_to_dropping_half_and_says_so(store_path):
    with open_store(store_path) as store:
        runs = _by_run(store, "run_summary")
        quality = run_analysis("quality", store).to_pylist()
    assert (runs["r8"]["warmup_steps"], runs["r8"]["steady_steps"]) == (4, 4)
    assert any(q["kind"] == "few_steady_steps" and q["run_id"] == "r8" for q in quality)


def test_warmup_override_keeps_every_step(store_path):
    with open_store(store_path) as store:
        runs = _by_run(store, "run_summary", Selection(run_ids=("r40",), warmup_steps=0))
    assert list(runs) == ["r40"]
    assert runs["r40"]["steady_steps"] == 40
    # 10 of 40 steps are 75 ms: the p90 sees them, the median does not
    assert runs["r40"]["step_p90_ns"] == pytest.approx(75 * MS)
    assert runs["r40"]["step_median_ns"] == pytest.approx(35 * MS)
    # step time is elapsed time per step: the slow steps count in full
    assert runs["r40"]["step_ns"] == pytest.approx((30 * 35 + 10 * 75) / 40 * MS)


def test_step_time_is_the_slowest_rank_and_phases_add_up(store_path):
    with open_store(store_path) as store:
        r = _by_run(store, "run_summary")["r2"]
        phases = [p for p in run_analysis("phase_breakdown", store).to_pylist() if p["run_id"] == "r2"]
        ranks = [x for x in run_analysis("rank_breakdown", store).to_pylist() if x["run_id"] == "r2"]
    assert r["step_ns"] == pytest.approx(37 * MS)  # rank 1: 35 ms + 2 ms more forward
    assert r["forward_ns"] == pytest.approx(11 * MS)  # mean over ranks
    assert r["imbalance_ns"] == pytest.approx(1 * MS)  # max - mean step time
    total = sum(
        r[f"{p}_ns"]
        for p in ("data", "forward", "backward", "sync_exposed", "optimizer", "other", "imbalance")
    )
    assert total == pytest.approx(r["step_ns"])
    assert sum(p["share"] for p in phases) == pytest.approx(1.0)
    assert r["samples_per_step"] == 64
    assert r["throughput_samples_per_s"] == pytest.approx(64 / 0.037)
    assert [x["useful_ns"] for x in ranks] == pytest.approx([31 * MS, 33 * MS])
    assert [x["step_ns"] for x in ranks] == pytest.approx([35 * MS, 37 * MS])


def test_step_series_marks_warmup_and_covers_every_rank(store_path):
    with open_store(store_path) as store:
        rows = run_analysis("step_series", store, Selection(run_ids=("r2",))).to_pylist()
    assert len(rows) == 80
    assert sum(not r["steady"] for r in rows) == 20
    assert {r["rank"] for r in rows} == {0, 1}


def test_selection_filters_by_source_and_experiment(tmp_path):
    make_run(tmp_path, "m", experiment="a")
    make_run(tmp_path, "s", experiment="b", source="simulated")
    with open_store(tmp_path) as store:
        assert set(_by_run(store, "run_summary", Selection(source="simulated"))) == {"s"}
        assert set(_by_run(store, "run_summary", Selection(experiments="a"))) == {"m"}
        assert _by_run(store, "run_summary")["s"]["source"] == "simulated"
