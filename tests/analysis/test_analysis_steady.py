"""Steady state, step time (max over ranks), the additive phase breakdown and per-rank numbers."""

from __future__ import annotations

import pytest
from storegen import MS, T0_NS, make_run, row

from perfscope.analysis import Selection, run_analysis
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter


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


# ---- elapsed time is the window's wall clock (issue 21): ranks' step boundaries are not aligned


def unaligned_run(root, run_id, step_ms, *, steps=40, world_size=2, shift_ns=None, start_ns=True):
    """A run whose ranks each run their steps back to back on their own timeline: rank r's step k
    takes step_ms(r, k) ms and starts where its previous step ended (plus shift_ns(r) on its clock).
    Returns {rank: (start of step 10, end of the last step)} on the store's clock."""
    make_run(root, run_id, world_size=world_size, steps=0, batch_size_per_rank=32)
    rows, bounds = [], {}
    for r in range(world_size):
        t = T0_NS + (shift_ns(r) if shift_ns else 0)
        for k in range(steps):
            d = int(step_ms(r, k) * MS)
            if k == 10:
                bounds[r] = [t, None]
            rows.append(row("steps", rank=r, step=k, start_ns=t if start_ns else None, step_ns=d,
                            forward_ns=d // 2, backward_ns=d - d // 2, samples=32, clock="host"))  # fmt: skip
            t += d
        bounds[r][1] = t
    with StoreWriter(root, run_id, writer_id=f"unaligned-{run_id}") as w:
        w.extend("steps", rows)
    return bounds


def alternating(rank: int, step: int) -> float:
    """Each rank alternates 30 and 20 ms steps, out of phase: every step's slowest rank takes 30 ms,
    while both ranks cover the window at 25 ms a step."""
    return 30.0 if (rank + step) % 2 == 0 else 20.0


def test_step_time_is_the_windows_wall_clock_not_a_sum_of_per_step_maxima(tmp_path):
    bounds = unaligned_run(tmp_path, "alt", alternating)
    with open_store(tmp_path) as store:
        r = _by_run(store, "run_summary")["alt"]
    elapsed = max(e for _, e in bounds.values()) - min(s for s, _ in bounds.values())
    assert r["steady_steps"] == 30
    assert (r["elapsed_source"], r["elapsed_s"]) == ("wall_clock", pytest.approx(elapsed / 1e9, rel=1e-9))
    assert r["step_ns"] == pytest.approx(elapsed / 30, rel=1e-9)
    assert r["step_ns"] == pytest.approx(25 * MS, rel=1e-9)  # not 30 ms, the sum of maxima's mean
    assert r["throughput_samples_per_s"] == pytest.approx(64 * 30 / (elapsed / 1e9), rel=1e-9)
    # the spread statistics still describe the per-step slowest rank
    assert r["step_median_ns"] == pytest.approx(30 * MS)
    # each rank's own steps fill the window: nothing is imbalance, and the phases add up to T
    assert r["imbalance_ns"] == pytest.approx(0, abs=1)
    total = sum(r[f"{p}_ns"] for p in ("data", "forward", "backward", "sync_exposed", "optimizer", "other"))
    assert total + r["imbalance_ns"] == pytest.approx(r["step_ns"], rel=1e-9)


def test_a_rank_that_starts_later_widens_the_window_by_its_lag(tmp_path):
    """Rank 1 runs the same steps 7 ms behind rank 0: the window runs from rank 0's start to rank
    1's end, and the lag shows as imbalance (time the mean rank's steps do not cover)."""
    bounds = unaligned_run(tmp_path, "lag", lambda r, k: 25.0, shift_ns=lambda r: r * 7 * MS)
    with open_store(tmp_path) as store:
        r = _by_run(store, "run_summary")["lag"]
    assert bounds[1][1] - bounds[0][0] == 30 * 25 * MS + 7 * MS
    assert r["step_ns"] == pytest.approx((30 * 25 + 7) / 30 * MS, rel=1e-9)
    assert r["imbalance_ns"] == pytest.approx(7 / 30 * MS, rel=1e-6)


def test_without_start_times_or_with_disagreeing_clocks_the_sum_of_maxima_stands_in(tmp_path):
    """No start times, or rank 1's clock 10 s off (a window longer than the steps could take on one
    clock): the elapsed time falls back to the sum of the slowest rank per step, and says so."""
    unaligned_run(tmp_path, "nots", alternating, start_ns=False)
    unaligned_run(tmp_path, "skew", alternating, shift_ns=lambda r: r * 10_000 * MS)
    unaligned_run(tmp_path, "ok", alternating)
    with open_store(tmp_path) as store:
        rows = _by_run(store, "run_summary")
    assert rows["nots"]["elapsed_source"] == "sum_no_timestamps"
    assert rows["skew"]["elapsed_source"] == "sum_clocks_disagree"
    assert rows["ok"]["elapsed_source"] == "wall_clock"
    assert rows["nots"]["step_ns"] == pytest.approx(30 * MS) and rows["skew"]["step_ns"] == pytest.approx(
        30 * MS
    )
    assert rows["ok"]["step_ns"] == pytest.approx(25 * MS)


def test_pop_divides_by_the_step_time_not_the_mean_per_step_maximum(tmp_path):
    """Both ranks compute their whole window (25 ms a step on average): communication efficiency
    max(useful)/T is 1, not 25/30 (which a mean of per-step maxima made a false 'comm' loss)."""
    unaligned_run(tmp_path, "alt", alternating)
    with open_store(tmp_path) as store:
        (p,) = run_analysis("pop", store, Selection()).to_pylist()
    assert p["step_mean_ns"] == pytest.approx(25 * MS)
    assert p["load_balance"] == pytest.approx(1.0)
    assert p["comm_efficiency"] == pytest.approx(1.0)
