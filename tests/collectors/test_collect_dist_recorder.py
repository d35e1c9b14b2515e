"""The torch.distributed recorder on real gloo jobs: FSDP2, a send/recv pipeline, a parameter server,
local SGD, async ops; DDP and prof.all_reduce counted once; functions restored at close."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from collect_helpers import ddp_worker, run_ranks

from perfscope import demo_patterns as patterns
from perfscope import open_store

#: recorded communication per step against the job's own perf_counter timing around its calls
TOLERANCE = 0.35
WARMUP_STEPS = 2


def _ok(results: dict[int, Any]) -> dict[int, Any]:
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    return {rank: value for rank, (_, value) in results.items()}


def _rows(store: Path, sql: str) -> list[dict[str, Any]]:
    with open_store(store) as s:
        return s.query(sql).to_pylist()


def _agrees_with_own_timing(store: Path, rank: int, measured_per_step_ns: list[int]) -> None:
    recorded = {
        r["step"]: r["ns"]
        for r in _rows(
            store, f"SELECT step, sum(exposed_ns)::BIGINT AS ns FROM comm WHERE rank = {rank} GROUP BY step"
        )
    }
    steps = range(WARMUP_STEPS, len(measured_per_step_ns))
    want = sum(measured_per_step_ns[i] for i in steps)
    got = sum(recorded.get(i, 0) for i in steps)
    assert want > 0
    assert got == pytest.approx(want, rel=TOLERANCE)
    # and the steps row says the step waited for it (sync_exposed_ns), not computed it
    sync = {r["step"]: r["sync_exposed_ns"] for r in _rows(store, f"SELECT * FROM steps WHERE rank = {rank}")}
    assert sum(sync[i] for i in steps) == pytest.approx(got, rel=0.01)


def test_fsdp2_all_gathers_and_reduce_scatters_carry_the_sharded_parameters(tmp_path: Path) -> None:
    out = _ok(run_ranks(patterns.fsdp_worker, 2, str(tmp_path), {"steps": 4, "layers": 4}))
    unsharded = sorted(2 * b for b in out[0]["shard_bytes"])  # padded shard bytes x world size
    rows = _rows(tmp_path, "SELECT * FROM comm WHERE rank = 0 AND step = 2 ORDER BY seq")
    gathers = [r for r in rows if r["op"].startswith("all_gather")]
    scatters = [r for r in rows if r["op"].startswith("reduce_scatter")]
    # every fully_shard module is gathered in forward and reduce-scattered in backward
    assert sorted(r["bytes"] for r in gathers if r["phase"] == "forward") == unsharded
    assert sorted(r["bytes"] for r in scatters) == unsharded
    assert {r["phase"] for r in scatters} == {"backward"}
    assert all(r["group_size"] == 2 and r["peer"] is None and r["bucket"] is None for r in rows)
    # the all-gather time in forward left forward_ns for sync_exposed_ns
    step = _rows(tmp_path, "SELECT * FROM steps WHERE rank = 0 AND step = 2")[0]
    exposed = sum(r["exposed_ns"] for r in rows)
    assert step["sync_exposed_ns"] == pytest.approx(exposed, rel=0.01)
    spans = _rows(tmp_path, "SELECT name, dur_ns FROM spans WHERE rank = 0 AND step = 2 AND name = 'forward'")
    forward_gather = sum(r["exposed_ns"] for r in gathers if r["phase"] == "forward")
    assert step["forward_ns"] == pytest.approx(spans[0]["dur_ns"] - forward_gather, abs=1000)


def test_pipeline_send_recv_per_step_agrees_with_the_jobs_own_timing(tmp_path: Path) -> None:
    out = _ok(run_ranks(patterns.pipeline_worker, 2, str(tmp_path), {"steps": 8, "micro_batches": 4}))
    for rank in (0, 1):
        _agrees_with_own_timing(tmp_path, rank, out[rank]["comm_per_step_ns"])
    ops = _rows(tmp_path, "SELECT rank, op, phase, peer, count(*) AS n FROM comm GROUP BY ALL ORDER BY ALL")
    assert ops == [
        {"rank": 0, "op": "recv", "phase": "backward", "peer": 1, "n": 32},
        {"rank": 0, "op": "send", "phase": "forward", "peer": 1, "n": 32},
        {"rank": 1, "op": "recv", "phase": "forward", "peer": 0, "n": 32},
        {"rank": 1, "op": "send", "phase": "backward", "peer": 0, "n": 32},
    ]
    roles = _rows(tmp_path, "SELECT rank, role FROM ranks ORDER BY rank")
    assert roles == [{"rank": 0, "role": "stage:0"}, {"rank": 1, "role": "stage:1"}]


def test_parameter_server_push_and_pull_per_step_agree_with_the_workers_timing(tmp_path: Path) -> None:
    out = _ok(run_ranks(patterns.ps_worker, 3, str(tmp_path), {"steps": 6}))
    for rank in (1, 2):
        _agrees_with_own_timing(tmp_path, rank, out[rank]["comm_per_step_ns"])
    server = _rows(
        tmp_path, "SELECT op, peer, count(*) AS n FROM comm WHERE rank = 0 GROUP BY ALL ORDER BY ALL"
    )
    # the server received from and answered each worker once per worker step (recv from any source)
    assert server == [
        {"op": "recv", "peer": 1, "n": 6},
        {"op": "recv", "peer": 2, "n": 6},
        {"op": "send", "peer": 1, "n": 6},
        {"op": "send", "peer": 2, "n": 6},
    ]
    assert _rows(tmp_path, "SELECT count(*) AS n FROM steps WHERE rank = 0") == [{"n": 0}]


def test_local_sgd_records_the_averaging_every_kth_step_only(tmp_path: Path) -> None:
    out = _ok(run_ranks(patterns.paramavg_worker, 2, str(tmp_path), {"steps": 12, "every": 4}))
    for rank in (0, 1):
        _agrees_with_own_timing(tmp_path, rank, out[rank]["comm_per_step_ns"])
    steps = _rows(tmp_path, "SELECT DISTINCT step, op, phase FROM comm ORDER BY step")
    assert steps == [{"step": s, "op": "allreduce", "phase": "other"} for s in (3, 7, 11)]


def test_async_op_waited_after_compute_is_exposed_less_than_its_total(tmp_path: Path) -> None:
    _ok(run_ranks(patterns.async_worker, 2, str(tmp_path), {"steps": 6, "compute": 40}))
    rows = _rows(tmp_path, f"SELECT * FROM comm WHERE step >= {WARMUP_STEPS}")
    assert rows and all(r["is_async"] and r["op"] == "allreduce" for r in rows)
    assert all(0 <= r["exposed_ns"] <= r["dur_ns"] for r in rows)
    # the 4 MiB transfer ran while the rank computed: what it waited is less than it took
    assert sum(r["exposed_ns"] for r in rows) < 0.8 * sum(r["dur_ns"] for r in rows)


def test_ddp_buckets_are_recorded_once_by_the_comm_hook(tmp_path: Path) -> None:
    _ok(run_ranks(ddp_worker, 2, str(tmp_path), {"steps": 3}))
    # from step 1: DDP rebuilds its buckets in the order gradients arrived during step 0
    rows = _rows(
        tmp_path, "SELECT step, bucket, op, phase, exposed_ns FROM comm WHERE rank = 0 AND step >= 1"
    )
    assert rows and all(r["bucket"] is not None and r["op"] == "allreduce" for r in rows)
    per_step = {r["step"]: 0 for r in rows}
    for r in rows:
        per_step[r["step"]] += 1
    buckets = len({r["bucket"] for r in rows})
    assert set(per_step.values()) == {buckets}  # one row per bucket and step: not two
    assert all(r["phase"] is None and r["exposed_ns"] is None for r in rows)


def test_hand_written_all_reduce_is_recorded_once(tmp_path: Path) -> None:
    _ok(run_ranks(ddp_worker, 2, str(tmp_path), {"steps": 2, "manual_sync": True}))
    rows = _rows(
        tmp_path,
        "SELECT step, count(*) AS n, any_value(phase) AS phase FROM comm WHERE rank = 0 GROUP BY step",
    )
    assert [(r["n"], r["phase"]) for r in rows] == [(6, "sync"), (6, "sync")]  # one per parameter


def _restore_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import perfscope

    before = (dist.all_reduce, dist.isend, dist.distributed_c10d.all_reduce)
    with perfscope.profile(store + "/alone", poll_hz=0, gpu_telemetry=False):
        untouched = dist.all_reduce is before[0]  # no process group yet: nothing patched
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    with perfscope.profile(store + "/job", poll_hz=0, gpu_telemetry=False) as prof:
        patched = dist.all_reduce is not before[0]
        t = torch.full((4,), float(rank))
        peer = 1 - rank
        # P2POps built with the original functions before the profile and with the patched ones
        ops = [dist.P2POp(before[1], t, peer) if rank == 0 else dist.P2POp(dist.irecv, t, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if rank == 1:
            got = torch.zeros(2)
            dist.recv(got)  # from any source
        else:
            dist.send(torch.ones(2), 1)
        prof.step()
        value = t.tolist()
    restored = (dist.all_reduce, dist.isend, dist.distributed_c10d.all_reduce) == before
    dist.destroy_process_group()
    return {"untouched": untouched, "patched": patched, "restored": restored, "value": value}


def test_functions_are_patched_only_with_a_process_group_and_restored_at_close(tmp_path: Path) -> None:
    out = _ok(run_ranks(_restore_worker, 2, str(tmp_path)))
    for rank in (0, 1):
        assert out[rank]["untouched"] and out[rank]["patched"] and out[rank]["restored"]
    assert out[1]["value"] == [0.0] * 4  # rank 0's tensor arrived: the send was a send
    rows = _rows(tmp_path / "job", "SELECT rank, op, peer, bytes, is_async FROM comm ORDER BY rank, seq")
    assert rows == [
        {"rank": 0, "op": "isend", "peer": 1, "bytes": 16, "is_async": True},
        {"rank": 0, "op": "send", "peer": 1, "bytes": 8, "is_async": False},
        {"rank": 1, "op": "irecv", "peer": 0, "bytes": 16, "is_async": True},
        {"rank": 1, "op": "recv", "peer": 0, "bytes": 8, "is_async": False},
    ]
    assert _rows(tmp_path / "alone", "SELECT count(*) AS n FROM comm") == [{"n": 0}]


def _failing_recorder_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import perfscope

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    with perfscope.profile(store, poll_hz=0, gpu_telemetry=False) as prof:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug of ours")

        prof._timeline.begin_collective = broken
        values = []
        for _ in range(3):  # the first call finds the bug; every call still runs
            t = torch.full((2,), float(rank + 1))
            dist.all_reduce(t)
            values.append(t.tolist())
            prof.step()
    dist.destroy_process_group()
    return {"values": values}


def test_a_recorder_failure_is_one_warning_and_the_collectives_still_run(tmp_path: Path) -> None:
    out = _ok(run_ranks(_failing_recorder_worker, 2, str(tmp_path)))
    assert out[0]["values"] == [[3.0, 3.0]] * 3 == out[1]["values"]
    events = _rows(tmp_path, "SELECT rank, kind FROM events ORDER BY rank")
    assert events == [
        {"rank": 0, "kind": "dist_recorder_failed"},
        {"rank": 1, "kind": "dist_recorder_failed"},
    ]
    assert _rows(tmp_path, "SELECT count(*) AS n FROM steps") == [{"n": 6}]
