"""Summarise a store: runs, experiments, ranks, steps, time span, and the files skipped and why."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..store import Store, open_store
from ..terminal import format_table, heading, use_colour

_RUNS_SQL = """
SELECT r.run_id, r.experiment, r.source, r.world_size, r.backend, r.cluster,
       r.batch_size_per_rank AS batch_per_rank,
       (SELECT count(DISTINCT s.rank) FROM steps s WHERE s.run_id = r.run_id) AS ranks_seen,
       (SELECT count(*) FROM steps s WHERE s.run_id = r.run_id) AS step_rows
FROM runs r ORDER BY r.experiment, r.cluster, r.backend, r.batch_size_per_rank, r.world_size, r.run_id
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def summary(store: Store) -> dict[str, Any]:
    q = store.query
    runs = q(_RUNS_SQL)
    # HUGEINT: a start and a duration near the INT64 limits add up beyond them
    span = q(
        "SELECT min(start_ns) AS first_ns, max(start_ns::HUGEINT + step_ns) AS last_ns FROM steps"
    ).to_pylist()[0]
    exps = q("SELECT DISTINCT experiment FROM runs WHERE experiment IS NOT NULL ORDER BY 1")
    orphans = q("SELECT DISTINCT run_id FROM steps EXCEPT SELECT run_id FROM runs ORDER BY 1")
    return {
        "store": str(store.root),
        "experiments": exps.column("experiment").to_pylist(),
        "runs": runs.to_pylist(),
        "runs_without_metadata": orphans.column("run_id").to_pylist(),
        "rows": {name: store.row_count(name) for name in store.listing.segments},
        "files": {name: len(segs) for name, segs in store.listing.segments.items()},
        "first_step_ns": span["first_ns"],
        "last_step_end_ns": None if span["last_ns"] is None else int(span["last_ns"]),  # a Decimal
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
        print(heading(f"store {info['store']}", colour=colour))
        print(f"experiments: {', '.join(info['experiments']) or '(none)'}")
        if info["first_step_ns"] is not None and info["last_step_end_ns"] is not None:
            secs = (info["last_step_end_ns"] - info["first_step_ns"]) / 1e9
            print(f"time span of recorded steps: {secs:,.1f} s")
        rows = ", ".join(f"{k} {v:,}" for k, v in info["rows"].items() if v)
        print(f"rows: {rows or '(none)'}")
        print(f"files: {sum(info['files'].values())}")
        print()
        print(heading("runs", colour=colour))
        print(format_table(store.query(_RUNS_SQL), colour=colour))
        if info["runs_without_metadata"]:
            print(f"\nsteps without a runs row (rank 0 missing?): {', '.join(info['runs_without_metadata'])}")
        if info["skipped"]:
            print(heading(f"\nskipped {len(info['skipped'])} file(s)", colour=colour))
            for s in info["skipped"]:
                print(f"  {s['path']}: {s['reason']}")
        if info["doubtful"]:
            print(heading(f"\nread {len(info['doubtful'])} file(s) with a claim ignored", colour=colour))
            for s in info["doubtful"]:
                print(f"  {s['path']}: {s['reason']}")
    return 0
