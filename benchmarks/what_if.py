"""Time and peak RSS of `perfscope import op-table` and `perfscope analyze` on synthetic 3D-parallel op
tables (issue 23: "a 128-rank, 250,000-op trace imported and analysed in seconds").

    .venv/bin/python benchmarks/what_if.py                        # 16 and 128 ranks, ~250k ops at 128
    .venv/bin/python benchmarks/what_if.py --layouts 2x8,16x8 --ops 250000 --dir /tmp/bench-what-if --keep

A layout DPxPP is a GPipe job of DP data-parallel ranks by PP pipeline stages (tp = cp = 1), written by
tests/analysis/test_what_if.py's `synthetic` (the op table of the straggler study's schema, Megatron-LM's op
names: forward/backward compute per micro-batch, blocking forward/backward send and recv between
stages, a reduce-scatter per stage over its dp group, the gradient-norm all-reduce, the optimizer),
with its last stage 20% longer (so the analysis has a cause to find: stage-imbalance). The number of
steps is chosen so that the largest layout holds about --ops operations; every other layout gets the
same steps, so that its ops scale with its ranks (the simulation is to be linear in the ops).

Each command runs as the only child of a fresh Python (benchmarks/analysis.py's `_measure`): wall
time, CPU time (user + system, steadier than wall on a shared machine) and peak RSS. Three commands
per layout: `perfscope import op-table`, `perfscope analyze --json` (every analysis and the
findings), and the what_if analysis alone in a fresh process (its wall and CPU time the analysis
call's only; its peak RSS the whole process's, Python, the imports and the open store included).
Not part of the test suite.
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
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "analysis"))  # tests/rooms.py
from analysis import _measure  # the benchmarks' one timer
from test_what_if import synthetic  # the GPipe op-table generator of the what-if tests

MICRO = 8
SLOW = 1.2

WHAT_IF_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from perfscope.analysis import Selection, run_analysis
from perfscope.store import open_store
with open_store(sys.argv[1]) as s:
    t1, c1 = time.perf_counter(), time.process_time()
    (row,) = run_analysis("what_if", s, Selection()).to_pylist()
    t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"open_s": t1 - t0, "what_if_s": t2 - t1, "what_if_cpu_s": c2 - c1,
                  "slowdown": row["slowdown"], "cause": row["cause"], "replay_error": row["replay_error"],
                  "top_stage": row["by_stage"][0]["stage"]}))
"""


def write_job(path: Path, dp: int, pp: int, steps: int) -> int:
    """Write the layout's op table; returns its rows."""
    slow = {(d, pp - 1): SLOW for d in range(dp)}
    table = synthetic(dp, pp, m=MICRO, steps=steps, slow=slow, seed=dp * 1000 + pp)
    pq.write_table(table, path, compression="zstd")
    return table.num_rows


def bench(work: Path, dp: int, pp: int, steps: int) -> dict[str, Any]:
    src = work / f"ops-{dp}x{pp}.parquet"
    store = work / f"store-{dp}x{pp}"
    shutil.rmtree(store, ignore_errors=True)
    t = time.perf_counter()
    rows = write_job(src, dp, pp, steps)
    gen_s = time.perf_counter() - t
    py = sys.executable
    imp = _measure(
        [
            py,
            "-m",
            "perfscope",
            "import",
            "op-table",
            str(src),
            "--dp",
            str(dp),
            "--pp",
            str(pp),
            "--store",
            str(store),
        ]
    )
    ana = _measure([py, "-m", "perfscope", "analyze", str(store), "--json"])
    (w,) = json.loads(ana["stdout"])["what_if"]
    alone = _measure([py, "-c", WHAT_IF_CHILD, str(store)])
    inner = json.loads(alone["stdout"].strip().splitlines()[-1])
    return {
        "ranks": dp * pp,
        "layout": f"dp {dp} x pp {pp}",
        "steps": steps,
        "ops": rows,
        "mb": src.stat().st_size / 1e6,
        "gen_s": gen_s,
        "import": imp,
        "analyze": ana,
        "what_if": {**inner, "peak_rss_mb": alone["peak_rss_mb"], "cpu_s": alone["cpu_s"]},
        "cause": w["cause"],
        "slowdown": w["slowdown"],
        "replay_error": w["replay_error"],
    }


def ops_per_step(dp: int, pp: int) -> int:
    return synthetic(dp, pp, m=MICRO, steps=1).num_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x8,16x8", help="DPxPP,... (default 2x8,16x8: 16 and 128 ranks)")
    ap.add_argument("--ops", type=int, default=250_000, help="ops of the largest layout (default 250000)")
    ap.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the op tables and stores")
    args = ap.parse_args(argv)
    layouts = [tuple(int(x) for x in s.lower().split("x")) for s in args.layouts.split(",")]
    dp_max, pp_max = max(layouts, key=lambda lp: lp[0] * lp[1])
    steps = max(1, round(args.ops / ops_per_step(dp_max, pp_max)))
    work = args.dir or Path(tempfile.mkdtemp(prefix="perfscope-what-if-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} CPUs, load average {load:.1f} at start; python {sys.version.split()[0]}")
    print(
        "| ranks (layout) | steps | ops | Parquet MB | import wall s | import CPU s | import peak MB "
        "| analyze wall s | analyze CPU s | analyze peak MB | what_if call wall s / CPU s (process peak MB) "
        "| what_if CPU µs per op | "
        "slowdown, cause (replay error) | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for dp, pp in layouts:
            r = bench(work, dp, pp, steps)
            i, a, w = r["import"], r["analyze"], r["what_if"]
            print(
                f"| {r['ranks']} ({r['layout']}) | {r['steps']} | {r['ops']:,} | {r['mb']:.1f} | "
                f"{i['wall_s']:.1f} | {i['cpu_s']:.1f} | {i['peak_rss_mb']:.0f} | "
                f"{a['wall_s']:.1f} | {a['cpu_s']:.1f} | {a['peak_rss_mb']:.0f} | "
                f"{w['what_if_s']:.2f} / {w['what_if_cpu_s']:.2f} ({w['peak_rss_mb']:.0f}) | "
                f"{w['what_if_cpu_s'] / r['ops'] * 1e6:.1f} | "
                f"{r['slowdown']:.3f}, {r['cause']} ({r['replay_error']:.4f}) | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(work / f"store-{dp}x{pp}", ignore_errors=True)
                (work / f"ops-{dp}x{pp}.parquet").unlink(missing_ok=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
