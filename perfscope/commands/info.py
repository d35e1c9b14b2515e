"""Summarise a store: runs, experiments, ranks, steps, time span, and the files skipped and why.

Counts come from the listing (the store's manifest, or the footers), summed as columns a partition
folder at a time (store.Block): a store of 100,000 segments is summarised without reading them and
without a Python object per segment. Ranks and the time span come from each segment's column
ranges; only a run whose segments hold several ranks each, or the few segments that may hold the
last step, are read. No statement binds a parameter: DuckDB's first one imports pandas (0.3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa

from ..schema import PARTITION_KEY
from ..store import Block, Store, open_store, sql_text
from ..terminal import format_table, heading, printable, terminal_width, use_colour, wrap
from ..words import counted

_RUNS_SQL = f"""
SELECT run_id, experiment, source, world_size, backend, cluster, batch_size_per_rank AS batch_per_rank
FROM runs ORDER BY experiment, cluster, backend, batch_size_per_rank, world_size, {PARTITION_KEY}
"""


def _steps_by_run(store: Store) -> dict[str, list[Block]]:
    """The steps segments, a Block per partition folder, by run: their folder's `run_id=` value,
    decoded as DuckDB's hive partitioning decodes it."""
    by_run: dict[str, list[Block]] = {}
    for block in store.listing.blocks.get("steps", []):
        run = unquote(os.path.basename(block.folder[:-1]).partition("=")[2])
        by_run.setdefault(run, []).append(block)
    return by_run


def _ranges(blocks: list[Block], column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The smallest and largest value of `column` in each segment holding rows (in `_held` order),
    and where both are known."""
    found = [b.range_of(column) for b in blocks]
    rows = np.concatenate([b.num_rows for b in blocks]) if blocks else np.zeros(0, np.int64)
    lo, hi, ok = (np.concatenate([f[k] for f in found]) if found else np.zeros(0) for k in range(3))
    held = rows > 0
    return lo[held], hi[held], ok[held].astype(bool)


def _held(blocks: list[Block], chosen: np.ndarray) -> list[str]:
    """The files of the segments holding rows at positions `chosen` (in `_ranges` order)."""
    held = [np.flatnonzero(b.num_rows > 0) for b in blocks]
    ends = np.cumsum([len(h) for h in held])
    owners = np.searchsorted(ends, chosen, side="right")
    starts = ends - [len(h) for h in held]
    return [
        blocks[k].file(int(held[k][i - starts[k]]))
        for k, i in zip(owners.tolist(), chosen.tolist(), strict=True)
    ]


def _ranks_seen(store: Store, run_id: str, blocks: list[Block]) -> int:
    """Distinct ranks in a run's steps: from the segments' rank ranges when each holds one rank,
    else counted in the run's rows."""
    lo, hi, ok = _ranges(blocks, "rank")
    if not any(b.live for b in blocks) and ok.all() and (lo == hi).all():
        return len(np.unique(lo))
    sql = f"SELECT count(DISTINCT rank) AS n FROM steps WHERE {PARTITION_KEY} = {sql_text(run_id)}"
    return int(store.query(sql).column("n")[0].as_py())


#: start and duration bounds beyond which their sum might not fit in int64: the rows decide
_SAFE_NS = 1 << 62


def _span_ns(store: Store, blocks: list[Block]) -> tuple[int | None, int | None]:
    """The first step's start and the last step's end (start_ns + step_ns): the start from the
    segments' ranges; the end read from the few segments whose ranges allow a later end than the
    latest one found."""
    full_sql = "SELECT min(start_ns) AS first_ns, max(start_ns::HUGEINT + step_ns) AS last_ns FROM steps"
    start_lo, start_hi, start_ok = _ranges(blocks, "start_ns")
    _, step_hi, step_ok = _ranges(blocks, "step_ns")
    if (
        not len(start_lo)
        or any(b.live for b in blocks)
        or not (start_ok.all() and step_ok.all())
        or max(abs(int(start_lo.min())), abs(int(start_hi.max())), abs(int(step_hi.max()))) >= _SAFE_NS
    ):
        # HUGEINT: a start and a duration near the INT64 limits add up beyond them
        row = store.query(full_sql).to_pylist()[0]
        return row["first_ns"], None if row["last_ns"] is None else int(row["last_ns"])  # a Decimal
    first_ns = int(start_lo.min())
    bound = start_hi + step_hi

    def last_end(chosen: list[str]) -> int | None:
        files = ", ".join(sql_text(f) for f in chosen)
        sql = f"SELECT max(start_ns::HUGEINT + step_ns) AS e FROM read_parquet([{files}])"
        value = store.query(sql).column("e")[0].as_py()
        return None if value is None else int(value)

    latest = last_end(_held(blocks, bound.argmax(keepdims=True)))
    chosen = np.flatnonzero(bound >= latest) if latest is not None else bound[:0]
    if not len(chosen):  # its rows have no duration, or end past its range (an entry lying): the rows decide
        row = store.query(full_sql).to_pylist()[0]
        return first_ns, None if row["last_ns"] is None else int(row["last_ns"])
    return first_ns, last_end(_held(blocks, chosen))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def summary(store: Store) -> dict[str, Any]:
    by_run = _steps_by_run(store)
    runs = store.query(_RUNS_SQL).to_pylist()
    for r in runs:
        blocks = by_run.get(r["run_id"], [])
        r["step_rows"] = sum(int(b.num_rows.sum()) for b in blocks)
        r["ranks_seen"] = _ranks_seen(store, r["run_id"], blocks) if r["step_rows"] else 0
    first_ns, last_ns = _span_ns(store, [b for blocks in by_run.values() for b in blocks])
    known = {r["run_id"] for r in runs}
    exps = sorted({r["experiment"] for r in runs if r["experiment"] is not None})
    return {
        "store": str(store.root),
        "experiments": exps,
        "runs": runs,
        "runs_without_metadata": sorted(run for run in by_run if run not in known),
        # a run's row is written again when it ends (the latest wins): count the runs the view shows
        "rows": {
            name: len(runs) if name == "runs" else store.row_count(name) for name in store.listing.blocks
        },
        "files": {name: store.listing.count(name) for name in store.listing.blocks},
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
            missing = printable(", ".join(info["runs_without_metadata"]))
            print(f"\nsteps without a runs row (rank 0 missing?): {missing}")
        if info["skipped"]:
            print(heading(f"\nskipped {counted(len(info['skipped']), 'file')}", colour=colour))
            for s in info["skipped"]:
                print(printable(f"  {s['path']}: {s['reason']}"))
        if info["doubtful"]:
            print(
                heading(
                    f"\nread {counted(len(info['doubtful']), 'file')} with a claim ignored", colour=colour
                )
            )
            for s in info["doubtful"]:
                print(printable(f"  {s['path']}: {s['reason']}"))
    return 0


def _runs_table(runs: list[dict[str, Any]]) -> pa.Table:
    names = ["run_id", "experiment", "source", "world_size", "backend", "cluster", "batch_per_rank"]
    return pa.table({k: [r[k] for r in runs] for k in [*names, "ranks_seen", "step_rows"]})
