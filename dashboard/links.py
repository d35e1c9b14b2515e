"""Where each analysis is drawn in the dashboard, so a finding can link to the chart behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: Query parameters that open a page's tab, pick a run or a scaling group (the widgets bind to them).
SCALING_TAB = "scaling_tab"
RUN_TAB = "run_tab"
RUN = "run"
GROUP = "group"


@dataclass(frozen=True)
class Place:
    page: str  # url path of the page
    tab: str | None  # tab label on that page
    label: str  # what the link says

    def params(self, run_id: str | None = None, group_id: str | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.tab and self.page == "scaling":
            out[SCALING_TAB] = self.tab
        if self.tab and self.page == "run":
            out[RUN_TAB] = self.tab
        if self.page == "run" and run_id:
            out[RUN] = run_id
        if self.page == "scaling" and group_id:
            out[GROUP] = group_id
        return out


#: analysis -> the chart that shows it. An analysis missing here has no chart of its own.
PLACES: dict[str, Place] = {
    "scaling": Place("scaling", "Speedup", "Scaling: speedup and efficiency"),
    "lost_time": Place("scaling", "Phases", "Scaling: lost time by phase"),
    "phase_breakdown": Place("scaling", "Phases", "Scaling: phase breakdown"),
    "pop": Place("scaling", "Phases", "Scaling: POP efficiencies"),
    "sync": Place("scaling", "Sync", "Scaling: sync time and bus bandwidth"),
    "collectives": Place("scaling", "Sync", "Scaling: collectives by message size"),
    "allreduce_fit": Place("scaling", "Sync", "Scaling: alpha-beta fit"),
    "utilisation": Place("scaling", "Utilisation", "Scaling: utilisation and energy"),
    "mfu": Place("scaling", "Utilisation", "Scaling: MFU"),
    "backend_compare": Place("scaling", "Groups", "Scaling: backends side by side"),
    "scaling_model": Place("scaling", "Model", "Scaling: model and prediction"),
    "scaling_prediction": Place("scaling", "Model", "Scaling: model and prediction"),
    "stragglers": Place("run", "Stragglers", "Run: wait at collective"),
    "collective_wait": Place("run", "Stragglers", "Run: wait at collective"),
    "rank_breakdown": Place("run", "Phases", "Run: per-rank breakdown"),
    "step_series": Place("run", "Steps", "Run: step time per rank"),
    "run_summary": Place("run", "Steps", "Run: step time per rank"),
    "gpu_timeline": Place("run", "Telemetry", "Run: GPU telemetry"),
    "host_timeline": Place("run", "Telemetry", "Run: host telemetry"),
    "placement": Place("run", "Telemetry", "Run: ranks per host"),
    "rank_timeline": Place("run", "Timeline", "Run: per-rank timeline of a window of steps"),
    "what_if": Place("run", "What-if", "Run: what-if, the ideal step and what each part costs"),
    "batch_sweep": Place("batch", None, "Batch size: throughput against batch size"),
    "metric_curves": Place("batch", None, "Batch size: metric against wall time"),
    "time_to_metric": Place("batch", None, "Batch size: time to target"),
    "quality": Place("overview", None, "Overview: data quality"),
}


@dataclass(frozen=True)
class Link:
    place: Place
    params: dict[str, str] = field(default_factory=dict)


def links_for(analyses: Sequence[str], run_ids: Sequence[str], group_id: str | None) -> list[Link]:
    """The pages and tabs behind a finding's evidence, first-named analysis first, each place once."""
    out: list[Link] = []
    seen: set[tuple[str, str | None]] = set()
    for name in analyses:
        place = PLACES.get(name)
        if place is None or (place.page, place.tab) in seen:
            continue
        seen.add((place.page, place.tab))
        # the Run page shows one run: the last-named run is the largest or the one the rule points at
        run_id = run_ids[-1] if run_ids else None
        out.append(Link(place, place.params(run_id=run_id, group_id=group_id)))
    return out
