"""Run a read-only SQL query over a store's tables (runs, steps, spans, comm, gpu_samples, ...)."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..errors import PerfscopeError
from ..output import check_output_file, open_output, printable_columns, write_output
from ..schema import TABLES
from ..store import open_store
from ..terminal import format_table, use_colour


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


def run(args: argparse.Namespace) -> int:
    if args.format == "parquet" and not args.output:
        raise PerfscopeError("--format parquet needs -o FILE (Parquet is binary)")
    if args.output:
        check_output_file(args.output)  # before the query, which may take long
    with open_store(args.store) as store:
        result = store.read_only_query(args.query)
    if args.format == "parquet":
        with open_output(args.output) as f:
            try:
                pq.write_table(result, f)
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
                raise PerfscopeError(f"cannot write this result as Parquet: {exc}") from None
        print(f"wrote {result.num_rows} rows to {args.output}", file=sys.stderr)
        return 0
    result = printable_columns(result, nested=args.format == "json")
    if args.format == "csv":
        buf = io.BytesIO()
        pacsv.write_csv(result, buf)
        text = buf.getvalue().decode()
    elif args.format == "json":
        text = json.dumps(result.to_pylist(), indent=2, default=str) + "\n"
    else:
        colour = use_colour() and not args.output
        text = format_table(result, colour=colour, limit=args.limit) + "\n"
    if args.output:
        write_output(args.output, text.encode())
    else:
        sys.stdout.write(text)
    return 0
