"""Summarise a store: runs, experiments, ranks, steps, time span, and the files skipped and why.

Counts come from the listing (the store's manifest, or the footers): a store of 100,000 segments is
summarised without reading them. Ranks and the time span come from each segment's column ranges;
only a run whose segments hold several ranks each, or the few segments that may hold the last step,
are read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from ..schema import PARTITION_KEY
from ..store import Segment, Store, open_store
from ..terminal import format_table, heading, terminal_width, use_colour, wrap
from ..words import counted

_RUNS_SQL = f"""
SELECT run_id, experiment, source, world_size, backend, cluster, batch_size_per_rank AS batch_per_rank
FROM runs ORDER BY experiment, cluster, backend, batch_size_per_rank, world_size, {PARTITION_KEY}
"""


def _steps_by_run(store: Store) -> dict[str, list[Segment]]:
    """The steps segments holding rows, by run: their folder's `run_id=` value, decoded as DuckDB's
    hive partitioning decodes it (once per folder)."""
    by_folder: dict[str, list[Segment]] = {}
    for seg in store.segments("steps"):
        if seg.num_rows:
            by_folder.setdefault(seg.file[: len(seg.file) - len(seg.name) - 1], []).append(seg)
    by_run: dict[str, list[Segment]] = {}
    for folder, segs in by_folder.items():
        by_run.setdefault(unquote(os.path.basename(folder).partition("=")[2]), []).extend(segs)
    return by_run


def _ranks_seen(store: Store, run_id: str, segs: list[Segment]) -> int:
    """Distinct ranks in a run's steps: from the segments' rank ranges when each holds one rank,
    else counted in the run's rows."""
    ranks = [s.range_of("rank") for s in segs]
    if all(r is not None and r[0] == r[1] and s.live is None for r, s in zip(ranks, segs, strict=True)):
        return len({r[0] for r in ranks if r is not None})
    sql = f"SELECT count(DISTINCT rank) AS n FROM steps WHERE {PARTITION_KEY} = ?"
    return int(store.query(sql, [run_id]).column("n")[0].as_py())


def _span_ns(store: Store, segs: list[Segment]) -> tuple[int | None, int | None]:
    """The first step's start and the last step's end (start_ns + step_ns): the start from the
    segments' ranges; the end read from the few segments whose ranges allow a later end than the
    latest one found."""
    full_sql = "SELECT min(start_ns) AS first_ns, max(start_ns::HUGEINT + step_ns) AS last_ns FROM steps"
    starts = [s.range_of("start_ns") for s in segs]
    durations = [s.range_of("step_ns") for s in segs]
    if not segs or any(s.live is not None for s in segs) or None in starts or None in durations:
        # HUGEINT: a start and a duration near the INT64 limits add up beyond them
        row = store.query(full_sql).to_pylist()[0]
        return row["first_ns"], None if row["last_ns"] is None else int(row["last_ns"])  # a Decimal
    first_ns = min(r[0] for r in starts if r is not None)
    bound = {s.file: r[1] + d[1] for s, r, d in zip(segs, starts, durations, strict=True) if r and d}

    def last_end(files: list[str]) -> int | None:
        sql = "SELECT max(start_ns::HUGEINT + step_ns) AS e FROM read_parquet(?)"
        value = store.query(sql, [files]).column("e")[0].as_py()
        return None if value is None else int(value)

    latest = last_end([max(bound, key=bound.__getitem__)])
    if latest is None:  # its rows have no duration: the rows decide
        row = store.query(full_sql).to_pylist()[0]
        return first_ns, None if row["last_ns"] is None else int(row["last_ns"])
    return first_ns, last_end([f for f, b in bound.items() if b >= latest])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def summary(store: Store) -> dict[str, Any]:
    by_run = _steps_by_run(store)
    runs = store.query(_RUNS_SQL).to_pylist()
    for r in runs:
        segs = by_run.get(r["run_id"], [])
        r["ranks_seen"] = _ranks_seen(store, r["run_id"], segs) if segs else 0
        r["step_rows"] = sum(s.num_rows for s in segs)
    first_ns, last_ns = _span_ns(store, [s for segs in by_run.values() for s in segs])
    known = {r["run_id"] for r in runs}
    exps = sorted({r["experiment"] for r in runs if r["experiment"] is not None})
    return {
        "store": str(store.root),
        "experiments": exps,
        "runs": runs,
        "runs_without_metadata": sorted(run for run in by_run if run not in known),
        # a run's row is written again when it ends (the latest wins): count the runs the view shows
        "rows": {
            name: len(runs) if name == "runs" else store.row_count(name) for name in store.listing.segments
        },
        "files": {name: len(segs) for name, segs in store.listing.segments.items()},
        "first_step_ns": first_ns,
        "last_step_end_ns": last_ns,
        "skipped": [{"path": s.path, "reason": s.reason} for s in store.skipped],
        "doubtful": [{"path": s.path, "reason": s.reason} for s in store.doubtful],
    }


def run(args: argparse.Namespace) -> int:
    with open_store(args.store, warn=False) as store:
        info = summary(store)
        if args.json:
            json.dump(info, sys.stdout, indent=2)
            print()
            return 0
        colour = use_colour()
        width = terminal_width()
        print(heading(f"store {info['store']}", colour=colour))
        print(wrap(f"experiments: {', '.join(info['experiments']) or '(none)'}", width, hang="  "))
        if info["first_step_ns"] is not None and info["last_step_end_ns"] is not None:
            secs = (info["last_step_end_ns"] - info["first_step_ns"]) / 1e9
            print(f"time span of recorded steps: {secs:,.1f} s")
        rows = ", ".join(f"{k} {v:,}" for k, v in info["rows"].items() if v)
        print(wrap(f"rows: {rows or '(none)'}", width, hang="  "))
        print(f"files: {sum(info['files'].values()):,}")
        print()
        print(heading("runs", colour=colour))
        print(format_table(_runs_table(info["runs"]), colour=colour, width=width))
        if info["runs_without_metadata"]:
            print(f"\nsteps without a runs row (rank 0 missing?): {', '.join(info['runs_without_metadata'])}")
        if info["skipped"]:
            print(heading(f"\nskipped {counted(len(info['skipped']), 'file')}", colour=colour))
            for s in info["skipped"]:
                print(f"  {s['path']}: {s['reason']}")
        if info["doubtful"]:
            print(
                heading(
                    f"\nread {counted(len(info['doubtful']), 'file')} with a claim ignored", colour=colour
                )
            )
            for s in info["doubtful"]:
                print(f"  {s['path']}: {s['reason']}")
    return 0


def _runs_table(runs: list[dict[str, Any]]) -> pa.Table:
    names = ["run_id", "experiment", "source", "world_size", "backend", "cluster", "batch_per_rank"]
    return pa.table({k: [r[k] for r in runs] for k in [*names, "ranks_seen", "step_rows"]})
