"""Backends side by side (e.g. NCCL vs MPI): step time relative to the best backend at each world
size, inside one node and across nodes."""

from __future__ import annotations

import altair as alt
import pyarrow as pa

from ..words import known
from .rows import Row, data, rows, series_labels, sources, world_size_ticks
from .style import (
    PANEL_HEIGHT,
    PANEL_WIDTH,
    SERIES_SCHEME,
    ChartLike,
    finish,
    no_data,
    world_size_x,
)

_COLUMNS = (
    "experiment",
    "cluster",
    "model",
    "batch_size_per_rank",
    "world_size",
    "nodes",
    "backend",
    "run_id",
    "source",
    "step_ns",
    "sync_exposed_ns",
    "throughput_samples_per_s",
    "best_backend",
    "ratio_to_best",
)
PLACES = ("inside one node", "across nodes")


def _panel_key(r: Row) -> tuple[str, ...]:
    """What names a panel: experiment, cluster, model, per-rank batch; an unknown one is left out."""
    batch = f"b{r['batch_size_per_rank']}" if known(r["batch_size_per_rank"]) else ""
    return (*(str(v) if known(v) else "" for v in (r["experiment"], r["cluster"], r["model"])), batch)


def backend_compare_chart(backend_compare: pa.Table | None) -> ChartLike:
    """Step time of each backend over the best one at the same N (1.0 = the winner), per cluster."""
    title = "Step time relative to the best backend"  # narrow panels: a title that fits over them
    values = [r for r in rows(backend_compare, _COLUMNS) if r["ratio_to_best"] is not None]
    if len({r["backend"] for r in values}) < 2:
        return no_data(title, "fewer than two backends at the same world size in this selection")
    panels = series_labels({_panel_key(r) for r in values})
    for r in values:
        r["panel"] = panels[_panel_key(r)]
        r["place"] = PLACES[0] if (r["nodes"] or 1) <= 1 else PLACES[1]
        r["step_ms"] = (r["step_ns"] or 0) / 1e6
        r["sync_ms"] = (r["sync_exposed_ns"] or 0) / 1e6
    ticks = world_size_ticks(values)
    base = alt.Chart(data(values)).encode(
        world_size_x(ticks),
        alt.Y("ratio_to_best:Q", title="step time / best backend's", scale=alt.Scale(zero=False)),
        alt.Color("backend:N", title="backend", scale=alt.Scale(scheme=SERIES_SCHEME)),
    )
    chart = alt.layer(
        base.mark_line().encode(detail="backend:N"),
        base.mark_point(filled=True, size=70).encode(
            alt.Shape(
                "place:N", title="placement", scale=alt.Scale(domain=list(PLACES), range=["circle", "square"])
            ),
            tooltip=[
                alt.Tooltip("run_id:N"),
                alt.Tooltip("backend:N"),
                alt.Tooltip("world_size:Q", title="N"),
                alt.Tooltip("nodes:Q"),
                alt.Tooltip("step_ms:Q", title="step ms", format=".3f"),
                alt.Tooltip("sync_ms:Q", title="exposed sync ms", format=".3f"),
                alt.Tooltip("ratio_to_best:Q", title="× best", format=".3f"),
                alt.Tooltip("best_backend:N", title="best"),
                alt.Tooltip("source:N"),
            ],
        ),
    ).properties(width=PANEL_WIDTH, height=PANEL_HEIGHT)
    n_panels = len(set(panels.values()))
    if n_panels > 1:
        chart = chart.facet(facet=alt.Facet("panel:N", title=None), columns=min(3, n_panels))
    subtitle = ["1.0 = the faster backend at that N; circles inside one node, squares across nodes"]
    if "simulated" in sources(values):
        subtitle.append(
            "all runs simulated (not measured)"
            if sources(values) == {"simulated"}
            else "includes simulated runs"
        )
    return finish(chart, title, subtitle)
