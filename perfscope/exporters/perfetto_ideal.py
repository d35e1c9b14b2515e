"""The ideal step of the what-if analysis (issue 23) as its own track group in the Perfetto export.

For a run that has a what-if row, each rank gets a second process, `ideal/rank N`, sorted after the
recorded ranks: a `ideal steps` track with one slice per step (from the recorded step's start, as
long as the replayed ideal step) and its ops as the ideal replay places them (every op at its typical
time among its data-parallel peers, `perfscope.analysis.what_if`), lanes where ops overlap. The
recorded and the ideal step of a rank sit side by side on one time axis. A run without a what-if row
(one rank, no layout that can be read) gets no ideal group. The replay is the one the report's and
the dashboard's timeline chart draws (`perfscope.analysis.what_if_timeline`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..analysis.selection import Selection
from ..analysis.what_if_timeline import replayed_run, what_if_runs
from ..store.reader import Store
from .perfetto_events import meta_event, slice_event

#: pid of rank N's ideal process: IDEAL_PID + N (recorded ranks are 0..N-1, hosts from 1,000,000)
IDEAL_PID = 2_000_000
#: tid of the ideal step slices and of the first lane of ideal ops in an ideal process
IDEAL_STEP_TID, IDEAL_OP_TID = 1, 10


def ideal_ops(
    store: Store, run_id: str, first: int | None = None, last: int | None = None
) -> dict[str, Any] | None:
    """The run's ops of steps first..last (None: open) replayed at their ideal times: rank, step, name,
    start_ns, end_ns per op, and each step's ideal start and end; None when the run has no what-if (as
    `what_if` decides) or none of its replayed steps is in the window."""
    sel = Selection(run_ids=(run_id,))
    run = next((r for r in what_if_runs(store, sel) if r["run_id"] == run_id), None)
    rep = replayed_run(store, sel, run) if run is not None else None
    if rep is None:
        return None
    cols, g = rep.cols, rep.g
    start, end = rep.ideal()
    step_end = np.full(len(g.step_start), -np.inf)
    np.maximum.at(step_end, g.step_code, end)
    lo = -(2**63) if first is None else first
    hi = 2**63 - 1 if last is None else last
    steps = np.unique(cols["step"])
    op_in = (cols["step"] >= lo) & (cols["step"] <= hi)
    step_in = (steps >= lo) & (steps <= hi)
    if not op_in.any():
        return None
    return {
        "rank": cols["rank"][op_in],
        "step": cols["step"][op_in],
        "name": cols["names"][cols["name"][op_in]],
        "start_ns": start[op_in],
        "end_ns": end[op_in],
        "steps": steps[step_in],
        "step_start_ns": g.step_start[step_in],
        "step_end_ns": step_end[step_in],
    }


def ideal_events(ops: dict[str, Any] | None, t_lo: float) -> list[dict[str, Any]]:
    """Trace events of `ideal_ops`' steps, times in µs from `t_lo` (ns): one process per rank."""
    if ops is None:
        return []

    def us(ns: float) -> float:
        return round((float(ns) - t_lo) / 1000.0, 3)

    events: list[dict[str, Any]] = []
    ranks = sorted(set(ops["rank"].tolist()))
    for rank in ranks:
        pid = IDEAL_PID + rank
        events += [
            meta_event("process_name", pid, 0, f"ideal/rank {rank}"),
            meta_event("process_sort_index", pid, 0, pid, key="sort_index"),
            meta_event("thread_name", pid, IDEAL_STEP_TID, "ideal steps"),
        ]
        for k, step in enumerate(ops["steps"].tolist()):
            s0, s1 = ops["step_start_ns"][k], ops["step_end_ns"][k]
            dur = round(s1 - s0)
            events.append(
                slice_event(
                    f"ideal step {step}",
                    "ideal",
                    pid,
                    IDEAL_STEP_TID,
                    us(s0),
                    dur,
                    {"step": step, "ideal_step_ns": dur},
                )
            )
    lanes: dict[int, list[float]] = {}
    order = np.lexsort((ops["start_ns"], ops["rank"]))
    for i in order.tolist():
        rank, s0, s1 = int(ops["rank"][i]), float(ops["start_ns"][i]), float(ops["end_ns"][i])
        ends = lanes.setdefault(rank, [])
        lane = next((j for j, e in enumerate(ends) if e <= s0), len(ends))
        if lane == len(ends):
            ends.append(0.0)
            events.append(
                meta_event("thread_name", IDEAL_PID + rank, IDEAL_OP_TID + lane, f"ideal ops {lane}")
            )
        ends[lane] = s1
        events.append(
            slice_event(
                str(ops["name"][i]),
                "ideal",
                IDEAL_PID + rank,
                IDEAL_OP_TID + lane,
                us(s0),
                round(s1 - s0),
                {"step": int(ops["step"][i])},
            )
        )
    return events
