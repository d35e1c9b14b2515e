"""The per-rank timeline of a window of steps (the `rank_timeline` analysis): one row per rank, its
steps, spans and collectives as bars against time in ms, coloured by phase or collective."""

from __future__ import annotations

import altair as alt
import pyarrow as pa
import pyarrow.compute as pc

from .rows import Row, rows
from .style import PHASE_COLOURS, WIDTH, ChartLike, finish, no_data
from .timeline import inline

TITLE = "Per-rank timeline"
#: Span names that are canonical phases, with the phase colour every chart uses for them.
_PHASE_OF_SPAN = {"data": "data", "forward": "forward", "backward": "backward", "sync": "sync_exposed",
                  "optimizer": "optimizer", "other": "other"}  # fmt: skip
_STEP_COLOUR = "#dddddd"
#: Colours of user spans and collective ops, apart from the phase colours.
_OTHER_COLOURS = ("#4E79A7", "#F28E2B", "#E15759", "#76B7B2", "#59A14F", "#EDC948", "#B07AA1", "#FF9DA7",
                  "#9C755F", "#BAB0AC")  # fmt: skip
#: Height of one lane (steps, each span depth, collectives) of a rank, in pixels.
LANE_PX = 12


def _lane(r: Row) -> str:
    if r["kind"] == "span":
        return f"span {int(r['depth'] or 0)}"
    return "collectives" if r["kind"] == "collective" else "steps"


def name_colours(names: set[str]) -> tuple[list[str], list[str]]:
    """Colour domain and range of span and op names, sorted: phases in their colours, other names from
    a palette (also the what-if timeline's)."""
    domain, colours = [], []
    others = 0
    for name in sorted(names):
        domain.append(name)
        phase = _PHASE_OF_SPAN.get(name)
        if phase is not None:
            colours.append(PHASE_COLOURS[phase])
        else:
            colours.append(_OTHER_COLOURS[others % len(_OTHER_COLOURS)])
            others += 1
    return domain, colours


def _colours(values: list[Row]) -> tuple[list[str], list[str]]:
    """Colour domain and range: steps grey, phases in their colours, other names from a palette."""
    domain, colours = name_colours({r["colour"] for r in values} - {"step"})
    return ["step", *domain], [_STEP_COLOUR, *colours]


def rank_timeline_chart(table: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """Bars per rank (y) against ms from the window's start (x): a lane for the steps, one per span
    depth and one for collectives; colour by phase, span or collective op; tooltip with name and
    duration. Draws `run_id`, else the table's first run."""
    if table is None or table.num_rows == 0:
        return no_data(TITLE, "no steps in this window")
    if run_id is None:
        run_id = str(table["run_id"][0].as_py())
    run = table.filter(pc.equal(table["run_id"], run_id))
    if run.num_rows == 0:
        return no_data(TITLE, f"no steps of run {run_id} in this window")
    values = rows(run, ["rank", "hostname", "step", "kind", "name", "depth", "bytes", "start_ns", "dur_ns"])
    for r in values:
        r["start_ms"] = r["start_ns"] / 1e6
        r["end_ms"] = (r["start_ns"] + r["dur_ns"]) / 1e6
        r["dur_ms"] = r["dur_ns"] / 1e6
        r["lane"] = _lane(r)
        r["colour"] = "step" if r["kind"] == "step" else r["name"]
        r["rank_label"] = f"rank {r['rank']}" + (f" · {r['hostname']}" if r["hostname"] else "")
        del r["start_ns"], r["dur_ns"]
    lanes = sorted(
        {r["lane"] for r in values}, key=lambda lane: (lane != "steps", lane == "collectives", lane)
    )
    ranks = sorted({(r["rank"], r["rank_label"]) for r in values})
    domain, colours = _colours(values)
    steps = sorted({r["step"] for r in values})
    chart = (
        alt.Chart(inline(values))
        .mark_bar(cornerRadius=1, stroke="white", strokeWidth=0.5)
        .encode(
            x=alt.X("start_ms:Q", title="time from the window's first step start (ms)"),
            x2="end_ms:Q",
            y=alt.Y("rank_label:N", title=None, sort=[label for _, label in ranks]),
            yOffset=alt.YOffset("lane:N", sort=lanes),
            color=alt.Color(
                "colour:N", title="phase, span or collective", scale=alt.Scale(domain=domain, range=colours)
            ),
            tooltip=[
                alt.Tooltip("rank_label:N", title="rank"),
                alt.Tooltip("step:Q", title="step", format="d"),
                alt.Tooltip("kind:N", title="kind"),
                alt.Tooltip("name:N", title="name"),
                alt.Tooltip("dur_ms:Q", title="duration (ms)", format=".3f"),
                alt.Tooltip("start_ms:Q", title="start (ms)", format=".3f"),
                alt.Tooltip("bytes:Q", title="bytes", format=",d"),
            ],
        )
        .properties(width=WIDTH * 2, height=alt.Step(LANE_PX * len(lanes)))
    )
    window = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"
    return finish(
        chart,
        TITLE,
        [f"run {run_id}, {window}; lanes per rank: {', '.join(lanes)}", "times on rank 0's clock"],
    )
