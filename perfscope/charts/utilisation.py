"""GPU kernel-active time share (NVML) and energy per sample against world size, per scaling group."""

from __future__ import annotations

from typing import Any

import altair as alt
import pyarrow as pa

from .rows import Row, data, group_label_map, prefer_curves, rows, sources, world_size_ticks
from .style import (
    HEIGHT,
    SERIES_SCHEME,
    WIDTH,
    ChartLike,
    finish,
    no_data,
    source_fill_opacity,
    source_note,
    source_shape,
    world_size_x,
)

_COLUMNS = (
    "group_id",
    "mixed",
    "run_id",
    "source",
    "world_size",
    "nodes",
    "gpus",
    "util_gpu_pct",
    "util_gpu_p10_pct",
    "util_gpu_p90_pct",
    "power_w",
    "energy_j",
    "energy_per_sample_j",
    "energy_source",
)

#: The only honest name for nvmlDeviceGetUtilizationRates().gpu (DESIGN.md): never "efficiency".
UTILISATION_LABEL = "kernel-active time share (NVML)"


def _points(values: list[Row], y: alt.Y, tooltip: list[alt.Tooltip], whiskers: tuple[str, str] | None) -> Any:
    values = prefer_curves(values)
    labels = group_label_map(r["group_id"] for r in values)
    for r in values:
        r["series"] = labels.get(r["group_id"], r["group_id"])
    ticks = world_size_ticks(values)
    colour = alt.Color(
        "series:N", title="group", scale=alt.Scale(scheme=SERIES_SCHEME), legend=alt.Legend(title="group")
    )
    stroke = alt.Stroke("series:N", legend=None, scale=alt.Scale(scheme=SERIES_SCHEME))
    base = alt.Chart(data(values)).encode(world_size_x(ticks), colour)
    layers: list[Any] = []
    if whiskers:
        layers.append(
            base.mark_rule(strokeWidth=1).encode(alt.Y(f"{whiskers[0]}:Q"), alt.Y2(f"{whiskers[1]}:Q"))
        )
    layers += [
        base.mark_line().encode(y, detail="series:N"),
        base.mark_point(filled=True).encode(
            alt.Y(y.shorthand), stroke, source_shape(sources(values)), source_fill_opacity(), tooltip=tooltip
        ),
    ]
    return alt.layer(*layers).properties(width=WIDTH, height=HEIGHT)


def utilisation_chart(utilisation: pa.Table | None) -> ChartLike:
    """Kernel-active time share (NVML utilisation.gpu, %) against N, p10–p90 whiskers."""
    title = f"GPU {UTILISATION_LABEL} against world size"
    values = [r for r in rows(utilisation, _COLUMNS) if not r["mixed"] and r["util_gpu_pct"] is not None]
    if not values:
        return no_data(title, "no GPU samples in this selection (CPU runs or NVML missing)")
    y = alt.Y("util_gpu_pct:Q", title=f"{UTILISATION_LABEL}, %", scale=alt.Scale(domain=[0, 100]))
    tooltip = [
        alt.Tooltip("series:N", title="group"),
        alt.Tooltip("run_id:N"),
        alt.Tooltip("world_size:Q", title="N"),
        alt.Tooltip("util_gpu_pct:Q", title=f"{UTILISATION_LABEL} %", format=".1f"),
        alt.Tooltip("gpus:Q"),
    ]
    chart = _points(values, y, tooltip, ("util_gpu_p10_pct", "util_gpu_p90_pct"))
    subtitle = [
        "share of time some kernel ran (nvmlDeviceGetUtilizationRates): not an efficiency; whiskers p10–p90",
        source_note(sources(values)),
    ]
    return finish(chart, title, subtitle)


def energy_chart(utilisation: pa.Table | None) -> ChartLike:
    """GPU energy per training sample (mJ) against N: what each extra GPU costs."""
    title = "GPU energy per sample against world size"
    values = [
        r for r in rows(utilisation, _COLUMNS) if not r["mixed"] and r["energy_per_sample_j"] is not None
    ]
    if not values:
        return no_data(title, "no GPU energy readings in this selection (CPU runs or NVML missing)")
    for r in values:
        r["energy_per_sample_mj"] = r["energy_per_sample_j"] * 1e3
    y = alt.Y("energy_per_sample_mj:Q", title="GPU energy per sample (mJ)")
    tooltip = [
        alt.Tooltip("series:N", title="group"),
        alt.Tooltip("run_id:N"),
        alt.Tooltip("world_size:Q", title="N"),
        alt.Tooltip("energy_per_sample_mj:Q", title="mJ per sample", format=".3f"),
        alt.Tooltip("power_w:Q", title="mean power per GPU (W)", format=".0f"),
        alt.Tooltip("energy_source:N", title="from"),
    ]
    chart = _points(values, y, tooltip, None)
    subtitle = [
        "Σ over the run's GPUs of the NVML energy counter over the steady window, per sample",
        source_note(sources(values)),
    ]
    return finish(chart, title, subtitle)
