"""Gradient sync: exposed vs total, bus bandwidth by value, alpha-beta fit recovering α and β."""

from __future__ import annotations

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run

from perfscope.analysis import run_analysis
from perfscope.store.open import open_store

ALPHA_INTRA, BETA_INTRA = 5e-6, 1 / 10e9
ALPHA_INTER, BETA_INTER = 20e-6, 1 / 2e9


def _ring_ns(p: int, nbytes: int, alpha: float, beta: float) -> float:
    return 1e9 * (2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta)


def _ring_run(root, n, gpn=8, buckets=(1 << 20, 1 << 22, 1 << 24)):
    a, b = (ALPHA_INTRA, BETA_INTRA) if n <= gpn else (ALPHA_INTER, BETA_INTER)
    make_run(
        root,
        f"r{n}",
        world_size=n,
        gpus_per_node=gpn,
        comm=Comm(list(buckets), lambda nb: _ring_ns(n, nb, a, b)),
    )


def test_busbw_from_comm_rows(tmp_path):
    make_run(tmp_path, "r4", world_size=4, comm=Comm([4 * 2**20], lambda nb: 1e6))
    with open_store(tmp_path) as store:
        s = run_analysis("sync", store).to_pylist()[0]
        c = run_analysis("collectives", store).to_pylist()[0]
    # algbw = bytes/t = 4 MiB / 1 ms; busbw = algbw·2(n−1)/n
    assert s["algbw_gb_per_s"] == pytest.approx(4 * 2**20 / 1e-3 / 1e9)
    assert s["busbw_gb_per_s"] == pytest.approx(4 * 2**20 / 1e-3 / 1e9 * 2 * 3 / 4)
    assert s["bw_source"] == "comm"
    assert s["scope"] == "intra-node"
    assert s["comm_count"] == 1
    assert s["bytes_per_step"] == 4 * 2**20
    assert c["transfer_ns"] == pytest.approx(1e6)
    assert c["busbw_gb_per_s"] == pytest.approx(s["busbw_gb_per_s"])


def test_waiting_for_a_late_rank_is_not_transfer_time(tmp_path):
    make_run(
        tmp_path,
        "r2",
        world_size=2,
        comm=Comm([2**20], lambda nb: 1e6, delay_ns=lambda r, s: 5e6 if r == 1 else 0),
    )
    with open_store(tmp_path) as store:
        c = run_analysis("collectives", store).to_pylist()[0]
        s = run_analysis("sync", store).to_pylist()[0]
    assert c["transfer_ns"] == pytest.approx(1e6)
    # rank 0 waits 5 ms in the collective: total comm per step is the mean over ranks of 6 and 1 ms
    assert s["comm_total_ns"] == pytest.approx(3.5e6)
    # exposed 2 ms of 3.5 ms total: 43% overlapped
    assert s["overlap_share"] == pytest.approx(1 - 2 / 3.5)


def test_alpha_beta_fit_recovers_intra_and_inter_node_parameters(tmp_path):
    for n in (2, 4, 8, 16, 32):
        _ring_run(tmp_path, n)
    with open_store(tmp_path) as store:
        fits = {r["scope"]: r for r in run_analysis("allreduce_fit", store).to_pylist()}
    intra, inter = fits["intra-node"], fits["inter-node"]
    assert intra["alpha_s"] == pytest.approx(ALPHA_INTRA, rel=1e-3)
    assert intra["beta_s_per_byte"] == pytest.approx(BETA_INTRA, rel=1e-3)
    assert intra["bandwidth_gb_per_s"] == pytest.approx(10.0, rel=1e-3)
    assert inter["alpha_s"] == pytest.approx(ALPHA_INTER, rel=1e-3)
    assert inter["bandwidth_gb_per_s"] == pytest.approx(2.0, rel=1e-3)
    assert intra["world_sizes"] == "2,4,8"
    assert intra["points"] == 9 and not intra["too_few_points"]
    assert intra["smape_pct"] < 0.01 and intra["r2_adj"] > 0.9999


def test_few_points_are_flagged(tmp_path):
    _ring_run(tmp_path, 2, buckets=(1 << 20,))
    _ring_run(tmp_path, 4, buckets=(1 << 20,))
    with open_store(tmp_path) as store:
        fit = run_analysis("allreduce_fit", store).to_pylist()[0]
    assert fit["points"] == 2 and fit["too_few_points"]


def test_without_comm_rows_bandwidth_falls_back_to_exposed_sync(tmp_path):
    # a Horovod-like summary: only the exposed sync per step and the gradient bytes
    for n in (1, 4):
        make_run(
            tmp_path,
            f"h{n}",
            world_size=n,
            backend="horovod-nccl",
            grad_bytes=8 * 2**20,
            phases={**DEFAULT_PHASES, "sync_exposed": 4 * MS if n > 1 else 0},
        )
    with open_store(tmp_path) as store:
        rows = {r["run_id"]: r for r in run_analysis("sync", store).to_pylist()}
        fit = run_analysis("allreduce_fit", store).to_pylist()
    h4 = rows["h4"]
    assert h4["bw_source"] == "steps.sync_exposed_ns+runs.grad_bytes"
    assert h4["busbw_gb_per_s"] == pytest.approx(8 * 2**20 / 4e-3 / 1e9 * 2 * 3 / 4)
    assert h4["comm_total_ns"] is None and h4["overlap_share"] is None
    assert rows["h1"]["busbw_gb_per_s"] is None
    assert fit[0]["data_source"] == "steps.sync_exposed_ns"
