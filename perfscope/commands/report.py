"""Write the scaling study of a store as one self-contained HTML file (or Markdown with PNG charts),
with every analysis table it used exportable as CSV or Parquet."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from ..analysis import Selection
from ..analysis.compare import Comparison
from ..errors import PerfscopeError
from ..store.open import open_store
from ..store.reader import Store
from ..words import counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="report file (default perfscope-report.html, or .md with --format md)",
    )
    p.add_argument(
        "--format",
        choices=["html", "md", "pdf"],
        help="html: one self-contained file (default, or from -o's suffix); md: Markdown with PNG charts "
        "in FILE_files/ beside it; pdf: not supported (says why)",
    )
    p.add_argument(
        "--experiment",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="only these experiments (repeatable)",
    )
    p.add_argument(
        "--run", action="append", dest="runs", default=[], metavar="RUN_ID", help="only this run (repeatable)"
    )
    # the old spelling, kept working: --runs A B C
    p.add_argument("--runs", action="extend", nargs="+", dest="runs", help=argparse.SUPPRESS)
    p.add_argument("--source", choices=["measured", "simulated"], help="only measured or only simulated runs")
    p.add_argument(
        "--title", metavar="TEXT", help="the report's title (default: 'Scaling study: EXPERIMENTS')"
    )
    p.add_argument("--tables", metavar="DIR", help="also write every analysis table the report used into DIR")
    p.add_argument(
        "--table-format",
        choices=["csv", "parquet"],
        default="csv",
        help="format of --tables files (default csv)",
    )
    p.add_argument(
        "--compare",
        metavar="BASE",
        help="open with a section comparing the report's run with a base run in the store BASE (as "
        "`perfscope compare BASE STORE` does: verdict, interval, by phase, rank, collective, op type)",
    )
    p.add_argument("--compare-run", metavar="ID", help="the base run in BASE (needed when it holds several)")
    p.add_argument(
        "--to",
        choices=["mlflow", "wandb", "tensorboard"],
        help="send per-step phase times, the scaling summary and the findings to a tracker instead "
        "(-o: MLflow tracking URI or folder, W&B folder (offline unless WANDB_MODE), TensorBoard log dir)",
    )


def run(args: argparse.Namespace) -> int:
    if args.to:
        from ..exporters.trackers import export_command

        return export_command(args)
    try:
        from ..report import default_output, infer_format, write_report
    except ImportError as exc:  # altair / vl-convert are the dashboard extra
        raise PerfscopeError(
            f"the report needs altair and vl-convert-python ({exc.name} is missing): "
            "pip install 'perfscope[dashboard]'"
        ) from exc
    if args.output:
        fmt = infer_format(Path(args.output), args.format)
        output = Path(args.output)
    else:
        fmt = infer_format(Path("report.html"), args.format)
        output = default_output(fmt)
    sel = Selection(experiments=tuple(args.experiment), run_ids=tuple(args.runs), source=args.source)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(open_store(args.store))
        comparison = None
        if args.compare:
            comparison = _comparison(stack, store, args)
        written = write_report(
            store,
            sel,
            output,
            fmt=fmt,
            title=args.title,
            tables_dir=args.tables,
            table_format=args.table_format,
            stream=sys.stderr,
            compare=comparison,
        )
    extra = f" and {counted(len(written.files) - 1, 'more file')}" if len(written.files) > 1 else ""
    print(
        f"wrote {written.report}{extra}: {counted(written.runs, 'run')}, {counted(written.charts, 'chart')}, "
        f"{counted(written.findings, 'finding')}",
        file=sys.stderr,
    )
    return 0


def _comparison(stack: contextlib.ExitStack, store: Store, args: argparse.Namespace) -> Comparison:
    """--compare: the report's run (the one run of the selection) against BASE's run."""
    from ..analysis.compare import compare, pick_run

    base_store = stack.enter_context(open_store(args.compare, warn=False))
    base = pick_run(base_store, args.compare_run, "--compare BASE", "--compare-run")
    if len(args.runs) > 1:
        raise PerfscopeError("--compare compares one run: give at most one --run")
    cand = pick_run(store, args.runs[0] if args.runs else None, "the report's store", "--run")
    if base_store.root == store.root and base.run_id == cand.run_id:
        raise PerfscopeError(f"--compare: the base run is the report's own run ({cand.run_id}); pick another")
    return compare(base, cand)
