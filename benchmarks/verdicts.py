"""The verdicts on jobs with a cause of known size (issue 31): every scenario of tests/scenarios.py
recorded in two batches at the same time (each the others' noisy neighbour; the stragglers beside their
twin without a delay), `perfscope analyze --json` on each, and the first cause warning set against what
was injected, `--rounds` times, optionally beside `--burners` processes that each spin a core. Prints
the scenario table of BENCHMARKS.md: what was injected, perfscope's first finding (rule, rank, phase),
its cost per step (median and range over the rounds) against what the cause cost (a straggler: its
job's step less its twin's; a loader: the wait of the rank that waits most; an allreduce: its time;
each by the jobs' own clocks), and in how many rounds `scenarios.judge` found the verdict right.

    .venv/bin/python benchmarks/verdicts.py [--rounds 10] [--burners 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from scenarios import SCENARIOS, STRAGGLERS, analyze, expected_cost_ns, first_verdict, judge, record_all

INJECTED = {
    "forward-straggler": "rank 1 sleeps 8 ms more in every forward",
    "backward-straggler": "rank 1 sleeps 8 ms more in every backward",
    "optimizer-straggler": "rank 1 sleeps 8 ms more in every optimizer step",
    "unwatched-straggler": "rank 1 sleeps 8 ms more in every forward; no prof.watch(model)",
    "input-bound": "the Dataset sleeps 30 ms per batch, num_workers=0",
    "input-bound-workers": "the Dataset sleeps 2 ms per sample, batch 32, num_workers=2, 4 ms of work",
    "healthy": "nothing: identical ranks",
    "noisy-neighbour": "nothing, beside a process spinning a core",
    "accumulation": "nothing: identical ranks, 4 micro-batches per optimizer step (no_sync for 3)",
    "exposed-sync": "a hand-written 32 MB allreduce every step, 10 ms of work",
    "compiled": "nothing: identical ranks, torch.compile(DDP(model))",
    "tensor-parallel": "nothing: identical ranks, DTensor dp 2 x tp 2 on 4 ranks",
}


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--burners", type=int, default=0, help="processes spinning a core each during the rounds")
    ap.add_argument("--keep", type=Path, help="copy the store of every wrong verdict here, to look at")
    args = ap.parse_args()
    seen: dict[str, list[tuple[dict[str, Any] | None, float | None, list[str]]]] = {n: [] for n in SCENARIOS}
    burners = [
        mp.get_context("spawn").Process(target=_spin, args=(time.monotonic() + 3600,), daemon=True)
        for _ in range(args.burners)
    ]
    for b in burners:
        b.start()
    loads = []
    try:
        for k in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                stores = record_all(Path(tmp))
                loads.append(os.getloadavg()[0])
                for name, (store, ranks) in stores.items():
                    out = analyze(store)
                    twin = stores["healthy"][1] if name in STRAGGLERS else None
                    bad = judge(name, out, ranks, twin)
                    seen[name].append((first_verdict(out), expected_cost_ns(name, ranks, twin), bad))
                    if bad and args.keep:
                        shutil.copytree(store, args.keep / f"{name}-{k}")
            print(f"round {k + 1}/{args.rounds}: load {loads[-1]:.1f}", file=sys.stderr)
    finally:
        for b in burners:
            b.kill()
    print(
        f"{args.rounds} rounds, {args.burners} burners, load average {min(loads):.1f}-{max(loads):.1f} "
        f"on {os.cpu_count()} cores\n"
    )
    print(
        "| scenario | injected | first cause warning | cost per step (median, range) | injected cost "
        "| right |"
    )
    print("|---|---|---|---|---|---|")
    for name, rows in seen.items():
        firsts = [f for f, _, _ in rows]
        words = sorted(
            {
                f"{f['rule']}"
                + (f", rank {f['numbers']['rank']}" if f["numbers"].get("rank") is not None else "")
                + (f", {f['numbers']['phase']}" if f["numbers"].get("phase") else "")
                if f
                else "none"
                for f in firsts
            }
        )
        costs = [
            f["numbers"]["cost_ns"] / 1e6 for f in firsts if f and f["numbers"].get("cost_ns") is not None
        ]
        want = [w / 1e6 for _, w, _ in rows if w is not None]
        cost = f"{statistics.median(costs):.1f} ms ({min(costs):.1f}-{max(costs):.1f})" if costs else "-"
        wanted = f"{statistics.median(want):.1f} ms" if want else "-"
        right = sum(1 for _, _, bad in rows if not bad)
        print(f"| {name} | {INJECTED[name]} | {'; '.join(words)} | {cost} | {wanted} | {right}/{len(rows)} |")
        for _, _, bad in rows:
            for b in bad:
                print(f"    {name}: {b}", file=sys.stderr)


if __name__ == "__main__":
    main()
