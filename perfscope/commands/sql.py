"""Run a read-only SQL query over a store's tables (runs, steps, spans, comm, gpu_samples, ...).

The result streams in batches to standard output or the file named, so its size is bounded by neither
memory nor the terminal; `--timeout` and `--memory-limit` bound the query itself (see
perfscope.store.user_sql).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Callable
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import PerfscopeError
from ..output import check_output_file, csv_pieces, csv_text, open_output, printable_columns
from ..store.open import open_store
from ..store.schema import TABLES
from ..store.user_sql import DEFAULT_MEMORY_LIMIT, Rows, UserSql, worker_memory_bound
from ..terminal import format_table, terminal_width, use_colour
from ..words import counted

Emit = Callable[[str], object]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds; got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument("query", help=f"SELECT ... over the views {', '.join(TABLES)}")
    p.add_argument(
        "--format",
        choices=["table", "csv", "json", "parquet"],
        default="table",
        help="output format",
    )
    p.add_argument("-o", "--output", help="write to this file instead of standard output")
    p.add_argument("--limit", type=int, default=200, help="rows shown in table format (default 200)")
    p.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        help="stop the query after this many seconds and exit with an error (default: no limit)",
    )
    p.add_argument(
        "--memory-limit",
        default=DEFAULT_MEMORY_LIMIT,
        metavar="SIZE",
        help=f"memory the query may use, e.g. 500MB or 8GB; beyond it large sorts and joins spill "
        f"to disk, and a query whose process passes it by {worker_memory_bound(0) // 2**20} MB is stopped "
        f"(default {DEFAULT_MEMORY_LIMIT})",
    )


def run(args: argparse.Namespace) -> int:
    if args.format == "parquet" and not args.output:
        raise PerfscopeError("--format parquet needs -o FILE (Parquet is binary)")
    if args.output:
        check_output_file(args.output)  # before the query, which may take long
    with (
        open_store(args.store) as store,
        UserSql(store, memory_limit=args.memory_limit) as session,
        session.batches(args.query, timeout_s=args.timeout) as rows,
    ):
        if not args.output:
            _write(rows, args, sys.stdout.write)
            return 0
        with open_output(args.output) as f:
            n = _write(rows, args, lambda text: f.write(text.encode()), f)
    if args.format == "parquet":
        print(f"wrote {counted(n, 'row')} to {args.output}", file=sys.stderr)
    return 0


def _write(rows: Rows, args: argparse.Namespace, emit: Emit, binary: BinaryIO | None = None) -> int:
    """Write the result batch by batch in the chosen format; the number of rows."""
    if args.format == "parquet":
        assert binary is not None
        return _parquet(rows, binary)
    if args.format == "csv":
        return _csv(rows, emit)
    if args.format == "json":
        return _json(rows, emit)
    to_terminal = not args.output
    return _table(
        rows,
        emit,
        colour=use_colour() and to_terminal,
        width=terminal_width() if to_terminal else None,
        limit=args.limit,
    )


def _parquet(rows: Rows, f: BinaryIO) -> int:
    n = 0
    try:
        with pq.ParquetWriter(f, rows.schema) as w:
            for batch in rows:
                w.write_batch(batch)
                n += batch.num_rows
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
        raise PerfscopeError(f"cannot write this result as Parquet: {exc}") from None
    return n


def _csv(rows: Rows, emit: Emit) -> int:
    n = 0
    emit(csv_text(rows.schema.empty_table()))  # the header
    for batch in rows:
        for count, text in csv_pieces(batch, header=False):  # a few rows at a time, however wide
            emit(text)
            n += count
    return n


def _json(rows: Rows, emit: Emit) -> int:
    """The same text as json.dumps(all rows, indent=2), one row at a time."""
    n = 0
    for batch in rows:
        for row in printable_columns(pa.Table.from_batches([batch]), nested=True).to_pylist():
            emit(("[\n" if n == 0 else ",\n") + textwrap.indent(json.dumps(row, indent=2, default=str), "  "))
            n += 1
    emit("\n]\n" if n else "[]\n")
    return n


def _table(rows: Rows, emit: Emit, *, colour: bool, width: int | None, limit: int) -> int:
    shown: list[pa.RecordBatch] = []
    n = 0
    for batch in rows:
        if n < limit:
            shown.append(batch)
        n += batch.num_rows
    table = pa.Table.from_batches(shown, schema=rows.schema).slice(0, max(limit, 0))
    text = format_table(printable_columns(table), colour=colour, width=width)
    if n > table.num_rows:
        text += f"\n... {counted(n - table.num_rows, 'more row')}"
    emit(text + "\n")
    return n
