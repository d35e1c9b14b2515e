"""Export a run for another tool. `perfscope export perfetto STORE [--run ID] [--steps A:B] -o FILE`
writes Chrome trace-event JSON (gzip for FILE.gz) that Perfetto UI and chrome://tracing open."""

from __future__ import annotations

import argparse
import sys

from ..exporters import perfetto
from ..output import check_output_file
from ..store.open import open_store


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "format", choices=["perfetto"], help="perfetto: Chrome trace-event JSON, one process per rank"
    )
    p.add_argument("store", help="store folder")
    p.add_argument("--run", metavar="RUN_ID", help="the run to export (needed when the store holds several)")
    p.add_argument("--steps", metavar="A:B", help="only steps A to B, both included (A: and :B are open)")
    p.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="trace file; gzip when it ends in .gz"
    )


def run(args: argparse.Namespace) -> int:
    window = perfetto.StepWindow.parse(args.steps)
    check_output_file(args.output, what="trace", flag="-o")
    with open_store(args.store) as store:
        run_id = perfetto.pick_run(store, args.run)
        doc = perfetto.build(store, run_id, window)
    size = perfetto.write(doc, args.output)
    slices = sum(1 for e in doc["traceEvents"] if e["ph"] == "X")
    print(f"wrote {slices:,} slices of run {run_id} to {args.output} ({size / 1e6:.2f} MB)", file=sys.stderr)
    return 0
