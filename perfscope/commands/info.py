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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..store.listing import Block, sql_text
from ..store.open import open_store
from ..store.reader import Store
from ..store.schema import PARTITION_KEY
from ..terminal import format_table, heading, printable, terminal_width, use_colour, wrap
from ..words import counted

T = TypeVar("T")

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
    """Distinct ranks in a run's steps: from the segments' rank ranges where a segment holds one
    rank, and from the rank column of the others (several ranks, no range, live rows)."""
    lo, hi, ok = _ranges(blocks, "rank")
    read = ~ok | (lo != hi)
    live = _live_rows(blocks)
    if live:
        read |= np.isin(np.array(_held(blocks, np.arange(len(lo))), dtype=object), list(live))
    ranks = set(np.unique(lo[~read]).tolist())
    try:
        for found in _each(lambda f: _ranks_in(f, live), _held(blocks, np.flatnonzero(read))):
            ranks |= found
    except (OSError, pa.ArrowException):  # a file compacted away or unreadable meanwhile: the store decides
        sql = f"SELECT count(DISTINCT rank) AS n FROM steps WHERE {PARTITION_KEY} = {sql_text(run_id)}"
        return int(store.query(sql).column("n")[0].as_py())
    return len(ranks)


def _each(fn: Callable[[str], T], files: list[str]) -> list[T]:
    """`fn` of each file, in order: several files read at once in threads (pyarrow reads without
    the GIL), one in this thread (threads cost their memory arenas: 10 MB on every `info`)."""
    if len(files) <= 1:
        return [fn(f) for f in files]
    with ThreadPoolExecutor(_READERS) as pool:
        return list(pool.map(fn, files))


def _live_rows(blocks: list[Block]) -> dict[str, pa.Table]:
    """The live segments' rows as the listing read them, by file."""
    return {s.file: s.live for b in blocks if b.live for s in b.segments() if s.live is not None}


#: rows read at a time from a file: a compacted file of a billion rows is read in bounded memory
_BATCH_ROWS = 1 << 20


def _read(file: str, live: dict[str, pa.Table], columns: tuple[str, ...]) -> Iterator[pa.Table]:
    """`columns` of a segment (those it has), in batches, or of a live segment's rows as the listing
    read them."""
    table = live.get(file)
    if table is not None:
        yield table.select([c for c in columns if c in table.column_names])
        return
    with pq.ParquetFile(file) as f:
        present = [c for c in columns if c in f.schema_arrow.names]
        for batch in f.iter_batches(batch_size=_BATCH_ROWS, columns=present):
            yield pa.Table.from_batches([batch])


def _ranks_in(file: str, live: dict[str, pa.Table]) -> set[int]:
    import pyarrow.compute as pc  # only when a file is read: its import costs 10 MB on every open

    ranks: set[int] = set()
    for table in _read(file, live, ("rank",)):
        if "rank" in table.column_names:
            ranks |= set(pc.unique(table.column("rank")).drop_null().to_pylist())
    return ranks


#: start and duration bounds beyond which their sum might not fit in int64: the rows decide
_SAFE_NS = 1 << 62
#: files read at once while looking for the last step's end (pyarrow reads them without the GIL)
_READERS = 8


def _file_span(file: str, live: dict[str, pa.Table]) -> tuple[int | None, int | None]:
    """A steps segment's earliest start and latest end (start_ns + step_ns, as Python ints: beyond
    int64 for hostile values), from its two columns (a live segment's rows as the listing read them)."""
    import pyarrow.compute as pc

    first: int | None = None
    last: int | None = None
    for table in _read(file, live, ("start_ns", "step_ns")):
        if "start_ns" not in table.column_names:
            return None, None
        start = table.column("start_ns")
        lo = pc.min(start).as_py()
        first = lo if first is None or (lo is not None and lo < first) else first
        if "step_ns" not in table.column_names:
            continue
        try:
            hi = pc.max(pc.add_checked(start, table.column("step_ns"))).as_py()
        except pa.ArrowInvalid:  # overflow: the same sum in Python's integers
            ends = [s + d for s, d in zip(start.to_pylist(), table.column("step_ns").to_pylist(), strict=True)
                    if s is not None and d is not None]  # fmt: skip
            hi = max(ends, default=None)
        last = hi if last is None or (hi is not None and hi > last) else last
    return first, last


def _span_ns(store: Store, blocks: list[Block]) -> tuple[int | None, int | None]:
    """The first step's start and the last step's end (start_ns + step_ns), from what the listing
    knows: each segment's start_ns and step_ns ranges (the manifest's, or the footers'). The start is
    the smallest start range; a segment's ends are at most its start_ns maximum plus its step_ns
    maximum, so the end is read from the segments in the order of that bound, a few at a time, until
    no segment left can end later than the latest end found: one or a few files of 100,000, however
    the segments lie in time. A segment without ranges (a live one, no footer statistics, values near
    the int64 limits) is read whole; ranges the rows contradict (a lying manifest entry) leave the
    answer to the rows (one query over every file)."""
    full_sql = "SELECT min(start_ns) AS first_ns, max(start_ns::HUGEINT + step_ns) AS last_ns FROM steps"

    def from_rows() -> tuple[int | None, int | None]:
        row = store.query(full_sql).to_pylist()[0]
        return row["first_ns"], None if row["last_ns"] is None else int(row["last_ns"])  # a Decimal

    start_lo, start_hi, start_ok = _ranges(blocks, "start_ns")
    _, step_hi, step_ok = _ranges(blocks, "step_ns")
    if not len(start_lo):
        return None, None
    live = _live_rows(blocks)
    safe = np.maximum(np.abs(start_lo), np.abs(start_hi)) < _SAFE_NS
    known = start_ok & step_ok & safe & (np.abs(step_hi) < _SAFE_NS)
    if live:  # a live segment's rows may grow past its ranges: read them as the listing holds them
        known &= ~np.isin(np.array(_held(blocks, np.arange(len(start_lo))), dtype=object), list(live))
    bound = np.where(known, start_hi + np.where(known, step_hi, 0), 0)
    first: int | None = int(start_lo[start_ok & safe].min()) if (start_ok & safe).any() else None
    last: int | None = None
    # the segments that must be read whatever the others say, then the rest by their bound
    must = int((~known).sum())
    order = np.concatenate(
        [np.flatnonzero(~known), np.flatnonzero(known)[np.argsort(-bound[known], kind="stable")]]
    )
    pos = 0
    try:
        while pos < len(order):
            if pos >= must and last is not None and int(bound[order[pos]]) <= last:
                break  # no segment left can end later
            batch = order[pos : pos + (1 if pos == must == 0 else _READERS)]  # mostly one file is enough
            pos += len(batch)
            spans = _each(lambda f: _file_span(f, live), _held(blocks, batch))
            for i, (lo, hi) in zip(batch.tolist(), spans, strict=True):
                if known[i] and ((lo is not None and lo < start_lo[i]) or (hi is not None and hi > bound[i])):
                    return from_rows()  # the ranges lie about this file's rows
                if lo is not None and (first is None or lo < first):
                    first = lo
                if hi is not None and (last is None or hi > last):
                    last = hi
    except (OSError, pa.ArrowException):  # a file compacted away or unreadable meanwhile: the store decides
        return from_rows()
    return first, last


#: Segments (files) beyond which `perfscope analyze` cannot answer within a minute: every query of
#: its analyses opens every file of the tables it reads (20,000 small segments took 408 s and 2.9 GB,
#: 2,000 took 32 s, on the shared 2-core machine, BENCHMARKS.md "Opening a store nobody has opened
#: before"); `perfscope compact` merges each partition's segments into one file first.
ANALYZE_MAX_SEGMENTS = 10_000
#: `perfscope compact`'s wall time per segment merged, measured on that machine (100,000 one-run
#: segments, BENCHMARKS.md): the estimate compact_first gives.
COMPACT_S_PER_SEGMENT = 0.003


def compact_first(store: Store, run_ids: tuple[str, ...] = ()) -> str | None:
    """One line saying to run `perfscope compact` first, and about how long it will take, when the
    store (the runs `run_ids`, when given) holds more than ANALYZE_MAX_SEGMENTS segments; else None.
    Counted from the listing: nothing is read."""
    wanted = set(run_ids)
    n = sum(
        len(block)
        for blocks in store.listing.blocks.values()
        for block in blocks
        if not wanted or unquote(os.path.basename(block.folder[:-1]).partition("=")[2]) in wanted
    )
    if n <= ANALYZE_MAX_SEGMENTS:
        return None
    minutes = n * COMPACT_S_PER_SEGMENT / 60
    took = f"about {max(1, round(minutes))} minute{'s' if round(minutes) > 1 else ''}"
    return (
        f"{store.root} holds {n:,} segments, too many small files to analyse within a minute: run "
        f"`perfscope compact {store.root}` first ({took} on a 2-core machine; it merges them, once), "
        "then analyze again"
    )


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
