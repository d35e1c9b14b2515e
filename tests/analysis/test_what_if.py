"""What-if analysis of 3D-parallel jobs (issue 23): the straggler study's real op table imported through
the CLI, synthetic op tables of known causes, hostile op tables refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from perfscope.analysis import Selection, run_analysis
from perfscope.explain import explain
from perfscope.store.open import open_store
from perfscope.store.process_groups import COMM_MEMBERS_SQL

STUDY = Path("/work/shared/traces/straggler-study")
if not STUDY.exists():  # the repository's copy, wherever the checkout is
    STUDY = Path(__file__).resolve().parents[3] / "shared" / "traces" / "straggler-study"


def _cli(*args: str | int | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    env.pop("PERFSCOPE_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, "-m", "perfscope", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _analyze(store: Path) -> dict:
    res = _cli("analyze", store, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.skipif(
    not (STUDY / "trace-ST.parquet").exists(), reason="the straggler study's trace is not here"
)
def test_straggler_study_stage_imbalance(tmp_path: Path) -> None:
    store = tmp_path / "s"
    res = _cli(
        "import", "op-table", STUDY / "trace-ST.parquet", "--meta", STUDY / "meta-ST.yaml", "--store", store
    )
    assert res.returncode == 0, res.stderr
    out = _analyze(store)
    expected = json.loads((STUDY / "expected-ST.json").read_text())
    (w,) = out["what_if"]
    assert w["slowdown"] == pytest.approx(expected["straggler_slowdown"], rel=0.10)
    assert w["by_stage"][0]["stage"] == 3
    assert w["by_stage"][0]["slowdown"] == pytest.approx(expected["by_stage"]["3"], rel=0.10)
    assert w["cause"] == "stage-imbalance"
    assert w["replay_error"] < 0.03
    # its steady steps, the run's own (one step time for the run everywhere: DESIGN.md's warm-up cut)
    (run,) = out["runs"]
    assert w["steps"] == run["steady_steps"] and len(w["by_worker"]) == 8
    assert w["actual_step_ns"] == pytest.approx(run["step_ns"], rel=1e-9)
    # the compute ops carry the excess, as in the study's attribution by op type
    assert {r["op_type"] for r in w["by_op_type"][:2]} == {"forward-compute", "backward-compute"}
    (f,) = [f for f in out["findings"] if f["rule"] == "what-if"]
    assert "stage 3" in f["title"] and "fewer layers" in f["recommendation"]
    # the first finding (issue 31): the long stage, sized by the replay against the run's own step, with
    # the pipeline's waits as its symptoms; no generic communication or straggler verdict on a pipeline
    assert out["findings"][0]["id"] == f["id"], [g["title"] for g in out["findings"]]
    assert f["numbers"]["cost_share"] == pytest.approx(
        f["numbers"]["cost_ns"] / w["actual_step_ns"], rel=1e-9
    )
    rules = {g["rule"] for g in out["findings"]}
    assert not rules & {"communication-share", "straggler"}, rules
    # the layout reached the store
    with open_store(store) as s:
        ranks = s.query(
            "SELECT rank, dp_rank, pp_stage, tp_rank, cp_rank FROM ranks ORDER BY rank"
        ).to_pylist()
        runs = s.query("SELECT dp_size, pp_size, tp_size, cp_size FROM runs").to_pylist()
        groups = s.query(
            f"SELECT DISTINCT group_ranks FROM ({COMM_MEMBERS_SQL}) comm WHERE name = 'grads-reduce-scatter'"
        ).to_pylist()
    assert [(r["dp_rank"], r["pp_stage"]) for r in ranks] == [(r % 2, r // 2) for r in range(8)]
    assert runs == [{"dp_size": 2, "pp_size": 4, "tp_size": 1, "cp_size": 1}]
    assert sorted(g["group_ranks"] for g in groups) == ["0,1", "2,3", "4,5", "6,7"]


def synthetic(
    dp: int,
    pp: int,
    *,
    m: int = 4,
    steps: int = 12,
    fwd: float = 0.010,
    slow: dict[tuple[int, int], float] | None = None,
    noise: float = 0.01,
    seed: int = 0,
    uneven: float = 0.0,
    vpp: int | None = None,
    batched: bool = False,
) -> pa.Table:
    """An op table of a GPipe job (all forwards, then all backwards, blocking send/recv, a
    reduce-scatter per stage over the dp group, a gradient-norm all-reduce over every rank, the
    optimizer), timed by the schedule itself. `slow` multiplies a worker's (dp rank, stage) compute;
    `uneven` multiplies each dp rank's compute in each step by 1 to 1 + uneven at random (the data,
    sequence lengths, differ between dp ranks from step to step).

    `vpp`: instead, Megatron-LM's interleaved 1F1B schedule with vpp model chunks per stage (`m` a
    multiple of pp), each chunk a vpp-th of the stage's layers, timed by a small simulation of its
    own (see `_interleaved`; `batched`: its exchanges recorded as batch_isend_irecv's)."""
    rng = np.random.default_rng(seed)
    slow = slow or {}
    data = 1 + uneven * rng.random((steps, dp))
    rows: list[tuple] = []
    ready = np.zeros((dp, pp))
    xfer = 0.0002
    seq: dict[tuple[int, int, str], int] = {}
    current = [0]  # the step being written

    def emit(
        d: int, s: int, op: str, start: float, end: float, mb: int = -1, mc: int = 0, gmc: int | None = None
    ) -> None:
        k = seq.get((d, s, op), 0)
        seq[(d, s, op)] = k + 1
        rows.append(
            (d, s, s * dp + d, current[0], op, start, end - start, k, mc, mb, s if gmc is None else gmc)
        )

    def took(d: int, s: int, base: float) -> float:
        return base * slow.get((d, s), 1.0) * data[current[0], d] * (1 + noise * rng.standard_normal())

    def compute(d: int, s: int, op: str, base: float, mb: int) -> None:
        t = took(d, s, base)
        emit(d, s, op, ready[d, s], ready[d, s] + t, mb)
        ready[d, s] += t

    for step in range(steps):
        seq.clear()
        current[0] = step
        if vpp is not None:
            for d in range(dp):
                _interleaved(d, pp, vpp, m, fwd, xfer, ready[d], emit, took, batched)
        for phase, order, base in (
            (("forward", range(pp), fwd), ("backward", range(pp - 1, -1, -1), 2 * fwd)) if vpp is None else ()
        ):
            pending = np.zeros((dp, pp))
            for k in range(m):
                prev = None
                for s in order:
                    for d in range(dp):
                        if prev is not None:  # the transfer from the previous stage in this direction
                            start_send, start_recv = pending[d, prev], ready[d, s]
                            end = max(start_send, start_recv) + xfer
                            emit(d, prev, f"{phase}-send", start_send, end)
                            emit(d, s, f"{phase}-recv", start_recv, end)
                            ready[d, prev] = max(ready[d, prev], end)
                            ready[d, s] = end
                        compute(d, s, f"{phase}-compute", base, k)
                        pending[d, s] = ready[d, s]
                    prev = s
        for s in range(pp):
            end = ready[:, s].max() + 0.002
            for d in range(dp):
                emit(d, s, "grads-reduce-scatter", ready[d, s], end)
                ready[d, s] = end
        end = ready.max() + 0.0005
        for s in range(pp):
            for d in range(dp):
                emit(d, s, "optimizer-clip-main-grad", ready[d, s], end)
                ready[d, s] = end
                compute(d, s, "optimizer", 0.003, -1)
    cols = list(zip(*rows, strict=True))
    names = (
        "dp_rank",
        "stage",
        "rank",
        "step",
        "optype",
        "start_ts",
        "duration",
        "seq_id",
        "mc",
        "mb_id",
        "gmc",
    )
    return pa.table({n: list(c) for n, c in zip(names, cols, strict=True)})


def _interleaved(
    d: int,
    pp: int,
    vpp: int,
    m: int,
    fwd: float,
    xfer: float,
    ready: np.ndarray,
    emit: Callable[..., None],
    took: Callable[[int, int, float], float],
    batched: bool = False,
) -> None:
    """One step of dp rank `d`'s pipeline under Megatron-LM's interleaved 1F1B schedule (without
    overlapped communication), from each stage's `ready` time (updated). Stage s runs its m·vpp
    forwards in Megatron's order (the k-th: model chunk (k mod pp·vpp) div pp, micro-batch
    (k div pp·vpp)·pp + k mod pp; the backwards the same with the chunks reversed): a warm-up of
    2·(pp − s − 1) + (vpp − 1)·pp forwards (all of them when m = pp), then a forward and a backward at
    a time, then the remaining backwards. After each of these it exchanges, as Megatron's batched
    send/recv does, the outputs just computed and the inputs of its next forward and next backward
    (posted one after the other, 20 µs apart), and waits for all of them. Virtual stage v = chunk·pp +
    stage feeds v + 1 in the forward and v − 1 in the backward; a transfer ends `xfer` after both of
    its sides are posted. `batched`: a stage's transfers of one exchange are recorded as Megatron-LM's
    batch_isend_irecv is (the straggler study's traces): all posted at once, each lasting until the
    last of them ends. Timed by its own clock: a stage moves when what it waits for is known; a
    stage that can never move is a deadlock (an error here, not a table)."""
    total, group, gap = m * vpp, pp * vpp, 0.0 if batched else 0.00002
    assert m % pp == 0, "Megatron-LM's interleaved schedule runs a multiple of pp micro-batches"
    Op = tuple[str, int, int, int]  # (phase, stage, chunk, micro-batch) of a compute

    def compute_op(s: int, k: int, forward: bool) -> Op:
        c = (k % group) // pp
        return (
            "forward" if forward else "backward",
            s,
            c if forward else vpp - 1 - c,
            (k // group) * pp + k % pp,
        )

    def neighbour(op: Op, toward: int) -> Op | None:
        """The compute of the next (toward 1) or previous (-1) virtual stage on the same micro-batch."""
        v = op[2] * pp + op[1] + toward
        return (op[0], v % pp, v // pp, op[3]) if 0 <= v < group else None

    def feeds(op: Op) -> Op | None:  # the compute that takes op's output
        return neighbour(op, 1 if op[0] == "forward" else -1)

    def fed_by(op: Op) -> Op | None:  # the compute whose output op takes in
        return neighbour(op, -1 if op[0] == "forward" else 1)

    # each stage: segments of (computes, then the transfers exchanged after them)
    plans: list[list[tuple[list[Op], list[tuple[str, Op]]]]] = []
    for s in range(pp):
        warm = total if m == pp else min(2 * (pp - s - 1) + (vpp - 1) * pp, total)
        f = [compute_op(s, k, True) for k in range(total)]
        b = [compute_op(s, k, False) for k in range(total)]
        runs: list[list[Op]] = [[x] for x in f[:warm]]
        runs += [[f[warm + j], b[j]] for j in range(total - warm)] + [[x] for x in b[total - warm :]]
        plan: list[tuple[list[Op], list[tuple[str, Op]]]] = [([], [("recv", f[0])])]
        nf, nb = 0, 0  # the next forward and backward not yet received
        for ops in runs:
            sends = [("send", x) for x in ops]
            nf += sum(x[0] == "forward" for x in ops)
            nb += sum(x[0] == "backward" for x in ops)
            recvs = [("recv", f[nf])] if nf < total else []
            if nf >= warm and nb < total and (nb > 0 or nf == warm):
                recvs.append(("recv", b[nb]))
            plan.append((ops, sends + recvs))
        for _, xs in plan:  # only the transfers that have a peer
            xs[:] = [(kind, x) for kind, x in xs if (feeds(x) if kind == "send" else fed_by(x)) is not None]
        plans.append(plan)

    sent: dict[Op, float] = {}  # a compute's output: when its send was posted
    wanted: dict[Op, float] = {}  # a compute's input: when its recv was posted
    pos, clock, waiting = [0] * pp, [float(x) for x in ready], [False] * pp
    while any(pos[s] < len(plans[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while pos[s] < len(plans[s]):
                ops, xs = plans[s][pos[s]]
                if not waiting[s]:  # run the computes, then post the transfers
                    for op in ops:
                        dur = took(d, s, (fwd if op[0] == "forward" else 2 * fwd) / vpp)
                        emit(d, s, f"{op[0]}-compute", clock[s], clock[s] + dur, op[3], op[2], op[2] * pp + s)
                        clock[s] += dur
                    for n, (kind, x) in enumerate(xs):
                        (sent if kind == "send" else wanted)[x] = clock[s] + n * gap
                    waiting[s], moved = True, True
                other: list[Op] = []
                for kind, x in xs:
                    o = feeds(x) if kind == "send" else fed_by(x)
                    assert o is not None  # transfers without a peer were left out of the plan
                    other.append(o)
                seen = [
                    (wanted if kind == "send" else sent).get(o)
                    for (kind, _), o in zip(xs, other, strict=True)
                ]
                if None in seen:
                    break
                t = clock[s]
                done = [max(t + n * gap, float(p or 0.0)) + xfer for n, p in enumerate(seen)]
                end = max([t, *done])
                for n, (kind, x) in enumerate(xs):  # batched: each op as long as the whole batch
                    emit(d, s, f"{x[0]}-{kind}", t + n * gap, end if batched else done[n], -1, -1, -1)
                clock[s], waiting[s], moved = end, False, True
                pos[s] += 1
        if not moved:
            raise AssertionError(f"the interleaved schedule deadlocks at {pos}")
    ready[:] = clock


def _what_if(
    tmp_path: Path,
    table: pa.Table,
    dp: int,
    pp: int,
    name: str = "t",
    *args: str | int,
    csv: bool = False,
    sel: Selection | None = None,
) -> dict:
    path = tmp_path / f"{name}.{'csv' if csv else 'parquet'}"
    if csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    store = tmp_path / f"store-{name}"
    res = _cli("import", "op-table", path, "--dp", dp, "--pp", pp, "--store", store, *args)
    assert res.returncode == 0, res.stderr
    with open_store(store) as s:
        (row,) = run_analysis("what_if", s, sel or Selection()).to_pylist()
        row["findings"] = [g for f in explain(s) for g in f.flatten() if g.rule == "what-if"]
    return row


def _recorded_step(table: pa.Table) -> float:
    """Mean step time of a synthetic table (its steps follow one another)."""
    step = np.asarray(table.column("step"))
    start = np.asarray(table.column("start_ts"))
    end = start + np.asarray(table.column("duration"))
    return float(np.mean([end[step == k].max() - start[step == k].min() for k in np.unique(step)]))


def test_slow_worker_named_and_ideal_is_the_job_without_it(tmp_path: Path) -> None:
    slow = synthetic(4, 2, slow={(2, 1): 1.6})
    w = _what_if(tmp_path, slow, 4, 2)
    assert w["cause"] == "slow-worker"
    top = w["by_worker"][0]
    assert (top["dp_rank"], top["stage"], top["ranks"]) == (2, 1, [6])
    assert w["replay_error"] < 0.01
    # the ideal step is the same job without the slow worker, within 5%
    without = _recorded_step(synthetic(4, 2))
    assert w["ideal_step_ns"] / 1e9 == pytest.approx(without, rel=0.05)
    assert w["slowdown"] > 1.2
    (f,) = w["findings"]
    assert (
        "dp rank 2 at stage 1" in f.title
        and "rank 6" in f.title
        and "replace or cordon" in f.recommendation.lower()
    )
    assert f.numbers["cost_ns"] == pytest.approx(w["actual_step_ns"] - w["ideal_step_ns"], rel=0.1)


def test_each_workers_slowdown_is_given_per_step(tmp_path: Path) -> None:
    """The heat map over steps: a worker slow from step 6 on is slow in those steps' bins only, and the
    bins' means give back its whole-run slowdown."""
    from perfscope.analysis import what_if as wi

    first = synthetic(4, 2, steps=6, seed=1)
    later = synthetic(4, 2, steps=6, seed=2, slow={(2, 1): 1.8})
    shift = pc.add(later.column("step"), 6)
    both = pa.concat_tables([first, later.set_column(later.schema.get_field_index("step"), "step", shift)])
    start = np.asarray(both.column("start_ts"), dtype=float)
    span = float(np.asarray(first.column("start_ts")).max() + np.asarray(first.column("duration")).max())
    start[first.num_rows :] += span + 0.01  # the later steps after the first ones
    both = both.set_column(both.schema.get_field_index("start_ts"), "start_ts", pa.array(start))
    # every step (no warm-up cut: the heat map's bins are the table's steps)
    w = _what_if(tmp_path, both, 4, 2, sel=Selection(warmup_steps=0))
    assert w["steps"] == 12 and w["steps_per_bin"] == 1
    by = {(x["dp_rank"], x["stage"]): x for x in w["by_worker"]}
    slow = by[(2, 1)]["step_slowdown"]
    assert len(slow) == 12 and all(s > 1.15 for s in slow[6:]) and all(s < 1.05 for s in slow[:6]), slow
    assert max(max(x["step_slowdown"]) for k, x in by.items() if k != (2, 1)) < 1.05
    # bins of several steps when a run has more steps than bins
    t, ideal = np.array([2.0, 2.0, 1.0, 1.0, 3.0]), np.ones(5)
    assert wi._binned_ratios(t, ideal, 2) == [2.0, 1.0, 3.0]


def test_balanced_job_has_no_cause(tmp_path: Path) -> None:
    w = _what_if(tmp_path, synthetic(4, 2), 4, 2)
    assert w["cause"] == "none"
    assert w["slowdown"] == pytest.approx(1.0, abs=0.03)
    assert w["replay_error"] < 0.01
    assert w["findings"] == []


def test_long_stage_is_stage_imbalance(tmp_path: Path) -> None:
    w = _what_if(tmp_path, synthetic(2, 3, slow={(0, 1): 1.8, (1, 1): 1.8}), 2, 3)
    assert w["cause"] == "stage-imbalance"
    assert w["by_stage"][0]["stage"] == 1
    (f,) = w["findings"]
    assert "stage 1" in f.title and "fewer layers" in f.recommendation


def test_work_that_moves_between_dp_ranks_is_data_imbalance(tmp_path: Path) -> None:
    w = _what_if(tmp_path, synthetic(4, 2, uneven=0.5, steps=16), 4, 2)
    assert w["cause"] == "data-imbalance"
    assert w["slowdown"] > 1.05
    (f,) = w["findings"]
    assert "sequence packing" in f.recommendation


def test_data_parallel_job_without_pipeline(tmp_path: Path) -> None:
    """pp = 1: a DDP-like job whose dp rank 1 is slow; the ideal is the job without the delay."""
    w = _what_if(tmp_path, synthetic(2, 1, slow={(1, 0): 1.5}), 2, 1)
    assert w["cause"] == "slow-worker" and w["by_worker"][0]["dp_rank"] == 1
    assert w["ideal_step_ns"] / 1e9 == pytest.approx(_recorded_step(synthetic(2, 1)), rel=0.05)


def _hostile(tmp_path: Path, table: pa.Table, *args: str, name: str = "h.parquet") -> str:
    path = tmp_path / name
    if name.endswith(".csv"):
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    res = _cli("import", "op-table", path, "--store", tmp_path / "store", *args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert not list((tmp_path / "store").glob("*/run_id=*"))  # nothing of the run is left
    return lines[0]


def _with(table: pa.Table, column: str, values: list) -> pa.Table:
    i = table.column_names.index(column)
    return table.set_column(i, column, pa.array(values))


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "no column duration"),
        ("nan", "duration holds nan"),
        ("negative", "no negative"),
        ("rank", "column rank holds 1000000000"),
        ("claimed", "no job has more than"),
        ("meta", "only flat 'key: value' lines"),
        ("world", "contradicts itself"),
        ("span", "no job runs that long"),
        ("csv-nan", "duration holds nan"),
    ],
)
def test_hostile_op_tables_are_refused_in_one_line(tmp_path: Path, case: str, says: str) -> None:
    good = synthetic(2, 2, steps=2)
    n = good.num_rows
    meta = tmp_path / "meta.yaml"
    meta.write_text("dp_size: 2\npp_size: 2\n")
    layout = ("--dp", "2", "--pp", "2")
    if case == "missing":
        line = _hostile(tmp_path, good.drop_columns(["duration"]), *layout)
    elif case == "nan":
        line = _hostile(tmp_path, _with(good, "duration", [float("nan")] * n), "--meta", str(meta))
    elif case == "negative":
        line = _hostile(tmp_path, _with(good, "duration", [-1.0] * n), *layout)
    elif case == "rank":
        line = _hostile(tmp_path, _with(good, "rank", [10**9] * n), *layout)
    elif case == "claimed":
        line = _hostile(tmp_path, good, "--dp", str(10**9), "--pp", "2")
    elif case == "world":
        meta.write_text("dp_size: 2\npp_size: 2\nworld_size: 1000000\n")
        line = _hostile(tmp_path, good, "--meta", str(meta))
    elif case == "span":  # every step restarts its clock and lasts a year
        line = _hostile(tmp_path, _with(good, "duration", [3.0e7] * n), *layout)
    elif case == "meta":
        meta.write_text("dp_size: 2\nparallel:\n  pp_size: 2\n")
        line = _hostile(tmp_path, good, "--meta", str(meta))
    else:
        line = _hostile(tmp_path, _with(good, "duration", [float("nan")] * n), *layout, name="h.csv")
    assert line.startswith("perfscope import: error: ") and says in line, line


def test_version_2_stores_read_the_layout_as_null(tmp_path: Path) -> None:
    """Segments written before schema version 3 lack the layout columns: they read as NULL, and
    what_if leaves such runs out instead of failing."""
    from perfscope.store.schema import META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES

    assert SCHEMA_VERSION >= 3
    store = tmp_path / "store-old"
    path = tmp_path / "t.parquet"
    pq.write_table(synthetic(2, 2, steps=3), path)
    assert _cli("import", "op-table", path, "--dp", 2, "--pp", 2, "--store", store).returncode == 0
    for table in ("runs", "ranks", "comm"):
        new = [c.name for c in TABLES[table].columns if c.since >= 3]
        for seg in (store / table).glob("run_id=*/*.parquet"):
            t = pq.read_table(seg, partitioning=None).drop_columns(new)
            meta = {META_TABLE: table.encode(), META_VERSION: b"2"}
            pq.write_table(t.replace_schema_metadata(meta), seg)
    with open_store(store) as s:
        ranks = s.query("SELECT count(*) AS n, count(dp_rank) AS laid FROM ranks").to_pylist()
        comm = s.query(
            "SELECT count(*) AS n, count(coalesce(group_id, group_ranks)) AS grouped FROM comm"
        ).to_pylist()
        runs = s.query("SELECT dp_size, pp_size FROM runs").to_pylist()
        assert run_analysis("what_if", s, Selection()).num_rows == 0
    assert ranks == [{"n": 4, "laid": 0}] and comm[0]["n"] > 0 and comm[0]["grouped"] == 0
    assert runs == [{"dp_size": None, "pp_size": None}]
    assert _analyze(store)["what_if"] == []


def test_csv_reads_as_parquet(tmp_path: Path) -> None:
    table = synthetic(4, 2, slow={(2, 1): 1.6}, steps=6)
    a = _what_if(tmp_path, table, 4, 2, "p")
    b = _what_if(tmp_path, table, 4, 2, "c", csv=True)
    assert b["cause"] == a["cause"] == "slow-worker"
    assert b["slowdown"] == pytest.approx(a["slowdown"], rel=1e-3)


def test_a_worker_is_all_its_tensor_parallel_ranks(tmp_path: Path) -> None:
    """tp 2: every op of the table runs on both tensor-parallel ranks of its worker (Megatron-LM's
    rank order: tp fastest); the slow worker is named with both ranks, and its peers are matched
    tp rank with tp rank."""
    base = synthetic(2, 2, slow={(1, 1): 1.6}, steps=6)
    parts = []
    for tp_rank in range(2):
        rank = pc.add(pc.multiply(base.column("rank"), 2), tp_rank)
        parts.append(base.set_column(base.column_names.index("rank"), "rank", rank))
    w = _what_if(tmp_path, pa.concat_tables(parts), 2, 2, "tp", "--tp", 2)
    assert w["cause"] == "slow-worker"
    top = w["by_worker"][0]
    assert (top["dp_rank"], top["stage"], top["ranks"]) == (1, 1, [6, 7])
    assert w["replay_error"] < 0.01


@pytest.mark.parametrize(
    ("dp", "pp", "slow", "uneven"),
    [(4, 4, {(0, 0): 2.0}, 0.0), (8, 2, None, 0.5), (2, 1, {(1, 0): 1.3}, 0.0)],
    ids=["dp4xpp4-worker-0-0-at-2x", "dp8xpp2-random-lengths", "dp2-one-slow-rank"],
)
def test_the_ideal_is_the_job_without_the_cause(
    tmp_path: Path, dp: int, pp: int, slow: dict[tuple[int, int], float] | None, uneven: float
) -> None:
    """Synthetic jobs whose truth is known (issue 31): the ideal step lies within 5% of the same job
    without its cause (the slow worker at its peers' speed; the random sequence lengths replaced by
    their mean, every rank's share equal), and no part's slowdown exceeds the whole's."""
    w = _what_if(tmp_path, synthetic(dp, pp, slow=slow, uneven=uneven, steps=16, seed=3), dp, pp)
    truth = _recorded_step(synthetic(dp, pp, fwd=0.010 * (1 + uneven / 2), steps=16, seed=3))
    assert w["ideal_step_ns"] / 1e9 == pytest.approx(truth, rel=0.05), (w["slowdown"], w["cause"])
    assert all(
        r["slowdown"] <= w["slowdown"] + 1e-12 for k in ("by_worker", "by_stage", "by_op_type") for r in w[k]
    )
    if slow:
        (worker,) = slow
        top = w["by_worker"][0]
        assert w["cause"] == "slow-worker" and (top["dp_rank"], top["stage"]) == worker, w["cause"]
    else:
        assert w["cause"] == "data-imbalance"


def test_an_imported_pipeline_with_a_long_stage_gets_the_pipeline_story_first(tmp_path: Path) -> None:
    """Issue 31's pipeline: pp 4 x dp 2, stage 2 at 1.5x the others. The first finding is the what-if's
    stage 2, its cost against the run's own step; the pipeline's waits are its symptoms (the bubble),
    never the generic communication-share or a straggler rank (ranks of one stage are identical), and
    every figure uses the run's step time."""
    table = synthetic(2, 4, slow={(0, 2): 1.5, (1, 2): 1.5}, steps=16)
    path = tmp_path / "pp.parquet"
    pq.write_table(table, path)
    store = tmp_path / "store"
    res = _cli("import", "op-table", path, "--dp", 2, "--pp", 4, "--store", store)
    assert res.returncode == 0, res.stderr
    out = _analyze(store)
    (run,) = out["runs"]
    (w,) = out["what_if"]
    assert w["cause"] == "stage-imbalance" and w["by_stage"][0]["stage"] == 2
    assert w["actual_step_ns"] == pytest.approx(run["step_ns"], rel=1e-6)
    first = out["findings"][0]
    titles = [f["title"] for f in out["findings"]]
    assert first["rule"] == "what-if" and first["numbers"]["stage"] == 2, titles
    n = first["numbers"]
    assert n["cost_share"] == pytest.approx(n["cost_ns"] / run["step_ns"], rel=1e-6)

    def rules(fs: list[dict]) -> set[str]:
        return {f["rule"] for f in fs} | {r for f in fs for r in rules(f["symptoms"] + f["also_in"])}

    assert not rules(out["findings"]) & {"communication-share", "straggler"}
    # the stages wait for the long one for more than a quarter of the step: the bubble is said
    assert "pipeline-bubble" in rules(out["findings"])
