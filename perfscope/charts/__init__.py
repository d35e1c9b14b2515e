"""One chart builder per chart (Altair), shared by the dashboard and the report: the `CHARTS` registry
and SVG/PNG rendering through vl-convert (no browser).

A builder takes analysis tables (pyarrow, in the order of `ChartSpec.analyses`) and returns a chart;
it reads no store and holds no SQL. An empty table gives a chart that says "no data".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .backends import backend_compare_chart
from .batch import batch_sweep_chart, metric_curve_chart
from .comm import comm_ops_chart, comm_roles_chart
from .phases import lost_time_chart, phase_breakdown_chart
from .rank_timeline import rank_timeline_chart
from .scaling import efficiency_chart, per_gpu_speedup_chart, speedup_chart
from .stragglers import last_rank_chart, wait_heatmap
from .style import ChartLike
from .sync import busbw_chart, sync_time_chart
from .utilisation import energy_chart, utilisation_chart
from .what_if import what_if_attribution, what_if_heatmap, what_if_step_heatmap, what_if_steps
from .what_if_timeline import what_if_timeline_chart


@dataclass(frozen=True)
class ChartSpec:
    name: str
    title: str
    builder: Callable[..., ChartLike]
    analyses: tuple[str, ...]  # names in perfscope.analysis.ANALYSES, passed positionally

    def build(self, tables: Mapping[str, pa.Table | None], **options: Any) -> ChartLike:
        """The chart from the tables it reads (a missing one counts as empty)."""
        return self.builder(*(tables.get(a) for a in self.analyses), **options)


def _spec(name: str, title: str, builder: Callable[..., ChartLike], *analyses: str) -> ChartSpec:
    return ChartSpec(name, title, builder, analyses)


#: Every chart by name, in the order a scaling study reads.
CHARTS: dict[str, ChartSpec] = {
    s.name: s
    for s in (
        _spec("speedup", "Speedup against world size", speedup_chart, "scaling", "scaling_prediction"),
        _spec(
            "efficiency", "Efficiency against world size", efficiency_chart, "scaling", "scaling_prediction"
        ),
        _spec("per_gpu_speedup", "Per-GPU speedup", per_gpu_speedup_chart, "scaling"),
        _spec("phase_breakdown", "Phase breakdown per run", phase_breakdown_chart, "phase_breakdown"),
        _spec("lost_time", "Lost time by phase", lost_time_chart, "lost_time"),
        _spec("sync_time", "Gradient sync time", sync_time_chart, "sync"),
        _spec(
            "busbw",
            "Bus bandwidth, the alpha-beta model and the nccl-tests reference",
            busbw_chart,
            "sync",
            "allreduce_fit",
            "reference_busbw",
        ),
        _spec("utilisation", "GPU kernel-active time share (NVML)", utilisation_chart, "utilisation"),
        _spec("energy", "Energy per sample", energy_chart, "utilisation"),
        _spec("wait_heatmap", "Wait at collective, rank × step", wait_heatmap, "collective_wait"),
        _spec("last_rank", "Last rank to enter the collective", last_rank_chart, "stragglers"),
        _spec("batch_sweep", "Batch-size sweep", batch_sweep_chart, "batch_sweep"),
        _spec(
            "metric_curves", "Metric against wall time", metric_curve_chart, "metric_curves", "time_to_metric"
        ),
        _spec("backend_compare", "Backends compared", backend_compare_chart, "backend_compare"),
        _spec("comm_ops", "Communication by op type and phase", comm_ops_chart, "comm_ops"),
        _spec("comm_roles", "Per rank and role: compute and waiting", comm_roles_chart, "comm_by_role"),
        _spec("what_if_heatmap", "What-if: slowdown per worker", what_if_heatmap, "what_if"),
        _spec(
            "what_if_step_heatmap",
            "What-if: slowdown per worker, step by step",
            what_if_step_heatmap,
            "what_if",
        ),
        _spec(
            "what_if_attribution",
            "What-if: the excess by stage, op type and worker",
            what_if_attribution,
            "what_if",
        ),
        _spec("what_if_steps", "What-if: recorded against ideal step", what_if_steps, "what_if"),
        _spec(
            "what_if_timeline",
            "What-if: recorded against ideal timeline of one step",
            what_if_timeline_chart,
            "what_if_timeline",
        ),
    )
}


def _spec_of(chart: ChartLike) -> dict[str, Any]:
    # Altair's JSON-schema validation costs more than the rendering; the builders' specs are
    # validated by the chart tests, so exports skip it.
    spec: dict[str, Any] = chart.to_dict(validate=False)
    return spec


def to_svg(chart: ChartLike) -> str:
    """The chart as a standalone SVG document (rendered by vl-convert, no browser, no network)."""
    import vl_convert as vlc

    # inline data only: allow no base URL, so rendering can never reach the network
    return str(vlc.vegalite_to_svg(_spec_of(chart), allowed_base_urls=[]))


def to_png(chart: ChartLike, scale: float = 2.0) -> bytes:
    """The chart as PNG bytes; `scale` 2 gives sharp images on high-density screens and in print."""
    import vl_convert as vlc

    return bytes(vlc.vegalite_to_png(_spec_of(chart), scale=scale, allowed_base_urls=[]))


__all__ = [
    "CHARTS",
    "ChartLike",
    "ChartSpec",
    "backend_compare_chart",
    "batch_sweep_chart",
    "busbw_chart",
    "comm_ops_chart",
    "comm_roles_chart",
    "efficiency_chart",
    "energy_chart",
    "last_rank_chart",
    "lost_time_chart",
    "metric_curve_chart",
    "per_gpu_speedup_chart",
    "phase_breakdown_chart",
    "rank_timeline_chart",
    "speedup_chart",
    "sync_time_chart",
    "to_png",
    "to_svg",
    "utilisation_chart",
    "wait_heatmap",
    "what_if_timeline_chart",
]
