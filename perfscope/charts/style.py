"""The look every chart shares: phase colours, the marks for measured, simulated and predicted points,
the theme, and the "no data" chart."""

from __future__ import annotations

import textwrap
from typing import Any, Final, TypeAlias

import altair as alt

from ..analysis.steady import PHASE_LABELS

#: Canonical step phases in stacking order, with the colour and words every chart uses for them.
#: Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
PHASES: tuple[str, ...] = (
    "data",
    "forward",
    "backward",
    "sync_exposed",
    "optimizer",
    "other",
    "imbalance",
)
PHASE_COLOURS: dict[str, str] = {
    "data": "#E69F00",
    "forward": "#56B4E9",
    "backward": "#0072B2",
    "sync_exposed": "#D55E00",
    "optimizer": "#009E73",
    "other": "#999999",
    "imbalance": "#CC79A7",
}

#: Where a point comes from. Measured points are filled circles on solid lines; simulated runs are
#: hollow triangles; model predictions are hollow diamonds on dashed lines. The legend names them.
SOURCES: tuple[str, ...] = ("measured", "simulated", "prediction")
SOURCE_SHAPES: dict[str, str] = {"measured": "circle", "simulated": "triangle-up", "prediction": "diamond"}
SOURCE_FILL_OPACITY: dict[str, float] = {"measured": 1.0, "simulated": 0.0, "prediction": 0.0}
SOURCE_DASH: dict[str, list[int]] = {"measured": [1, 0], "simulated": [1, 0], "prediction": [6, 4]}

#: Series colours (groups, backends, batch sizes): Tableau 10, the phase colours stay separate.
SERIES_SCHEME: Final = "tableau10"
IDEAL_COLOUR = "#555555"
THRESHOLD_COLOUR = "#B22222"

#: px of blank on either side of a chart (see _theme_config): room for a browser's wider font
TEXT_SLACK = 40
WIDTH = 460
HEIGHT = 280
PANEL_WIDTH = 220
PANEL_HEIGHT = 180
FONT = "Helvetica, Arial, sans-serif"

#: What a builder returns: a single or layered chart, or a facet/concatenation of them.
ChartLike: TypeAlias = alt.Chart | alt.LayerChart | alt.FacetChart | alt.HConcatChart | alt.VConcatChart


def is_wide(ticks: list[int]) -> bool:
    return bool(ticks) and min(ticks) > 0 and max(ticks) / min(ticks) > 16


def world_size_x(ticks: list[int], field: str = "world_size") -> alt.X:
    """The world-size axis: ticks at the measured sizes; log2 once they span more than 16x, so
    predictions far out do not squash the measured points into a corner."""
    wide = is_wide(ticks)
    scale = alt.Scale(type="log", base=2) if wide else alt.Scale(zero=False)
    return alt.X(
        f"{field}:Q",
        title="world size N (ranks)" + (", log scale" if wide else ""),  # a rank: one GPU or CPU process
        scale=scale,
        axis=alt.Axis(values=ticks, format="d", labelOverlap=True),
    )


def phase_scale() -> alt.Scale:
    return alt.Scale(domain=list(PHASES), range=[PHASE_COLOURS[p] for p in PHASES])


def phase_legend_expr() -> str:
    """A Vega expression that shows a phase's words in legends instead of its column name."""
    cases = " : ".join(f"datum.label === '{p}' ? '{PHASE_LABELS[p]}'" for p in PHASES)
    return f"{cases} : datum.label"


def source_shape(present: set[str] | None = None) -> alt.Shape:
    """Shape by source; the legend lists only the sources `present` (all when None), while the
    scale keeps every source so a shape means the same in every chart."""
    shown = [s for s in SOURCES if present is None or s in present]
    return alt.Shape(
        "source:N",
        title="source",
        scale=alt.Scale(domain=list(SOURCES), range=[SOURCE_SHAPES[s] for s in SOURCES]),
        legend=alt.Legend(values=shown),
    )


def source_fill_opacity() -> alt.FillOpacity:
    return alt.FillOpacity(
        "source:N",
        legend=None,
        scale=alt.Scale(domain=list(SOURCES), range=[SOURCE_FILL_OPACITY[s] for s in SOURCES]),
    )


def source_note(sources: set[str], *, marks: str = "points") -> str:
    """The subtitle line that says which kinds of marks a chart holds, so simulation is never silent.

    `marks` is "points" (hollow triangles mark simulated runs) or "bars" (labels say "sim").
    """
    parts = []
    if "simulated" in sources:
        if marks == "bars":
            only = "measured" not in sources
            parts.append(
                "all runs simulated (not measured)" if only else "'sim': simulated run (not measured)"
            )
        else:
            parts.append("simulated runs: hollow triangles (not measured)")
    if "prediction" in sources:
        parts.append("model predictions: hollow diamonds, dashed")
    return "; ".join(parts)


def _theme_config() -> dict[str, Any]:
    return {
        "font": FONT,
        # slack on both sides: vl-convert lays text out with Arial's widths, and a browser without
        # Helvetica or Arial (Linux: DejaVu Sans, about 13% wider) draws it wider; y-axis labels grow
        # leftwards from the axis and legends sit at the right edge, so either side would cut letters
        "padding": {"left": TEXT_SLACK, "top": 5, "right": TEXT_SLACK, "bottom": 5},
        "view": {"stroke": None},
        "axis": {"labelFontSize": 11, "titleFontSize": 12, "gridColor": "#e6e6e6"},
        "legend": {"labelFontSize": 11, "titleFontSize": 12, "labelLimit": 260},
        "title": {"fontSize": 14, "subtitleFontSize": 11, "subtitleColor": "#555", "anchor": "start"},
        "header": {"labelFontSize": 11, "titleFontSize": 12},
        "point": {"size": 60, "strokeWidth": 1.6},
        "line": {"strokeWidth": 2},
    }


#: characters of an 11 px subtitle line that fit the narrowest chart with a browser's wider font
SUBTITLE_CHARS = 80


def finish(chart: Any, title: str, subtitle: str | list[str] = "", *, legend_offset: int = 18) -> Any:
    """Give a chart its title (and subtitle lines) and the shared theme; the result is top level."""
    lines = [subtitle] if isinstance(subtitle, str) else list(subtitle)
    # a subtitle line is not wrapped by the renderer: longer than the narrowest chart it is cut off
    lines = [part for s in lines if s for part in textwrap.wrap(s, SUBTITLE_CHARS)]
    t = alt.Title(text=title, subtitle=lines) if lines else alt.Title(text=title)
    config = _theme_config()
    config["legend"]["offset"] = legend_offset
    return chart.properties(title=t).configure(**config)


def no_data(title: str, reason: str = "no data in this selection") -> alt.Chart:
    """The chart every builder returns for an empty table: the title and a line saying why."""
    chart = (
        alt.Chart(alt.Data(values=[{"text": reason}]))
        .mark_text(fontSize=13, color="#777", align="center", baseline="middle")
        .encode(text="text:N")
        .properties(width=WIDTH, height=80)
    )
    return finish(chart, title)
