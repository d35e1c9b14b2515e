"""Two runs or two scaling groups side by side, with the differences that matter highlighted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import altair as alt
import pyarrow as pa

from .rows import Row, data, rows
from .style import HEIGHT, PANEL_HEIGHT, PHASE_LABELS, PHASES, WIDTH, ChartLike, finish, no_data

#: A relative change smaller than this is "about the same": run-to-run noise of a steady step time
#: is a few per cent (the seed study's repeated runs differ by 1-3 %).
NOTABLE_CHANGE = 0.05

SIDE_COLOURS = {"A": "#4C78A8", "B": "#F58518"}
VERDICT_COLOURS = {"better": "#009E73", "worse": "#D55E00", "same": "#999999", "": "#999999"}


@dataclass(frozen=True)
class Quantity:
    """One number to compare: its column, its words, the display unit and which direction is good."""

    column: str
    label: str
    unit: str = ""
    scale: float = 1.0
    better: str = ""  # 'lower', 'higher' or '' when neither direction is better


def verdict(a: float | None, b: float | None, better: str, threshold: float = NOTABLE_CHANGE) -> str:
    """'better' / 'worse' for B against A, 'same' within `threshold`, '' when it cannot be said."""
    if a is None or b is None:
        return ""
    if a == 0:
        if b == 0:
            return "same"
        change = float("inf") if b > 0 else float("-inf")
    else:
        change = b / a - 1
    if abs(change) < threshold:
        return "same"
    if not better:
        return "different"
    up_is_good = better == "higher"
    return "better" if (change > 0) == up_is_good else "worse"


def difference_table(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    quantities: Sequence[Quantity],
    threshold: float = NOTABLE_CHANGE,
) -> pa.Table:
    """One row per quantity: A, B (display units), B − A, B/A − 1 and the verdict for B."""
    out: dict[str, list[Any]] = {
        k: [] for k in ("quantity", "unit", "a", "b", "difference", "change", "verdict")
    }
    for q in quantities:
        va, vb = _number(a.get(q.column)), _number(b.get(q.column))
        sa = None if va is None else va * q.scale
        sb = None if vb is None else vb * q.scale
        out["quantity"].append(q.label)
        out["unit"].append(q.unit)
        out["a"].append(sa)
        out["b"].append(sb)
        out["difference"].append(None if sa is None or sb is None else sb - sa)
        out["change"].append(None if sa is None or sb is None or sa == 0 else sb / sa - 1)
        out["verdict"].append(verdict(sa, sb, q.better, threshold))
    return pa.table(
        out,
        schema=pa.schema(
            [
                ("quantity", pa.string()),
                ("unit", pa.string()),
                ("a", pa.float64()),
                ("b", pa.float64()),
                ("difference", pa.float64()),
                ("change", pa.float64()),
                ("verdict", pa.string()),
            ]
        ),
    )


def _number(v: Any) -> float | None:
    if v is None or isinstance(v, (str, bool)):
        return None
    f = float(v)
    return None if f != f else f  # NaN is "unknown"


def _diff_text(ta: float | None, tb: float | None) -> str:
    if ta is None or tb is None:
        return ""
    return f"{tb - ta:+.3f} ms" + (f" ({tb / ta - 1:+.1%})" if ta else "")


def _verdict_colour() -> alt.Color:
    return alt.Color(
        "verdict:N",
        title="B against A",
        scale=alt.Scale(
            domain=list(VERDICT_COLOURS)[:3], range=[VERDICT_COLOURS[k] for k in ("better", "worse", "same")]
        ),
    )


def phase_compare_chart(
    phase_breakdown: pa.Table | None, run_a: str, run_b: str, threshold: float = NOTABLE_CHANGE
) -> ChartLike:
    """Each phase's steady-state time in run A and run B, with B − A labelled and coloured by verdict."""
    title = "Phase times, A against B"
    vals = rows(phase_breakdown, ("run_id", "phase", "time_ns"))
    by: dict[tuple[str, str], float] = {}
    for r in vals:
        if r["run_id"] in (run_a, run_b) and r["time_ns"] is not None:
            by[(r["run_id"], r["phase"])] = r["time_ns"] / 1e6
    if not any(k[0] == run_a for k in by) or not any(k[0] == run_b for k in by):
        return no_data(title, "pick two runs that both have steady-state steps")
    phases = [p for p in PHASES if (run_a, p) in by or (run_b, p) in by]
    bars: list[Row] = []
    diffs: list[Row] = []
    for p in phases:
        ta, tb = by.get((run_a, p)), by.get((run_b, p))
        label = PHASE_LABELS.get(p, p)
        bars.append({"phase": label, "side": "A", "ms": ta})
        bars.append({"phase": label, "side": "B", "ms": tb})
        diffs.append(
            {
                "phase": label,
                "text": _diff_text(ta, tb),
                "verdict": verdict(ta, tb, "lower", threshold),
                "at": max(x for x in (ta, tb, 0.0) if x is not None),
            }
        )
    y = alt.Y("phase:N", title=None, sort=[PHASE_LABELS.get(p, p) for p in phases])
    bar = (
        alt.Chart(data(bars))
        .mark_bar()
        .encode(
            y,
            alt.YOffset("side:N", sort=["A", "B"]),
            alt.X("ms:Q", title="time per step (ms, steady-state median)"),
            alt.Color(
                "side:N",
                title="run",
                scale=alt.Scale(domain=["A", "B"], range=[SIDE_COLOURS["A"], SIDE_COLOURS["B"]]),
            ),
            tooltip=[
                alt.Tooltip("phase:N"),
                alt.Tooltip("side:N", title="run"),
                alt.Tooltip("ms:Q", format=".3f"),
            ],
        )
    )
    text = (
        alt.Chart(data(diffs))
        .mark_text(align="left", dx=6, fontSize=11, fontWeight="bold")
        .encode(
            y,
            alt.X("at:Q"),
            text="text:N",
            color=alt.Color(
                "verdict:N",
                scale=alt.Scale(domain=list(VERDICT_COLOURS), range=list(VERDICT_COLOURS.values())),
                legend=None,
            ),
        )
    )
    chart = alt.layer(bar, text).resolve_scale(color="independent").properties(width=WIDTH, height=HEIGHT)
    return finish(
        chart,
        title,
        [
            f"A = {run_a}",
            f"B = {run_b}",
            f"B − A labelled; green = B faster, orange = B slower (≥ {threshold:.0%})",
        ],
    )


_SCALING_FIELDS = {
    "efficiency": ("efficiency E(N)", ".0%"),
    "speedup": ("speedup S(N)", ".2f"),
    "per_gpu_speedup": ("per-GPU speedup S(N)/N", ".2f"),
    "throughput_samples_per_s": ("throughput (samples/s)", ",.0f"),
}


def scaling_compare_chart(
    scaling: pa.Table | None,
    group_a: str,
    group_b: str,
    field: str = "efficiency",
    threshold: float = NOTABLE_CHANGE,
) -> ChartLike:
    """A scaling quantity against world size for two groups, and B − A at every world size both have."""
    label, fmt = _SCALING_FIELDS[field]
    title = f"{label[0].upper()}{label[1:]}: group A against group B"
    vals = [
        {**r, "side": "A" if r["group_id"] == group_a else "B"}
        for r in rows(scaling, ("group_id", "world_size", "source", field))
        if r["group_id"] in (group_a, group_b) and r[field] is not None
    ]
    if not any(r["side"] == "A" for r in vals) or not any(r["side"] == "B" for r in vals):
        return no_data(title, "pick two groups that both have runs in this selection")
    ticks = sorted({int(r["world_size"]) for r in vals})
    x = alt.X("world_size:Q", title="world size N", axis=alt.Axis(values=ticks, format="d"))
    side_colour = alt.Color(
        "side:N",
        title="group",
        scale=alt.Scale(domain=["A", "B"], range=[SIDE_COLOURS["A"], SIDE_COLOURS["B"]]),
    )
    tooltip = [
        alt.Tooltip("side:N", title="group"),
        alt.Tooltip("world_size:Q", title="N"),
        alt.Tooltip(f"{field}:Q", format=fmt),
        alt.Tooltip("source:N"),
    ]
    base = alt.Chart(data(vals)).encode(
        x, alt.Y(f"{field}:Q", title=label, axis=alt.Axis(format=fmt)), side_colour
    )
    curves = alt.layer(
        base.mark_line(), base.mark_point(filled=True, size=60).encode(tooltip=tooltip)
    ).properties(width=WIDTH, height=HEIGHT)
    a_at = {r["world_size"]: r[field] for r in vals if r["side"] == "A"}
    diffs = [
        {
            "world_size": r["world_size"],
            "difference": r[field] - a_at[r["world_size"]],
            "verdict": verdict(a_at[r["world_size"]], r[field], "higher", threshold),
        }
        for r in vals
        if r["side"] == "B" and r["world_size"] in a_at
    ]
    lines = [f"A = {group_a}", f"B = {group_b}"]
    if not diffs:
        lines.append("the groups share no world size: no difference to draw")
        return finish(curves, title, lines)
    bars = (
        alt.Chart(data(diffs))
        .mark_bar(size=14)
        .encode(
            x,
            alt.Y("difference:Q", title="B − A", axis=alt.Axis(format=fmt)),
            _verdict_colour(),
            tooltip=[
                alt.Tooltip("world_size:Q", title="N"),
                alt.Tooltip("difference:Q", title="B − A", format=fmt),
                alt.Tooltip("verdict:N", title="B against A"),
            ],
        )
        .properties(width=WIDTH, height=PANEL_HEIGHT * 0.6)
    )
    lines.append(
        f"lower panel: B − A where both have the world size; within {threshold:.0%} counts as the same"
    )
    chart = alt.vconcat(curves, bars).resolve_scale(color="independent")
    return finish(chart, title, lines)


def step_distribution_chart(steps: pa.Table | None) -> ChartLike:
    """`perfscope compare`'s two step-time distributions: a histogram of each run's steady steps (each
    step's share of the wall clock, ms), base and candidate overlaid. `steps`: side, step_ms."""
    title = "Steady step times, base and candidate"
    vals = [r for r in rows(steps, ("side", "step_ms")) if r["step_ms"] is not None]
    if not {r["side"] for r in vals} >= {"base", "candidate"}:
        return no_data(title, "both runs need steady steps")
    colours = alt.Scale(domain=["base", "candidate"], range=[SIDE_COLOURS["A"], SIDE_COLOURS["B"]])
    chart = (
        alt.Chart(data(vals))
        .mark_bar(opacity=0.55, binSpacing=0)
        .encode(
            alt.X("step_ms:Q", bin=alt.Bin(maxbins=40), title="step time (ms, share of the wall clock)"),
            alt.Y("count():Q", title="steps", stack=None),
            alt.Color("side:N", title="run", scale=colours),
            tooltip=[alt.Tooltip("side:N", title="run"), alt.Tooltip("count():Q", title="steps")],
        )
        .properties(width=WIDTH, height=HEIGHT)
    )
    return finish(
        chart, title, "each steady step's share of the window's wall clock; its mean is the step time"
    )


def phase_waterfall_chart(by_phase: pa.Table | None) -> ChartLike:
    """`perfscope compare`'s difference by phase as a waterfall: the base's step time, each phase's
    change per step (the additive breakdown: they add up), and the candidate's step time.
    `by_phase`: phase, label, base_ns, candidate_ns, delta_ns, in the breakdown's order."""
    title = "Where the step time went: base to candidate by phase"
    vals = rows(by_phase, ("label", "base_ns", "candidate_ns", "delta_ns"))
    if not vals:
        return no_data(title, "no steady steps in one of the runs")
    base = sum(float(r["base_ns"] or 0.0) for r in vals) / 1e6
    bars: list[Row] = [{"what": "base step", "start": 0.0, "end": base, "kind": "total", "ms": base}]
    at = base
    for r in vals:
        d = float(r["delta_ns"] or 0.0) / 1e6
        kind = "slower" if d > 0 else "faster"
        bars.append({"what": str(r["label"]), "start": at, "end": at + d, "kind": kind, "ms": d})
        at += d
    bars.append({"what": "candidate step", "start": 0.0, "end": at, "kind": "total", "ms": at})
    order = [b["what"] for b in bars]
    chart = (
        alt.Chart(data(bars))
        .mark_bar()
        .encode(
            alt.X("what:N", sort=order, title=None, axis=alt.Axis(labelAngle=-30, labelLimit=160)),
            alt.Y("start:Q", title="step time (ms)"),
            alt.Y2("end:Q"),
            alt.Color(
                "kind:N",
                title=None,
                scale=alt.Scale(
                    domain=["total", "slower", "faster"],
                    range=["#999999", VERDICT_COLOURS["worse"], VERDICT_COLOURS["better"]],
                ),
            ),
            tooltip=[alt.Tooltip("what:N"), alt.Tooltip("ms:Q", title="ms per step", format="+.3f")],
        )
        .properties(width=WIDTH, height=HEIGHT)
    )
    return finish(chart, title, "steady step, mean over ranks; the phases add up to the difference")
