"""Renders tables and headings for a terminal: aligned columns, colour only where it is supported."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import pyarrow as pa


def use_colour(stream: TextIO | None = None) -> bool:
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM") != "dumb"


def style(text: str, code: str, *, enabled: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if enabled else text


def format_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) >= 1e7 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    return str(v)


def format_rows(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    colour: bool = False,
    max_width: int = 60,
) -> str:
    cells = [[format_value(v) for v in row] for row in rows]
    cells = [[c if len(c) <= max_width else c[: max_width - 1] + "…" for c in row] for row in cells]
    widths = [len(h) for h in header]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and bool(rows)
        for i in range(len(header))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [style(line(list(header)), "1", enabled=colour), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def format_table(table: pa.Table, *, colour: bool = False, limit: int | None = None) -> str:
    rows = table.to_pylist() if limit is None else table.slice(0, limit).to_pylist()
    text = format_rows(table.column_names, [list(r.values()) for r in rows], colour=colour)
    if limit is not None and table.num_rows > limit:
        text += f"\n... {table.num_rows - limit} more rows"
    return text


def heading(text: str, *, colour: bool = False) -> str:
    return style(text, "1;36", enabled=colour)
