"""What every report section reads: the Context (the analysis tables, the ranked findings, the
group labels and what one rank runs on) and the helpers the sections share to pick and word their rows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ..analysis.selection import SOURCES
from ..charts import CHARTS
from ..charts.rows import natural_key, rows
from ..explain.finding import Finding as ExplainFinding
from ..words import joined, known
from .model import ChartBlock, Finding, device_unit

#: the analysis tables by name
Tables = Mapping[str, pa.Table]


@dataclass
class Context:
    tables: Tables
    findings: list[Finding]
    labels: dict[str, str]  # group_id -> short label
    unit: str = "GPU"  # what one rank runs on, in words: "rank" when every run was on CPU
    #: every rule firing behind the findings, with the rank of the finding that says it (a symptom
    #: is said by its root cause's finding): the sections read these, never judge on their own
    fired: list[tuple[int, ExplainFinding]] = field(default_factory=list)

    def rows(self, name: str, columns: Iterable[str] | None = None) -> list[dict[str, Any]]:
        return rows(self.tables.get(name), list(columns) if columns is not None else None)

    def unit_of(self, run_id: Any) -> str:
        """What one rank of this run runs on, in words (a mixed store has CPU and GPU runs)."""
        models = [
            r["device_model"]
            for r in self.rows("run_summary", ["run_id", "device_model"])
            if r["run_id"] == run_id
        ]
        return device_unit(models) if models else self.unit

    def chart(
        self,
        name: str,
        caption: str = "",
        *,
        without: tuple[str, ...] = (),
        title: str | None = None,
        drawn: str | None = None,
        **options: Any,
    ) -> ChartBlock:
        """Chart `name` from the report's tables, leaving out the analyses in `without`; `drawn`: the
        column the chart plots, so that only rows with a value there say where the figure comes from
        (CPU runs have no GPU utilisation: a chart of it beside them draws simulated GPUs only)."""
        spec = CHARTS[name]
        tables = {k: v for k, v in self.tables.items() if k not in without}
        chart = spec.build(tables, **options)
        used = tuple(a for a in spec.analyses if a not in without)
        origin = source_words(self.sources_of(used, options.get("run_id"), drawn=drawn))
        words = ", ".join(c for c in (origin, caption) if c)
        return ChartBlock(name, title or spec.title, chart, used, words)

    def sources_of(
        self, analyses: Iterable[str], run_id: str | None = None, *, drawn: str | None = None
    ) -> set[str]:
        """Where the runs behind these analyses' rows come from (measured, simulated), read from a row's
        own source, else from its run or group; only `run_id`'s rows when one is given."""
        by_run = {r["run_id"]: r["source"] for r in self.rows("run_summary", ("run_id", "source"))}
        by_group: dict[str, set[str]] = {}
        for r in self.rows("scaling", ("group_id", "source")):
            by_group.setdefault(r["group_id"], set()).add(r["source"])
        out: set[str] = set()
        for name in analyses:
            if name == "scaling_prediction":  # a model's output, named by the caption itself
                continue
            for r in self.rows(name, ("source", "run_id", "group_id", drawn or "source")):
                if run_id is not None and r["run_id"] not in (None, run_id):
                    continue
                if drawn is not None and r[drawn] is None:
                    continue
                if r["source"] in SOURCES:
                    out.add(r["source"])
                elif r["run_id"] in by_run:
                    out.add(by_run[r["run_id"]])
                else:
                    out |= by_group.get(r["group_id"], set())
        return out & set(SOURCES)

    def label(self, group_id: str | None) -> str:
        return self.labels.get(group_id or "", group_id or "")


def source_words(sources: set[str]) -> str:
    """A figure's origin in words: never "measured" for a figure of simulated runs only."""
    if sources == {"measured"}:
        return "measured"
    if sources == {"simulated"}:
        return "simulated"
    if sources:
        return "measured and simulated runs (simulated ones hollow)"
    return ""


def with_group(ctx: Context, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, each with its group's short label added as 'group' (in place)."""
    for r in values:
        r["group"] = ctx.label(r.get("group_id"))
    return values


def curve_groups(values: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by scaling group, only groups with two or more world sizes and not mixed, N ascending."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in values:
        if not r.get("mixed"):
            by.setdefault(r["group_id"], []).append(r)
    return {
        g: sorted(rs, key=lambda r: r["world_size"])
        for g, rs in sorted(by.items())
        if len({r["world_size"] for r in rs}) >= 2
    }


def largest_world_size(values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The row at the largest world size of each group."""
    return [rs[-1] for rs in curve_groups(values).values()]


def span(values: list[int]) -> str:
    """'lo–hi' of the values, or the one value when they are all equal."""
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def known_joined(items: Iterable[Any]) -> str:
    """The distinct known values, in natural order; an unknown one (None, '', '-') is left out."""
    names: list[str] = sorted({str(i) for i in items if known(i)}, key=natural_key)
    return joined(names, ", ")
