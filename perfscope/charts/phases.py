"""Where a step's time goes: stacked phases per run, and the lost time split by phase."""

from __future__ import annotations

from collections.abc import Iterable

import altair as alt
import pyarrow as pa

from .rows import (
    Row,
    data,
    group_label_map,
    multi_point_groups,
    natural_key,
    rows,
    run_label_map,
    series_labels,
    sources,
)
from .style import (
    PANEL_HEIGHT,
    PANEL_WIDTH,
    PHASES,
    ChartLike,
    finish,
    no_data,
    phase_legend_expr,
    phase_scale,
    source_note,
)

_BREAKDOWN_COLUMNS = (
    "run_id",
    "experiment",
    "source",
    "cluster",
    "backend",
    "world_size",
    "phase",
    "time_ns",
    "share",
)
_LOST_COLUMNS = ("group_id", "run_id", "source", "world_size", "phase", "lost_ns", "share_of_lost")


def _phase_order(values: list[Row]) -> None:
    """Stack in the canonical order; user-defined phases go on top, after the canonical ones."""
    for r in values:
        p = r["phase"]
        r["phase_order"] = PHASES.index(p) if p in PHASES else len(PHASES)


def _colour() -> alt.Color:
    return alt.Color(
        "phase:N",
        title="phase",
        scale=phase_scale(),
        sort=list(PHASES),
        legend=alt.Legend(labelExpr=phase_legend_expr()),
    )


def _panels(n: int) -> int:
    return min(n, 3)


#: panels whose largest bars differ more than this many times get a y axis each (a CPU job's 250 ms
#: beside a GPU study's 5 ms would leave the GPU panels flat)
_Y_SPREAD = 10.0


def _facet() -> alt.Facet:
    """One panel per setup; a long title is cut ('…') to the panel's width instead of running into
    the next panel's."""
    return alt.Facet("panel:N", title=None, header=alt.Header(labelLimit=PANEL_WIDTH))


def _y_scales(values: list[Row], field: str) -> str:
    """'independent' when the panels' stacked totals differ by more than _Y_SPREAD times, else 'shared'."""
    totals: dict[tuple[str, str], float] = {}
    for r in values:
        key = (r["panel"], r.get("run_id") or "")
        totals[key] = totals.get(key, 0.0) + max(r[field] or 0.0, 0.0)
    tops: dict[str, float] = {}
    for (panel, _), total in totals.items():
        tops[panel] = max(tops.get(panel, 0.0), total)
    positive = [t for t in tops.values() if t > 0]
    return "independent" if positive and max(positive) > _Y_SPREAD * min(positive) else "shared"


#: a bar's run label longer than this is replaced by the run id's last token when that is unique
_LONG_LABEL_CHARS = 16


def _short_labels(run_ids: Iterable[str]) -> dict[str, str]:
    """run_id -> a bar label: the tokens that differ ('n004-b75'), or, when those are long (two
    timestamped ids differ in every token), the last token alone ('82b02634') if it tells them apart.
    A long label standing on end under a bar runs into the axis title below it."""
    labels = run_label_map(run_ids)
    tails = {r: r.rsplit("-", 1)[-1] for r in labels}
    if any(len(v) > _LONG_LABEL_CHARS for v in labels.values()) and len(set(tails.values())) == len(tails):
        return tails
    return labels


def phase_breakdown_chart(phase_breakdown: pa.Table | None) -> ChartLike:
    """Stacked steady-state phase times per run (ms per step), one panel per experiment/cluster/backend."""
    title = "Where the step time goes"
    values = [r for r in rows(phase_breakdown, _BREAKDOWN_COLUMNS) if r["time_ns"] is not None]
    if not values:
        return no_data(title, "no steps in this selection")
    panels = series_labels((r["experiment"] or "", r["cluster"] or "", r["backend"] or "") for r in values)
    runs_at: dict[tuple[str, int], set[str]] = {}
    for r in values:
        r["panel"] = panels[(r["experiment"] or "", r["cluster"] or "", r["backend"] or "")]
        runs_at.setdefault((r["panel"], r["world_size"]), set()).add(r["run_id"])
    # a bar is "N" when one run has that N in its panel; otherwise N plus what tells the runs apart
    short: dict[str, str] = {}
    for panel in {r["panel"] for r in values}:
        short.update(_short_labels(r["run_id"] for r in values if r["panel"] == panel))
    srcs = sources(values)
    mark_sim = len(srcs) > 1
    for r in values:
        crowded = len(runs_at[(r["panel"], r["world_size"])]) > 1
        r["bar"] = f"N={r['world_size']} {short[r['run_id']]}" if crowded else f"N={r['world_size']}"
        if mark_sim and r["source"] == "simulated":
            r["bar"] += " sim"
        r["time_ms"] = r["time_ns"] / 1e6
    _phase_order(values)
    bars = sorted({(r["world_size"], natural_key(r["bar"]), r["bar"]) for r in values})
    n_panels = len({r["panel"] for r in values})
    chart = (
        alt.Chart(data(values))
        .mark_bar()
        .encode(
            # no axis title: below labels standing on end the renderer draws it across them; the
            # labels (N=2, N=2 b75 ...) say what a bar is, and the subtitle says it too
            x=alt.X("bar:N", title=None, sort=[b for _, _, b in bars]),
            # two lines: on one, the title is taller than a panel and runs up into the subtitle
            y=alt.Y("sum(time_ms):Q", title=["time per step", "(ms, steady state)"]),
            color=_colour(),
            order=alt.Order("phase_order:Q"),
            tooltip=[
                alt.Tooltip("run_id:N"),
                alt.Tooltip("phase:N"),
                alt.Tooltip("time_ms:Q", title="ms per step", format=".3f"),
                alt.Tooltip("share:Q", format=".1%"),
                alt.Tooltip("source:N"),
            ],
        )
        .properties(width=PANEL_WIDTH, height=PANEL_HEIGHT)
    )
    y_scales = _y_scales(values, "time_ms")
    if n_panels > 1:
        chart = chart.facet(facet=_facet(), columns=_panels(n_panels)).resolve_scale(
            x="independent", y=y_scales
        )
    subtitle = [
        "one bar per run, labelled by its world size N",
        "phases add up to the step time (slowest rank); imbalance = max − mean over ranks",
    ]
    if n_panels > 1 and y_scales == "independent":
        subtitle.append("each panel has its own time axis: their step times differ more than tenfold")
    subtitle.append(source_note(srcs, marks="bars"))
    return finish(chart, title, subtitle)


def lost_time_chart(lost_time: pa.Table | None, unit: str = "GPU") -> ChartLike:
    """Lost time L(N) per phase (GPU·ms per step; `unit`·ms, e.g. rank·ms for CPU jobs) against N,
    one panel per scaling group."""
    title = "Where the lost time went"
    values = [r for r in rows(lost_time, _LOST_COLUMNS) if r["lost_ns"] is not None]
    keep = multi_point_groups(values)
    values = [r for r in values if r["group_id"] in keep]
    if not values:
        return no_data(title, "no scaling group with two or more world sizes in this selection")
    labels = group_label_map(r["group_id"] for r in values)
    for r in values:
        r["panel"] = labels[r["group_id"]]
        r["lost_gpu_ms"] = r["lost_ns"] / 1e6
    _phase_order(values)
    n_panels = len(labels)
    chart = (
        alt.Chart(data(values))
        .mark_bar()
        .encode(
            x=alt.X("world_size:O", title="world size N"),
            y=alt.Y("sum(lost_gpu_ms):Q", title=f"lost {unit}·ms per step"),
            color=_colour(),
            order=alt.Order("phase_order:Q"),
            tooltip=[
                alt.Tooltip("run_id:N"),
                alt.Tooltip("phase:N"),
                alt.Tooltip("lost_gpu_ms:Q", title=f"lost {unit}·ms per step", format=".3f"),
                alt.Tooltip("share_of_lost:Q", title="share of lost", format=".1%"),
            ],
        )
        .properties(width=PANEL_WIDTH, height=PANEL_HEIGHT)
    )
    y_scales = _y_scales(values, "lost_gpu_ms")
    if n_panels > 1:
        chart = chart.facet(facet=_facet(), columns=_panels(n_panels)).resolve_scale(y=y_scales)
    subtitle = [
        "L(N) = N·T(N) − N0·T(N0)·G(N)/G(N0), split by phase; a bar below zero is time saved",
        source_note(sources(values), marks="bars"),
    ]
    if n_panels > 1 and y_scales == "independent":
        subtitle.append("each panel has its own axis: their lost times differ more than tenfold")
    return finish(chart, title, subtitle)
