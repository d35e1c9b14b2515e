"""Gradient synchronisation against world size: exposed and total sync time, and bus bandwidth with
the fitted alpha-beta model's prediction."""

from __future__ import annotations

from typing import Any

import altair as alt
import pyarrow as pa

from .rows import Row, data, group_label_map, multi_point_groups, rows, sources, world_size_ticks
from .style import (
    HEIGHT,
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
    world_size_x,
)

_SYNC_COLUMNS = (
    "group_id",
    "mixed",
    "cluster",
    "backend",
    "run_id",
    "source",
    "world_size",
    "nodes",
    "scope",
    "sync_exposed_ns",
    "comm_total_ns",
    "comm_count",
    "bytes_per_step",
    "overlap_share",
    "busbw_gb_per_s",
    "busbw_p10_gb_per_s",
    "busbw_p90_gb_per_s",
    "bw_source",
)
_FIT_COLUMNS = (
    "cluster",
    "backend",
    "scope",
    "alpha_s",
    "beta_s_per_byte",
    "bandwidth_gb_per_s",
    "too_few_points",
)

_MEASURES = {
    "sync_exposed_ns": "exposed sync (the step waits)",
    "comm_total_ns": "total collective time",
}


def _series(values: list[Row]) -> None:
    labels = group_label_map(r["group_id"] for r in values)
    for r in values:
        r["series"] = labels.get(r["group_id"], r["group_id"])


def _colour(title: str = "group") -> alt.Color:
    return alt.Color(
        "series:N", title=title, scale=alt.Scale(scheme=SERIES_SCHEME), legend=alt.Legend(title=title)
    )


def _stroke() -> alt.Stroke:
    return alt.Stroke("series:N", legend=None, scale=alt.Scale(scheme=SERIES_SCHEME))


def sync_time_chart(sync: pa.Table | None) -> ChartLike:
    """Exposed and total gradient-sync time per step (ms) against N, per scaling group."""
    title = "Gradient synchronisation time against world size"
    base_rows = [r for r in rows(sync, _SYNC_COLUMNS) if not r["mixed"]]
    keep = multi_point_groups(base_rows)
    base_rows = [r for r in base_rows if r["group_id"] in keep]
    values: list[Row] = []
    for r in base_rows:
        for col, label in _MEASURES.items():
            if r[col] is not None:
                values.append({**r, "measure": label, "ms": r[col] / 1e6})
    if not values:
        return no_data(title, "no gradient synchronisation recorded in this selection")
    _series(values)
    ticks = world_size_ticks(values)
    enc: list[Any] = [
        world_size_x(ticks),
        alt.Y("ms:Q", title="ms per step (steady-state median)"),
        _colour(),
    ]
    base = alt.Chart(data(values)).encode(*enc)
    chart = (
        alt.layer(
            base.mark_line().encode(detail="series:N"),
            base.mark_point(filled=True).encode(
                _stroke(),
                source_shape(sources(values)),
                source_fill_opacity(),
                tooltip=[
                    alt.Tooltip("series:N", title="group"),
                    alt.Tooltip("run_id:N"),
                    alt.Tooltip("world_size:Q", title="N"),
                    alt.Tooltip("measure:N"),
                    alt.Tooltip("ms:Q", format=".3f"),
                    alt.Tooltip("overlap_share:Q", title="overlap with backward", format=".0%"),
                    alt.Tooltip("scope:N"),
                ],
            ),
        )
        .properties(width=PANEL_WIDTH + 60, height=PANEL_HEIGHT + 40)
        .facet(column=alt.Column("measure:N", title=None, sort=list(_MEASURES.values())))
    )
    subtitle = [
        "exposed = the part of the step spent waiting for gradients; total = every collective's duration",
        source_note(sources(values)),
    ]
    return finish(chart, title, subtitle)


def ring_allreduce_busbw_gb_per_s(
    p: int, n_bytes: float, alpha_s: float, beta_s_per_byte: float
) -> float | None:
    """The bus bandwidth the fitted ring model T = 2(p−1)·α + 2(p−1)/p·n·β implies for one message."""
    if p < 2 or n_bytes <= 0:
        return None
    t = 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * n_bytes * beta_s_per_byte
    if t <= 0:
        return None
    return n_bytes / t * 2 * (p - 1) / p / 1e9


def _model_points(values: list[Row], fit: pa.Table | None) -> list[Row]:
    """Per run: the fitted model's busbw at its N and mean message size ((cluster, backend, scope) fit)."""
    fits = {(f["cluster"], f["backend"], f["scope"]): f for f in rows(fit, _FIT_COLUMNS)}
    out = []
    for r in values:
        f = fits.get((r["cluster"], r["backend"], r["scope"]))
        if f is None or f["alpha_s"] is None or f["beta_s_per_byte"] is None:
            continue
        count = r["comm_count"] or 1
        if not r["bytes_per_step"]:
            continue
        bw = ring_allreduce_busbw_gb_per_s(
            int(r["world_size"]), r["bytes_per_step"] / count, f["alpha_s"], f["beta_s_per_byte"]
        )
        if bw is not None:
            out.append(
                {
                    "series": r["series"],
                    "world_size": r["world_size"],
                    "model_gb_per_s": bw,
                    "scope": r["scope"],
                }
            )
    return out


def _reference_points(values: list[Row], reference: pa.Table | None) -> list[Row]:
    """Per run with an nccl-tests reference: the reference busbw at its message size, in its series."""
    series = {r["run_id"]: r["series"] for r in values}
    cols = ("run_id", "world_size", "ref_busbw_gb_per_s", "delivered_share", "ref_ranks", "ref_file")
    return [
        {**r, "series": series[r["run_id"]]}
        for r in rows(reference, cols)
        if r["run_id"] in series and r["ref_busbw_gb_per_s"] is not None
    ]


def busbw_chart(
    sync: pa.Table | None, allreduce_fit: pa.Table | None = None, reference: pa.Table | None = None
) -> ChartLike:
    """Allreduce bus bandwidth against N per group (p10–p90 whiskers), the alpha-beta model's line,
    and the cluster's nccl-tests busbw at the same message size where one was imported (dotted)."""
    title = "Allreduce bus bandwidth against world size"
    values = [
        r
        for r in rows(sync, _SYNC_COLUMNS)
        if not r["mixed"] and r["busbw_gb_per_s"] is not None and r["world_size"] > 1
    ]
    if not values:
        return no_data(title, "no collectives between two or more ranks in this selection")
    _series(values)
    model = _model_points(values, allreduce_fit)
    ticks = world_size_ticks(values)
    base = alt.Chart(data(values)).encode(world_size_x(ticks), _colour())
    layers: list[Any] = [
        base.mark_rule(strokeWidth=1).encode(alt.Y("busbw_p10_gb_per_s:Q"), alt.Y2("busbw_p90_gb_per_s:Q")),
        base.mark_line().encode(alt.Y("busbw_gb_per_s:Q", title="bus bandwidth (GB/s)"), detail="series:N"),
        base.mark_point(filled=True).encode(
            alt.Y("busbw_gb_per_s:Q"),
            _stroke(),
            source_shape(sources(values)),
            source_fill_opacity(),
            tooltip=[
                alt.Tooltip("series:N", title="group"),
                alt.Tooltip("run_id:N"),
                alt.Tooltip("world_size:Q", title="N"),
                alt.Tooltip("scope:N"),
                alt.Tooltip("busbw_gb_per_s:Q", title="busbw GB/s", format=".2f"),
                alt.Tooltip("bw_source:N", title="from"),
            ],
        ),
    ]
    if model:
        layers.append(
            alt.Chart(data(model))
            .mark_line(strokeDash=[6, 4], strokeWidth=1.5)
            .encode(world_size_x(ticks), alt.Y("model_gb_per_s:Q"), _colour(), detail="series:N")
        )
    refs = _reference_points(values, reference)
    if refs:
        ref = alt.Chart(data(refs)).encode(world_size_x(ticks), alt.Y("ref_busbw_gb_per_s:Q"), _colour())
        layers += [
            ref.mark_line(strokeDash=[2, 3], strokeWidth=1.5).encode(detail="series:N"),
            ref.mark_point(shape="diamond", filled=False).encode(
                tooltip=[
                    alt.Tooltip("series:N", title="group"),
                    alt.Tooltip("run_id:N"),
                    alt.Tooltip("ref_busbw_gb_per_s:Q", title="nccl-tests busbw GB/s", format=".2f"),
                    alt.Tooltip("delivered_share:Q", title="achieved / reference", format=".0%"),
                    alt.Tooltip("ref_ranks:Q", title="benchmark ranks"),
                    alt.Tooltip("ref_file:N", title="from"),
                ]
            ),
        ]
    subtitle = [
        "busbw = bytes/t · 2(n−1)/n (nccl-tests); whiskers p10–p90; dashed: fitted ring model "
        "T = 2(p−1)·α + 2(p−1)/p·n·β"
        + ("; dotted diamonds: the cluster's nccl-tests busbw at the same message size" if refs else ""),
        source_note(sources(values)),
    ]
    chart = alt.layer(*layers).properties(width=WIDTH, height=HEIGHT)
    return finish(chart, title, subtitle)
