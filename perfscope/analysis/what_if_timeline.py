"""The ideal against the actual timeline of one step (issue 23): the `what_if` analysis' replay kept op
by op, for the report's and the dashboard's chart and the Perfetto export's `ideal/rank N` processes.

`replayed_run` reads one run's ops and dependency graph as `what_if` does (perfscope.analysis.what_if:
its first steady step, its ops, the graph, every op's ideal time and launch gap); `what_if.replay_ops` replays
it keeping each op's entry and end. The `what_if_timeline` analysis draws one step of each run: the
step whose slowdown (replayed step over ideal step) is the run's median (the lower middle one of an
even count; ties by step), its ops replayed twice, with their recorded times (the `recorded` lane)
and with their ideal times (the `ideal` lane), on the first rank of each worker (a dp rank at a
stage: its tensor and context ranks move together). It is bounded: at most MAX_WORKERS workers (those
whose ops in the step exceed their ideal the most), and per lane ops shorter than a
1/MERGE_FRACTION of the step merged with their neighbours into one bar, the threshold doubled until a
lane holds at most MAX_BARS_PER_LANE bars.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..store.reader import Store
from . import what_if as wi
from .registry import analysis
from .selection import Selection
from .steady import thresholds_table

#: the workers the timeline draws at most (a lane pair each): those with the most excess in the step
MAX_WORKERS = 16
#: ops shorter than the step's span over this are merged with their short neighbours into one bar
MERGE_FRACTION = 400
#: the most bars of one lane (one worker, recorded or ideal): the merge threshold grows until it holds
MAX_BARS_PER_LANE = 150
LANES = ("recorded", "ideal")


@dataclass
class Replayed:
    """One run's ops (`what_if._columns`), their dependency graph and each op's ideal time and gap."""

    cols: dict[str, np.ndarray]
    g: wi.Graph
    x_ideal: np.ndarray
    gap_ideal: np.ndarray

    def recorded(self) -> tuple[np.ndarray, np.ndarray]:
        """Each op's entry and end (ns) replayed with its recorded time and gap."""
        return wi.replay_ops(self.g, self.g.x, self.g.gap)

    def ideal(self) -> tuple[np.ndarray, np.ndarray]:
        """Each op's entry and end (ns) replayed with its ideal time and gap."""
        return wi.replay_ops(self.g, self.x_ideal, self.gap_ideal)


def what_if_runs(store: Store, sel: Selection) -> list[dict[str, Any]]:
    """The runs `what_if` reads (run_id, source, kind), each with its `first_step`: its first steady
    step, as `what_if` reads it (an imported op table's too)."""
    runs = wi._laid_runs(store, sel)
    first: dict[str, int] = {}
    if runs:
        thr = thresholds_table(store, sel)
        got = store.query(f"SELECT run_id, first_steady_step FROM {thr}").to_pylist()
        first = {r["run_id"]: int(r["first_steady_step"] or 0) for r in got}
    return [{**r, "first_step": first.get(r["run_id"], 0)} for r in runs]


def replayed_run(store: Store, sel: Selection, run: dict[str, Any]) -> Replayed | None:
    """The run's (a row of `what_if_runs`) ops, graph and ideal times; None when it has no ops or
    its graph cannot be replayed (as `what_if` decides)."""
    try:
        t, _ = wi._run_ops(store, sel, run["run_id"], kind=run["kind"], first_step=run["first_step"])
    except wi.Unreplayable:
        return None
    if t.num_rows == 0:
        return None
    cols = wi._columns(t)
    g = wi.build(cols)
    if g is None:
        return None
    return Replayed(cols, g, wi.ideal(g, cols, g.x), wi.ideal(g, cols, g.gap, across_stages=False))


def median_step(t_act: np.ndarray, t_ideal: np.ndarray) -> int:
    """The index of the step whose slowdown (t_act / t_ideal) is the median: of an even count the
    lower middle one; of equal slowdowns the earlier step."""
    ratio = t_act / np.where(t_ideal > 0, t_ideal, 1.0)
    order = np.lexsort((np.arange(len(ratio)), ratio))
    return int(order[(len(ratio) - 1) // 2])


def _merge(start: np.ndarray, end: np.ndarray, min_ns: float) -> list[tuple[int, float, float, list[int]]]:
    """One lane's bars: (kind, start, end, ops) with kind 0 an op as it is, 1 a run of consecutive
    short ops (in start order, none longer than `min_ns`, no gap longer than `min_ns` between them)."""
    order = np.lexsort((end, start))
    out: list[tuple[int, float, float, list[int]]] = []
    run: list[int] = []
    run_lo = run_hi = 0.0

    def close() -> None:
        if run:
            out.append((1 if len(run) > 1 else 0, run_lo, run_hi, list(run)))
            run.clear()

    for i in order.tolist():
        s, e = float(start[i]), float(end[i])
        if e - s >= min_ns:
            close()
            out.append((0, s, e, [i]))
            continue
        if run and s - run_hi > min_ns:
            close()
        if not run:
            run_lo, run_hi = s, e
        run.append(i)
        run_hi = max(run_hi, e)
    close()
    return out


def _lane_bars(
    start: np.ndarray, end: np.ndarray, span: float
) -> tuple[list[tuple[int, float, float, list[int]]], float]:
    """A lane's bars and the merge threshold used: 1/MERGE_FRACTION of the span, doubled until the lane
    holds at most MAX_BARS_PER_LANE bars."""
    min_ns = span / MERGE_FRACTION
    while True:
        bars = _merge(start, end, min_ns)
        if len(bars) <= MAX_BARS_PER_LANE or min_ns > span:
            return bars, min_ns
        min_ns *= 2


SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("source", pa.string()),
        ("step", pa.int64()),
        ("steps", pa.int64()),
        ("step_slowdown", pa.float64()),
        ("recorded_step_ns", pa.float64()),
        ("actual_end_ns", pa.float64()),
        ("ideal_end_ns", pa.float64()),
        ("workers", pa.int64()),
        ("workers_shown", pa.int64()),
        ("step_ops", pa.int64()),
        ("merge_below_ns", pa.float64()),
        ("dp_rank", pa.int64()),
        ("stage", pa.int64()),
        ("rank", pa.int64()),
        ("ranks", pa.list_(pa.int64())),
        ("lane", pa.string()),
        ("name", pa.string()),
        ("op_type", pa.string()),
        ("ops", pa.int64()),
        ("compute", pa.bool_()),
        ("start_ns", pa.float64()),
        ("end_ns", pa.float64()),
    ]
)


def step_timeline(rep: Replayed) -> list[dict[str, Any]]:
    """The bars of one run's median step (see the module doc), times in ns from the step's recorded
    start; every row also carries the step's numbers."""
    g, cols = rep.g, rep.cols
    rec_enter, rec_end = rep.recorded()
    ide_enter, ide_end = rep.ideal()
    n_steps = len(g.step_start)
    t_act = np.full(n_steps, -np.inf)
    np.maximum.at(t_act, g.step_code, rec_end)
    t_ideal = np.full(n_steps, -np.inf)
    np.maximum.at(t_ideal, g.step_code, ide_end)
    t_act, t_ideal = t_act - g.step_start, t_ideal - g.step_start
    k = median_step(t_act, t_ideal)
    here = np.flatnonzero(g.step_code == k)
    t0 = g.step_start[k]
    dp, stage, rank = cols["dp_rank"][here], cols["pp_stage"][here], cols["rank"][here]
    excess = (g.x + g.gap - rep.x_ideal - rep.gap_ideal)[here]
    # each worker's excess in the step, summed at once (one pass over the step's ops, not one per worker)
    code = wi._codes(dp, stage)
    first_of = np.unique(code, return_index=True)[1]
    per_worker = np.bincount(code, weights=excess)
    workers = sorted(zip(dp[first_of].tolist(), stage[first_of].tolist(), strict=True))
    total = {(int(dp[i]), int(stage[i])): float(per_worker[c]) for c, i in enumerate(first_of.tolist())}
    by_excess = sorted(workers, key=lambda w: (-total[w], w[1], w[0]))
    shown = sorted(by_excess[:MAX_WORKERS], key=lambda w: (w[1], w[0]))
    span = max(float(t_act[k]), float(t_ideal[k]), 1.0)
    names = cols["names"]
    step_row = {
        "step": int(np.unique(cols["step"])[k]),
        "steps": n_steps,
        "step_slowdown": float(t_act[k] / t_ideal[k]) if t_ideal[k] > 0 else 1.0,
        "recorded_step_ns": float(g.recorded_step[k]),
        "actual_end_ns": float(t_act[k]),
        "ideal_end_ns": float(t_ideal[k]),
        "workers": len(workers),
        "workers_shown": len(shown),
        "step_ops": len(here),
    }
    out: list[dict[str, Any]] = []
    merged_at = 0.0
    for d, st in shown:
        mine = here[(dp == d) & (stage == st)]
        first = int(cols["rank"][mine].min())
        ops = mine[cols["rank"][mine] == first]
        for lane, enter, end in (("recorded", rec_enter, rec_end), ("ideal", ide_enter, ide_end)):
            bars, min_ns = _lane_bars(enter[ops] - t0, end[ops] - t0, span)
            merged_at = max(merged_at, min_ns)
            for kind, s, e, idx in bars:
                which = ops[idx]
                one = names[cols["name"][which[0]]]
                out.append(
                    {
                        "dp_rank": d,
                        "stage": st,
                        "rank": first,
                        "ranks": sorted(set(rank[(dp == d) & (stage == st)].tolist())),
                        "lane": lane,
                        "name": str(one) if kind == 0 else f"{len(idx)} short ops",
                        "op_type": str(one) if kind == 0 else "short ops (merged)",
                        "ops": len(idx),
                        "compute": bool(cols["compute"][which].all()),
                        "start_ns": s,
                        "end_ns": e,
                    }
                )
    for r in out:
        r.update(step_row, merge_below_ns=merged_at)
    return out


@analysis("what_if_timeline", "What-if: the recorded against the ideal timeline of one step", "what-if")
def what_if_timeline(store: Store, sel: Selection) -> pa.Table:
    """Per run that has a `what_if` row, its median step (the step whose slowdown is the median): per
    worker shown (its first rank) and lane (`recorded`: the replay with the recorded times, `ideal`:
    with the ideal times), one row per bar, op or merged run of short ops, times in ns from the
    step's recorded start; each row repeats the step's numbers (recorded_step_ns, actual_end_ns and
    ideal_end_ns: the two replays' step ends, step_slowdown, workers, workers_shown, step_ops,
    merge_below_ns)."""
    out: list[dict[str, Any]] = []
    for run in what_if_runs(store, sel):
        rep = replayed_run(store, sel, run)
        if rep is None:
            continue
        out += [{"run_id": run["run_id"], "source": run["source"], **r} for r in step_timeline(rep)]
    return pa.Table.from_pylist(out, schema=SCHEMA)
