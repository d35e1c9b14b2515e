"""Renders tables and headings for a terminal: aligned columns, colour only where it is supported."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import pyarrow as pa

from .errors import one_line


def use_colour(stream: TextIO | None = None) -> bool:
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM") != "dumb"


def style(text: str, code: str, *, enabled: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if enabled else text


def printable(text: str, *, lines: bool = False) -> str:
    """`text` safe to print: every character that is not printable (ESC and the other control
    characters, bidirectional overrides, a lone surrogate) written as its escape, so a string from a
    file (a backend, a host name, a tensor name) can neither move the cursor, recolour the terminal,
    nor reorder what it shows. With `lines`, line breaks are kept (text already wrapped)."""
    if text.isprintable():
        return text
    if lines:
        return "\n".join(one_line(part) for part in text.split("\n"))
    return one_line(text)


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
    return printable(str(v))


#: the narrowest width output is fitted to (a smaller COLUMNS is taken as this)
MIN_WIDTH = 40
#: the widest prose is wrapped to, however wide the terminal (long lines are hard to read)
PROSE_WIDTH = 110
#: a table's first column and its run ids (names that differ at both ends) are cut to no fewer
#: characters than this
_KEY_MIN_CHARS = 28
#: other text columns are cut to no fewer characters than this (or their heading's width)
_TEXT_MIN_CHARS = 16
_GAP = "  "


def terminal_width(stream: TextIO | None = None) -> int | None:
    """The columns output must fit in: COLUMNS when set, else the terminal's own width; None when the
    output goes to a file or a pipe and nobody said a width (tables are then written whole)."""
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return max(int(cols), MIN_WIDTH)
    stream = sys.stdout if stream is None else stream
    try:
        if not stream.isatty():
            return None
        return max(os.get_terminal_size(stream.fileno()).columns, MIN_WIDTH)
    except (AttributeError, OSError, ValueError):
        return None


def prose_width(width: int | None) -> int:
    """The width to wrap sentences to in a terminal of `width` columns (None: a file or pipe)."""
    return min(PROSE_WIDTH, width or PROSE_WIDTH)


def wrap(text: str, width: int | None, *, indent: str = "", hang: str | None = None) -> str:
    """`text` wrapped to the prose width, every line indented by `indent` (later lines by `hang`);
    a word longer than a line (a path, a URL) is left whole rather than broken."""
    import textwrap

    return textwrap.fill(
        printable(text),
        width=prose_width(width),
        initial_indent=indent,
        subsequent_indent=indent if hang is None else hang,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _cut(text: str, chars: int, *, middle: bool) -> str:
    """`text` in at most `chars` characters: its end (or, for names, its middle) replaced by '…'."""
    if len(text) <= chars:
        return text
    if not middle:
        return text[: chars - 1] + "…"
    head = (chars - 1) // 2
    return text[:head] + "…" + text[len(text) - (chars - 1 - head) :]


def _shrink(widths: list[int], floors: list[int], width: int) -> list[int]:
    """Column widths narrowed, widest first and never below their floor, until a line fits `width`
    (or no column can give more)."""
    widths = list(widths)
    while sum(widths) + len(_GAP) * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=lambda j: widths[j] - floors[j])
        if widths[i] <= floors[i]:
            break
        widths[i] -= 1
    return widths


def _panels(widths: list[int], width: int) -> list[list[int]]:
    """The columns after the first split into panels that each fit `width` beside the first column
    (which every panel repeats so its rows stay named); one panel when all fit."""
    panels: list[list[int]] = [[]]
    used = widths[0]
    for i in range(1, len(widths)):
        if panels[-1] and used + len(_GAP) + widths[i] > width:
            panels.append([])
            used = widths[0]
        panels[-1].append(i)
        used += len(_GAP) + widths[i]
    return panels


def format_rows(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    colour: bool = False,
    max_width: int = 60,
    width: int | None = None,
) -> str:
    """An aligned table: numbers right, text left, no cell wider than `max_width`. Given a terminal
    `width`, text columns are cut in the middle ('…', so both ends of a name show) down to a floor, and
    columns that still do not fit go to further panels below, each repeating the first column."""
    cells = [[format_value(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and bool(rows)
        for i in range(len(header))
    ]
    widths = [len(h) for h in header]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    widths = [min(w, max(max_width, len(h))) for w, h in zip(widths, header, strict=True)]
    if width is not None:
        floors = [
            w if num else min(w, max(len(h), _KEY_MIN_CHARS if i == 0 or h == "run" else _TEXT_MIN_CHARS))
            for i, (w, h, num) in enumerate(zip(widths, header, numeric, strict=True))
        ]
        widths = _shrink(widths, floors, width)
    cells = [[_cut(c, w, middle=True) for c, w in zip(row, widths, strict=True)] for row in cells]
    shown_header = [_cut(h, w, middle=False) for h, w in zip(header, widths, strict=True)]

    def line(values: Sequence[str], columns: Sequence[int]) -> str:
        return _GAP.join(
            values[i].rjust(widths[i]) if numeric[i] else values[i].ljust(widths[i]) for i in columns
        ).rstrip()

    def table(columns: Sequence[int]) -> list[str]:
        out = [
            style(line(shown_header, columns), "1", enabled=colour),
            line(["-" * w for w in widths], columns),
        ]
        return out + [line(r, columns) for r in cells]

    if width is None or len(header) < 2:
        return "\n".join(table(range(len(header))))
    blocks = ["\n".join(table([0, *panel])) for panel in _panels(widths, width)]
    return "\n\n".join(blocks)


def format_table(
    table: pa.Table, *, colour: bool = False, limit: int | None = None, width: int | None = None
) -> str:
    rows = table.to_pylist() if limit is None else table.slice(0, limit).to_pylist()
    text = format_rows(table.column_names, [list(r.values()) for r in rows], colour=colour, width=width)
    if limit is not None and table.num_rows > limit:
        text += f"\n... {table.num_rows - limit} more rows"
    return text


def heading(text: str, *, colour: bool = False) -> str:
    return style(printable(text, lines=True), "1;36", enabled=colour)


def footer_progress_line(stream: TextIO) -> Callable[[int, int], None] | None:
    """A listing's footer_progress report as one self-overwriting line on `stream`, when it is a
    terminal (None otherwise: nothing is written to a pipe or a file)."""
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    width = (terminal_width(stream) or 80) - 1  # a line as wide as the terminal would wrap
    shown = [0]  # the characters on the line now (-1: no terminal to write to any more)

    def report(done: int, total: int) -> None:
        if shown[0] < 0:
            return
        try:
            if done >= total:
                stream.write("\r" + " " * shown[0] + "\r")
                shown[0] = 0
            else:
                text = f"reading {done:,} / {total:,} {FOOTERS_WHAT}"[:width]
                stream.write("\r" + text.ljust(shown[0]))
                shown[0] = max(shown[0], len(text))
            stream.flush()
        except (OSError, ValueError):  # the terminal went away: the listing goes on without a line
            shown[0] = -1

    return report


#: what the progress line says is being read
FOOTERS_WHAT = "segment footers (first open of this store; later opens use its manifest)"
