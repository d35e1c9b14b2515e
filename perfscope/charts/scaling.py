"""Speedup, efficiency and per-GPU speedup against world size, per scaling group, with the ideal line
and the scaling model's predictions."""

from __future__ import annotations

from typing import Any

import altair as alt
import pyarrow as pa

from .rows import Row, data, group_label_map, multi_point_groups, rows, sources, world_size_ticks
from .style import (
    HEIGHT,
    IDEAL_COLOUR,
    SERIES_SCHEME,
    THRESHOLD_COLOUR,
    WIDTH,
    ChartLike,
    finish,
    is_wide,
    no_data,
    source_fill_opacity,
    source_note,
    source_shape,
    world_size_x,
)

_SCALING_COLUMNS = (
    "group_id",
    "mixed",
    "run_id",
    "source",
    "world_size",
    "nodes",
    "baseline_world_size",
    "speedup",
    "ideal_speedup",
    "efficiency",
    "per_gpu_speedup",
    "step_ns",
)
_PREDICTION_COLUMNS = ("group_id", "world_size", "kind", "model_speedup", "model_efficiency", "trusted")

#: Below this efficiency a finding is worth raising (DESIGN.md, POP efficiencies).
EFFICIENCY_THRESHOLD = 0.8


def _curves(scaling: pa.Table | None) -> list[Row]:
    """Rows of the groups that have a curve: two or more world sizes and not a mixed group."""
    vals = [r for r in rows(scaling, _SCALING_COLUMNS) if not r["mixed"]]
    keep = multi_point_groups(vals)
    return [r for r in vals if r["group_id"] in keep]


def _predictions(prediction: pa.Table | None, groups: set[str], field: str) -> list[Row]:
    out = []
    for r in rows(prediction, _PREDICTION_COLUMNS):
        if r["group_id"] in groups and r.get(field) is not None:
            out.append(
                {**r, "value": r[field], "source": "prediction" if r["kind"] == "prediction" else "model"}
            )
    return out


def _group_colour() -> alt.Color:
    """Colour by group with an explicit legend: without one, the browser's Vega-Lite (Streamlit's)
    drops the group legend of these layers, whose legend-less stroke shares the colour's field."""
    return alt.Color(
        "series:N", title="group", scale=alt.Scale(scheme=SERIES_SCHEME), legend=alt.Legend(title="group")
    )


def _label(values: list[Row], labels: dict[str, str]) -> None:
    for r in values:
        r["series"] = labels.get(r["group_id"], r["group_id"])


def _curve(
    values: list[Row],
    field: str,
    y: alt.Y,
    prediction: list[Row],
    ticks: list[int],
    extra_tooltip: tuple[str, ...] = (),
) -> list[Any]:
    """The curve's layers (a list: alt.layer() lifts shared data out of its layers)."""
    colour = _group_colour()
    # filled point marks take no stroke from `color`; hollow (simulated, predicted) ones need it
    stroke = alt.Stroke("series:N", legend=None, scale=alt.Scale(scheme=SERIES_SCHEME))
    tooltip = [
        alt.Tooltip("series:N", title="group"),
        alt.Tooltip("run_id:N"),
        alt.Tooltip("world_size:Q", title="N"),
        alt.Tooltip(f"{field}:Q", format=".3f"),
        alt.Tooltip("source:N"),
        *(alt.Tooltip(t) for t in extra_tooltip),
    ]
    pred_points = [p for p in prediction if p["source"] == "prediction"]
    present = sources(values) | ({"prediction"} if pred_points else set())
    base = alt.Chart(data(values)).encode(world_size_x(ticks), y.copy(), colour)
    layers: list[Any] = [
        base.mark_line().encode(detail="series:N"),
        base.mark_point(filled=True).encode(
            stroke, source_shape(present), source_fill_opacity(), tooltip=tooltip
        ),
    ]
    if prediction:
        pbase = alt.Chart(data(prediction)).encode(
            world_size_x(ticks),
            alt.Y("value:Q"),
            _group_colour(),
        )
        layers.append(pbase.mark_line(strokeDash=[6, 4], strokeWidth=1.5).encode(detail="series:N"))
        if pred_points:
            layers.append(
                alt.Chart(data(pred_points))
                .mark_point(filled=True)
                .encode(
                    world_size_x(ticks),
                    alt.Y("value:Q"),
                    _group_colour(),
                    stroke,
                    source_shape(present),
                    source_fill_opacity(),
                    tooltip=[
                        alt.Tooltip("series:N", title="group"),
                        alt.Tooltip("world_size:Q", title="N"),
                        alt.Tooltip("value:Q", title="predicted", format=".3f"),
                        alt.Tooltip("trusted:N"),
                    ],
                )
            )
    return layers


def _prepared(
    scaling: pa.Table | None, prediction: pa.Table | None, pred_field: str | None
) -> tuple[list[Row], list[Row], list[int]]:
    values = _curves(scaling)
    groups = {r["group_id"] for r in values}
    preds = _predictions(prediction, groups, pred_field) if pred_field else []
    labels = group_label_map(groups)
    _label(values, labels)
    _label(preds, labels)
    return values, preds, world_size_ticks(values + preds)


def _subtitle(values: list[Row], preds: list[Row], first: str) -> list[str]:
    untrusted = any(p["source"] == "prediction" and not p.get("trusted") for p in preds)
    note = source_note(sources(values) | sources(p for p in preds if p["source"] == "prediction"))
    lines = [first, note]
    if untrusted:
        lines.append("predictions from fewer than 5 measured world sizes are not trusted")
    return lines


def speedup_chart(scaling: pa.Table | None, prediction: pa.Table | None = None) -> ChartLike:
    """Speedup S(N) = X(N)/X(N0) against N per scaling group, with the ideal S = N/N0."""
    title = "Speedup against world size"
    values, preds, ticks = _prepared(scaling, prediction, "model_speedup")
    if not values:
        return no_data(title, "no scaling group with two or more world sizes in this selection")
    ideal = sorted(
        {(r["world_size"], r["ideal_speedup"]) for r in values if r["ideal_speedup"] is not None}
        | {(p["world_size"], p["world_size"] / _baseline(values, p["group_id"])) for p in preds}
    )
    ideal_rows = [{"world_size": n, "ideal": s} for n, s in ideal]
    ideal_layer = (
        alt.Chart(data(ideal_rows))
        .mark_line(color=IDEAL_COLOUR, strokeDash=[2, 3], strokeWidth=1.5)
        .encode(world_size_x(ticks), alt.Y("ideal:Q"))
    )
    ideal_text = (
        alt.Chart(data(ideal_rows[-1:]))
        .mark_text(align="right", dx=-4, dy=-8, color=IDEAL_COLOUR, fontSize=11)
        .encode(world_size_x(ticks), alt.Y("ideal:Q"), text=alt.value("ideal S = N/N0"))
    )
    # log-log when the axis is log: the ideal line stays straight and small N stays readable
    y_scale = alt.Scale(type="log", base=2) if is_wide(ticks) else alt.Scale()
    y = alt.Y("speedup:Q", title="speedup S(N) = X(N)/X(N0)", scale=y_scale)
    curve = _curve(values, "speedup", y, preds, ticks)
    chart = alt.layer(ideal_layer, ideal_text, *curve).properties(width=WIDTH, height=HEIGHT)
    return finish(chart, title, _subtitle(values, preds, "S(N) = X(N)/X(N0), N0 = smallest N in the group"))


def _baseline(values: list[Row], group_id: str) -> float:
    for r in values:
        if r["group_id"] == group_id and r.get("baseline_world_size"):
            return float(r["baseline_world_size"])
    return 1.0


def efficiency_chart(scaling: pa.Table | None, prediction: pa.Table | None = None) -> ChartLike:
    """Efficiency E(N) = S(N)·N0/N against N, with 100% and the 0.8 line below which it is a finding."""
    title = "Scaling efficiency against world size"
    values, preds, ticks = _prepared(scaling, prediction, "model_efficiency")
    if not values:
        return no_data(title, "no scaling group with two or more world sizes in this selection")
    rules = [
        {"y": 1.0, "label": "ideal 100%", "colour": IDEAL_COLOUR},
        {"y": EFFICIENCY_THRESHOLD, "label": "0.8: below this, a finding", "colour": THRESHOLD_COLOUR},
    ]
    rule = (
        alt.Chart(data(rules))
        .mark_rule(strokeDash=[2, 3])
        .encode(y="y:Q", color=alt.Color("colour:N", scale=None))
    )
    rule_text = (
        alt.Chart(data(rules))
        .mark_text(align="right", x=WIDTH - 4, dy=-7, fontSize=10)
        .encode(y="y:Q", text="label:N", color=alt.Color("colour:N", scale=None))
    )
    y = alt.Y("efficiency:Q", title="efficiency E(N) = S(N)·N0/N", axis=alt.Axis(format="%"))
    curve = _curve(values, "efficiency", y, preds, ticks)
    chart = alt.layer(rule, rule_text, *curve).properties(width=WIDTH, height=HEIGHT)
    return finish(chart, title, _subtitle(values, preds, "E(N) = S(N)·N0/N; 100% is perfect scaling"))


#: vertical room one value label needs, in pixels of the plot
LABEL_HEIGHT_PX = 12


def _spread(labels: list[Row], field: str) -> list[Row]:
    """The labels with a `label_y` each: their value, moved apart (largest first) so that no two
    overlap; the axis runs from 0 to the largest value (or 1), HEIGHT pixels tall."""
    top = max([1.0, *(r[field] for r in labels)])
    gap = top * LABEL_HEIGHT_PX / HEIGHT
    out: list[Row] = []
    for r in sorted(labels, key=lambda r: r[field], reverse=True):
        y = r[field] if not out else min(r[field], out[-1]["label_y"] - gap)
        out.append({**r, "label_y": y})
    return out


def per_gpu_speedup_chart(scaling: pa.Table | None, unit: str = "GPU") -> ChartLike:
    """Per-GPU speedup S(N)/N against N (what the seed study quotes), labelled at the largest N;
    `unit` names what a rank runs on ("rank" for CPU jobs)."""
    title = f"Per-{unit} speedup against world size"
    values, _, ticks = _prepared(scaling, None, None)
    if not values:
        return no_data(title, "no scaling group with two or more world sizes in this selection")
    last: dict[str, Row] = {}
    for r in values:
        if r["per_gpu_speedup"] is not None and (
            r["series"] not in last or r["world_size"] > last[r["series"]]["world_size"]
        ):
            last[r["series"]] = r
    y = alt.Y("per_gpu_speedup:Q", title=f"per-{unit} speedup S(N)/N")
    curve = _curve(values, "per_gpu_speedup", y, [], ticks)
    labels = (
        alt.Chart(data(_spread(list(last.values()), "per_gpu_speedup")))
        .mark_text(align="left", dx=7, fontSize=11)
        .encode(
            world_size_x(ticks),
            alt.Y("label_y:Q"),
            _group_colour(),
            text=alt.Text("per_gpu_speedup:Q", format=".2f"),
        )
    )
    chart = alt.layer(*curve, labels).properties(width=WIDTH, height=HEIGHT)
    subtitle = _subtitle(values, [], "S(N)/N; labels give the value at the largest N")
    # the offset leaves room for the value labels right of the last point
    return finish(chart, title, subtitle, legend_offset=44)
