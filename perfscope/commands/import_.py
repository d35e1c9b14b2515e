"""Import existing traces into a store as a measured run: `perfscope import FORMAT PATH... --store S`.

Formats: see `perfscope import --help`. All files given make one run (one file per rank where the
format has ranks). The run is tagged with its origin; every analysis, finding and report works on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import PerfscopeError
from ..importers import IMPORTERS, importer
from ..importers.common import ImportOptions, check_paths, ranks_in_range, stopped_by_signals
from ..store.objectstore import refuse_s3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "format",
        choices=list(IMPORTERS),
        help="; ".join(f"{name}: {help_text}" for name, (_, help_text) in IMPORTERS.items()),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files (one per rank where ranks apply)")
    p.add_argument("--store", required=True, help="store folder (made if missing)")
    p.add_argument("--experiment", default="imported", help="experiment label (default 'imported')")
    p.add_argument("--run-id", help="run id (default: derived from the files, so a re-import is refused)")
    p.add_argument("--rank", type=int, help="rank of the (single) file when the trace does not say")
    p.add_argument("--world-size", type=int, help="ranks in the job when the trace does not say")
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="samples per step on one rank (traces do not say; throughput and speedup need it)",
    )
    p.add_argument(
        "--ops",
        action="store_true",
        help="kineto: also store every operator (cpu_op) as a span of its step, so `perfscope compare` "
        "lists the op types added, removed, more frequent or slower (memory grows with the operators)",
    )
    p.add_argument("--meta", metavar="META.yaml", help="op-table: the job's layout (dp_size, pp_size ...)")
    for size in ("dp", "pp", "tp", "cp", "vpp"):
        p.add_argument(f"--{size}", type=int, metavar="N", help=f"op-table: {size} size (instead of --meta)")


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise PerfscopeError("--world-size must be 1 or more")
    if args.world_size is not None:
        ranks_in_range(args.world_size, "--world-size")
    if args.rank is not None and not (0 <= args.rank < (args.world_size or 1 << 30)):
        raise PerfscopeError("--rank must be 0 or more and less than --world-size")
    if args.batch_size is not None and not 0 < args.batch_size < 1 << 31:
        raise PerfscopeError("--batch-size must be a positive number of samples")
    if not args.experiment.strip():
        raise PerfscopeError("--experiment must not be empty")
    if args.ops and args.format != "kineto":
        raise PerfscopeError(f"--ops is for kineto traces, not {args.format}")
    refuse_s3(args.store, "perfscope import")
    opts = ImportOptions(
        store=Path(args.store),
        experiment=args.experiment,
        run_id=args.run_id,
        rank=args.rank,
        world_size=args.world_size,
        batch_size=args.batch_size,
        ops=args.ops,
    )
    with stopped_by_signals():
        if args.format == "op-table":
            from ..importers.op_table import import_op_table

            layout = {k: getattr(args, k) for k in ("dp", "pp", "tp", "cp", "vpp")}
            meta = check_paths([args.meta])[0] if args.meta else None
            result = import_op_table(check_paths(args.paths), opts, layout, meta)
        else:
            result = importer(args.format)(check_paths(args.paths), opts)
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(result.summary())
    return 0
