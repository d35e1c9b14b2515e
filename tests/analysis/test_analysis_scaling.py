"""Scaling groups, speedup, efficiency, per-GPU speedup and lost time, checked by value."""

from __future__ import annotations

import pytest
from storegen import DEFAULT_PHASES, MS, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.analysis.groups import assign_groups
from perfscope.store.open import open_store


def _weak(tmp_path, sizes=(1, 2, 4, 8), **kw):
    for n in sizes:
        make_run(tmp_path, f"w{n}", world_size=n, phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS * n}, **kw)


def _rows(store, name="scaling", sel=None):
    return {r["run_id"]: r for r in run_analysis(name, store, sel).to_pylist()}


def test_weak_scaling_speedup_efficiency_and_lost_time(tmp_path):
    _weak(tmp_path)
    with open_store(tmp_path) as store:
        rows = _rows(store)
        lost = run_analysis("lost_time", store).to_pylist()
    assert {r["scaling_mode"] for r in rows.values()} == {"weak"}
    assert {r["baseline_world_size"] for r in rows.values()} == {1}
    # T(N) = 33 ms + 2 ms·N, T(1) = 35 ms; weak scaling: S(N) = N·T(1)/T(N)
    for n, t_ms in ((1, 35), (2, 37), (4, 41), (8, 49)):
        r = rows[f"w{n}"]
        assert r["step_ns"] == pytest.approx(t_ms * MS)
        assert r["speedup"] == pytest.approx(n * 35 / t_ms)
        assert r["efficiency"] == pytest.approx(35 / t_ms)
        assert r["per_gpu_speedup"] == pytest.approx(35 / t_ms)
        assert r["ideal_speedup"] == n
        # lost = N·T(N) − N0·T(N0)·G(N)/G(N0) = N·(T(N) − T(1)), all of it exposed sync
        assert r["lost_ns"] == pytest.approx(n * (t_ms - 35) * MS)
        assert r["lost_sync_exposed_ns"] == pytest.approx(n * (t_ms - 35) * MS)
        assert r["lost_forward_ns"] == pytest.approx(0, abs=1)
    w8 = [x for x in lost if x["run_id"] == "w8"]
    assert sum(x["lost_ns"] for x in w8) == pytest.approx(112 * MS)
    assert next(x for x in w8 if x["phase"] == "sync_exposed")["share_of_lost"] == pytest.approx(1.0)


def test_strong_scaling_inferred_from_fixed_global_batch(tmp_path):
    for n in (1, 2, 4):
        phases = {
            **DEFAULT_PHASES,
            "forward": 40 * MS / n,
            "backward": 80 * MS / n,
            "sync_exposed": 5 * MS if n > 1 else 0,
        }
        make_run(tmp_path, f"s{n}", world_size=n, batch_size_per_rank=256 // n, phases=phases)
    with open_store(tmp_path) as store:
        rows = _rows(store)
    assert {r["scaling_mode"] for r in rows.values()} == {"strong"}
    assert rows["s4"]["group_id"].endswith("/strong:g256")
    # T(1) = 123 ms, T(4) = 38 ms, same global batch: S = 123/38, E = S/4, lost = 4·38 − 123 ms
    assert rows["s4"]["speedup"] == pytest.approx(123 / 38)
    assert rows["s4"]["efficiency"] == pytest.approx(123 / 38 / 4)
    assert rows["s4"]["lost_ns"] == pytest.approx((4 * 38 - 123) * MS)
    assert rows["s2"]["lost_ns"] == pytest.approx((2 * 68 - 123) * MS)


def test_groups_split_by_cluster_backend_and_batch(tmp_path):
    _weak(tmp_path, sizes=(1, 2))
    make_run(tmp_path, "mpi1", world_size=1, backend="mpi")
    make_run(tmp_path, "mpi2", world_size=2, backend="mpi", phases={**DEFAULT_PHASES, "sync_exposed": 9 * MS})
    make_run(tmp_path, "b64", world_size=1, batch_size_per_rank=64)
    with open_store(tmp_path) as store:
        rows = _rows(store)
    assert rows["mpi2"]["baseline_run_id"] == "mpi1"
    assert rows["w2"]["baseline_run_id"] == "w1"
    assert rows["mpi2"]["efficiency"] == pytest.approx(35 / 42)
    assert rows["b64"]["scaling_mode"] == "single"


def test_repeated_baseline_runs_use_their_median(tmp_path):
    make_run(tmp_path, "a", world_size=1, phases={**DEFAULT_PHASES, "forward": 9 * MS})
    make_run(tmp_path, "b", world_size=1, phases={**DEFAULT_PHASES, "forward": 11 * MS})
    make_run(tmp_path, "c", world_size=2)
    with open_store(tmp_path) as store:
        rows = _rows(store)
    assert rows["c"]["baseline_run_id"] == "a,b"
    assert rows["c"]["speedup"] == pytest.approx(2.0)


def _declared(modes: dict[int, str]) -> list[dict[str, object]]:
    """Runs of one weak series (per-rank batch 32) with the scaling mode each declares."""
    return [
        {"run_id": f"r{n}", "experiment": "e", "cluster": "c", "backend": "nccl", "model": "m",
         "world_size": n, "batch_size_per_rank": 32, "global_batch_size": 32 * n,
         "scaling_mode_declared": mode}
        for n, mode in modes.items()
    ]  # fmt: skip


def test_mixed_declared_modes_are_flagged_not_silently_compared():
    groups = {m.run_id: m for m in assign_groups(_declared({1: "weak", 2: "strong", 4: "weak"}))}
    # r2 says strong but shares the per-rank batch of the weak series: one group, flagged
    assert {m.group_id for m in groups.values()} == {"e/c/nccl/m/weak:b32"}
    assert all(m.mixed for m in groups.values())
    assert "different scaling modes" in groups["r1"].mode_note


def test_declared_mode_contradicted_by_batches_is_mixed():
    # every run says "strong", but the per-rank batch is what stays fixed
    ms = assign_groups(_declared({1: "strong", 2: "strong", 4: "strong"}))
    assert {m.group_id for m in ms} == {"e/c/nccl/m/weak:b32"}
    assert all(m.mixed and "declares strong" in m.mode_note for m in ms)


def test_backend_compare_names_the_faster_backend(tmp_path):
    for n in (1, 2):
        make_run(
            tmp_path, f"n{n}", world_size=n, backend="nccl", phases={**DEFAULT_PHASES, "sync_exposed": 4 * MS}
        )
        make_run(
            tmp_path, f"m{n}", world_size=n, backend="mpi", phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS}
        )
    with open_store(tmp_path) as store:
        rows = run_analysis("backend_compare", store).to_pylist()
    at2 = [r for r in rows if r["world_size"] == 2]
    assert {r["best_backend"] for r in at2} == {"mpi"}
    assert next(r for r in at2 if r["backend"] == "nccl")["ratio_to_best"] == pytest.approx(37 / 35)


def test_selection_by_cluster_only_compares_within_it(tmp_path):
    _weak(tmp_path, sizes=(1, 2), cluster="a")
    make_run(tmp_path, "other", world_size=1, cluster="b")
    with open_store(tmp_path) as store:
        rows = _rows(store, sel=Selection(clusters=("a",)))
    assert set(rows) == {"w1", "w2"}
