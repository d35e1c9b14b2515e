"""A tensor-parallel all-reduce is never read as gradient sync (issue 23): a dp2 x tp2 store whose
every step has a large all-reduce on each tp pair (in forward) and a small one on each dp pair (the
gradient sync), its ranks' coordinates in `ranks`, written through the real StoreWriter."""

from __future__ import annotations

import pytest
from storegen import DEFAULT_PHASES, MS, PHASE_ORDER, T0_NS, make_run, row

from perfscope.analysis import run_analysis
from perfscope.explain import explain
from perfscope.explain.words import dur
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

STEPS = 40
#: rank = dp_rank * 2 + tp_rank: tp pairs {0,1}, {2,3}, dp pairs {0,2}, {1,3}
TP = ((0, 1), (2, 3))
DP = ((0, 2), (1, 3))
TP_BYTES, TP_NS = 64 * 2**20, 6 * MS  # large, in forward
DP_BYTES, DP_NS = 2**20, 1 * MS  # small, the gradient sync


def _group(groups: tuple[tuple[int, ...], ...], rank: int) -> str:
    return ",".join(map(str, next(g for g in groups if rank in g)))


def _store(root, *, coords: bool, tp_ns: int = TP_NS, tp_name: str | None = None) -> None:
    """Steps as the recorder writes them: the tp call's exposed time left forward for
    sync_exposed_ns, comm_total_ns and comm_count count both calls."""
    make_run(root, "tpdp", world_size=4, steps=0, ranks_present=set())  # the runs row
    w = StoreWriter(root, "tpdp", writer_id="gen-tpdp-layout")
    step_len = int(sum(DEFAULT_PHASES.values())) + tp_ns + DP_NS
    steps, comm = [], []
    for step in range(STEPS):
        t = T0_NS + step * step_len
        for r in range(4):
            ph = dict(DEFAULT_PHASES, sync_exposed=DEFAULT_PHASES["sync_exposed"] + tp_ns + DP_NS)
            steps.append(
                row("steps", rank=r, step=step, start_ns=t, step_ns=step_len,
                    **{f"{p}_ns": int(ph[p]) for p in PHASE_ORDER},
                    comm_total_ns=tp_ns + DP_NS, comm_count=2, samples=32, clock="cuda")
            )  # fmt: skip
            tp_at = t + int(DEFAULT_PHASES["data"] + DEFAULT_PHASES["forward"])
            dp_at = tp_at + tp_ns + int(DEFAULT_PHASES["backward"])
            for seq, (groups, nbytes, at, length, phase) in enumerate(
                ((TP, TP_BYTES, tp_at, tp_ns, "forward"), (DP, DP_BYTES, dp_at, DP_NS, "sync"))
            ):
                comm.append(
                    row("comm", rank=r, step=step, seq=seq, op="allreduce", bytes=nbytes, start_ns=at,
                        dur_ns=length, exposed_ns=length, phase=phase, is_async=False, clock="cuda",
                        group_size=2, group_ranks=_group(groups, r), name=tp_name if seq == 0 else None)
                )  # fmt: skip
    w.extend("steps", steps)
    w.extend("comm", comm)
    for r in range(4):
        laid = {"dp_rank": r // 2, "pp_stage": 0, "tp_rank": r % 2, "cp_rank": 0} if coords else {}
        w.append("ranks", row("ranks", rank=r, local_rank=r, node_rank=0, hostname="node0", pid=1000 + r,
                              clock_offset_ns=0, cpu_count=64, started_ns=T0_NS, **laid))  # fmt: skip
    w.close()


def _read(root) -> tuple[dict, list[dict]]:
    with open_store(root) as store:
        return run_analysis("sync", store).to_pylist()[0], run_analysis("collectives", store).to_pylist()


def test_gradient_sync_counts_the_data_parallel_all_reduces_only(tmp_path):
    _store(tmp_path, coords=True)
    s, coll = _read(tmp_path)
    # per rank and step one dp call of DP_NS: the tp call (6x longer, 64x larger) is not gradient sync
    assert s["comm_count"] == pytest.approx(1.0)
    assert s["comm_total_ns"] == pytest.approx(DP_NS, rel=1e-6)
    assert s["bytes_per_step"] == pytest.approx(DP_BYTES)
    assert s["sync_exposed_ns"] == pytest.approx(DEFAULT_PHASES["sync_exposed"] + DP_NS, rel=1e-6)
    # a pair's ring: busbw = algbw · 2(2−1)/2
    assert s["busbw_gb_per_s"] == pytest.approx(DP_BYTES / (DP_NS / 1e9) / 1e9, rel=1e-6)
    # the tensor-parallel all-reduces under their own figure
    assert s["tp_comm_count"] == pytest.approx(1.0)
    assert s["tp_comm_total_ns"] == pytest.approx(TP_NS, rel=1e-6)
    assert s["tp_comm_exposed_ns"] == pytest.approx(TP_NS, rel=1e-6)
    kinds = {c["bytes"]: c["group_kind"] for c in coll}
    assert kinds == {TP_BYTES: "tensor-parallel", DP_BYTES: "data-parallel"}


def test_without_coordinates_every_all_reduce_stays_gradient_sync(tmp_path):
    _store(tmp_path, coords=False)
    s, coll = _read(tmp_path)
    # unknown groups keep the reading from before: both calls are sync
    assert s["comm_count"] == pytest.approx(2.0)
    assert s["comm_total_ns"] == pytest.approx(TP_NS + DP_NS, rel=1e-6)
    assert s["bytes_per_step"] == pytest.approx(TP_BYTES + DP_BYTES)
    assert s["sync_exposed_ns"] == pytest.approx(DEFAULT_PHASES["sync_exposed"] + TP_NS + DP_NS, rel=1e-6)
    assert s["tp_comm_total_ns"] is None and s["tp_comm_count"] is None
    assert {c["group_kind"] for c in coll} == {"unknown"}


def test_a_communication_bound_finding_names_the_tensor_parallel_part(tmp_path):
    # N=1 beside the dp2 x tp2 run, whose tp all-reduces (20 ms a step) make most of the loss
    make_run(tmp_path, "one", world_size=1)
    _store(tmp_path, coords=True, tp_ns=20 * MS)
    with open_store(tmp_path) as store:
        found = [g for f in explain(store) for g in f.flatten() if g.rule == "communication-bound"]
    assert len(found) == 1
    f = found[0]
    assert f.numbers["tp_comm_exposed_ns"] == pytest.approx(20 * MS, rel=1e-6)
    assert "Exposed gradient sync" not in f.text
    assert f"{dur(20 * MS)} is tensor-parallel communication" in f.text
    assert "not gradient sync" in f.text


def test_each_group_is_named_by_the_coordinates_its_members_differ_in(tmp_path):
    # 8 ranks, rank = (stage * 2 + dp_rank) * 2 + tp_rank (Megatron-LM's order, cp 1); one all-reduce
    # per group of each kind, told apart by its bytes
    groups = {
        "tensor-parallel": [(0, 1), (2, 3), (4, 5), (6, 7)],
        "data-parallel": [(0, 2), (1, 3), (4, 6), (5, 7)],
        "pipeline": [(0, 4), (1, 5), (2, 6), (3, 7)],
        "mixed": [(0, 1, 2, 3), (4, 5, 6, 7)],  # tp x dp of one stage
        "world": [tuple(range(8))],
        "unknown": [(0, 1, 9)],  # rank 9 has no coordinates
    }
    make_run(tmp_path, "l8", world_size=8, steps=0, ranks_present=set())
    w = StoreWriter(tmp_path, "l8", writer_id="gen-l8-layout")
    rows = []
    for step in range(STEPS):
        w.extend(
            "steps",
            [row("steps", rank=r, step=step, start_ns=T0_NS + step * 50 * MS, step_ns=50 * MS, samples=32,
                 clock="cuda") for r in range(8)],
        )  # fmt: skip
        for seq, gs in enumerate(groups.values()):
            for g in gs:
                for r in g:
                    at = T0_NS + step * 50 * MS + seq * MS
                    rows.append(
                        row("comm", rank=r, step=step, seq=seq, op="allreduce", bytes=1000 + seq,
                            start_ns=at, dur_ns=MS // 2, clock="cuda", group_size=len(g),
                            group_ranks=",".join(map(str, g)))
                    )  # fmt: skip
    w.extend("comm", rows)
    for r in range(8):
        w.append("ranks", row("ranks", rank=r, local_rank=r, node_rank=0, hostname="node0", pid=1000 + r,
                              clock_offset_ns=0, cpu_count=64, started_ns=T0_NS, dp_rank=(r // 2) % 2,
                              pp_stage=r // 4, tp_rank=r % 2, cp_rank=0))  # fmt: skip
    w.close()
    with open_store(tmp_path) as store:
        coll = run_analysis("collectives", store).to_pylist()
    got: dict[int, set[str]] = {}
    for c in coll:
        got.setdefault(c["bytes"], set()).add(c["group_kind"])
    assert got == {1000 + i: {kind} for i, kind in enumerate(groups)}


def test_a_gradient_all_reduce_on_the_tensor_parallel_group_is_gradient_sync(tmp_path):
    """Megatron-LM all-reduces the layernorm gradients on the tensor-parallel group (an op table names
    it layernorm-grads-all-reduce): gradient sync by its name, whatever its group."""
    _store(tmp_path, coords=True, tp_name="layernorm-grads-all-reduce")
    s, coll = _read(tmp_path)
    assert s["comm_count"] == pytest.approx(2.0)
    assert s["comm_total_ns"] == pytest.approx(TP_NS + DP_NS, rel=1e-6)
    assert s["bytes_per_step"] == pytest.approx(TP_BYTES + DP_BYTES)
    assert s["tp_comm_count"] is None and s["tp_comm_total_ns"] is None
    # its group is still named for what it is
    assert {c["bytes"]: c["group_kind"] for c in coll} == {
        TP_BYTES: "tensor-parallel",
        DP_BYTES: "data-parallel",
    }
