"""POP efficiencies and stragglers (wait at collective) by value on 1- and 4-rank runs."""

from __future__ import annotations

import pytest
from storegen import MS, Comm, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.store.open import open_store


def test_pop_metrics_by_value(tmp_path):
    make_run(tmp_path, "n1", world_size=1)
    make_run(tmp_path, "n4", world_size=4, phase_fn=lambda r, s: {"forward": 14 * MS} if r == 3 else {})
    with open_store(tmp_path) as store:
        pop = {r["run_id"]: r for r in run_analysis("pop", store).to_pylist()}
    p = pop["n4"]
    # useful = forward + backward + optimizer: 31, 31, 31, 35 ms; the slowest rank's step is 39 ms
    assert p["useful_mean_ns"] == pytest.approx(32 * MS)
    assert p["useful_max_ns"] == pytest.approx(35 * MS)
    assert p["load_balance"] == pytest.approx(32 / 35)
    assert p["comm_efficiency"] == pytest.approx(35 / 39)
    assert p["parallel_efficiency"] == pytest.approx(32 / 39)
    # per sample: 31 ms / 32 samples at N=1 against 128 ms / 128 samples at N=4
    assert p["computation_scaling"] == pytest.approx(31 / 32)
    assert p["global_efficiency"] == pytest.approx(32 / 39 * 31 / 32)
    assert pop["n1"]["load_balance"] == pytest.approx(1.0)
    assert pop["n1"]["computation_scaling"] == pytest.approx(1.0)


def test_straggler_ranking_from_comm_entries(tmp_path):
    make_run(
        tmp_path,
        "late2",
        world_size=4,
        comm=Comm([2**20, 2**21], lambda nb: 1e6, delay_ns=lambda r, s: 3e6 if r == 2 else 0),
    )
    make_run(
        tmp_path,
        "fair",
        world_size=4,
        comm=Comm([2**20], lambda nb: 1e6, delay_ns=lambda r, s: 1e6 if r == s % 4 else 0),
    )
    with open_store(tmp_path) as store:
        rows = run_analysis("stragglers", store).to_pylist()
        heat = run_analysis("collective_wait", store, Selection(run_ids=("late2",))).to_pylist()
    late = {r["rank"]: r for r in rows if r["run_id"] == "late2"}
    assert late[2]["last_share"] == 1.0 and late[2]["is_straggler"]
    assert late[2]["last_count"] == 60  # 30 steady steps x 2 buckets
    assert late[2]["wait_mean_ns"] == pytest.approx(0)
    for r in (0, 1, 3):
        assert not late[r]["is_straggler"]
        assert late[r]["wait_mean_ns"] == pytest.approx(3e6)
        assert late[r]["wait_per_step_ns"] == pytest.approx(6e6)
        assert late[r]["wait_share_of_step"] == pytest.approx(6 / 35)
    fair = [r for r in rows if r["run_id"] == "fair"]
    assert not any(r["is_straggler"] for r in fair)
    assert sorted(r["last_share"] for r in fair) == pytest.approx([7 / 30, 7 / 30, 8 / 30, 8 / 30])
    assert {h["rank"] for h in heat} == {0, 1, 2, 3}
    assert all(h["wait_ns"] == pytest.approx(0 if h["rank"] == 2 else 6e6) for h in heat)


def test_straggler_without_comm_rows_uses_exposed_sync(tmp_path):
    # the rank that waited least in the sync entered it last
    make_run(
        tmp_path,
        "h2",
        world_size=2,
        backend="horovod-mpi",
        phase_fn=lambda r, s: (
            {"forward": 13 * MS, "sync_exposed": 1 * MS} if r == 1 else {"sync_exposed": 4 * MS}
        ),
    )
    with open_store(tmp_path) as store:
        rows = {r["rank"]: r for r in run_analysis("stragglers", store).to_pylist()}
    assert rows[1]["is_straggler"] and rows[1]["last_share"] == 1.0
    assert rows[0]["wait_per_step_ns"] == pytest.approx(3 * MS)
    assert rows[0]["wait_source"] == "steps.sync_exposed_ns"
