"""Batch-size effects: throughput and epoch time against batch size, and the user metric against
wall time for each batch size (the statistical side of scaling)."""

from __future__ import annotations

import math
from typing import Any

import altair as alt
import pyarrow as pa

from ..words import known
from .rows import Row, data, rows, series_labels, sources
from .style import (
    PANEL_HEIGHT,
    PANEL_WIDTH,
    SERIES_SCHEME,
    WIDTH,
    ChartLike,
    finish,
    no_data,
    source_fill_opacity,
    source_note,
    source_shape,
)

_SWEEP_COLUMNS = (
    "experiment",
    "cluster",
    "backend",
    "world_size",
    "run_id",
    "source",
    "batch_size_per_rank",
    "global_batch_size",
    "step_ns",
    "per_sample_ns",
    "throughput_samples_per_s",
    "epoch_s",
    "throughput_vs_smallest",
)
_CURVE_COLUMNS = (
    "run_id",
    "source",
    "experiment",
    "world_size",
    "batch_size_per_rank",
    "global_batch_size",
    "metric",
    "elapsed_s",
    "value",
)
_TARGET_COLUMNS = ("experiment", "metric", "direction", "target")


def _batch_x(values: list[Row]) -> alt.X:
    batches = sorted({int(r["global_batch_size"]) for r in values})
    wide = len(batches) > 1 and batches[0] > 0 and batches[-1] / batches[0] > 8
    return alt.X(
        "global_batch_size:Q",
        title="global batch size (samples per step)" + (", log scale" if wide else ""),
        scale=alt.Scale(type="log") if wide else alt.Scale(zero=False),
        axis=alt.Axis(values=batches, format="d", labelOverlap=True),
    )


def batch_sweep_chart(batch_sweep: pa.Table | None) -> ChartLike:
    """Throughput and epoch time against global batch size, one line per (experiment, cluster,
    backend, N)."""
    title = "Batch-size sweep: throughput and epoch time"
    values = [
        r for r in rows(batch_sweep, _SWEEP_COLUMNS) if r["global_batch_size"] and r["step_ns"] is not None
    ]
    if not values:
        return no_data(title, "no batch-size sweep in this selection (one batch size per setup)")
    keys = {
        (r["experiment"] or "", r["cluster"] or "", r["backend"] or "", f"N={r['world_size']}")
        for r in values
    }
    labels = series_labels(keys)
    for r in values:
        r["series"] = labels[
            (r["experiment"] or "", r["cluster"] or "", r["backend"] or "", f"N={r['world_size']}")
        ]
    colour = alt.Color(
        "series:N", title="setup", scale=alt.Scale(scheme=SERIES_SCHEME), legend=alt.Legend(title="setup")
    )
    stroke = alt.Stroke("series:N", legend=None, scale=alt.Scale(scheme=SERIES_SCHEME))
    tooltip = [
        alt.Tooltip("run_id:N"),
        alt.Tooltip("global_batch_size:Q", title="global batch"),
        alt.Tooltip("throughput_samples_per_s:Q", title="samples/s", format=",.0f"),
        alt.Tooltip("epoch_s:Q", title="epoch s", format=",.2f"),
        alt.Tooltip("throughput_vs_smallest:Q", title="× smallest batch", format=".2f"),
    ]

    def panel(field: str, y_title: str) -> Any:
        base = alt.Chart(data(values)).encode(_batch_x(values), alt.Y(f"{field}:Q", title=y_title), colour)
        return alt.layer(
            base.mark_line().encode(detail="series:N"),
            base.mark_point(filled=True).encode(
                stroke, source_shape(sources(values)), source_fill_opacity(), tooltip=tooltip
            ),
        ).properties(width=PANEL_WIDTH + 40, height=PANEL_HEIGHT + 20)

    has_epoch = any(r["epoch_s"] is not None for r in values)
    parts = [panel("throughput_samples_per_s", "throughput (samples/s)")]
    if has_epoch:
        parts.append(panel("epoch_s", "epoch time (s)"))
    chart = alt.hconcat(*parts) if len(parts) > 1 else parts[0]
    subtitle = [
        "steady-state throughput X = G/T; epoch time = dataset samples / G · T",
        source_note(sources(values)),
    ]
    return finish(chart, title, subtitle)


def _log_worthy(values: list[Row]) -> bool:
    vs = [r["value"] for r in values if r["value"] is not None]
    return bool(vs) and min(vs) > 0 and max(vs) / min(vs) > 10


def metric_curve_chart(metric_curves: pa.Table | None, time_to_metric: pa.Table | None = None) -> ChartLike:
    """The user metric (e.g. loss) against wall time, one line per batch size; the common target
    from `time_to_metric` as a rule when given."""
    title = "Training metric against wall time, per batch size"
    values = [
        r
        for r in rows(metric_curves, _CURVE_COLUMNS)
        if r["value"] is not None and r["elapsed_s"] is not None
    ]
    if not values:
        return no_data(title, "no user metrics recorded in this selection")
    for r in values:
        gbs = r["global_batch_size"]
        r["batch"] = (
            f"{gbs} (N={r['world_size']})" if known(gbs) else f"batch size unknown (N={r['world_size']})"
        )
    batches = sorted({(r["global_batch_size"] or 0, r["world_size"] or 0, r["batch"]) for r in values})
    metrics = sorted({r["metric"] for r in values})
    layers_by_metric = []
    for m in metrics:
        mv = [r for r in values if r["metric"] == m]
        y_scale = alt.Scale(type="log") if _log_worthy(mv) else alt.Scale(zero=False)
        line = (
            alt.Chart(data(mv))
            .mark_line(strokeWidth=1.5)
            .encode(
                x=alt.X("elapsed_s:Q", title="wall time since the run's first step (s)"),
                y=alt.Y("value:Q", title=m, scale=y_scale),
                color=alt.Color(
                    "batch:N",
                    title="global batch",
                    sort=[b for _, _, b in batches],
                    scale=alt.Scale(scheme="viridis"),
                ),
                detail="run_id:N",
                tooltip=[
                    alt.Tooltip("run_id:N"),
                    alt.Tooltip("batch:N", title="global batch"),
                    alt.Tooltip("elapsed_s:Q", format=".2f"),
                    alt.Tooltip("value:Q", format=".4g"),
                ],
            )
        )
        targets = [
            {**t, "label": f"target {t['target']:.3g} ({t['direction']} is better)"}
            for t in rows(time_to_metric, _TARGET_COLUMNS)
            if t["metric"] == m and t["target"] is not None and not math.isnan(t["target"])
        ]
        targets = list({(t["experiment"], t["target"]): t for t in targets}.values())
        parts: list[Any] = [line]
        if targets:
            parts.append(
                alt.Chart(data(targets)).mark_rule(strokeDash=[4, 3], color="#555").encode(y="target:Q")
            )
            parts.append(
                alt.Chart(data(targets))
                .mark_text(align="right", x=WIDTH - 4, dy=-7, fontSize=10, color="#555")
                .encode(y="target:Q", text="label:N")
            )
        layers_by_metric.append(alt.layer(*parts).properties(width=WIDTH, height=PANEL_HEIGHT + 40))
    chart = alt.vconcat(*layers_by_metric) if len(layers_by_metric) > 1 else layers_by_metric[0]
    subtitle = ["lowest rank's value as recorded; time-to-target compares batch sizes fairly"]
    if "simulated" in sources(values):
        subtitle.append("simulated runs (not measured)")
    return finish(chart, title, subtitle)
