"""What-if (issue 23): the ideal against the actual timeline of one step. Per worker (its first rank) two
lanes, the step replayed with its recorded times and with its ideal times, ops coloured by phase or op
type, the two step ends marked. Reads the `what_if_timeline` analysis only (its median step, its
workers and merged short ops, all bounded there)."""

from __future__ import annotations

import altair as alt
import pyarrow as pa

from .rank_timeline import LANE_PX, name_colours
from .rows import Row, rows
from .style import IDEAL_COLOUR, THRESHOLD_COLOUR, WIDTH, ChartLike, finish, no_data
from .timeline import inline

TITLE = "What-if: the recorded against the ideal timeline of one step"
#: op types coloured on their own (those with the most time in the drawn step); the rest 'other ops'
MAX_COLOURS = 10
MERGED = "short ops (merged)"
OTHER_OPS = "other ops"
_MERGED_COLOUR, _OTHER_OPS_COLOUR = "#d9d9d9", "#8c8c8c"
#: the lanes of a worker, in drawing order, and how opaque each draws its ops
LANES = ("recorded", "ideal")
_LANE_OPACITY = (1.0, 0.55)
#: the step ends: the recorded times' replay and the ideal replay
ENDS = ("recorded step end (replayed)", "ideal step end")


def timeline_run(table: pa.Table | None, run_id: str | None = None) -> str | None:
    """The run to draw: `run_id` when the table has it, else the run whose drawn step is slowest
    against its ideal; None when there is none."""
    values = rows(table, ["run_id", "step_slowdown"])
    if run_id is not None:
        return run_id if any(r["run_id"] == run_id for r in values) else None
    ranked = sorted(values, key=lambda r: r["run_id"])
    best = max(ranked, key=lambda r: r["step_slowdown"] or 0.0, default=None)
    return None if best is None else str(best["run_id"])


def worker_label(r: Row) -> str:
    return f"dp {r['dp_rank']} · stage {r['stage']} · rank {r['rank']}"


def bar_rows(table: pa.Table | None, run_id: str) -> list[Row]:
    """The run's bars, times in ms from the step's recorded start, each with its worker's label and
    its colour class (`colour`: its op type, 'other ops' beyond the MAX_COLOURS op types with the most
    time, 'short ops (merged)' for merged bars)."""
    values = [r for r in rows(table) if r["run_id"] == run_id]
    time_of: dict[str, float] = {}
    for r in values:
        if r["op_type"] != MERGED:
            time_of[r["op_type"]] = time_of.get(r["op_type"], 0.0) + r["end_ns"] - r["start_ns"]
    kept = set(sorted(time_of, key=lambda k: (-time_of[k], k))[:MAX_COLOURS])
    out = []
    for r in values:
        colour = r["op_type"] if r["op_type"] in kept or r["op_type"] == MERGED else OTHER_OPS
        out.append(
            {
                "worker": worker_label(r),
                "order": (r["stage"], r["dp_rank"]),
                "lane": r["lane"],
                "name": r["name"],
                "colour": colour,
                "ops": r["ops"],
                "start_ms": r["start_ns"] / 1e6,
                "end_ms": r["end_ns"] / 1e6,
                "dur_ms": (r["end_ns"] - r["start_ns"]) / 1e6,
            }
        )
    return out


def _colours(names: set[str]) -> tuple[list[str], list[str]]:
    """Colour domain and range: phases in their colours, other op types from a palette (as the
    per-rank timeline colours them), 'other ops' and merged short ops in greys, last."""
    domain, colours = name_colours(names - {MERGED, OTHER_OPS})
    for name, colour in ((OTHER_OPS, _OTHER_OPS_COLOUR), (MERGED, _MERGED_COLOUR)):
        if name in names:
            domain.append(name)
            colours.append(colour)
    return domain, colours


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.4g} ms" if abs(ns) >= 1e6 else f"{ns / 1e3:.3g} µs"


def what_if_timeline_chart(table: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """Per worker shown, two lanes (the step replayed with its recorded times, and with its ideal
    times) of its ops against ms from the step's recorded start, coloured by op type; dashed rules at
    the two step ends. Draws `run_id`, else the run whose drawn step is slowest against its ideal."""
    run = timeline_run(table, run_id)
    if run is None:
        why = (
            f"run {run_id} has no what-if row (it needs more than one rank and a known layout)"
            if run_id
            else "no run in this selection has a what-if row (more than one rank and a known layout)"
        )
        return no_data(TITLE, why)
    values = bar_rows(table, run)
    head = next(r for r in rows(table) if r["run_id"] == run)
    workers = [v["worker"] for v in sorted(values, key=lambda v: v["order"])]
    workers = list(dict.fromkeys(workers))
    for v in values:
        del v["order"]
    domain, colours = _colours({v["colour"] for v in values})
    bars = (
        alt.Chart(inline(values))
        .mark_bar(stroke="white", strokeWidth=0.5)
        .encode(
            x=alt.X("start_ms:Q", title="ms from the step's recorded start"),
            x2="end_ms:Q",
            y=alt.Y("worker:N", title=None, sort=workers, axis=alt.Axis(labelLimit=260)),
            yOffset=alt.YOffset("lane:N", sort=list(LANES), scale=alt.Scale(domain=list(LANES))),
            color=alt.Color("colour:N", title="op type", scale=alt.Scale(domain=domain, range=colours)),
            opacity=alt.Opacity(
                "lane:N", title="lane", scale=alt.Scale(domain=list(LANES), range=list(_LANE_OPACITY))
            ),
            tooltip=[
                alt.Tooltip("worker:N"),
                alt.Tooltip("lane:N"),
                alt.Tooltip("name:N", title="op"),
                alt.Tooltip("ops:Q", title="ops in the bar", format="d"),
                alt.Tooltip("start_ms:Q", title="start (ms)", format=".3f"),
                alt.Tooltip("dur_ms:Q", title="duration (ms)", format=".3f"),
            ],
        )
    )
    ends = [
        {"end": ENDS[0], "ms": head["actual_end_ns"] / 1e6},
        {"end": ENDS[1], "ms": head["ideal_end_ns"] / 1e6},
    ]
    rules = (
        alt.Chart(inline(ends))
        .mark_rule(strokeWidth=2, strokeDash=[5, 3])
        .encode(
            x="ms:Q",
            stroke=alt.Stroke(
                "end:N",
                title="step end",
                scale=alt.Scale(domain=list(ENDS), range=[THRESHOLD_COLOUR, IDEAL_COLOUR]),
            ),
            tooltip=[alt.Tooltip("end:N", title="step end"), alt.Tooltip("ms:Q", format=".3f", title="ms")],
        )
    )
    chart = alt.layer(bars, rules).properties(width=WIDTH * 2, height=alt.Step(LANE_PX * len(LANES)))
    words = [
        f"run {run}, step {head['step']}: the step whose slowdown ({head['step_slowdown']:.3f}) is the "
        f"median of the run's {head['steps']} steps",
        f"recorded: the step replayed with its recorded times, ending at {_ms(head['actual_end_ns'])} "
        f"(recorded step {_ms(head['recorded_step_ns'])}); ideal: every op at its typical time among its "
        f"data-parallel peers, ending at {_ms(head['ideal_end_ns'])}",
        "the first rank of each worker"
        + (
            f"; the {head['workers_shown']} of {head['workers']} workers whose ops exceed their ideal most"
            if head["workers_shown"] < head["workers"]
            else ""
        ),
    ]
    merged = [v for v in values if v["colour"] == MERGED]
    if merged:
        words.append(
            f"{len(values)} bars: ops under {_ms(head['merge_below_ns'])} merged with their short "
            f"neighbours ({sum(v['ops'] for v in merged)} ops in {len(merged)} bars)"
        )
    if any(v["colour"] == OTHER_OPS for v in values):
        words.append(f"op types beyond the {MAX_COLOURS} with the most time: '{OTHER_OPS}'")
    return finish(chart, TITLE, words)
