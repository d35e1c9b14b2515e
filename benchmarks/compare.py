"""Time and peak memory of `perfscope compare` on two stores of about 1 M step rows each (issue 34).

    .venv/bin/python benchmarks/compare.py                 # 1e6 step rows per store under /tmp
    .venv/bin/python benchmarks/compare.py --rows 2e6 --keep --dir /tmp/bench-compare

Each store holds one run of WORLD ranks (8) written by perfscope's own segment writer: step rows with
realistic phase times and noise (benchmarks/analysis.py's generator) and one allreduce `comm` row per
rank and step (so the by-collective table reads as many comm rows as step rows). The candidate's rank 3
computes 1 ms more in every forward, and the other ranks wait for it in their exposed sync. Measured in
a fresh process (`perfscope compare BASE CAND --json`): wall time, CPU time and peak RSS of the child
(os.wait4 through RUSAGE_CHILDREN); the benchmark checks the verdict is `slower` with rank 3 and
forward named, so a fast wrong answer does not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from analysis import ROW_GROUP, _measure, _steps_table, _write_meta

from perfscope.store.schema import TABLES
from perfscope.store.segments import write_segment
from perfscope.store.writer import segment_dir

WORLD = 8
SLOW_RANK = 3
EXTRA_NS = 1_000_000


def _comm_table(steps: pa.Table) -> pa.Table:
    """One allreduce of 100 MB per rank and step, entered as its forward ends, its wait in dur_ns."""
    m = steps.num_rows
    start = steps["start_ns"].to_numpy() + steps["forward_ns"].to_numpy()
    cols = {
        "rank": steps["rank"].to_numpy(),
        "step": steps["step"].to_numpy(),
        "seq": np.zeros(m, np.int32),
        "op": pa.array(["allreduce"] * m),
        "bucket": np.zeros(m, np.int32),
        "bytes": np.full(m, 100_000_000, np.int64),
        "start_ns": start,
        "dur_ns": steps["sync_exposed_ns"].to_numpy() * 2,
        "clock": pa.array(["cuda"] * m),
        "group_size": np.full(m, WORLD, np.int32),
    }
    schema = TABLES["comm"].arrow_schema
    arrays = [pa.array(cols[f.name], type=f.type) if f.name in cols else pa.nulls(m, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def write_store(root: Path, rows: int, *, slow: bool, seed: int) -> int:
    """One run of WORLD ranks and rows // WORLD steps; with `slow`, rank SLOW_RANK's forward is
    EXTRA_NS longer and every other rank waits that long in its exposed sync."""
    rng = np.random.default_rng(seed)
    steps = rows // WORLD
    t = _steps_table(rng, WORLD, steps, 32, 1.0)
    if slow:
        rank = t["rank"].to_numpy()
        fwd = t["forward_ns"].to_numpy() + np.where(rank == SLOW_RANK, EXTRA_NS, 0)
        sync = t["sync_exposed_ns"].to_numpy() + np.where(rank == SLOW_RANK, 0, EXTRA_NS)
        step = t["step_ns"].to_numpy() + EXTRA_NS
        per_step = step.reshape(steps, WORLD).max(axis=1)
        start = t["start_ns"].to_numpy()[0] + np.repeat(
            np.concatenate([[0], np.cumsum(per_step)[:-1]]), WORLD
        )
        for name, values in (
            ("forward_ns", fwd),
            ("sync_exposed_ns", sync),
            ("step_ns", step),
            ("start_ns", start),
        ):
            i = t.schema.get_field_index(name)
            t = t.set_column(i, t.schema.field(i), pa.array(values, type=t.schema.field(i).type))
    run_id = "cand" if slow else "base"
    for table, data in (("steps", t), ("comm", _comm_table(t))):
        d = segment_dir(root, table, run_id)
        d.mkdir(parents=True, exist_ok=True)
        write_segment(d / "bench-000001.parquet", data, row_group_size=ROW_GROUP)
    _write_meta(root, run_id, WORLD, 1, "nccl", "bench", 32)
    return t.num_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=float, default=1e6, help="step rows per store (default 1e6)")
    p.add_argument("--dir", type=Path, help="where to write the stores (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the stores")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument("--repeat", type=int, default=1, help="runs of the command; the fastest is reported")
    args = p.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="perfscope-bench-compare-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        n_base = write_store(root / "base", int(args.rows), slow=False, seed=0)
        n_cand = write_store(root / "cand", int(args.rows), slow=True, seed=1)
        written_s = time.perf_counter() - t
        cmd = [sys.executable, "-m", "perfscope", "compare", str(root / "base"), str(root / "cand"), "--json"]
        runs = [_measure(cmd) for _ in range(max(1, args.repeat))]
        best = min(runs, key=lambda r: float(r["wall_s"]))
        out = json.loads(best["stdout"])
        ok = (
            out["verdict"] == "slower"
            and out["culprit"]["rank"] == SLOW_RANK
            and out["culprit"]["phase"] == "forward"
        )
        result = {
            "step_rows": [n_base, n_cand],
            "world_size": WORLD,
            "write_s": round(written_s, 1),
            "wall_s": round(float(best["wall_s"]), 2),
            "cpu_s": round(float(best["cpu_s"]), 2),
            "peak_rss_mb": round(float(best["peak_rss_mb"])),
            "verdict": out["verdict"],
            "step_ratio": out["step_ratio"],
            "ci": out["ci"],
            "culprit": out["culprit"],
            "right_answer": ok,
        }
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            load = os.getloadavg()[0]
            print(f"| measure (two stores of {n_base:,} step and comm rows, {WORLD} ranks) | value |")
            print("|---|---|")
            print(f"| `perfscope compare --json`, wall (fastest of {len(runs)}) | {result['wall_s']} s |")
            print(f"| CPU time (user + system) | {result['cpu_s']} s |")
            print(f"| peak RSS | {result['peak_rss_mb']} MB |")
            lo, hi = out["ci"]
            print(
                f"| verdict, ratio, interval | {out['verdict']}, {out['step_ratio']:.4f}, {lo:.4f}-{hi:.4f} |"
            )
            print(
                f"| culprit (injected: rank {SLOW_RANK}, forward) | rank {out['culprit']['rank']}, "
                f"{out['culprit']['phase']} |"
            )
            print(f"| load average (1 min) at the end | {load:.1f} |")
        return 0 if ok else 1
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
