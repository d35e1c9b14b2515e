"""Write the scaling study of a store as one self-contained HTML file (or Markdown with PNG charts),
with every analysis table it used exportable as CSV or Parquet."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..analysis import Selection
from ..errors import PerfscopeError
from ..store.open import open_store
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
    with open_store(args.store) as store:
        written = write_report(
            store,
            sel,
            output,
            fmt=fmt,
            title=args.title,
            tables_dir=args.tables,
            table_format=args.table_format,
            stream=sys.stderr,
        )
    extra = f" and {counted(len(written.files) - 1, 'more file')}" if len(written.files) > 1 else ""
    print(
        f"wrote {written.report}{extra}: {counted(written.runs, 'run')}, {counted(written.charts, 'chart')}, "
        f"{counted(written.findings, 'finding')}",
        file=sys.stderr,
    )
    return 0
