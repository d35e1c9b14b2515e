"""What-if analysis of 3D-parallel runs: what each step would take without each slow worker, stage or
op type (DESIGN.md, "Parallel layout and what-if"; the method of the public straggler study).

For every run whose ranks have coordinates (ranks.dp_rank, pp_stage) and op-level rows (spans of
depth 1 and comm rows), every recorded pure data-parallel run (`_dp_only_runs`) and every recorded
pipeline (`_staged_runs`: its phases cut at the blocking transfers inside them), each step's
dependency graph is built from what was recorded:

- each rank's ops in recorded order: an op waits for the latest op of its rank that ended before it
  started (ops that overlap, a compute and a transfer on another stream, run side by side), plus the
  launch gap recorded between the two;
- a point-to-point send and its recv (the k-th send from a to b with the k-th recv on b from a; in
  an imported op table, of the same direction, forward or backward: an interleaved pipeline's two
  stages of pp = 2 send each other both, and NCCL keeps each direction's order), the
  transfers one rank launched together (same start: Megatron-LM's batched send/recv), and the members
  of a collective (the k-th call of the same name on the same process group, comm.group_ranks) make
  one sync group: none ends before its last member enters; each member then takes its own recorded
  transfer time (its end − the last member's entry).

Replaying the graph with the recorded times gives the recorded step (the replay error is reported).
The ideal step replays every op with the typical (lower median) time and launch gap of the same op
(same name, same position in the step) at its data-parallel peers (same stage, same step), averaged
over the pipeline stages that run it: what a balanced job without a slow worker would do. (DESIGN.md
says "among its data-parallel peers, same stage"; without the average over stages a stage that is too
long at every dp rank would stay in the ideal, and stage imbalance, the issue's own example, could not
be seen. The average keeps the job's work: a balanced pipeline shares it evenly.) Attribution
replays the ideal with one worker's (dp rank at a stage, all its tensor and context ranks), one
stage's or one op type's ops as recorded.
Everything is vectorised: the graph is replayed level by level, linear in the number of ops.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..store.reader import Store
from .cache import memo
from .comm_patterns import P2P_OPS
from .registry import analysis, run_analysis
from .selection import Selection, sql_literal
from .steady import roles_table, run_stats_table, runs_table, thresholds_table

#: an op that ends this little after another starts still counts as before it (clock rounding: the
#: study's float32 seconds hold 2 s to about 0.1 µs, its ops' recorded ends drift by up to ~10 µs)
PRED_SLACK_NS = 100_000
#: slowdown under which a run has no straggler worth naming (the study's decomposition threshold)
NONE_BELOW = 1.03
#: a share of the excess that "explains most of it"
MAJOR_SHARE = 0.5
#: a stage's share that counts as small beside the imbalanced one
MINOR_SHARE = 0.1
#: compute differs across dp ranks beyond noise: the time by which ops differ from the median of the same
#: op at their dp peers, over the compute time (a share of time: a tiny op's jitter, large relative to
#: itself, is not the job's work differing; the median of per-op relative spreads read the scheduling
#: noise of a recorded DDP job's 0.2 ms optimizer and 1 ms backward on a loaded machine as data
#: imbalance)
DATA_SPREAD = 0.05
#: a dp rank slowest in more than this share of (step, stage) cells is a fixed worker
FIXED_SLOWEST = 0.6
#: a stage's compute is longer than the median stage's by this much to count as longer
LONGER = 0.02
#: the grid of (step, dp rank, stage) cells the causes compare holds at most this many cells per op
#: (or GRID_MIN): a full layout has about one cell per worker's ops in a step
GRID_PER_OP = 4
GRID_MIN = 1_000_000


@dataclass
class Graph:
    n: int
    step_code: np.ndarray  # step index per op (0..steps-1)
    step_start: np.ndarray  # per step: earliest recorded start (ns, float)
    recorded_step: np.ndarray  # per step: recorded step time (ns)
    pred: np.ndarray  # per op: previous op on its rank, or -1
    x: np.ndarray  # recorded time per op (duration, or transfer after the last member's entry)
    gap: np.ndarray  # recorded launch gap per op
    # the replay's layout: ops in level order (`perm`), so that each level is one slice
    perm: np.ndarray  # op index at each replay position
    pred_pos: np.ndarray  # replay position of each position's previous op; n when it has none
    base: np.ndarray  # per position: its step's start when it has no previous op, else -inf
    levels: list[tuple[int, int, np.ndarray, np.ndarray]]  # (lo, hi, group starts in the slice, group of op)
    by_step: np.ndarray  # replay positions sorted by step
    step_bounds: np.ndarray  # where each step begins in by_step


def _codes(*cols: np.ndarray) -> np.ndarray:
    """One int code per distinct row of the columns (dense, in the rows' sort order), column by
    column: 1-D uniques, far faster than one over rows."""
    code = np.zeros(len(cols[0]), dtype=np.int64)
    for c in cols:
        inv = np.unique(np.asarray(c, dtype=np.int64), return_inverse=True)[1].reshape(-1)
        code = np.unique(code * (int(inv.max(initial=0)) + 1) + inv, return_inverse=True)[1].reshape(-1)
    return code


def _components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Connected components of ops linked by edges (a, b): a label per op (vectorised union-find)."""
    lab = np.arange(n)
    if len(a) == 0:
        return lab
    while True:
        m = np.minimum(lab[a], lab[b])
        before = lab.copy()
        np.minimum.at(lab, a, m)
        np.minimum.at(lab, b, m)
        lab = lab[lab]
        if np.array_equal(lab, before):
            return lab


def _group_edges(code: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges linking every valid op to the first op of the same code."""
    idx = np.flatnonzero(valid)
    if len(idx) == 0:
        return idx, idx
    c = code[idx]
    first: dict[int, int] = {}
    uniq, first_pos = np.unique(c, return_index=True)
    first = dict(zip(uniq.tolist(), idx[first_pos].tolist(), strict=True))
    reps = np.array([first[v] for v in c.tolist()], dtype=np.int64)
    return idx, reps


def _medians(group: np.ndarray, values: np.ndarray, *, lower: bool = False) -> np.ndarray:
    """Per element: the median of `values` over its group (`lower`: of an even count, the lower of the
    two middle values)."""
    if len(values) == 0:
        return np.asarray(values, dtype=np.float64).copy()
    order = np.lexsort((values, group))
    g, v = group[order], values[order]
    counts = np.bincount(g)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    lo = v[starts + np.maximum(counts - 1, 0) // 2]
    med = lo if lower else (lo + v[starts + counts // 2]) / 2.0
    return med[group]


def _latest_before(by_end: np.ndarray, pos: np.ndarray, ties: np.ndarray) -> np.ndarray:
    """For each op k of `ties` (ascending): the op at the last position p <= pos[k] of the end order
    `by_end` whose index is below k, or -1. Ops are taken out of the end order from the last index
    down (union-find over positions, path halving: each deleted position points at the one before
    it), so every query and deletion is amortised O(1): linear, where stepping back one position at
    a time was quadratic in the ops that end at one instant."""
    m = len(by_end)
    at = np.empty(m, dtype=np.int64)
    at[by_end] = np.arange(m)  # the end-order position of each op
    parent = list(range(m + 1))  # position p + 1 -> p + 1 while present; 0 is "none"
    at_l, pos_l = at.tolist(), pos.tolist()
    ties_l = ties.tolist()
    out = []
    deleted_to = m  # ops with index >= deleted_to are out of the order
    for k in reversed(ties_l):
        while deleted_to > k:
            deleted_to -= 1
            p = at_l[deleted_to] + 1
            parent[p] = p - 1
        p = pos_l[k] + 1
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        out.append(int(by_end[p - 1]) if p > 0 else -1)
    return np.asarray(out[::-1], dtype=np.int64)


def build(cols: dict[str, np.ndarray]) -> Graph | None:
    """The dependency graph of one run's ops (sorted by step, rank, start), or None when cyclic."""
    n = len(cols["rank"])
    step, rank = cols["step"], cols["rank"]
    start, dur = cols["start_ns"].astype(np.float64), cols["dur_ns"].astype(np.float64)
    end = start + dur
    steps, step_code = np.unique(step, return_inverse=True)
    step_start = np.full(len(steps), np.inf)
    np.minimum.at(step_start, step_code, start)
    step_end = np.zeros(len(steps))
    np.maximum.at(step_end, step_code, end)

    # previous op on the rank: the latest end at or before this op's start, among ops before it
    pred = np.full(n, -1, dtype=np.int64)
    lane = _codes(step_code, rank)
    bounds = np.flatnonzero(np.diff(lane)) + 1
    for lo, hi in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [n]]), strict=True):
        ends = end[lo:hi]
        by_end = np.argsort(ends, kind="stable")
        pos = np.searchsorted(ends[by_end], start[lo:hi] + PRED_SLACK_NS, side="right") - 1
        found = np.where(pos >= 0, by_end[np.maximum(pos, 0)], -1)
        here = np.arange(hi - lo)
        ties = np.flatnonzero(found >= here)
        if len(ties):  # ops that end by this one's start but come after it: the latest one before it
            found[ties] = _latest_before(by_end, pos, ties)
        pred[lo:hi] = np.where(found >= 0, lo + found, -1)
    base = np.where(pred >= 0, end[np.maximum(pred, 0)], step_start[step_code])
    gap = np.maximum(start - base, 0.0)
    if cols.get("anchor_lanes") is not None:
        # a data-parallel rank's step starts when its previous step ended (its optimizer, then the
        # next batch): a rank that starts late does so for the previous step's excess, already replayed
        # there. Each rank's step is replayed from the step's start, its ops kept as recorded after it,
        # and the recorded step is the longest of the ranks' steps so aligned.
        lanes = _codes(step_code, rank)
        first_in_lane = np.full(int(lanes.max(initial=-1)) + 1, np.inf)
        np.minimum.at(first_in_lane, lanes, start)
        lane_start = first_in_lane[lanes]
        gap = np.where(pred >= 0, gap, np.maximum(start - lane_start, 0.0))
        step_end = np.zeros(len(steps))
        np.maximum.at(step_end, step_code, end - (lane_start - step_start[step_code]))

    # sync groups: p2p pairs, batched transfers, collectives
    peer, is_send, grp, name, nth, pnth = (cols[k] for k in ("peer", "is_send", "grp", "name", "nth", "pnth"))
    p2p = peer >= 0
    src = np.where(is_send, rank, peer)
    dst = np.where(is_send, peer, rank)
    pdir = cols.get("pdir", np.zeros(n, dtype=np.int64))  # forward 0, backward 1 (`_columns`)
    a1, b1 = _group_edges(_codes(step_code, src, dst, pdir, pnth), p2p)
    a2, b2 = _group_edges(_codes(step_code, rank, start.astype(np.int64)), p2p)
    coll = (grp >= 0) & ~p2p
    a3, b3 = _group_edges(_codes(step_code, grp, name, nth), coll)
    comp = _components(n, np.concatenate([a1, a2, a3]), np.concatenate([b1, b2, b3]))
    enter_max = np.full(n, -np.inf)
    np.maximum.at(enter_max, comp, start)
    x = np.maximum(end - enter_max[comp], 0.0)

    # topological levels of the groups (Kahn), then ops grouped by level and group
    nodes, node = np.unique(comp, return_inverse=True)
    n_nodes = len(nodes)
    has = pred >= 0
    e_from, e_to = node[pred[has]], node[has]
    keep = e_from != e_to
    e_from, e_to = e_from[keep], e_to[keep]
    order = np.argsort(e_from, kind="stable")
    e_from, e_to = e_from[order], e_to[order]
    out_start = np.searchsorted(e_from, np.arange(n_nodes + 1))
    indeg = np.bincount(e_to, minlength=n_nodes)
    level = np.zeros(n_nodes, dtype=np.int64)
    queue = deque(np.flatnonzero(indeg == 0).tolist())
    seen = 0
    e_to_l = e_to.tolist()
    out_l = out_start.tolist()
    indeg_l = indeg.tolist()
    level_l = level.tolist()
    while queue:
        u = queue.popleft()
        seen += 1
        for j in range(out_l[u], out_l[u + 1]):
            v = e_to_l[j]
            if level_l[u] + 1 > level_l[v]:
                level_l[v] = level_l[u] + 1
            indeg_l[v] -= 1
            if indeg_l[v] == 0:
                queue.append(v)
    if seen != n_nodes:
        return None
    op_level = np.asarray(level_l, dtype=np.int64)[node]
    perm = np.lexsort((node, op_level))
    position = np.empty(n, dtype=np.int64)
    position[perm] = np.arange(n)
    pred_p = pred[perm]
    pred_pos = np.where(pred_p >= 0, position[np.maximum(pred_p, 0)], n)
    base = np.where(pred_p >= 0, -np.inf, step_start[step_code[perm]])
    lv = op_level[perm]
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(lv)) + 1, [n]])
    levels = []
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        nd = node[perm[lo:hi]]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(nd)) + 1])
        which = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, hi - lo)))
        levels.append((lo, hi, starts, which))
    by_step = np.argsort(step_code[perm], kind="stable")
    step_bounds = np.concatenate([[0], np.flatnonzero(np.diff(step_code[perm][by_step])) + 1])
    return Graph(
        n, step_code, step_start, step_end - step_start, pred, x, gap, perm, pred_pos, base, levels, by_step,
        step_bounds,
    )  # fmt: skip


def _replay_levels(g: Graph, x: np.ndarray, gap: np.ndarray, enter_at: np.ndarray | None) -> np.ndarray:
    """Each op's replayed end (ns, replay order; end[n] is the sentinel -inf) with op times `x` and
    launch gaps `gap`: level by level, each level one slice of the ops in replay order; `enter_at`
    (replay order), when given, gets each op's entry."""
    end = np.full(g.n + 1, -np.inf)  # end[n]: the previous op of an op that has none
    xp, gp = x[g.perm], gap[g.perm]
    for lo, hi, starts, which in g.levels:
        enter = np.maximum(end[g.pred_pos[lo:hi]], g.base[lo:hi]) + gp[lo:hi]
        if enter_at is not None:
            enter_at[lo:hi] = enter
        end[lo:hi] = np.maximum.reduceat(enter, starts)[which] + xp[lo:hi]
    return end


def replay(g: Graph, x: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """Step times (ns) of the graph replayed with op times `x` and launch gaps `gap`."""
    end = _replay_levels(g, x, gap, None)
    last = np.maximum.reduceat(end[:-1][g.by_step], g.step_bounds)
    return last - g.step_start


def replay_ops(g: Graph, x: np.ndarray, gap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each op's replayed entry and end (ns, op order): the replay of `replay`, keeping every op's
    times instead of each step's end (the one-step timeline, the Perfetto export's ideal step)."""
    enter_at = np.empty(g.n)
    end = _replay_levels(g, x, gap, enter_at)
    out_enter, out_end = np.empty(g.n), np.empty(g.n)
    out_enter[g.perm], out_end[g.perm] = enter_at, end[:-1]
    return out_enter, out_end


def ideal(
    g: Graph, cols: dict[str, np.ndarray], values: np.ndarray, *, across_stages: bool = True
) -> np.ndarray:
    """Each op's ideal value: the typical value of the same op (name, position in the step) at its
    data-parallel peers (same stage), then (`across_stages`) the mean of those over the stages that
    run the op in that step: a balanced pipeline holds the same work, shared evenly.

    Typical is robust to noise (DESIGN.md, "The cost of a cause"): each peer's op is first taken at its
    median over the steps; the typical peer is the lower median of those (of two peers the faster
    one's median, never the faster of two noisy values in one step); and what moves every peer in a
    step (the step's data, a shared hiccup) is kept as the median over the peers of their departures
    from their own medians in that step. So a worker that is slower in every step is removed from the
    ideal whole, scheduler noise is neither taken as the ideal nor blamed, and work that changes from
    step to step for every peer stays in it.

    An op cut into pieces (a recorded phase around blocking transfers: `cols["unit"]` names the
    phase of each piece) is one op here: its pieces' total is what is compared, and each piece gets
    its share of the ideal total in proportion to its recorded value (an equal share when all are 0)."""
    unit = cols["unit"]
    _, first_op, inv = np.unique(unit, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    total = np.bincount(inv, weights=values)
    count = np.bincount(inv)
    u_step, u_name, u_nth = g.step_code[first_op], cols["name"][first_op], cols["nth"][first_op]
    u_stage, u_dp = cols["pp_stage"][first_op], cols["dp_rank"][first_op]
    op = _codes(u_name, u_nth, u_stage)  # the same op at one stage, any step, any peer
    peer = _codes(u_name, u_nth, u_stage, u_dp)  # one peer's op, over the steps
    peer_med = _medians(peer, total)
    rep = np.unique(peer, return_index=True)[1]  # one row per peer's op
    typical_peer = np.zeros(int(op.max(initial=-1)) + 1)
    typical_peer[op[rep]] = _medians(op[rep], peer_med[rep], lower=True)
    at_stage = _codes(u_step, u_name, u_nth, u_stage)
    typical = np.maximum(typical_peer[op] + _medians(at_stage, total - peer_med), 0.0)
    if across_stages:
        same = _codes(u_step, u_name, u_nth)
        first = np.unique(at_stage, return_index=True)[1]
        sums = np.bincount(same[first], weights=typical[first])
        stages = np.bincount(same[first])
        typical = (sums / np.maximum(stages, 1))[same]
    if len(first_op) == len(unit):  # no op in pieces
        return typical[inv]
    own = total[inv]
    share = np.where(own > 0, values / np.where(own > 0, own, 1.0), 1.0 / count[inv])
    return typical[inv] * share


def _ratio(t: np.ndarray, ideal: np.ndarray) -> float:
    """Mean step time over mean ideal step time; 1 when the ideal steps take no time at all."""
    return float(t.mean() / ideal.mean()) if ideal.mean() > 0 else 1.0


#: the per-step slowdowns of a worker are given for at most this many bins of consecutive steps
MAX_STEP_BINS = 200


def _binned_ratios(t: np.ndarray, ideal: np.ndarray, per_bin: int) -> list[float]:
    """Each bin of `per_bin` consecutive steps: its mean step time over its mean ideal step time."""
    n = len(t)
    edges = np.arange(0, n, per_bin)
    num, den = np.add.reduceat(t, edges), np.add.reduceat(ideal, edges)
    return [float(a / b) if b > 0 else 1.0 for a, b in zip(num.tolist(), den.tolist(), strict=True)]


def _share(s_x: float, s: float) -> float:
    return (s_x - 1.0) / (s - 1.0) if s > 1.0 else 0.0


def analyse_run(cols: dict[str, np.ndarray], step_ns: float | None = None) -> dict[str, Any] | None:
    """The what-if row of one run (see the module doc), or None when it cannot be replayed.

    `step_ns`, the run's step time (DESIGN.md: the steady window's elapsed time over its steps), is
    the recorded step the row gives, so the what-if and every other view of the run say one step
    time; the ideal step is it over the slowdown. (A replayed step runs from the first rank's start
    to the last rank's end: ranks' step boundaries are not aligned, so its mean is longer than the
    run's step by their skew; the ratios are the replay's.) Without it, the replayed steps' mean."""
    g = build(cols)
    if g is None:
        return None
    # launch gaps are the host's, not the stage's work: typical among the dp peers at the same stage
    # (a stage's first op of a step waits, as recorded, for the other stage's end of the last step:
    # averaged over the stages, that offset would be spread over another stage's ops)
    x_ideal, gap_ideal = ideal(g, cols, g.x), ideal(g, cols, g.gap, across_stages=False)
    t_rec = g.recorded_step
    t_act = replay(g, g.x, g.gap)
    t_ideal = replay(g, x_ideal, gap_ideal)
    s = _ratio(t_act, t_ideal)
    dp, stage, rank, name = cols["dp_rank"], cols["pp_stage"], cols["rank"], cols["name"]

    def mixed(mask: np.ndarray) -> np.ndarray:
        return replay(g, np.where(mask, g.x, x_ideal), np.where(mask, g.gap, gap_ideal))

    notes: list[str] = []
    over = (g.x + g.gap) - (x_ideal + gap_ideal)
    worker = _codes(stage, dp)  # dense, in (stage, dp) order
    workers = _replayed(worker, over, "worker", "workers", notes)
    w_first = np.unique(worker, return_index=True)[1]
    by_worker: list[dict[str, Any]] = []
    worker_steps: dict[tuple[int, int], np.ndarray] = {}
    per_bin = -(-len(t_ideal) // MAX_STEP_BINS)  # steps per bin of the per-step slowdowns
    for d, st in sorted((int(dp[w_first[w]]), int(stage[w_first[w]])) for w in workers.tolist()):
        mask = (dp == d) & (stage == st)
        t = mixed(mask)
        worker_steps[(d, st)] = t
        # what the job would save without it: every other op as recorded, its own at the ideal (on a
        # noisy host the others' noise still sets part of the pace, so this is less than its slowdown)
        without = replay(g, np.where(mask, x_ideal, g.x), np.where(mask, gap_ideal, g.gap))
        by_worker.append(
            {
                "dp_rank": d,
                "stage": st,
                "ranks": sorted(set(rank[mask].tolist())),
                "slowdown": _ratio(t, t_ideal),
                "step_slowdown": _binned_ratios(t, t_ideal, per_bin),
                "saving_ns": max(0.0, float(t_act.mean() - without.mean())),
            }
        )
    st_code = _codes(stage)
    st_first = np.unique(st_code, return_index=True)[1]
    stages = sorted(
        int(stage[st_first[c]]) for c in _replayed(st_code, over, "stage", "stages", notes).tolist()
    )
    by_stage: list[dict[str, Any]] = [
        {"stage": st, "slowdown": _ratio(mixed(stage == st), t_ideal)} for st in stages
    ]
    names = cols["names"]
    op_types = sorted(_replayed(name, over, "op type", "op types", notes).tolist())
    by_op: list[dict[str, Any]] = [
        {"op_type": names[c], "slowdown": _ratio(mixed(name == c), t_ideal)} for c in op_types
    ]
    for lst in (by_worker, by_stage, by_op):
        for r in lst:  # a part never costs more than the whole: they share one ideal (see _ratio)
            r["slowdown"] = min(r["slowdown"], s)
        lst.sort(key=lambda r: -r["slowdown"])
    _own_excess(g, cols, by_worker, x_ideal, gap_ideal)

    causes = _causes(cols, g, s, t_act, t_ideal, worker_steps, by_stage, notes)
    if s < 1.0:
        notes.append(
            f"slowdown {s:.3g} is below 1: the balanced replay (every op at its data-parallel peers' typical "
            "time, averaged over the stages that run it) is longer than the recorded one, so the stages' "
            "work does not share evenly here; no worker, stage or op type is named"
        )
    given = bool(step_ns and step_ns > 0)
    actual = float(step_ns) if given else float(t_rec.mean())  # type: ignore[arg-type]
    return {
        "steps": len(t_rec),
        "steps_per_bin": per_bin,
        "replay_error": float(np.mean(np.abs(t_act - t_rec) / np.maximum(t_rec, 1.0))),
        "actual_step_ns": actual,
        "ideal_step_ns": (actual / s if s > 0 else actual) if given else float(t_ideal.mean()),
        "slowdown": s,
        "by_worker": by_worker,
        "by_stage": by_stage,
        "by_op_type": by_op,
        "cause": causes[0] if causes else "none",
        "second_cause": causes[1] if len(causes) > 1 else None,
        "note": "; ".join(notes) if notes else None,
    }


#: the workers, stages and op types replayed each on their own at most (those whose ops exceed their
#: ideal the most): each is a replay of the whole run, so their count bounds the analysis' time at
#: this many times one replay, linear in the ops whatever the number of ranks or op names
MAX_REPLAYED = 64


def _replayed(code: np.ndarray, over: np.ndarray, one: str, many: str, notes: list[str]) -> np.ndarray:
    """The codes (dense, 0..k-1) to replay on their own: all of them, or the MAX_REPLAYED whose ops'
    excess over the ideal (`over`) is largest (ties: the lower code), said in `notes`."""
    total = np.bincount(code, weights=over)
    k = len(total)
    if k <= MAX_REPLAYED:
        return np.arange(k)
    top = np.lexsort((np.arange(k), -total))[:MAX_REPLAYED]
    notes.append(
        f"{k:,} {many}: the {MAX_REPLAYED} whose ops exceed their ideal the most were each replayed on their "
        f"own (every {one} is in the ideal and the slowdown)"
    )
    return np.sort(top)


def _own_excess(
    g: Graph,
    cols: dict[str, np.ndarray],
    by_worker: list[dict[str, Any]],
    x_ideal: np.ndarray,
    gap_ideal: np.ndarray,
) -> None:
    """Each worker's own excess per step over the ideal (its ops' recorded time and launch gaps
    against the typical, summed over the worker's ranks' ops of each name, ns per step), and the op
    (phase) that holds most of it: where the worker's time went, in the words of its job."""
    dp, stage, name, names = cols["dp_rank"], cols["pp_stage"], cols["name"], cols["names"]
    steps = max(len(g.step_start), 1)
    over = (g.x + g.gap) - (x_ideal + gap_ideal)
    # a transfer's launch gap holds the compute it overlaps (a DDP bucket's allreduce starts when
    # backward has made its gradients): the phase is named among the rank's own work, not its transfers
    own = cols["compute"] | (cols["grp"] < 0) & (cols["peer"] < 0)
    for w in by_worker:
        mine = (dp == w["dp_rank"]) & (stage == w["stage"]) & own
        per_name = np.bincount(name[mine], weights=over[mine], minlength=len(names)) / steps
        top = int(np.argmax(per_name)) if len(per_name) else -1
        # a worker runs its tensor and context ranks side by side: their excess is one, not a sum
        width = max(len(w["ranks"]), 1)
        w["phase"] = str(names[top]) if top >= 0 and per_name[top] > 0 else None
        w["excess_ns"] = float(per_name[top] / width) if top >= 0 and per_name[top] > 0 else 0.0


#: a worker is slower than its peers only where its own work exceeds theirs by more than this many of
#: their step-to-step spreads (a robust standard deviation: 1.4826 x the median absolute deviation)
NOISE_SPREADS = 1.0
#: ... in more than this share of the steps (a rank the scheduler gives less CPU for a while on a
#: loaded host exceeds its peer in about half the steps; an injected 8 ms straggler in 93-100% of them)
MOST_STEPS = 0.75
#: the least spread taken as noise, as a share of the peers' typical work (a perfectly steady replay)
NOISE_FLOOR = 0.01


def beyond_noise(mine: np.ndarray, peers: np.ndarray) -> bool:
    """Whether a worker's work per step (`mine`) exceeds its peers' (`peers`, steps x peers) by more
    than their step-to-step spread in most steps (DESIGN.md: "a difference smaller than the peers'
    step-to-step spread is no cause"). Two identical ranks differ by noise alone and fail it."""
    if peers.size == 0 or len(mine) == 0:
        return False
    typical = np.median(peers, axis=1)
    spread = 1.4826 * np.median(np.abs(peers - np.median(peers, axis=0)), axis=0)
    noise = max(NOISE_SPREADS * float(np.median(spread)), NOISE_FLOOR * float(np.median(typical)))
    return float(np.mean(mine - typical > noise)) > MOST_STEPS


#: data imbalance moves all the work of one micro-batch together (its forward and its backward grow
#: with its sequence lengths): the correlation of two ops' departures from their peers' typical time
#: across the micro-batches of every step and rank must reach this; scheduler noise has none
COHERENT = 0.5


def _coherent(cols: dict[str, np.ndarray], g: Graph, compute: np.ndarray, rel: np.ndarray) -> bool:
    """Whether the compute ops of one micro-batch (same step, rank, stage and position) depart from
    their peers' typical time together: the first op's departure against the mean of the others'."""
    idx = np.flatnonzero(compute)
    if len(idx) == 0:
        return False
    cell = _codes(g.step_code[idx], cols["rank"][idx], cols["nth"][idx])
    order = np.lexsort((idx, cell))
    cell, r = cell[order], rel[idx][order]
    starts = np.flatnonzero(np.r_[True, np.diff(cell) != 0])
    counts = np.diff(np.r_[starts, len(cell)])
    multi = counts > 1
    if multi.sum() < 3:
        return False
    first = r[starts[multi]]
    rest = (np.add.reduceat(r, starts) - r[starts])[multi] / (counts[multi] - 1)
    if np.std(first) == 0 or np.std(rest) == 0:
        return False
    return float(np.corrcoef(first, rest)[0, 1]) >= COHERENT


def _causes(
    cols: dict[str, np.ndarray],
    g: Graph,
    s: float,
    t_act: np.ndarray,
    t_ideal: np.ndarray,
    worker_steps: dict[tuple[int, int], np.ndarray],
    by_stage: list[dict[str, Any]],
    notes: list[str],
) -> list[str]:
    if not s >= NONE_BELOW:
        return []
    out: list[str] = []
    # the grid of (step, dp rank, stage) holds the coordinates present, in order (dense codes), never
    # sized by the largest coordinate; a layout its ranks fill too sparsely to hold in a grid is not judged
    dp_coord, st_coord = cols["dp_rank"], cols["pp_stage"]
    dp_vals, st_vals = np.unique(dp_coord), np.unique(st_coord)
    dp, stage = np.searchsorted(dp_vals, dp_coord), np.searchsorted(st_vals, st_coord)
    compute = cols["compute"]
    n_dp = int(dp.max()) + 1
    n_st = int(stage.max()) + 1
    cells = len(g.step_start) * n_dp * n_st
    if cells > max(GRID_PER_OP * len(dp), GRID_MIN):
        notes.append(
            f"its ranks fill {len(np.unique(_codes(dp, stage))):,} of {n_dp * n_st:,} (dp rank, stage) "
            "places of their layout: too sparse to compare peers, so no cause is named"
        )
        return []
    # compute per (step, dp rank, stage): the recorded durations of the rank's own ops
    work = np.zeros((len(g.step_start), n_dp, n_st))
    np.add.at(
        work, (g.step_code[compute], dp[compute], stage[compute]), cols["dur_ns"][compute].astype(np.float64)
    )

    # stage imbalance: one stage explains most, the others little, and is longer at every dp rank
    shares = {int(np.searchsorted(st_vals, r["stage"])): _share(r["slowdown"], s) for r in by_stage}
    top = int(np.searchsorted(st_vals, by_stage[0]["stage"]))
    if (
        n_st > 1
        and shares[top] >= MAJOR_SHARE
        and all(v <= MINOR_SHARE for k, v in shares.items() if k != top)
    ):
        others = np.delete(work, top, axis=2)
        longer = work[:, :, top] > np.median(others, axis=2) * (1 + LONGER)
        if longer.mean() >= 0.9:
            out.append("stage-imbalance")

    # slow worker: the same worker explains most of the excess in most steps, its dp peers do not
    excess = t_act / t_ideal - 1.0
    real = excess > 0.01
    if real.any():
        keys = list(worker_steps)
        step_shares = np.stack([(worker_steps[k] / t_ideal - 1.0)[real] / excess[real] for k in keys])
        best = np.argmax(step_shares, axis=0)
        top_w = int(np.bincount(best, minlength=len(keys)).argmax())
        d, st = keys[top_w]
        peers = [i for i, k in enumerate(keys) if k[1] == st and k != (d, st)]
        d, st = int(np.searchsorted(dp_vals, d)), int(np.searchsorted(st_vals, st))  # the grid's
        top_major = (step_shares[top_w] >= MAJOR_SHARE).mean() > 0.5 and (best == top_w).mean() > 0.5
        peer_share = max((float(np.median(step_shares[i])) for i in peers), default=0.0)
        # a worker without data-parallel peers (one per stage) is its stage: which of the two is slow,
        # the worker or the work, cannot be told (the stage rule speaks for it)
        if (
            peers
            and top_major
            and peer_share < MAJOR_SHARE * float(np.median(step_shares[top_w]))
            and beyond_noise(work[:, d, st], np.delete(work[:, :, st], d, axis=1))
        ):
            out.append("slow-worker")

    # data imbalance: the same op varies across dp ranks, and the slowest dp rank keeps changing
    if n_dp > 1 and compute.any():
        same_op = _codes(g.step_code, cols["name"], cols["nth"], stage)
        took = cols["dur_ns"].astype(np.float64)
        med = _medians(same_op[compute], took[compute])
        spread = float(np.abs(took[compute] - med).sum() / max(float(med.sum()), 1.0))
        slowest = np.argmax(work, axis=1).reshape(-1)
        fixed = np.bincount(slowest, minlength=n_dp).max() / max(len(slowest), 1)
        rel = np.zeros(len(took))
        rel[compute] = (took[compute] - med) / np.maximum(med, 1.0)
        if spread > DATA_SPREAD and fixed < FIXED_SLOWEST and _coherent(cols, g, compute, rel):
            out.append("data-imbalance")
    return out


def _laid_runs(store: Store, sel: Selection) -> list[dict[str, Any]]:
    """The selected runs with more than one rank whose coordinates are known, with their source, and
    the pure data-parallel runs (`kind` 'dp', see `_dp_only_runs`) and recorded pipelines (`kind`
    'staged', see `_staged_runs`) read as such."""
    runs = runs_table(store, sel)
    # a run recorded by perfscope.profile(parallel=...) (no runs.origin) is read as recorded runs are
    # (its phases, from its first steady step), with its ranks' coordinates: a pure data-parallel
    # layout as 'dp', any other as 'staged'; an imported op table by its ops ('laid')
    laid = store.query(
        f"""
        SELECT k.run_id, any_value(r.source) AS source,
               CASE WHEN bool_or(o.imported) THEN 'laid'
                    WHEN max(k.pp_stage) = 0 AND max(k.tp) = 0 AND max(k.cp) = 0 THEN 'dp'
                    ELSE 'staged' END AS kind
        FROM (SELECT run_id, rank, any_value(pp_stage) AS pp_stage, max(coalesce(tp_rank, 0)) AS tp,
                     max(coalesce(cp_rank, 0)) AS cp
              FROM ranks WHERE dp_rank IS NOT NULL AND pp_stage IS NOT NULL GROUP BY run_id, rank) k
        JOIN {runs} r USING (run_id)
        JOIN (SELECT run_id, bool_or(origin IS NOT NULL) AS imported FROM runs GROUP BY run_id) o
             USING (run_id)
        GROUP BY k.run_id HAVING count(*) > 1 ORDER BY k.run_id
        """
    ).to_pylist()
    return sorted(
        laid + _dp_only_runs(store, runs) + _staged_runs(store, sel, runs), key=lambda r: r["run_id"]
    )


def _staged_runs(store: Store, sel: Selection, runs: str) -> list[dict[str, Any]]:
    """Recorded pipelines: runs without coordinates (no rank has dp_rank, pp_stage, tp_rank or
    cp_rank) whose every rank is a pipeline stage, 'stage:K' as given with profile(role=...) or as
    `comm_roles` infers it (point-to-point with fixed peers and no collective), with at least two
    stages, and a transfer in every steady step of every rank. A stage's ranks are its data-parallel
    ranks, in rank order (the recorder knows no tensor or context parallelism)."""
    bare = store.query(
        f"""
        SELECT count(*) AS n FROM (
            SELECT run_id FROM ranks WHERE run_id IN (SELECT run_id FROM {runs}) GROUP BY run_id
            HAVING count(DISTINCT rank) > 1
               AND count(dp_rank) + count(pp_stage) + count(tp_rank) + count(cp_rank) = 0)
        """
    ).to_pylist()[0]["n"]
    if not bare:  # every run has its layout (an imported op table): no roles to work out
        return []
    roles = roles_table(store, sel)
    thr = thresholds_table(store, sel)
    return store.query(
        f"""
        WITH k AS (SELECT run_id, count(DISTINCT rank) AS n,
                          count(dp_rank) + count(pp_stage) + count(tp_rank) + count(cp_rank) AS laid
                   FROM ranks WHERE run_id IN (SELECT run_id FROM {runs}) GROUP BY run_id),
        ro AS (SELECT run_id, count(*) AS n, count(*) FILTER (WHERE role LIKE 'stage:%') AS staged,
                      count(DISTINCT role) FILTER (WHERE role LIKE 'stage:%') AS stages
               FROM {roles} GROUP BY run_id),
        st AS (SELECT s.run_id, count(*) AS rank_steps FROM steps s JOIN {thr} t
                   ON s.run_id = t.run_id AND s.step >= t.first_steady_step GROUP BY s.run_id),
        c AS (SELECT c.run_id, count(DISTINCT (c.rank, c.step)) AS rank_steps FROM comm c JOIN {thr} t
                  ON c.run_id = t.run_id AND c.step >= t.first_steady_step GROUP BY c.run_id)
        SELECT r.run_id, r.source, 'staged' AS kind
        FROM {runs} r JOIN k USING (run_id) JOIN ro USING (run_id) JOIN st USING (run_id)
             JOIN c USING (run_id)
        WHERE k.n > 1 AND k.laid = 0 AND ro.staged = ro.n AND ro.n = k.n AND ro.stages > 1
          AND c.rank_steps >= st.rank_steps
        ORDER BY r.run_id
        """
    ).to_pylist()


def _dp_only_runs(store: Store, runs: str) -> list[dict[str, Any]]:
    """Runs without a layout (no rank has dp_rank or pp_stage, none a role other than 'worker') that
    are pure data-parallel jobs in lockstep: more than one rank, a collective in every step of every
    rank, every collective on the whole world (its group_size and group_ranks, where recorded, the
    run's world size) and no point-to-point transfer. (Ranks that synchronise only every k-th step,
    parameter averaging, drift apart in between: step k of one rank is not step k of another, so a
    step has no dependency graph to replay.) Every rank is then a data-parallel rank at stage 0 (a
    recorded DDP, Horovod or hand-written allreduce job). A run with a pipeline's send/recv or collectives on
    sub-groups is not read this way: its layout cannot be told from what was recorded."""
    return store.query(
        f"""
        WITH k AS (SELECT run_id, count(DISTINCT rank) AS n,
                          count(dp_rank) + count(pp_stage) + count(tp_rank) + count(cp_rank) AS laid,
                          count(*) FILTER (WHERE role IS NOT NULL AND role <> 'worker') AS roles
                   FROM ranks WHERE run_id IN (SELECT run_id FROM {runs}) GROUP BY run_id),
        st AS (SELECT run_id, count(*) AS rank_steps FROM steps
               WHERE run_id IN (SELECT run_id FROM {runs}) GROUP BY run_id),
        c AS (SELECT c.run_id, count(*) AS calls, count(DISTINCT (c.rank, c.step)) AS rank_steps,
                     count(*) FILTER (
                         WHERE c.peer IS NOT NULL OR c.op IN {P2P_OPS}
                            OR coalesce(c.group_size, r.world_size) <> r.world_size
                            OR coalesce(len(string_split(c.group_ranks, ',')), r.world_size) <> r.world_size
                     ) AS partial
              FROM comm c JOIN {runs} r USING (run_id) GROUP BY c.run_id)
        SELECT r.run_id, r.source, 'dp' AS kind
        FROM {runs} r JOIN k USING (run_id) JOIN c USING (run_id) JOIN st USING (run_id)
        WHERE k.n > 1 AND k.laid = 0 AND k.roles = 0 AND c.calls > 0 AND c.partial = 0
          AND c.rank_steps >= st.rank_steps
        ORDER BY r.run_id
        """
    ).to_pylist()


#: the ops one run's replay reads at most: a run with more has its steps sampled (every k-th step,
#: said in the row), so the analysis' memory is bounded whatever the table's length
MAX_OPS = 1 << 20


class Unreplayable(Exception):
    """A run the what-if cannot replay; its message says why (one line)."""


def _step_sample(store: Store, run: str, kind: str, first: int) -> tuple[str, str | None]:
    """The SQL condition on `step` that keeps the run's ops under MAX_OPS (every k-th of its steps, in
    step order) and the words that say so, or ("true", None) when all of them fit. The ops are counted
    as the rows they are read from (spans of the depth the kind reads, comm rows, a dp run's steps rows
    four times: its phases)."""
    depth = {"laid": "depth = 1", "staged": "depth = 0"}.get(kind, "false")
    rows = f"""(SELECT step FROM spans WHERE run_id = {run} AND {depth} AND step >= {first}
                UNION ALL SELECT step FROM comm WHERE run_id = {run} AND step >= {first}
                UNION ALL SELECT step FROM steps, range(4) WHERE run_id = {run} AND step >= {first}
                          AND {"true" if kind == "dp" else "false"})"""
    per_step = f"(SELECT step, count(*) AS n FROM {rows} WHERE step IS NOT NULL GROUP BY step)"
    got = store.query(
        f"SELECT coalesce(sum(n), 0) AS total, count(*) AS steps, coalesce(max(n), 0) AS most FROM {per_step}"
    ).to_pylist()[0]
    total, steps, most = int(got["total"]), int(got["steps"]), int(got["most"])
    if total <= MAX_OPS:
        return "true", None
    if most > MAX_OPS:
        raise Unreplayable(
            f"one of its steps holds {most:,} ops, over the {MAX_OPS:,} one replay reads; import fewer "
            "micro-batches or ranks per step"
        )
    k = -(-total // MAX_OPS)
    while True:
        indexed = f"(SELECT step, n, row_number() OVER (ORDER BY step) - 1 AS i FROM {per_step})"
        kept = store.query(
            f"SELECT coalesce(sum(n), 0) AS n, count(*) AS steps FROM {indexed} WHERE i % {k} = 0"
        ).to_pylist()[0]
        if int(kept["n"]) <= MAX_OPS:
            break
        k *= 2
    keep = f"step IN (SELECT step FROM {indexed} WHERE i % {k} = 0)"
    return keep, (
        f"its {steps:,} steps hold {total:,} ops, over the {MAX_OPS:,} one replay reads: one step in {k} "
        f"was replayed ({int(kept['steps']):,} steps)"
    )


def _run_ops(
    store: Store, sel: Selection, run_id: str, *, kind: str = "laid", first_step: int = 0
) -> tuple[pa.Table, str | None]:
    """One run's ops (spans of depth 1 and comm rows) with their rank's coordinates, in step, rank and
    start order; a literal run id, so only that run's partitions are read. A pure data-parallel run
    (`dp_only`): every rank is dp rank = its rank at stage 0, its ops each step's phases from the
    `steps` row and its collectives (all on one group, the world), from `first_step` (its first
    steady step: the warm-up steps, which every other analysis of a recorded run leaves out, are not
    the job's step). A recorded pipeline (`kind` 'staged'): see `_staged_ops_sql`. At most about
    MAX_OPS ops: a longer run's steps are sampled, and the second value says so (else None); a run
    with a step over MAX_OPS raises Unreplayable."""
    run = sql_literal(run_id)
    keep, sampled = _step_sample(store, run, kind, int(first_step))
    kind_laid = kind == "staged" and _has_coordinates(store, run)
    if kind == "dp":
        return store.query(_dp_ops_sql(run, int(first_step), keep)), sampled
    if kind == "staged":
        roles = roles_table(store, sel)
        return store.query(_staged_ops_sql(run, int(first_step), roles, laid=kind_laid, keep=keep)), sampled
    first = int(first_step)
    t = store.query(
        f"""
        WITH k AS (SELECT rank, any_value(dp_rank) AS dp_rank, any_value(pp_stage) AS pp_stage
                   FROM ranks WHERE run_id = {run} AND dp_rank IS NOT NULL AND pp_stage IS NOT NULL
                   GROUP BY rank),
        ops AS (
            SELECT rank, step, name, start_ns, dur_ns, -1 AS peer, NULL AS grp, false AS is_send,
                   true AS compute, 0 AS pdir
            FROM spans WHERE run_id = {run} AND depth = 1 AND step >= {first} AND {keep}
            UNION ALL
            SELECT rank, step, coalesce(name, op), start_ns, dur_ns, coalesce(peer, -1),
                   coalesce(group_id, group_ranks), op IN ('send', 'isend'), false,
                   CASE WHEN coalesce(name, '') LIKE 'backward%' THEN 1 ELSE 0 END
            FROM comm WHERE run_id = {run} AND step >= {first} AND {keep}
        )
        SELECT o.*, k.dp_rank, k.pp_stage,
               row_number() OVER (PARTITION BY step, o.rank, name ORDER BY start_ns, dur_ns) - 1 AS nth,
               row_number() OVER (PARTITION BY step, o.rank, peer, is_send, pdir ORDER BY start_ns, dur_ns)
                   - 1 AS pnth
        FROM ops o JOIN k USING (rank)
        WHERE start_ns IS NOT NULL AND dur_ns IS NOT NULL AND step IS NOT NULL
        ORDER BY step, o.rank, start_ns, dur_ns, name, peer, is_send, compute
        """
    )
    return t, sampled


def _dp_ops_sql(run: str, first_step: int, keep: str = "true") -> str:
    """The ops of a pure data-parallel run. The `steps` row gives each phase's own time (its exposed
    communication left out): data, forward and backward one after the other from the step's start,
    the optimizer ending at the step's end (the exposed sync wait and the rest of the step before it,
    between the last collective and the optimizer). The comm rows (DDP buckets, allreduces) are
    collectives of the whole world, matched across ranks by their index in the step (`seq`).

    A collective issued inside backward (a DDP bucket: its gradients are ready) waits for the
    backward's compute before it, not for the whole phase: the backward is cut at those issue times
    (clamped to its own span) into pieces, one op to the ideal (`unit`), each collective after the
    piece that ends where it starts. Without the cut, a bucket issued at about the end of the
    phase's own time would follow the backward in some steps and the forward in others (its launch
    gap then holding the whole backward), and a typical launch gap taken over such steps is noise
    of the size of the backward, in every peer's ideal."""
    return f"""
        WITH s AS (SELECT rank, step, start_ns AS t0, step_ns,
                          coalesce(data_ns, 0) AS d, coalesce(forward_ns, 0) AS f,
                          coalesce(backward_ns, 0) AS b, coalesce(optimizer_ns, 0) AS o
                   FROM steps WHERE run_id = {run} AND start_ns IS NOT NULL AND step_ns IS NOT NULL
                         AND step >= {first_step} AND {keep}),
        cm AS (SELECT rank, step, coalesce(name, op) AS name, start_ns, dur_ns, coalesce(seq, 0) AS ord,
                      bucket IS NOT NULL OR phase = 'backward' AS in_backward
               FROM comm WHERE run_id = {run} AND step >= {first_step} AND {keep}),
        bw AS (SELECT row_number() OVER (ORDER BY rank, step) AS unit, rank, step,
                      t0 + d + f AS b0, t0 + d + f + b AS b1 FROM s),
        cut AS (SELECT bw.unit, least(greatest(cm.start_ns, bw.b0), bw.b1) AS c
                FROM bw JOIN cm ON bw.rank = cm.rank AND bw.step = cm.step
                WHERE cm.in_backward AND cm.start_ns IS NOT NULL),
        pieces AS (
            SELECT unit, lag(c) OVER (PARTITION BY unit ORDER BY c) AS p0, c AS p1 FROM cut
            UNION ALL
            SELECT bw.unit, max(cut.c), bw.b1 FROM bw LEFT JOIN cut USING (unit) GROUP BY bw.unit, bw.b1
        ),
        ops AS (
            SELECT rank, step, 'data' AS name, t0 AS start_ns, d AS dur_ns, 0 AS ord, true AS compute,
                   NULL AS unit FROM s
            UNION ALL SELECT rank, step, 'forward', t0 + d, f, 0, true, NULL FROM s
            UNION ALL
            SELECT bw.rank, bw.step, 'backward', coalesce(p.p0, bw.b0), p.p1 - coalesce(p.p0, bw.b0), 0, true,
                   bw.unit
            FROM pieces p JOIN bw USING (unit)
            UNION ALL
            SELECT rank, step, 'optimizer', t0 + greatest(step_ns - o, d + f + b), o, 0, true, NULL FROM s
            UNION ALL
            SELECT rank, step, name, start_ns, dur_ns, ord, false, NULL FROM cm
        )
        SELECT rank, step, name, start_ns, dur_ns, -1 AS peer, true AS anchor,
               CASE WHEN compute THEN NULL ELSE 'world' END AS grp, false AS is_send,
               compute AND name <> 'data' AS compute,
               rank AS dp_rank, 0 AS pp_stage,
               CASE WHEN unit IS NULL
                    THEN row_number() OVER (PARTITION BY step, rank, name, unit IS NULL
                                            ORDER BY ord, start_ns, dur_ns) - 1
                    ELSE 0 END AS nth,
               0 AS pnth, unit
        FROM ops
        WHERE start_ns IS NOT NULL AND dur_ns IS NOT NULL AND step IS NOT NULL
        ORDER BY step, rank, start_ns, dur_ns, name
        """


def _has_coordinates(store: Store, run: str) -> bool:
    n = store.query(f"SELECT count(pp_stage) AS n FROM ranks WHERE run_id = {run}").to_pylist()[0]["n"]
    return bool(n)


def _staged_ops_sql(run: str, first_step: int, roles: str, *, laid: bool = False, keep: str = "true") -> str:
    """The ops of a recorded pipeline, from its first steady step. Each rank's stage is its role's
    K, its dp rank its place among the stage's ranks. Its ops are its phases (spans of depth 0:
    forward, backward ... as the job named them) and its transfers. A phase holds the blocking
    transfers made inside it (a GPipe forward receives and sends every micro-batch's activations):
    it is cut at them into pieces of compute, each waiting for the transfer before it, all one op
    (`unit`) to the ideal. A point-to-point transfer is named by its phase and function
    ('forward-send', 'backward-recv', as Megatron-LM names them), a collective by its function; a
    collective is matched across its process group's members (comm.group_id, or comm.group_ranks in
    stores written before it; a sub-group's call without either is not matched). `laid`: the ranks' recorded
    coordinates (profile(parallel=...)) give their stage and dp rank instead of their roles."""
    kd = (
        f"""kd AS (SELECT rank, any_value(pp_stage) AS pp_stage, any_value(dp_rank) AS dp_rank FROM ranks
               WHERE run_id = {run} AND dp_rank IS NOT NULL AND pp_stage IS NOT NULL GROUP BY rank),"""
        if laid
        else f"""k AS (SELECT rank, CAST(split_part(role, ':', 2) AS INTEGER) AS pp_stage
                   FROM {roles} WHERE run_id = {run}),
        kd AS (SELECT rank, pp_stage, row_number() OVER (PARTITION BY pp_stage ORDER BY rank) - 1 AS dp_rank
               FROM k),"""
    )
    return f"""
        WITH {kd}
        w AS (SELECT max(world_size) AS world FROM runs WHERE run_id = {run}),
        ph AS (SELECT row_number() OVER (ORDER BY rank, step, start_ns, dur_ns, name) AS unit, rank, step,
                      name, start_ns AS s0, start_ns + dur_ns AS s1,
                      dense_rank() OVER (PARTITION BY step, rank, name ORDER BY start_ns, dur_ns) - 1 AS nth
               FROM spans
               WHERE run_id = {run} AND depth = 0 AND step >= {first_step} AND {keep} AND start_ns IS NOT NULL
                     AND dur_ns IS NOT NULL),
        cm AS (SELECT rank, step, start_ns, dur_ns, peer, op, is_async,
                      coalesce(name, CASE WHEN peer IS NOT NULL OR op IN {P2P_OPS}
                                          THEN coalesce(phase, 'other') || '-' || op ELSE op END) AS name,
                      CASE WHEN peer IS NULL AND NOT op IN {P2P_OPS}
                           THEN coalesce(group_id, group_ranks, CASE WHEN group_size = (SELECT world FROM w)
                                                           OR group_size IS NULL THEN 'world' END) END AS grp
               FROM comm
               WHERE run_id = {run} AND step >= {first_step} AND {keep} AND start_ns IS NOT NULL
                     AND dur_ns IS NOT NULL),
        cut AS (SELECT ph.unit, cm.start_ns AS c0, least(cm.start_ns + cm.dur_ns, ph.s1) AS c1
                FROM ph JOIN cm ON ph.rank = cm.rank AND ph.step = cm.step
                     AND cm.start_ns >= ph.s0 AND cm.start_ns < ph.s1
                WHERE NOT coalesce(cm.is_async, false)),
        pieces AS (
            SELECT unit, coalesce(lag(c1) OVER (PARTITION BY unit ORDER BY c0, c1), -1) AS p0, c0 AS p1
            FROM cut
            UNION ALL
            SELECT ph.unit, coalesce(max(cut.c1), -1), ph.s1
            FROM ph LEFT JOIN cut USING (unit) GROUP BY ph.unit, ph.s1
        ),
        ops AS (
            SELECT ph.rank, ph.step, ph.name, CASE WHEN p.p0 < 0 THEN ph.s0 ELSE p.p0 END AS start_ns,
                   greatest(p.p1 - CASE WHEN p.p0 < 0 THEN ph.s0 ELSE p.p0 END, 0) AS dur_ns,
                   -1 AS peer, NULL AS grp, false AS is_send, ph.name <> 'data' AS compute, ph.unit,
                   ph.nth, 0 AS pnth
            FROM pieces p JOIN ph USING (unit)
            UNION ALL
            SELECT rank, step, name, start_ns, dur_ns, coalesce(peer, -1), grp, op IN ('send', 'isend'),
                   false, NULL,
                   row_number() OVER (PARTITION BY step, rank, name ORDER BY start_ns, dur_ns) - 1,
                   row_number() OVER (PARTITION BY step, rank, peer, op IN ('send', 'isend')
                                      ORDER BY start_ns, dur_ns) - 1
            FROM cm
        )
        SELECT o.rank, o.step, o.name, o.start_ns, o.dur_ns, o.peer, o.grp, o.is_send, o.compute,
               kd.dp_rank, kd.pp_stage, o.nth, o.pnth, o.unit
        FROM ops o JOIN kd USING (rank)
        ORDER BY o.step, o.rank, o.start_ns, o.dur_ns, o.name, o.peer, o.is_send, o.compute
        """


def _columns(t: pa.Table) -> dict[str, np.ndarray]:
    cols = {c: np.asarray(t.column(c).to_numpy(zero_copy_only=False)) for c in
            ("rank", "step", "start_ns", "dur_ns", "peer", "is_send", "compute", "dp_rank", "pp_stage", "nth",
             "pnth")}  # fmt: skip
    for c in ("rank", "step", "start_ns", "dur_ns", "peer", "dp_rank", "pp_stage", "nth", "pnth"):
        cols[c] = cols[c].astype(np.int64)
    cols["is_send"] = cols["is_send"].astype(bool)
    cols["compute"] = cols["compute"].astype(bool)
    name = t.column("name").combine_chunks().dictionary_encode()
    cols["name"] = np.asarray(name.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    cols["names"] = np.asarray(name.dictionary.to_pylist(), dtype=object)
    grp = t.column("grp").cast(pa.string()).combine_chunks().dictionary_encode()
    cols["grp"] = np.asarray(grp.indices.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
    # the phase each piece of a cut phase belongs to (staged runs); every other op is one of its own
    n = t.num_rows
    unit = (
        np.array(t.column("unit").fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
        if "unit" in t.column_names
        else np.full(n, -1, dtype=np.int64)
    )
    alone = unit < 0
    unit[alone] = int(unit.max(initial=-1)) + 1 + np.arange(int(alone.sum()))
    cols["unit"] = unit
    # the direction of a pipeline transfer (1: backward) where the op table names it: under interleaving
    # the same two ranks exchange forward and backward transfers both ways (pp = 2)
    if "anchor" in t.column_names:  # a pure data-parallel run (see `build`)
        cols["anchor_lanes"] = np.ones(1, dtype=bool)
    cols["pdir"] = (
        np.asarray(t.column("pdir").to_numpy(zero_copy_only=False), dtype=np.int64)
        if "pdir" in t.column_names
        else np.zeros(n, dtype=np.int64)
    )
    return cols


WORKER = pa.struct([("dp_rank", pa.int64()), ("stage", pa.int64()), ("ranks", pa.list_(pa.int64())),
                    ("slowdown", pa.float64()), ("step_slowdown", pa.list_(pa.float64())),
                    ("phase", pa.string()), ("excess_ns", pa.float64()),
                    ("saving_ns", pa.float64())])  # fmt: skip
SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("source", pa.string()),
        ("steps", pa.int64()),
        ("steps_per_bin", pa.int64()),
        ("replay_error", pa.float64()),
        ("actual_step_ns", pa.float64()),
        ("ideal_step_ns", pa.float64()),
        ("slowdown", pa.float64()),
        ("by_worker", pa.list_(WORKER)),
        ("by_stage", pa.list_(pa.struct([("stage", pa.int64()), ("slowdown", pa.float64())]))),
        ("by_op_type", pa.list_(pa.struct([("op_type", pa.string()), ("slowdown", pa.float64())]))),
        ("cause", pa.string()),
        ("second_cause", pa.string()),
        ("note", pa.string()),
    ]
)


@analysis("what_if", "What-if: step time without each slow worker, stage or op type", "what-if")
def what_if(store: Store, sel: Selection) -> pa.Table:
    """Per run with a parallel layout (ranks.dp_rank, pp_stage) and op-level rows: steps, replay_error,
    actual_step_ns, ideal_step_ns, slowdown (actual / ideal), by_worker (with each worker's slowdown per
    bin of steps_per_bin consecutive steps, at most MAX_STEP_BINS bins), by_stage, by_op_type (each
    sorted by slowdown, largest first), cause and second_cause (slow-worker, stage-imbalance,
    data-imbalance, none), note (what the row leaves out or why it reads as it does: sampled steps,
    workers, stages or op types not replayed on their own, a slowdown below 1; else null). A run it
    cannot replay has no row here but one in `what_if_unreplayed`."""
    rows = []
    laid = _laid_runs(store, sel)
    first: dict[str, int] = {}
    step_ns: dict[str, float] = {}
    if laid:
        stats = run_stats_table(store, sel)
        for r in store.query(
            f"SELECT run_id, first_step + warmup_steps AS first_steady_step, step_ns FROM {stats}"
        ).to_pylist():
            first[r["run_id"]] = r["first_steady_step"] or 0
            step_ns[r["run_id"]] = r["step_ns"]
    notes = []
    for run in laid:
        # every run from its first steady step, with the run's step time (DESIGN.md's elapsed time):
        # one step time for a run everywhere, an imported op table's too
        try:
            t, sampled = _run_ops(
                store, sel, run["run_id"], kind=run["kind"], first_step=first.get(run["run_id"]) or 0
            )
            row = analyse_run(_columns(t), step_ns.get(run["run_id"])) if t.num_rows else None
            if row is None and t.num_rows:
                raise Unreplayable(CYCLE)
        except Unreplayable as e:
            notes.append({"run_id": run["run_id"], "source": run["source"], "note": str(e)})
            continue
        if row is not None:
            if sampled:
                row["note"] = "; ".join(x for x in (sampled, row["note"]) if x)
            rows.append({"run_id": run["run_id"], "source": run["source"], **row})
    memo(store, ("what_if_unreplayed", sel), lambda: pa.Table.from_pylist(notes, schema=UNREPLAYED))
    return pa.Table.from_pylist(rows, schema=SCHEMA)


#: why a run's graph cannot be replayed (`build` found a cycle)
CYCLE = (
    "its ops wait on each other in a cycle (a deadlocked schedule: each side of a transfer waits for an op "
    "the other side runs after it; an interleaved table paired with the wrong --vpp does so too), so no "
    "replay order exists; check the order of its sends and recvs, or its --vpp"
)
UNREPLAYED = pa.schema([("run_id", pa.string()), ("source", pa.string()), ("note", pa.string())])


@analysis("what_if_unreplayed", "What-if: the runs it cannot replay, and why", "what-if")
def what_if_unreplayed(store: Store, sel: Selection) -> pa.Table:
    """Per run the what-if reads but cannot replay (a cyclic, deadlocked dependency graph; a step with
    more than MAX_OPS ops): run_id, source and note, one line that says why."""
    run_analysis("what_if", store, sel)
    return memo(store, ("what_if_unreplayed", sel), lambda: pa.Table.from_pylist([], schema=UNREPLAYED))
