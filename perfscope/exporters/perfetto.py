"""A run as Chrome trace-event JSON, which Perfetto UI and chrome://tracing open.

One process per rank (named `host/rank N`): a `steps` track with one slice per step, one track per
span depth (phases and user spans), and collective tracks (one slice per collective; overlapping
collectives get lanes). GPU utilisation and power become counters of one process per host.
A run with a what-if (perfscope.analysis.what_if) also gets its ideal step: one process per rank,
`ideal/rank N`, beside the recorded ones (exporters/perfetto_ideal.py). Times
(`ts`, `dur`) are µs from the first event shown; the wall-clock origin is in `otherData`.
Reads the store through DuckDB only.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..analysis.rank_timeline import window_intervals
from ..errors import PerfscopeError, shown
from ..output import open_output
from ..store.reader import Store
from .perfetto_events import meta_event, slice_event

#: tid of each kind of track within a rank's process; span depth d gets SPAN_TID + d
STEP_TID, SPAN_TID, COMM_TID = 1, 10, 100
#: pid of the host processes holding GPU counters: HOST_PID + node index (ranks are pids 0..N-1)
HOST_PID = 1_000_000


def _step_number(part: str) -> int | None:
    """A step number of --steps (None when left open); it fits a steps row's BIGINT."""
    part = part.strip()
    if not part:
        return None
    if len(part) > 20 or not -(2**63) <= (n := int(part)) < 2**63:  # int() of 5000 digits is slow
        raise ValueError(part)
    return n


@dataclass(frozen=True)
class StepWindow:
    """Steps first..last, both included; None is open."""

    first: int | None = None
    last: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> StepWindow:
        if not text:
            return cls()
        a, sep, b = text.partition(":")
        try:
            first, last = _step_number(a), _step_number(b)
        except ValueError:
            what = shown(repr(text))
            raise PerfscopeError(f"--steps {what}: give A:B, A: or :B with step numbers") from None
        if not sep:
            last = first
        if first is not None and last is not None and last < first:
            raise PerfscopeError(f"--steps {shown(repr(text))}: the last step is before the first")
        return cls(first, last)

    def sql(self, column: str = "step") -> str:
        conds = ["TRUE"]
        if self.first is not None:
            conds.append(f"{column} >= {int(self.first)}")
        if self.last is not None:
            conds.append(f"{column} <= {int(self.last)}")
        return " AND ".join(conds)


def pick_run(store: Store, run_id: str | None) -> str:
    runs = [r["run_id"] for r in store.query("SELECT DISTINCT run_id FROM steps ORDER BY run_id").to_pylist()]
    if run_id is not None:
        if run_id not in runs:
            raise PerfscopeError(f"no steps of run {run_id!r} in the store; runs with steps: {_few(runs)}")
        return run_id
    if len(runs) == 1:
        return str(runs[0])
    if not runs:
        raise PerfscopeError("the store has no steps to export")
    raise PerfscopeError(f"the store holds {len(runs)} runs; pick one with --run ({_few(runs)})")


def _few(items: list[Any]) -> str:
    shown = ", ".join(map(str, items[:5]))
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "") if items else "none"


def build(store: Store, run_id: str, window: StepWindow = StepWindow()) -> dict[str, Any]:
    """The trace of `run_id` (steps in `window`) as a trace-event document."""
    p = [run_id]
    steps = store.query(
        "SELECT rank, step, start_ns, step_ns, data_ns, forward_ns, backward_ns, sync_exposed_ns, "
        f"optimizer_ns, other_ns, comm_total_ns, comm_count FROM steps WHERE run_id = ? AND {window.sql()} "
        "ORDER BY rank, start_ns",
        p,
    ).to_pylist()
    if not steps:
        raise PerfscopeError(f"run {run_id} has no steps in the window given")
    # spans and collectives of the window: the query the dashboard's rank timeline reads too
    intervals = window_intervals(store, run_id, window.first, window.last).to_pylist()
    spans = [i for i in intervals if i["kind"] == "span"]
    comm = [i for i in intervals if i["kind"] == "collective"]
    hosts = {i["rank"]: i["hostname"] for i in intervals if i["kind"] == "step"}
    # the what-if analysis' ideal steps (None without a what-if): they may start before a steps row
    from .perfetto_ideal import ideal_events, ideal_ops  # it reads this module's event helpers

    ideal = ideal_ops(store, run_id, window.first, window.last)
    t_lo = min([s["start_ns"] for s in steps] + ([int(ideal["step_start_ns"].min())] if ideal else []))
    t_hi = max(s["start_ns"] + s["step_ns"] for s in steps)
    gpu = store.query(
        "SELECT hostname, node_rank, gpu_index, ts_ns, util_gpu_pct, power_mw FROM gpu_samples "
        "WHERE run_id = ? AND ts_ns BETWEEN ? AND ? ORDER BY hostname, gpu_index, ts_ns",
        [run_id, t_lo, t_hi],
    ).to_pylist()

    def us(ns: int) -> float:
        return round((ns - t_lo) / 1000.0, 3)

    events: list[dict[str, Any]] = []
    for rank in sorted({s["rank"] for s in steps}):
        host = hosts.get(rank, "")
        events.append(meta_event("process_name", rank, 0, f"{host}/rank {rank}" if host else f"rank {rank}"))
        events.append(meta_event("process_sort_index", rank, 0, rank, key="sort_index"))
        events.append(meta_event("thread_name", rank, STEP_TID, "steps"))
    for s in steps:
        phases = {k: s[k] for k in ("data_ns", "forward_ns", "backward_ns", "sync_exposed_ns", "optimizer_ns",
                                    "other_ns", "comm_total_ns", "comm_count")}  # fmt: skip
        events.append(
            slice_event(
                f"step {s['step']}", "step", s["rank"], STEP_TID, us(s["start_ns"]), s["step_ns"], phases
            )
        )
    depths: set[tuple[int, int]] = set()
    for sp in spans:
        depth = int(sp["depth"] or 0)
        if (sp["rank"], depth) not in depths:
            depths.add((sp["rank"], depth))
            events.append(meta_event("thread_name", sp["rank"], SPAN_TID + depth, f"spans (depth {depth})"))
        tid = SPAN_TID + depth
        events.append(
            slice_event(
                sp["name"], "span", sp["rank"], tid, us(sp["start_ns"]), sp["dur_ns"], {"step": sp["step"]}
            )
        )
    lanes: dict[int, list[int]] = {}  # rank -> end (ns) of the last collective in each lane
    for c in comm:
        ends = lanes.setdefault(c["rank"], [])
        lane = next((i for i, end in enumerate(ends) if end <= c["start_ns"]), len(ends))
        if lane == len(ends):
            ends.append(0)
            events.append(meta_event("thread_name", c["rank"], COMM_TID + lane, f"collectives {lane}"))
        ends[lane] = c["start_ns"] + c["dur_ns"]
        args = {"step": c["step"], "seq": c["seq"], "bytes": c["bytes"]}
        events.append(
            slice_event(c["name"], "comm", c["rank"], COMM_TID + lane, us(c["start_ns"]), c["dur_ns"], args)
        )
    host_pid: dict[str, int] = {}
    for g in gpu:
        host = g["hostname"] or f"node {g['node_rank']}"
        if host not in host_pid:
            host_pid[host] = HOST_PID + len(host_pid)
            events.append(meta_event("process_name", host_pid[host], 0, f"{host} GPUs"))
        pid = host_pid[host]
        ts = us(g["ts_ns"])
        if g["util_gpu_pct"] is not None:
            events.append({"ph": "C", "name": f"GPU {g['gpu_index']} utilisation %", "pid": pid, "tid": 0,
                           "ts": ts, "args": {"util_gpu_pct": g["util_gpu_pct"]}})  # fmt: skip
        if g["power_mw"] is not None:
            events.append({"ph": "C", "name": f"GPU {g['gpu_index']} power W", "pid": pid, "tid": 0,
                           "ts": ts, "args": {"power_w": g["power_mw"] / 1000.0}})  # fmt: skip
    # the what-if analysis' ideal step of each rank, its own process beside the recorded one
    events += ideal_events(ideal, t_lo)
    # metadata first, then each track in time order
    events.sort(key=lambda e: (e["ph"] != "M", e["pid"], e["tid"], e.get("ts", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"perfscope_run_id": run_id, "origin_unix_ns": t_lo},
    }


def write(doc: dict[str, Any], path: str | Path) -> int:
    """Write `doc` to `path` (gzip when the name ends in .gz) whole and safely; returns the bytes written."""
    payload = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if str(path).endswith(".gz"):
        payload = gzip.compress(payload, compresslevel=6)
    with open_output(path, what="trace", flag="-o") as f:
        f.write(payload)
    return len(payload)
