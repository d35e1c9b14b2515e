"""Merge a store's small finished segments into large files; safe while jobs write and readers read."""

from __future__ import annotations

import argparse
import math

from ..errors import PerfscopeError
from ..store.compact import compact
from ..store.objectstore import refuse_s3
from ..words import counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument("--dry-run", action="store_true", help="say what would be merged, change nothing")
    p.add_argument(
        "--grace",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="keep replaced segments this long after the merged files appear, so readers that "
        "listed the store just before finish their query (default 1)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.grace < math.inf:  # also refuses nan
        raise PerfscopeError(f"--grace must be a finite number of seconds, 0 or more; got {args.grace}")
    refuse_s3(args.store, "perfscope compact")
    r = compact(args.store, dry_run=args.dry_run, grace_s=args.grace)
    verb = "would merge" if args.dry_run else "merged"
    print(
        f"{verb} {counted(r.files_merged, 'segment')} in {counted(r.partitions, 'partition')} "
        f"({counted(r.rows, 'row')})"
    )
    if not args.dry_run:
        print(
            f"wrote {counted(r.files_written, 'file')}, removed {r.files_removed}; "
            f"{r.bytes_before / 1e6:.2f} MB -> {r.bytes_after / 1e6:.2f} MB"
        )
    for path in r.live_sealed:
        print(f"sealed {path} (a killed writer's live segment)")
    for path in r.leftovers_removed:
        print(f"removed leftover {path} (a killed writer's, compaction's or query's)")
    for s in r.skipped:
        print(f"left alone {s.path}: {s.reason}")
    return 0
