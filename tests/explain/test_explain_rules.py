"""Every diagnosis rule fires on a store made to show its problem and stays silent on a healthy study."""

from __future__ import annotations

import math

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, Gpu, Host, healthy_study, make_run, ring_transfer_ns

from perfscope.explain import RULES, explain
from perfscope.store.open import open_store

# a rule that raises is skipped with a PerfscopeWarning in production; here it must fail the test
pytestmark = pytest.mark.filterwarnings("error::perfscope.errors.PerfscopeWarning")


def _findings(root):
    with open_store(root) as store:
        return explain(store)


def _rule(findings, rule):
    """Every firing of the rule, also those merged into a root cause or collapsed across groups."""
    return [g for f in findings for g in f.flatten() if g.rule == rule]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    root = tmp_path_factory.mktemp("healthy")
    healthy_study(root)
    return _findings(root)


def test_a_healthy_study_raises_no_alarm(healthy):
    assert healthy == []


def test_every_design_rule_is_registered():
    assert {r.design_number for r in RULES} >= set(range(1, 13))


def _sync_grows(root, sizes=(1, 2, 4, 8), sync_ms=2.0, **kw):
    for n in sizes:
        make_run(
            root, f"n{n}", world_size=n, phases={**DEFAULT_PHASES, "sync_exposed": sync_ms * MS * n}, **kw
        )


def test_communication_bound(tmp_path, healthy):
    _sync_grows(tmp_path)
    f = _rule(_findings(tmp_path), "communication-bound")
    assert len(f) == 1
    assert f[0].severity == "alarm" and f[0].explained_loss == pytest.approx(1.0)
    assert f[0].numbers["efficiency"] == pytest.approx(35 / 49)
    assert "0.71" in f[0].text and "16.0 ms" in f[0].text
    assert not _rule(healthy, "communication-bound")


def test_network_under_delivering_one_slow_run(tmp_path, healthy):
    for n in (2, 3, 4, 6, 8):
        beta = 1 / (10e9 if n != 6 else 1e9)  # run n6 moves its bytes ten times slower
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            device_model="cpu",
            backend="gloo",
            comm=Comm([1 << 22, 1 << 23], lambda nb, n=n, beta=beta: ring_transfer_ns(n, nb, 5e-6, beta)),
        )
    f = _rule(_findings(tmp_path), "network-under-delivering")
    assert [x.evidence.run_ids for x in f] == [("n6",)]
    assert f[0].numbers["slowdown"] > 5
    assert not _rule(healthy, "network-under-delivering")


def test_network_under_delivering_tcp_like_nccl(tmp_path):
    for n in (16, 24, 32):
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            gpus_per_node=8,
            comm=Comm([1 << 24], lambda nb, n=n: ring_transfer_ns(n, nb, 30e-6, 1 / 1.2e9)),
        )
    f = _rule(_findings(tmp_path), "network-under-delivering")
    assert len(f) == 1 and "TCP" in f[0].text and "across nodes" in f[0].title


def test_latency_bound(tmp_path, healthy):
    for n in (2, 4, 8):
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS * n},
            comm=Comm([16 << 10] * 50, lambda nb, n=n: ring_transfer_ns(n, nb, 20e-6, 1 / 10e9)),
        )
    make_run(tmp_path, "n1", world_size=1)
    f = _rule(_findings(tmp_path), "latency-bound")
    assert len(f) == 1
    assert f[0].numbers["collectives_per_step"] == 50
    assert f[0].numbers["latency_share"] > 0.9
    assert "bucket_cap_mb" in f[0].recommendation
    assert not _rule(healthy, "latency-bound")


def test_node_boundary_knee(tmp_path, healthy):
    for n in (1, 2, 4, 8, 16):
        sync = 0 if n == 1 else (1 * MS if n <= 4 else 10 * MS)
        make_run(
            tmp_path, f"n{n}", world_size=n, gpus_per_node=4, phases={**DEFAULT_PHASES, "sync_exposed": sync}
        )
    f = _rule(_findings(tmp_path), "node-boundary-knee")
    assert len(f) == 1
    assert (f[0].numbers["world_size_inside"], f[0].numbers["world_size_outside"]) == (4, 8)
    # T(1) = 33 ms (no sync), T(4) = 34 ms, T(8) = 43 ms
    assert f[0].numbers["relative_drop"] == pytest.approx(1 - (33 / 43) / (33 / 34))
    assert not _rule(healthy, "node-boundary-knee")


def test_straggler(tmp_path, healthy):
    make_run(tmp_path, "n1", world_size=1)
    make_run(
        tmp_path,
        "n4",
        world_size=4,
        comm=Comm([1 << 20], lambda nb: 1e5, delay_ns=lambda r, s: 4e6 if r == 2 else 0),
    )
    f = _rule(_findings(tmp_path), "straggler")
    assert len(f) == 1 and f[0].numbers["last_rank"] == 2
    assert "rank 2" in f[0].text and "100%" in f[0].text
    assert not _rule(healthy, "straggler")


def test_load_imbalance_is_a_straggler_too(tmp_path):
    make_run(tmp_path, "n1", world_size=1)
    make_run(tmp_path, "n4", world_size=4, phase_fn=lambda r, s: {"forward": 18 * MS} if r == 3 else {})
    f = _rule(_findings(tmp_path), "straggler")
    assert len(f) == 1 and f[0].numbers["load_balance"] == pytest.approx(33 / 39)


def test_input_bound(tmp_path, healthy):
    for n in (1, 2, 4):
        make_run(tmp_path, f"n{n}", world_size=n, phases={**DEFAULT_PHASES, "data": 3 * MS * n})
    f = _rule(_findings(tmp_path), "input-bound")
    assert len(f) == 1 and f[0].numbers["data_share"] == pytest.approx(12 / 46)
    assert "num_workers" in f[0].recommendation
    assert not _rule(healthy, "input-bound")


def test_small_per_gpu_work_with_batch_headroom_and_lr_caveats(tmp_path, healthy):
    for n in (1, 2, 4, 8):
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            batch_size_per_rank=75,
            gpu=Gpu(util_pct=lambda r: 20.0),
            phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS * (n > 1)},
        )
    for b in (300, 1200):
        k = b / 75
        make_run(
            tmp_path,
            f"b{b}",
            world_size=1,
            batch_size_per_rank=b,
            phases={
                **DEFAULT_PHASES,
                "forward": 10 * MS * math.sqrt(k),
                "backward": 20 * MS * math.sqrt(k),
                "sync_exposed": 0,
            },
        )
    f = _rule(_findings(tmp_path), "small-per-gpu-work")
    assert len(f) == 1
    x = f[0]
    assert x.numbers["better_batch_size_per_rank"] == 1200
    # T(1, 1200) = 3 ms + 30 ms·4 = 123 ms; at N=8 the 2 ms sync stays: gain = (1200/125) / (75/35)
    assert x.numbers["gain_N8"] == pytest.approx((1200 / 125) / (75 / 35))
    assert "kernel-active time share" in x.text and "learning rate" in x.recommendation
    assert "√k" in x.recommendation and "LARS" in x.recommendation and "warm" in x.recommendation
    assert not _rule(healthy, "small-per-gpu-work")


def test_overlap_failure(tmp_path, healthy):
    make_run(tmp_path, "n1", world_size=1)
    make_run(
        tmp_path,
        "n4",
        world_size=4,
        phases={**DEFAULT_PHASES, "sync_exposed": 8 * MS},
        comm=Comm([1 << 22, 1 << 22], lambda nb: 4e6),
    )
    f = _rule(_findings(tmp_path), "overlap-failure")
    assert len(f) == 1 and f[0].numbers["overlap_share"] == pytest.approx(0.0)
    assert not _rule(healthy, "overlap-failure")


def test_overlap_failure_names_the_recorded_ddp_settings(tmp_path):
    ddp = {
        "ddp_bucket_cap_mb": 25.0,
        "ddp_gradient_as_bucket_view": False,
        "ddp_find_unused_parameters": True,
        "ddp_static_graph": False,
    }
    make_run(tmp_path, "n1", world_size=1)
    make_run(
        tmp_path,
        "n4",
        world_size=4,
        phases={**DEFAULT_PHASES, "sync_exposed": 8 * MS},
        comm=Comm([1 << 22, 1 << 22], lambda nb: 4e6),
        runs_extra=ddp,
    )
    (f,) = _rule(_findings(tmp_path), "overlap-failure")
    assert f.recommendation.startswith(
        "DDP ran with bucket_cap_mb=25, gradient_as_bucket_view=False, find_unused_parameters=True, "
        "static_graph=False. find_unused_parameters=True walks the autograd graph"
    )
    # static_graph=True: the settings are named, the cost of find_unused_parameters is not claimed
    other = tmp_path / "static"
    make_run(other, "n1", world_size=1)
    make_run(
        other,
        "n4",
        world_size=4,
        phases={**DEFAULT_PHASES, "sync_exposed": 8 * MS},
        comm=Comm([1 << 22, 1 << 22], lambda nb: 4e6),
        runs_extra={**ddp, "ddp_static_graph": True},
    )
    (g,) = _rule(_findings(other), "overlap-failure")
    assert "static_graph=True. " in g.recommendation and "walks the autograd graph" not in g.recommendation


def test_backend_comparison_inside_and_across_nodes(tmp_path, healthy):
    for n in (1, 2, 4, 8, 16):
        across = n > 4
        mpi = (0.5 if not across else 8.0) * MS * (n > 1)
        nccl = (3.0 if not across else 4.0) * MS * (n > 1)
        for backend, sync in (("mpi", mpi), ("nccl", nccl)):
            make_run(
                tmp_path,
                f"{backend}{n}",
                world_size=n,
                gpus_per_node=4,
                backend=backend,
                phases={**DEFAULT_PHASES, "sync_exposed": sync},
            )
    f = _rule(_findings(tmp_path), "backend-comparison")
    assert len(f) == 1
    assert "inside one node: mpi faster" in f[0].title and "across nodes: nccl faster" in f[0].title
    assert f[0].numbers["N4_best"] == "mpi" and f[0].numbers["N16_best"] == "nccl"
    assert not _rule(healthy, "backend-comparison")


def _util_jump_study(root, backend, jump):
    for n in (1, 2, 4, 8):
        util = 60.0 if (jump and n > 4) else 30.0
        make_run(
            root,
            f"{backend}{n}",
            world_size=n,
            gpus_per_node=4,
            backend=backend,
            gpu=Gpu(util_pct=lambda r, u=util: u),
            phases={**DEFAULT_PHASES, "sync_exposed": MS * n},
        )


def test_utilisation_jump_is_a_measurement_effect(tmp_path, healthy):
    _util_jump_study(tmp_path, "nccl", jump=True)
    _util_jump_study(tmp_path, "mpi", jump=False)
    f = _rule(_findings(tmp_path), "utilisation-jump")
    assert len(f) == 1 and f[0].category == "measurement" and f[0].severity == "info"
    assert "spins" in f[0].text and "nvmlDeviceGetUtilizationRates" in f[0].text
    assert "not a gain" in f[0].text and "mpi" in f[0].text
    assert f[0].numbers["util_outside_pct"] - f[0].numbers["util_inside_pct"] == pytest.approx(30)
    assert not _rule(healthy, "utilisation-jump")


def test_utilisation_jump_with_a_real_speedup_is_not_flagged(tmp_path):
    for n in (1, 2, 4, 8):
        # the jump comes with a faster step: the extra utilisation is real work
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            gpus_per_node=4,
            gpu=Gpu(util_pct=lambda r, n=n: 60.0 if n > 4 else 30.0),
            phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS if 1 < n <= 4 else 0},
        )
    assert not _rule(_findings(tmp_path), "utilisation-jump")


def test_data_quality_findings_never_crash(tmp_path, healthy):
    make_run(tmp_path, "full", world_size=1)
    make_run(tmp_path, "missing-rank", world_size=4, ranks_present={0, 1, 3})
    make_run(tmp_path, "no-phases", world_size=2, phases={"forward": None, "step_only": 0, "other": 30 * MS})
    make_run(tmp_path, "no-baseline", world_size=3, batch_size_per_rank=7)
    make_run(tmp_path, "orphan", world_size=1, write_runs_row=False)
    make_run(tmp_path, "noisy", world_size=2, phase_fn=lambda r, s: {"forward": (10 + 30 * (s % 2)) * MS})
    f = _findings(tmp_path)
    kinds = {x.rule for x in f if x.category == "data-quality"}
    assert {
        "quality:missing_ranks",
        "quality:missing_phases",
        "quality:no_baseline",
        "quality:runs_without_metadata",
        "quality:high_variance",
    } <= kinds
    assert not [x for x in healthy if x.category == "data-quality"]


def test_superlinear_and_mixed_sources_are_confounds(tmp_path):
    make_run(tmp_path, "a1", world_size=1)
    make_run(tmp_path, "a2", world_size=2, source="simulated", phases={**DEFAULT_PHASES, "forward": 1 * MS})
    f = _findings(tmp_path)
    rules = {x.rule for x in f}
    assert {"quality:superlinear", "quality:mixed_sources"} <= rules
    assert all("simulated" in x.title for x in f if x.rule == "quality:superlinear")


def test_oversubscribed_cpu_host(tmp_path, healthy):
    for n in (1, 2, 4):
        slow = 3.0 if n == 4 else 1.0  # 4 ranks on 2 cores: compute runs at a third of the speed
        make_run(
            tmp_path,
            f"gloo{n}",
            world_size=n,
            backend="gloo",
            device=False,
            device_model="cpu",
            cpu_count=2,
            gpus_per_node=8,
            clock="host",
            phases={**DEFAULT_PHASES, "forward": 10 * MS * slow, "backward": 20 * MS * slow},
        )
    f = _rule(_findings(tmp_path), "oversubscription")
    assert len(f) == 1 and f[0].severity == "alarm"
    x = f[0]
    assert x.evidence.run_ids == ("gloo4",)
    assert "4 ranks share 2 logical CPUs" in x.text and "50%" in x.text
    assert x.numbers["cap_gloo4"] == 0.5
    # efficiency 35/95: the 2-core cap alone explains (1 - 0.5) / (1 - 35/95) of the loss, and the
    # whole loss at N=4 is confounded by contention
    assert x.numbers["explains_at_least_gloo4"] == pytest.approx(0.5 / (1 - 35 / 95))
    assert x.explained_loss == 1.0
    # a cause found in the same runs carries the caveat
    others = [f for f in _findings(tmp_path) if f.category == "cause" and f.rule != "oversubscription"]
    assert all("Caveat" in f.text for f in others if "gloo4" in f.evidence.run_ids)
    assert not _rule(healthy, "oversubscription")


def test_two_ranks_on_one_gpu(tmp_path):
    make_run(tmp_path, "g1", world_size=1)
    make_run(tmp_path, "g2", world_size=2, gpus_per_node=1)  # fine: one rank per GPU on two nodes
    assert not _rule(_findings(tmp_path), "oversubscription")


def test_cluster_comparison_names_slower_compute(tmp_path, healthy):
    for cluster, scale in (("fast", 1.0), ("slow", 3.0)):
        for n in (1, 2, 4, 8):
            phases = {
                **DEFAULT_PHASES,
                "forward": 10 * MS * scale,
                "backward": 20 * MS * scale,
                "sync_exposed": 3 * MS * math.log2(n) if n > 1 else 0,
            }
            make_run(tmp_path, f"{cluster}{n}", world_size=n, cluster=cluster, phases=phases)
    f = _rule(_findings(tmp_path), "cluster-comparison")
    assert len(f) == 1
    assert f[0].title.startswith("slow scales better than fast because its GPUs compute slower")
    assert f[0].numbers["throughput_ratio"] > 1
    assert not _rule(healthy, "cluster-comparison")


def test_findings_are_ranked_by_explained_loss(tmp_path):
    _sync_grows(tmp_path)
    make_run(
        tmp_path, "cpu4", world_size=4, experiment="other", cpu_count=2, device=False, device_model="cpu"
    )
    f = _findings(tmp_path)
    losses = [x.explained_loss or 0 for x in f]
    assert losses == sorted(losses, reverse=True)


def test_simulated_runs_are_marked_in_findings(tmp_path):
    _sync_grows(tmp_path, source="simulated")
    f = _rule(_findings(tmp_path), "communication-bound")
    assert "[simulated runs]" in f[0].title and f[0].text.startswith("(Simulated runs.)")


def test_host_samples_do_not_matter_for_healthy(tmp_path):
    make_run(tmp_path, "h1", world_size=1, host=Host(sys_cpu_pct=100.0))
    # a busy host is a measurement confound (other processes took 63 of 64 cores), never a cause
    assert [f.id for f in _findings(tmp_path)] == ["contention:other-processes"]


def _slow(steps):
    """A phase_fn making the given steps' forward 400 ms (on every rank) instead of the default 10:
    slow past 1.5x the median even when every 2nd step is slow (the median then falls between)."""
    return lambda rank, step: {"forward": 400 * MS} if step in steps else {}


def test_slow_steps_are_named_by_a_real_period_in_words(tmp_path):
    from perfscope.analysis import run_analysis

    steps = 50  # warm-up: the first 10
    make_run(tmp_path, "burst", experiment="burst", steps=steps, phase_fn=_slow(set(range(20, 28))))
    make_run(tmp_path, "every2", experiment="every2", steps=steps, phase_fn=_slow(set(range(0, steps, 2))))
    make_run(tmp_path, "every3", experiment="every3", steps=steps, phase_fn=_slow(set(range(0, steps, 3))))
    with open_store(tmp_path) as store:
        periods = {r["run_id"]: r["step_period"] for r in run_analysis("run_summary", store).to_pylist()}
        findings = explain(store)
    # eight slow steps in a row are a run of slow steps, not "every 1th step"
    assert periods == {"burst": None, "every2": 2, "every3": 3}
    every = [g for f in findings for g in f.flatten()]
    (periodic,) = [g for g in every if g.rule == "quality:periodic_steps"]  # one finding per kind
    assert periodic.evidence.run_ids == ("every2", "every3")
    assert "run every2: every 2nd step takes" in periodic.text
    assert "run every3: every 3rd step takes" in periodic.text
    (bimodal,) = [g for g in every if g.rule == "quality:bimodal_steps"]
    assert "run burst: 20% of steady steps take " in bimodal.text  # 8 of 40: two kinds of step
    words = " ".join(" ".join((g.title, g.text, g.recommendation)) for g in every)
    assert "1th" not in words and "2th" not in words and "3th" not in words
    # users do not have the design notes: a finding says its reason in words, never cites them
    assert "DESIGN" not in words
    assert "10% of the mean step" in words


def test_ordinals_are_words():
    from perfscope.words import ordinal

    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th",
    ]  # fmt: skip


def test_one_run_waiting_on_communication_says_so_and_what_to_record_next(tmp_path, healthy):
    heavy = {**DEFAULT_PHASES, "sync_exposed": 90 * MS}  # most of the step
    make_run(tmp_path, "alone", experiment="alone", world_size=8, phases=heavy, scaling_mode="weak")
    for n in (1, 8):  # the same wait in a series: the scaling rules speak for it, not this rule
        make_run(
            tmp_path, f"series-{n}", experiment="series", world_size=n, phases=heavy, scaling_mode="weak"
        )
    found = _rule(_findings(tmp_path), "communication-share")
    assert [f.evidence.run_ids for f in found] == [("alone",)]
    (f,) = found
    step = sum(v for v in heavy.values() if v)
    assert f.numbers["comm_share"] == pytest.approx(90 * MS / step, rel=0.01)
    assert f.numbers["measure_world_sizes"] == "1,4,16" and "N=1, N=4 and N=16" in f.recommendation
    assert not _rule(healthy, "communication-share")


def test_memory_imbalance_and_creep_on_recorded_rows(tmp_path, healthy):
    gib = 2**30
    make_run(
        tmp_path,
        "mem",
        world_size=4,
        host=Host(),
        # rank 3 holds 12 GiB more on its device; rank 1's RSS grows 4 MiB per step
        cuda_peak_fn=lambda r, s: 20 * gib + 12 * gib * (r == 3),
        rss_fn=lambda r, s: 2 * gib + (4 << 20) * s * (r == 1),
    )
    found = _findings(tmp_path)
    (imb,) = _rule(found, "memory-imbalance")
    assert imb.numbers["rank"] == 3 and imb.numbers["kind"] == "device"
    assert imb.numbers["peak_bytes"] == 32 * gib + 2**28
    (creep,) = _rule(found, "memory-creep")
    assert (creep.numbers["kind"], creep.numbers["rank"]) == ("host", 1)
    assert creep.numbers["slope_bytes_per_step"] == pytest.approx(4 << 20)
    assert not _rule(found, "memory-headroom")  # 32.25 of 80 GiB
    for name in ("memory-imbalance", "memory-creep", "memory-headroom"):
        assert not _rule(healthy, name)


def test_memory_headroom_names_the_recorded_precision(tmp_path):
    make_run(
        tmp_path,
        "full",
        world_size=2,
        cuda_peak_fn=lambda r, s: 75 * 2**30,  # + 256 MiB reserved: 94% of 80 GiB
        runs_extra={"param_dtypes": "float32", "autocast": ""},
    )
    (f,) = _rule(_findings(tmp_path), "memory-headroom")
    assert f.numbers["share_of_device"] == pytest.approx((75 * 2**30 + 2**28) / (80 * 2**30))
    assert f.recommendation.startswith("The model ran with float32 parameters and no autocast")
