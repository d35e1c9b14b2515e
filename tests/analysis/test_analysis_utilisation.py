"""Utilisation, energy per sample, throttling, placement, batch sweeps, time-to-metric and MFU."""

from __future__ import annotations

import math

import pytest
from storegen import DEFAULT_PHASES, MS, Gpu, Host, make_run, row

from perfscope.analysis import run_analysis
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter


def test_utilisation_and_energy_per_sample(tmp_path):
    for n in (1, 2):
        make_run(tmp_path, f"w{n}", world_size=n, gpu=Gpu(util_pct=lambda r: 80.0), host=Host())
    # an idle GPU on the same host that no rank of w1 uses must not count
    with StoreWriter(tmp_path, "w1", writer_id="foreign") as w:
        w.append(
            "gpu_samples",
            row("gpu_samples", ts_ns=1_700_000_000_500_000_000, hostname="node0", node_rank=0, gpu_index=7,
                util_gpu_pct=0.0, power_mw=50_000.0, energy_mj=0.0),
        )  # fmt: skip
    with open_store(tmp_path) as store:
        u = {r["run_id"]: r for r in run_analysis("utilisation", store).to_pylist()}
    w1, w2 = u["w1"], u["w2"]
    assert (w1["gpus"], w2["gpus"]) == (1, 2)
    assert w1["util_gpu_pct"] == pytest.approx(80.0)
    # 300 W for the 30 steady steps of 35 ms = 1.05 s per GPU; 32 samples per rank and step
    assert w1["energy_j"] == pytest.approx(300 * 1.05, rel=1e-6)
    assert w2["energy_j"] == pytest.approx(2 * 300 * 1.05, rel=1e-6)
    assert w1["energy_per_sample_j"] == pytest.approx(300 * 1.05 / (30 * 32), rel=1e-6)
    assert w2["energy_per_sample_j"] == pytest.approx(w1["energy_per_sample_j"], rel=1e-6)
    assert w1["energy_source"] == "energy_mj counter"
    assert w1["power_w"] == pytest.approx(300.0)
    assert w1["host_proc_cpu_pct"] == pytest.approx(100.0)


def test_energy_without_counter_integrates_power(tmp_path):
    make_run(tmp_path, "p", world_size=1, gpu=Gpu(with_energy=False, power_w=200.0))
    with open_store(tmp_path) as store:
        u = run_analysis("utilisation", store).to_pylist()[0]
    assert u["energy_source"] == "mean power x time"
    assert u["energy_j"] == pytest.approx(200 * 1.05, rel=1e-6)


def test_throttling_at_larger_world_size_is_a_quality_issue(tmp_path):
    make_run(tmp_path, "a", world_size=1, gpu=Gpu())
    make_run(tmp_path, "b", world_size=8, gpu=Gpu(clocks_event_reasons=0x4, sm_clock_mhz=1500.0))
    with open_store(tmp_path) as store:
        u = {r["run_id"]: r for r in run_analysis("utilisation", store).to_pylist()}
        q = run_analysis("quality", store).to_pylist()
    assert u["b"]["throttle_share"] == 1.0 and u["a"]["throttle_share"] == 0.0
    assert [x["run_id"] for x in q if x["kind"] == "throttling"] == ["b"]


def test_placement_counts_ranks_cores_and_gpus(tmp_path):
    make_run(tmp_path, "cpu4", world_size=4, cpu_count=2, device=False, device_model="cpu", backend="gloo")
    make_run(tmp_path, "gpu2", world_size=2, gpus_per_node=1)
    with open_store(tmp_path) as store:
        p = run_analysis("placement", store).to_pylist()
    cpu = [r for r in p if r["run_id"] == "cpu4"]
    assert len(cpu) == 1 and cpu[0]["ranks_on_host"] == 4 and cpu[0]["cpu_count"] == 2
    assert cpu[0]["oversubscribed_cpu"] and not cpu[0]["oversubscribed_gpu"]
    assert cpu[0]["gpus_on_host"] is None and cpu[0]["cores_per_rank"] == 0.5
    gpu = [r for r in p if r["run_id"] == "gpu2"]
    assert [r["ranks_on_host"] for r in gpu] == [1, 1]
    assert not any(r["oversubscribed_cpu"] or r["oversubscribed_gpu"] for r in gpu)


def _sweep(tmp_path):
    for b in (75, 300, 1000):
        make_run(
            tmp_path,
            f"b{b}",
            world_size=1,
            batch_size_per_rank=b,
            steps=100,
            dataset_samples=750_000,
            flops_per_step=1e12,
            device_peak_flops=1e15,
            phases={**DEFAULT_PHASES, "forward": 10 * MS * math.sqrt(b / 75)},
            metrics={"loss": lambda s, b=b: 2 * math.exp(-s * b / 3000) + 0.1},
        )


def test_batch_sweep_step_epoch_and_throughput(tmp_path):
    _sweep(tmp_path)
    with open_store(tmp_path) as store:
        rows = {r["batch_size_per_rank"]: r for r in run_analysis("batch_sweep", store).to_pylist()}
        mfu = {r["run_id"]: r for r in run_analysis("mfu", store).to_pylist()}
    assert rows[75]["step_ns"] == pytest.approx(35 * MS)
    assert rows[75]["epoch_s"] == pytest.approx(750_000 / 75 * 0.035)
    t1000 = 25 * MS + 10 * MS * math.sqrt(1000 / 75)
    assert rows[1000]["step_ns"] == pytest.approx(t1000, rel=1e-6)
    assert rows[1000]["throughput_vs_smallest"] == pytest.approx((1000 / t1000) / (75 / (35 * MS)), rel=1e-6)
    assert rows[75]["per_sample_ns"] == pytest.approx(35 * MS / 75)
    assert mfu["b75"]["achieved_flops_per_s"] == pytest.approx(1e12 / 0.035)
    assert mfu["b75"]["mfu"] == pytest.approx(1e12 / 0.035 / 1e15)


def test_time_to_metric_common_target(tmp_path):
    _sweep(tmp_path)
    with open_store(tmp_path) as store:
        ttm = run_analysis("time_to_metric", store).to_pylist()
        curves = run_analysis("metric_curves", store).to_pylist()
    assert {r["direction"] for r in ttm} == {"lower"}
    assert all(r["reached"] for r in ttm)
    # the loosest best (smoothed over 10 steps) is batch 75's: it reaches the target last
    assert [r["run_id"] for r in ttm] == ["b1000", "b300", "b75"]
    assert ttm[-1]["best_value"] == pytest.approx(ttm[0]["target"])
    assert len([c for c in curves if c["run_id"] == "b75"]) == 100
    first = next(c for c in curves if c["run_id"] == "b75" and c["step"] == 0)
    assert first["value"] == pytest.approx(2.1) and first["samples_seen"] == 75
