"""Run-level charts over time: step time per rank, GPU and host telemetry with the steady window shaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import altair as alt
import pyarrow as pa
import pyarrow.compute as pc

from .rows import Row, data, natural_key, rows
from .style import HEIGHT, PANEL_HEIGHT, SERIES_SCHEME, WIDTH, ChartLike, finish, no_data

#: Above this many series (ranks, GPUs, hosts) a chart draws the min-median-max band over them
#: instead of one line each: a legend of 64 ranks says nothing and the page would carry every point.
MAX_LINES = 16

_WINDOW_FILL = "#2ca02c"
_WARMUP_FILL = "#bbbbbb"


def inline(values: list[Row]) -> Any:
    """Rows as chart data in a plain dict: Altair walks an `alt.Data(values=...)` value by value when
    it builds the spec (about 0.4 ms a row, 40 s for a 16-rank step series), a dict it passes on."""
    return {"values": values}


@dataclass(frozen=True)
class Window:
    """The steady-state window of a run in seconds since its first step (the statistics' window)."""

    start_s: float
    end_s: float


def steady_window(step_series: pa.Table | None) -> Window | None:
    """The steady window of the (single) run in `step_series`, in the telemetry's time base.

    Uses the analysis' `t_s` column when present; otherwise the lowest rank's cumulated step times
    (a step lasts from the end of the previous step to its own end, so the sum is the elapsed time).
    """
    if step_series is None or step_series.num_rows == 0:
        return None
    low = pc.min(step_series.column("rank")).as_py()
    own = step_series.filter(pc.equal(step_series.column("rank"), low)).sort_by("step")
    steady = own.column("steady").to_pylist()
    if not any(steady):
        return None
    first = steady.index(True)
    last = len(steady) - 1 - steady[::-1].index(True)
    if "t_s" in own.column_names:
        starts = own.column("t_s").to_pylist()
        ends = [
            t + (d or 0) * k / 1e9
            for t, d, k in zip(
                starts,
                own.column("step_ns").to_pylist(),
                own.column("steps_in_bucket").to_pylist(),
                strict=True,
            )
        ]
        return Window(float(starts[first]), float(ends[last]))
    elapsed = [0.0]
    for d, k in zip(
        own.column("step_ns").to_pylist(), own.column("steps_in_bucket").to_pylist(), strict=True
    ):
        elapsed.append(elapsed[-1] + (d or 0.0) * k / 1e9)
    return Window(elapsed[first], elapsed[last + 1])


def _band(values: list[Row], x: str, y: str) -> list[Row]:
    """min / median / max of `y` over the series at each x."""
    by_x: dict[Any, list[float]] = {}
    for r in values:
        if r[y] is not None:
            by_x.setdefault(r[x], []).append(r[y])
    out = []
    for xv, ys in sorted(by_x.items()):
        ys.sort()
        mid = len(ys) // 2
        median = ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2
        out.append({x: xv, "lo": ys[0], "median": median, "hi": ys[-1], "series_count": len(ys)})
    return out


def _lines(
    values: list[Row],
    x: alt.X,
    y_field: str,
    y_title: str,
    series: str,
    series_title: str,
    tooltip: list[Any],
    *,
    legend: alt.Legend | None = None,
    y_scale: alt.Scale | None = None,
    metric: str | None = None,
) -> tuple[list[Any], list[Row]]:
    """One line per series, or the band over them when there are too many to tell apart.

    Returns the layers, which carry no data of their own, and the rows they draw: the caller puts
    those on the enclosing chart (see `inline`); `metric` picks a panel's rows out of a shared set.
    """
    field = str(x.shorthand).split(":")[0]
    names = {r[series] for r in values}
    base = alt.Chart() if metric is None else alt.Chart().transform_filter(alt.datum.metric == metric)
    scale = y_scale if y_scale is not None else alt.Undefined
    if len(names) <= MAX_LINES:
        shown_legend: Any = alt.Undefined if legend is None else legend
        colour = alt.Color(
            f"{series}:N",
            title=series_title,
            scale=alt.Scale(scheme=SERIES_SCHEME),
            legend=None if len(names) == 1 else shown_legend,
            sort=sorted(names, key=natural_key),  # rank 2 before rank 10
        )
        line = base.mark_line(strokeWidth=1.4, interpolate="step-after", clip=True).encode(
            x, alt.Y(f"{y_field}:Q", title=y_title, scale=scale), colour, tooltip=tooltip
        )
        return [line], values
    band = _band(values, field, y_field)
    for r in band:
        r["metric"] = metric
    b = base.encode(x)
    layers = [
        b.mark_area(opacity=0.25, color="#4c78a8", interpolate="step-after", clip=True).encode(
            alt.Y("lo:Q", title=y_title, scale=scale), alt.Y2("hi:Q")
        ),
        b.mark_line(color="#4c78a8", strokeWidth=1.4, interpolate="step-after", clip=True).encode(
            alt.Y("median:Q"),
            tooltip=[
                alt.Tooltip(f"{field}:Q"),
                alt.Tooltip("median:Q", format=".3g"),
                alt.Tooltip("lo:Q", title="min", format=".3g"),
                alt.Tooltip("hi:Q", title="max", format=".3g"),
                alt.Tooltip("series_count:Q", title=series_title + "s"),
            ],
        ),
    ]
    return layers, band


def _shade(window: Window | None, label: str) -> list[Any]:
    if window is None:
        return []
    span = [{"x0": window.start_s, "x1": window.end_s, "label": label}]
    rect = (
        alt.Chart(data(span)).mark_rect(color=_WINDOW_FILL, opacity=0.08).encode(x=alt.X("x0:Q"), x2="x1:Q")
    )
    if not label:
        return [rect]
    text = (
        alt.Chart(data(span))
        .mark_text(align="left", baseline="top", dx=4, y=4, fontSize=10, color="#2b6a2b")
        .encode(x=alt.X("x0:Q"), text="label:N")
    )
    return [rect, text]


def _per_run(table: pa.Table | None) -> list[str]:
    if table is None or table.num_rows == 0 or "run_id" not in table.column_names:
        return []
    return sorted({str(r) for r in table.column("run_id").to_pylist()})


def step_series_chart(step_series: pa.Table | None) -> ChartLike:
    """Step time per rank over the run (bucket medians), the warm-up steps shaded as excluded."""
    title = "Step time per rank"
    vals = rows(step_series, ("run_id", "rank", "step", "steps_in_bucket", "steady", "step_ns"))
    if not vals:
        return no_data(title, "no steps recorded for this run")
    for r in vals:
        r["step_ms"] = None if r["step_ns"] is None else r["step_ns"] / 1e6
        r["rank_label"] = f"rank {r['rank']}"
    panels = []
    cut: list[float] = []
    runs = _per_run(step_series)
    for run_id in runs:
        own = [r for r in vals if r["run_id"] == run_id]
        y_scale, peak = _steady_scale(own)
        if peak is not None:
            cut.append(peak)
        x = alt.X("step:Q", title="step", axis=alt.Axis(format="d"))
        tooltip = [
            alt.Tooltip("rank:Q"),
            alt.Tooltip("step:Q", title="first step of bucket"),
            alt.Tooltip("steps_in_bucket:Q", title="steps in bucket"),
            alt.Tooltip("step_ms:Q", title="step (ms, median)", format=".3f"),
        ]
        layers, drawn = _lines(
            own, x, "step_ms", "step time (ms)", "rank_label", "rank", tooltip, y_scale=y_scale
        )
        warm = [r["step"] for r in own if not r["steady"]]
        steady = [r["step"] for r in own if r["steady"]]
        if warm and steady:
            span = [{"x0": min(warm), "x1": min(steady), "label": "warm-up: not in the statistics"}]
            layers.insert(
                0,
                alt.Chart(data(span))
                .mark_rect(color=_WARMUP_FILL, opacity=0.25)
                .encode(x=alt.X("x0:Q"), x2="x1:Q"),
            )
            layers.append(
                alt.Chart(data(span))
                .mark_text(align="left", baseline="top", dx=4, y=4, fontSize=10, color="#555")
                .encode(x=alt.X("x0:Q"), text="label:N")
            )
        panel = alt.layer(*layers, data=inline(drawn)).properties(
            width=2 * WIDTH, height=HEIGHT if len(runs) == 1 else PANEL_HEIGHT
        )
        panels.append(panel.properties(title=run_id) if len(runs) > 1 else panel)
    chart = panels[0] if len(panels) == 1 else alt.vconcat(*panels)
    ranks = len({r["rank"] for r in vals})
    shown = "one line per rank" if ranks <= MAX_LINES else f"median and min-max band over {ranks} ranks"
    lines = [f"{shown}; long runs are shown as medians of step buckets"]
    if cut:
        lines.append(
            f"the axis fits the steady steps: warm-up steps up to {max(cut):,.1f} ms run off the top"
        )
    return finish(chart, title, lines)


def _steady_scale(own: list[Row]) -> tuple[alt.Scale | None, float | None]:
    """A y scale that fits the steady steps when warm-up steps dwarf them (a first step that compiles
    or warms caches can take 10x longer and would flatten the steady part into a line), and the
    largest step time it cuts off."""
    steady = [r["step_ms"] for r in own if r["steady"] and r["step_ms"] is not None]
    every = [r["step_ms"] for r in own if r["step_ms"] is not None]
    if not steady or not every or max(every) <= 2 * max(steady):
        return None, None
    return alt.Scale(domain=[0, 1.5 * max(steady)]), max(every)


@dataclass(frozen=True)
class Metric:
    column: str
    title: str
    scale: float = 1.0


GPU_METRICS: tuple[Metric, ...] = (
    Metric("util_gpu_pct", "kernel-active share (%)"),
    Metric("power_w", "power (W)"),
    Metric("mem_used_bytes", "memory used (GiB)", 1 / 2**30),
    Metric("sm_clock_mhz", "SM clock (MHz)"),
    Metric("temp_c", "temperature (°C)"),
)
HOST_METRICS: tuple[Metric, ...] = (
    Metric("proc_cpu_pct", "process CPU (%; 100 = one core)"),
    Metric("sys_cpu_pct", "system CPU (%)"),
    Metric("rss_bytes", "resident memory (GiB)", 1 / 2**30),
    Metric("load1", "load average (1 min)"),
)


def _telemetry(
    table: pa.Table | None,
    title: str,
    subtitle: str,
    empty: str,
    metrics: Sequence[Metric],
    series: str,
    series_title: str,
    window: Window | None,
) -> ChartLike:
    columns = ["run_id", "hostname", "gpu_index", "t_s", *(m.column for m in metrics)]
    vals = rows(table, columns)
    if not vals:
        return no_data(title, empty)
    for r in vals:
        r["series"] = f"{r['hostname']}:{r['gpu_index']}" if series == "gpu" else str(r["hostname"])
    shown = [m for m in metrics if any(r[m.column] is not None for r in vals)]
    panels = []
    drawn: list[Row] = []
    for i, m in enumerate(shown):
        present = [r for r in vals if r[m.column] is not None]
        # one time axis title, under the last panel; the window's label once, on the first
        x = alt.X("t_s:Q", title="time since the run's first step (s)" if i == len(shown) - 1 else None)
        own = [
            {"t_s": r["t_s"], "series": r["series"], "value": r[m.column] * m.scale, "metric": m.column}
            for r in present
        ]
        tooltip = [
            alt.Tooltip("series:N", title=series_title),
            alt.Tooltip("t_s:Q", title="t (s)", format=".1f"),
            alt.Tooltip("value:Q", title=m.title, format=".3g"),
        ]
        # legend under the panels: the chart often sits in half a page's width
        legend = alt.Legend(orient="bottom", columns=4)
        lines, rows_drawn = _lines(
            own, x, "value", m.title, "series", series_title, tooltip, legend=legend, metric=m.column
        )
        drawn.extend(rows_drawn)
        layers = _shade(window, "steady state" if i == 0 else "") + lines
        panels.append(alt.layer(*layers).properties(width=WIDTH, height=PANEL_HEIGHT * 0.7))
    if not panels:
        return no_data(title, empty)
    # one data set for every panel, on the outer chart (see `inline`)
    chart = alt.vconcat(*panels, data=inline(drawn)).resolve_scale(color="shared")
    runs = _per_run(table)
    lines = [subtitle]
    if len(runs) > 1:
        lines.append(f"{len(runs)} runs overlaid: filter to one run for a clear timeline")
    if window is not None:
        lines.append("green: the steady-state window the statistics use")
    return finish(chart, title, lines)


def gpu_timeline_chart(gpu_timeline: pa.Table | None, window: Window | None = None) -> ChartLike:
    """NVML telemetry per GPU over the run: kernel-active share, power, memory, SM clock, temperature."""
    return _telemetry(
        gpu_timeline,
        "GPU telemetry over time",
        "kernel-active share = nvmlDeviceGetUtilizationRates().gpu: some kernel ran, not an efficiency",
        "no GPU samples for this run (a CPU job, or NVML was unavailable)",
        GPU_METRICS,
        "gpu",
        "GPU",
        window,
    )


def host_timeline_chart(host_timeline: pa.Table | None, window: Window | None = None) -> ChartLike:
    """Host telemetry per host over the run: process and system CPU, resident memory, load."""
    return _telemetry(
        host_timeline,
        "Host telemetry over time",
        "per host: the training processes' CPU, the whole system's CPU, resident memory and load",
        "no host samples for this run",
        HOST_METRICS,
        "host",
        "host",
        window,
    )
