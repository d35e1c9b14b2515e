"""Turns analysis tables into the plain rows a chart embeds, and names series and runs briefly."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

import altair as alt
import pyarrow as pa
from altair.utils.schemapi import debug_mode

from ..analysis.groups import common_tokens, group_label_map

Row = dict[str, Any]


def rows(table: pa.Table | None, columns: Sequence[str] | None = None) -> list[Row]:
    """The table's rows as dicts, NaN as None (JSON has no NaN), decimals as floats; absent columns
    read as None."""
    if table is None or table.num_rows == 0:
        return []
    names = list(columns) if columns is not None else table.column_names
    present = [c for c in names if c in table.column_names]
    out = table.select(present).to_pylist()
    for r in out:
        for k, v in r.items():
            if isinstance(v, Decimal):  # DuckDB sums of integers come back as DECIMAL
                v = r[k] = float(v)
            if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
                r[k] = None
        for c in names:
            r.setdefault(c, None)
    return out


def data(values: list[Row]) -> alt.Data:
    """Inline chart data. Altair validates every row against the JSON schema when it builds the
    object, which takes seconds for a few thousand rows; the rows here are plain JSON values, so
    that check is skipped (the spec is still validated by to_dict())."""
    with debug_mode(False):
        return alt.Data(values=values)


def sources(values: Iterable[Row]) -> set[str]:
    return {str(r.get("source") or "measured") for r in values}


def series_labels(keys: Iterable[Sequence[str]], *, sep: str = " · ") -> dict[tuple[str, ...], str]:
    """Short labels for series keys: the parts that differ between them (all parts if they never do)."""
    uniq = sorted({tuple(str(p) for p in k) for k in keys})
    same = common_tokens(uniq) if len(uniq) > 1 else set()
    labels = {}
    for k in uniq:
        parts = [p for i, p in enumerate(k) if i not in same and p]
        labels[k] = sep.join(parts) if parts else sep.join(p for p in k if p)
    return labels


def group_labels(group_ids: Iterable[str], scaling: Iterable[Row]) -> dict[str, str]:
    """The name of every group in `group_ids`; groups with a curve in the scaling rows get the short
    names the charts give them (charts label only those). The report and the dashboard use these."""
    labels = group_label_map(group_ids)
    labels.update(group_label_map(multi_point_groups([r for r in scaling if not r.get("mixed")])))
    return labels


def run_label_map(run_ids: Iterable[str]) -> dict[str, str]:
    """run_id -> the '-'-separated tokens that differ between the runs (e.g. 'n004-b75')."""
    ids = sorted({r for r in run_ids if r})
    if len(ids) <= 1:
        return {r: r for r in ids}
    tokens = [r.split("-") for r in ids]
    if len({len(t) for t in tokens}) != 1:
        return {r: r for r in ids}
    labels = series_labels(tokens, sep="-")
    return {r: labels[tuple(t)] for r, t in zip(ids, tokens, strict=True)}


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort 'b75' before 'b150': digit runs compare as numbers."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))


def multi_point_groups(values: Iterable[Row], *, key: str = "group_id") -> set[Any]:
    """Groups measured at two or more world sizes: only those have a scaling curve to draw."""
    sizes: dict[Any, set[Any]] = {}
    for r in values:
        sizes.setdefault(r.get(key), set()).add(r.get("world_size"))
    return {g for g, s in sizes.items() if len(s) >= 2}


def prefer_curves(values: list[Row], *, key: str = "group_id") -> list[Row]:
    """Only the groups with a curve (two or more world sizes) when there are any, else every row."""
    keep = multi_point_groups(values, key=key)
    return [r for r in values if r.get(key) in keep] if keep else values


def world_size_ticks(values: Iterable[Row]) -> list[int]:
    return sorted({int(r["world_size"]) for r in values if r.get("world_size") is not None})
