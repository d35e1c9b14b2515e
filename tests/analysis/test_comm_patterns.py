"""Analyses and rules of communication beyond DDP on real gloo jobs (perfscope.demo_patterns): the
top finding names the real cause, p2p stays out of wait-at-collective and the ring model, and the
pattern rules stay silent on a DDP job."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from collect_helpers import run_ranks

from perfscope import demo_patterns as patterns
from perfscope import open_store
from perfscope.analysis import run_analysis
from perfscope.explain import explain

SAMPLE_DDP = Path(__file__).resolve().parents[2] / "sample_traces" / "demo-cpu"
PATTERN_RULES = {"pipeline-bubble", "parameter-server", "periodic-sync", "sharded-exposed"}
#: this 2-core machine runs 3-rank jobs oversubscribed, and shares it: those confounds are true,
#: and ranked first; the cause asked about is the first one after them
CONFOUNDS = {"oversubscription", "contention"}


def _record(
    tmp_path_factory: pytest.TempPathFactory, name: str, fn: Any, world: int, opts: dict[str, Any]
) -> Path:
    root = tmp_path_factory.mktemp(name)
    for rank, (status, value) in run_ranks(fn, world, str(root), opts).items():
        assert status == "ok", f"rank {rank}: {value}"
    return root


#: The pipeline job: stage 1 runs six times stage 0's layers on micro-batches large enough that
#: the layers, not Python's per-call overhead, are the compute. At 16 rows and three times the
#: layers the stages differed by about 2.5 ms a step, and on this shared 2-core machine a rank loses
#: the CPU for 10-50 ms inside a phase now and then: one such loss on stage 0 among the six steady
#: steps made it the "slowest" stage. Here stage 1 computes about 60 ms a step more (measured 66-90
#: ms against 9-11 ms under a load of 10), far beyond what preemption adds to either mean.
PIPELINE = {
    "steps": 12,
    "micro_batches": 4,
    "micro_batch": 256,
    "slow_stage": 1,
    "slow_factor": 6,
    "role": False,  # roles are not given: they are inferred
    "global_batch": False,
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, "pipeline", patterns.pipeline_worker, 2, PIPELINE)


@pytest.fixture(scope="module")
def ps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, "ps", patterns.ps_worker, 3, {"steps": 12, "role": False})


@pytest.fixture(scope="module")
def paramavg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, "paramavg", patterns.paramavg_worker, 2, {"steps": 16, "every": 4})


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, "fsdp", patterns.fsdp_worker, 2, {"steps": 12})


def _analysis(store: Path, name: str) -> list[dict[str, Any]]:
    with open_store(store) as s:
        return run_analysis(name, s).to_pylist()


def _causes(store: Path) -> list[Any]:
    with open_store(store) as s:
        return [f for f in explain(s) if f.category == "cause" and f.rule not in CONFOUNDS]


def test_pipeline_stages_are_inferred_and_the_slow_stage_is_named(pipeline: Path) -> None:
    roles = {r["rank"]: (r["role"], r["role_source"]) for r in _analysis(pipeline, "comm_roles")}
    assert roles == {0: ("stage:0", "inferred"), 1: ("stage:1", "inferred")}
    stages = _analysis(pipeline, "pipeline_stages")
    assert [s["stage"] for s in stages] == [0, 1]
    assert all(s["stages"] == 2 and s["micro_batches"] == 4 and s["slowest_stage"] == 1 for s in stages)
    assert stages[0]["ideal_bubble_fraction"] == pytest.approx(1 / 5)
    assert stages[0]["compute_ns"] < stages[1]["compute_ns"]
    for s in stages:  # the bubble is the step's p2p wait, and compute + wait stay within the step
        assert s["bubble_fraction"] == pytest.approx(s["p2p_wait_ns"] / s["step_ns"])
        assert s["compute_ns"] + s["p2p_wait_ns"] <= s["step_ns"] * 1.001
    causes = _causes(pipeline)
    # first: the long stage, as the what-if replay sizes it, with the bubble (the other stage waiting
    # for it) as its symptom
    what_if = causes[0]
    assert what_if.rule == "what-if" and what_if.numbers["stage"] == 1, [(f.rule, f.title) for f in causes]
    (top,) = [f for f in what_if.symptoms if f.rule == "pipeline-bubble"]
    assert top.numbers["slowest_stage"] == 1
    assert "stage 1" in top.title and "not gradient synchronisation" in top.text
    assert "micro-batches" in top.recommendation and "1F1B" in top.recommendation
    # the waiting stage is a victim: no straggler verdict, and no DDP-style advice
    assert not {f.rule for f in causes} & {"straggler", "overlap-failure", "latency-bound"}


def test_point_to_point_stays_out_of_wait_at_collective_and_the_ring_model(pipeline: Path) -> None:
    assert [r for r in _analysis(pipeline, "stragglers") if r["wait_source"] == "comm.start_ns"] == []
    assert _analysis(pipeline, "collectives") == []
    ops = {(r["op"], r["kind"]) for r in _analysis(pipeline, "comm_ops")}
    assert ops == {("send", "p2p"), ("recv", "p2p")}


def test_parameter_server_is_inferred_and_its_workers_wait_on_it(ps: Path) -> None:
    roles = {r["rank"]: r["role"] for r in _analysis(ps, "comm_roles")}
    assert roles == {0: "server", 1: "worker", 2: "worker"}
    rows = {r["rank"]: r for r in _analysis(ps, "parameter_server")}
    assert 0 < rows[0]["server_busy_share"] <= 1 and rows[0]["push_ns"] is None
    for w in (1, 2):
        assert rows[w]["push_ns"] > 0 and rows[w]["pull_ns"] > 0 and rows[w]["servers"] == 1
    top = _causes(ps)[0]
    assert top.rule == "parameter-server" and top.numbers["server_rank"] == 0
    assert "straggler" not in {f.rule for f in _causes(ps)}


def test_samples_are_counted_once_per_global_batch(pipeline: Path, ps: Path) -> None:
    (run,) = _analysis(pipeline, "run_summary")
    # one global batch through both stages
    assert run["samples_per_step"] == pytest.approx(PIPELINE["micro_batches"] * PIPELINE["micro_batch"])
    (run,) = _analysis(ps, "run_summary")
    assert run["samples_per_step"] == pytest.approx(2 * 32)  # two workers; the server has no samples
    assert "missing_ranks" not in {q["kind"] for q in _analysis(ps, "quality")}


def test_periodic_sync_cost_share_and_the_k_that_keeps_it_under_ten_percent(paramavg: Path) -> None:
    (row,) = _analysis(paramavg, "periodic_sync")
    assert row["every_k"] == pytest.approx(4)
    cost, t0 = row["sync_cost_ns"], row["plain_step_ns"]
    assert row["amortised_share"] == pytest.approx(cost / 4 / (t0 + cost / 4))
    assert row["k_for_target"] == math.floor(9 * cost / t0) + 1
    k = row["k_for_target"]  # k is the smallest period meeting the target
    assert cost / k / (t0 + cost / k) < 0.1 <= cost / (k - 1) / (t0 + cost / (k - 1)) or k == 1
    if row["amortised_share"] >= 0.1:
        top = _causes(paramavg)[0]
        assert top.rule == "periodic-sync" and f"every {k} steps" in top.text


def test_message_sizes_come_from_their_distribution(paramavg: Path) -> None:
    (op,) = _analysis(paramavg, "comm_ops")
    # 4 Linear layers of (64->256, 256->256, 256->256, 256->64): weights and biases, float32
    sizes = sorted(4 * n for n in (64 * 256, 256, 256 * 256, 256, 256 * 256, 256, 256 * 64, 64))
    assert (op["bytes_min"], op["bytes_max"]) == (min(sizes), max(sizes))
    assert op["bytes_median"] == pytest.approx((sizes[3] + sizes[4]) / 2)
    (sync,) = _analysis(paramavg, "periodic_sync")
    assert op["calls"] == len(sizes) * 2 * sync["sync_steps"]  # every parameter, on both ranks


def test_fsdp_gathers_exposed_in_forward_are_the_named_cause(fsdp: Path) -> None:
    ops = {(r["op"], r["phase"]): r for r in _analysis(fsdp, "comm_ops")}
    assert {"forward", "backward"} <= {phase for op, phase in ops if op.startswith("all_gather")}
    assert all(r["kind"] == "collective" and r["group_size"] == 2 for r in ops.values())
    with open_store(fsdp) as s:
        findings = explain(s)
    sharded = [f for f in findings if f.rule == "sharded-exposed"]
    share = sum(r["exposed_share_of_step"] for (op, ph), r in ops.items() if ph in ("forward", "backward"))
    assert bool(sharded) == (share >= 0.15)


def test_pattern_rules_stay_silent_on_a_ddp_job() -> None:
    with open_store(SAMPLE_DDP) as s:
        findings = explain(s)
        roles = run_analysis("comm_roles", s).to_pylist()
        assert run_analysis("pipeline_stages", s).num_rows == 0
        assert run_analysis("parameter_server", s).num_rows == 0
        assert run_analysis("periodic_sync", s).num_rows == 0
    assert {r["role"] for r in roles} == {"worker"}
    assert not {f.rule for f in findings} & PATTERN_RULES


def test_the_bundled_pattern_store_names_each_jobs_cause() -> None:
    store = SAMPLE_DDP.parent / "patterns-cpu"
    expected = {
        "pattern-fsdp": "sharded-exposed",
        "pattern-pipeline": "pipeline-bubble",
        "pattern-ps": "parameter-server",
        "pattern-paramavg": "periodic-sync",
    }
    with open_store(store) as s:
        experiments = {
            r["run_id"]: r["experiment"] for r in s.query("SELECT run_id, experiment FROM runs").to_pylist()
        }
        summary = run_analysis("run_summary", s).to_pylist()
        findings = [f for f in explain(s) if f.category == "cause" and f.rule not in CONFOUNDS]
    first: dict[str, str] = {}
    for f in findings:
        first.setdefault(experiments[f.evidence.run_ids[0]], f.rule)
    assert first == expected
    assert {r["samples_per_step"] for r in summary} == {64}


def test_a_version_1_store_reads_migrated_and_compacts_without_losing_it(tmp_path: Path) -> None:
    import shutil

    from perfscope.store.compact import compact
    from perfscope.store.schema import SCHEMA_VERSION
    from perfscope.store.writer import StoreWriter

    store = tmp_path / "v1"
    shutil.copytree(SAMPLE_DDP, store)  # recorded with schema version 1: DDP buckets, no v2 columns
    import pyarrow.parquet as pq

    run_id = _analysis(store, "run_summary")[0]["run_id"]
    (v1_file,) = (store / "comm" / f"run_id={run_id}").glob("*.parquet")
    table = pq.read_table(v1_file)  # split into two version-1 segments, so compaction merges them
    half = table.num_rows // 2
    for name, part in (("a", table.slice(0, half)), ("b", table.slice(half))):
        pq.write_table(
            part.replace_schema_metadata(table.schema.metadata), v1_file.with_name(f"v1-{name}.parquet")
        )
    v1_file.unlink()
    with StoreWriter(store, run_id, writer_id="v2") as w:  # a version-2 segment beside them
        w.append("comm", (0, 999, 0, "send", None, 8, 1, 2, "host", 1, 2, 2, False, "forward"))

    def comm() -> list[dict[str, Any]]:
        with open_store(store) as s:
            return s.query(
                "SELECT step, is_async, phase, exposed_ns, peer, count(*) AS n FROM comm "
                "GROUP BY ALL ORDER BY step"
            ).to_pylist()

    before = comm()
    v1 = [r for r in before if r["step"] != 999]
    assert v1 and all(r["is_async"] is True and r["phase"] is None and r["exposed_ns"] is None for r in v1)
    assert [r for r in before if r["step"] == 999] == [
        {"step": 999, "is_async": False, "phase": "forward", "exposed_ns": 2, "peer": 1, "n": 1}
    ]
    assert compact(store, grace_s=0).files_merged >= 2
    merged = next((store / "comm" / f"run_id={run_id}").glob("c-*.parquet"))
    # both versions in it, written as the current one
    assert pq.read_metadata(merged).metadata[b"perfscope.schema_version"] == str(SCHEMA_VERSION).encode()
    assert comm() == before  # the old rows were migrated as they were merged


def test_findings_describe_message_sizes_from_their_distribution(paramavg: Path) -> None:
    from perfscope.analysis import Selection
    from perfscope.explain.context import Context
    from perfscope.explain.rules_comm import _recorded_sizes

    with open_store(paramavg) as s:
        ctx = Context(s, Selection())
        run_id = ctx.rows("run_summary")[0]["run_id"]
        words = _recorded_sizes(ctx, run_id)
    # 8 parameters from 256 B (a bias) to 256 KiB (a 256x256 weight): never one "average" size
    assert words == "of 256 B to 256 KiB (median 32 KiB for allreduce)"
