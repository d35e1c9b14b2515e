"""What a report holds, as plain data every renderer (HTML, Markdown, PDF) formats: sections of
paragraphs, numbers tied to the analysis they come from, charts and tables; and how numbers read."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..charts import ChartLike

#: where a reader finds every analysis, definition and finding in words (it ships in the repository)
REFERENCE = "docs/analysis.md in the perfscope repository describes every analysis, definition and finding"


def device_unit(device_models: Iterable[Any]) -> str:
    """What one rank runs on, in words: "rank" when every run was on CPU, else "GPU" (an unknown
    device counts as a GPU: perfscope's collectors record "cpu" for CPU jobs)."""
    models = [str(m).strip().lower() for m in device_models]
    return "rank" if models and all(m == "cpu" for m in models) else "GPU"


@dataclass(frozen=True)
class Num:
    """One number in running text, with where it comes from: analysis, column and row key."""

    value: Any
    analysis: str
    column: str
    key: str = ""  # run_id or group_id of the row

    def text(self) -> str:
        return format_value(self.column, self.value)


@dataclass(frozen=True)
class Ref:
    """A link to another place in the report (an element id)."""

    text: str
    anchor: str


#: A paragraph: text fragments, numbers and links.
Para = list[str | Num | Ref]


@dataclass(frozen=True)
class Column:
    name: str  # the analysis column
    header: str  # what the reader sees, with the unit


@dataclass
class TableBlock:
    """Rows of one analysis (a subset of its rows and columns, values untouched)."""

    analysis: str
    caption: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    key: str = "run_id"  # the column that names a row (for data attributes and lookups)
    collapsed: bool = False  # long tables fold away in HTML


#: a table of more rows than this is folded (collapsed) at first
FOLD_ROWS = 14


def table_columns(*pairs: tuple[str, str]) -> list[Column]:
    """Columns from (name, heading) pairs."""
    return [Column(n, h) for n, h in pairs]


def table_block(
    analysis: str, caption: str, columns: list[Column], values: list[dict[str, Any]], key: str = "run_id"
) -> TableBlock:
    """A table of an analysis' rows, folded when it has more than FOLD_ROWS."""
    return TableBlock(analysis, caption, columns, values, key=key, collapsed=len(values) > FOLD_ROWS)


@dataclass
class ChartBlock:
    name: str  # key in perfscope.charts.CHARTS
    title: str
    chart: ChartLike
    analyses: tuple[str, ...]
    caption: str = ""


@dataclass
class Finding:
    """A finding as the report shows it (perfscope.explain.Finding, flattened)."""

    id: str
    rank: int
    severity: str
    category: str
    title: str
    text: str
    recommendation: str
    confidence: float
    confidence_label: str
    explained_loss: float | None
    run_ids: tuple[str, ...]
    analyses: tuple[str, ...]
    group_id: str | None
    group_label: str = ""  # the group's short name in this report's charts and tables
    symptoms: tuple[tuple[str, str], ...] = ()  # (title, text) of each symptom of this root cause
    also_in: tuple[str, ...] = ()  # titles of the same cause on other groups


@dataclass
class FindingsBlock:
    """The ranked findings, each with its evidence and recommendation."""

    findings: list[Finding]


Block = Para | TableBlock | ChartBlock | FindingsBlock


@dataclass
class Section:
    id: str
    heading: str
    blocks: list[Block] = field(default_factory=list)
    definitions: tuple[str, ...] = ()  # DEFINITIONS keys the section's numbers follow


@dataclass
class Report:
    title: str
    subtitle: list[str]
    generated_utc: str
    store: str
    selection: dict[str, Any]
    perfscope_version: str
    runs: int
    simulated_runs: int
    sections: list[Section]
    findings: list[Finding]
    definitions: dict[str, str]  # every definition the report uses, by key
    analysis_titles: dict[str, str]  # analysis name -> title
    analysis_definitions: dict[str, tuple[str, ...]]  # analysis name -> definition keys

    def charts(self) -> list[ChartBlock]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, ChartBlock)]

    def tables(self) -> list[TableBlock]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, TableBlock)]


# ---- how numbers read ---------------------------------------------------------------------------

_FRACTIONS_AS_PERCENT = (
    "share",
    "share_of_lost",
    "sync_share",
    "data_share",
    "overlap_share",
    "last_share",
    "wait_share_of_step",
    "throttle_share",
    "mfu",
)
_RATIOS = (
    "speedup",
    "ideal_speedup",
    "efficiency",
    "per_gpu_speedup",
    "load_balance",
    "comm_efficiency",
    "parallel_efficiency",
    "computation_scaling",
    "global_efficiency",
    "model_speedup",
    "model_efficiency",
    "ratio_to_best",
    "throughput_vs_smallest",
    "step_cv",
    "r2_adj",
    "confidence",
    "explained_loss",
)


def _sig(v: float, digits: int = 3) -> str:
    if v == 0:
        return "0"
    mag = math.floor(math.log10(abs(v)))
    decimals = max(0, digits - 1 - mag)
    return f"{v:,.{decimals}f}"


def _bytes(v: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            return f"{_sig(v / size)} {unit}"
    return f"{int(v)} B"


def format_value(column: str, value: Any) -> str:
    """A value as the report prints it; the unit follows from the column name (docs/analysis.md)."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "–"  # a cell nobody recorded (an empty cluster name too): the same dash as a NULL
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    v = float(value)
    if column in _FRACTIONS_AS_PERCENT or column.endswith("_share"):
        return f"{v * 100:.1f}%"
    if column in _RATIOS:
        return f"{v:.2f}" if column != "step_cv" else f"{v:.3f}"
    if column == "alpha_s":
        return f"{_sig(v * 1e6)} µs"
    if column == "beta_s_per_byte":
        return f"{_sig(v * 1e12)} ps/B"
    if column.endswith("_ns"):
        if abs(v) >= 1e9:
            return f"{_sig(v / 1e9)} s"
        if abs(v) >= 1e6 or v == 0:
            return f"{_sig(v / 1e6)} ms"
        return f"{_sig(v / 1e3)} µs"
    if column.endswith("_pct"):
        return f"{v:.1f}%"
    if column.endswith("_bytes") or column.startswith("bytes"):
        return _bytes(v)
    if column.endswith("_gb_per_s"):
        return f"{_sig(v)} GB/s"
    if column.endswith("_flops_per_s") or column in ("flops_per_step", "device_peak_flops"):
        return f"{v / 1e12:.3g} TFLOP" + ("/s" if column != "flops_per_step" else "")
    if column.endswith("_per_sample_j"):
        return f"{_sig(v * 1e3)} mJ"
    if column.endswith("_per_s"):
        return f"{v:,.0f}/s"
    for suffix, unit in (("_j", "J"), ("_w", "W"), ("_mhz", "MHz"), ("_c", "°C"), ("_s", "s")):
        if column.endswith(suffix):
            return f"{_sig(v)} {unit}"
    if isinstance(value, int) or v.is_integer():
        return f"{int(v):,}"
    return _sig(v)
