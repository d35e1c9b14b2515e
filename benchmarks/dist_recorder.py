"""Cost of the torch.distributed recorder per call: small gloo collectives in a one-rank process
group, bare and inside perfscope.profile, interleaved in blocks, each round in a rotated order.

    .venv/bin/python benchmarks/dist_recorder.py [--rounds 10] [--calls 2000]

A one-rank group keeps the network out: what is left is the call itself (microseconds), so the
difference is the recorder's wrapper (argument binding, one comm row, the Work wrapper for async
calls). The result is a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import perfscope


def calls(kind: str) -> Callable[[torch.Tensor], None]:
    if kind == "all_reduce":
        return lambda t: dist.all_reduce(t)
    if kind == "all_reduce async + wait":
        return lambda t: dist.all_reduce(t, async_op=True).wait()
    if kind == "broadcast":
        return lambda t: dist.broadcast(t, 0)
    raise ValueError(kind)


def block_us(fn: Callable[[torch.Tensor], None], n: int, t: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(t)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(16)
    kinds = ["all_reduce", "all_reduce async + wait", "broadcast"]
    store = Path(tempfile.mkdtemp(prefix="perfscope-bench-dist-"))
    bare: dict[str, list[float]] = {k: [] for k in kinds}
    rec: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        warnings.simplefilter("ignore")
        for r in range(args.rounds):
            for k in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                fn = calls(k)
                bare[k].append(block_us(fn, args.calls, t))
                with perfscope.profile(store, experiment="bench", poll_hz=0, gpu_telemetry=False) as prof:
                    # one step per 100 calls, as a training step with many collectives would
                    per = 100
                    t0 = time.perf_counter()
                    for _ in range(args.calls // per):
                        for _ in range(per):
                            fn(t)
                        prof.step()
                    rec[k].append((time.perf_counter() - t0) / (args.calls // per * per) * 1e6)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)
    load = os.getloadavg()[0]
    print(
        f"One-rank gloo group, 16-float tensor, {args.rounds} rounds x {args.calls} calls; "
        f"load average {load:.1f}."
    )
    print()
    print("| call | bare (median µs) | recorded (median µs) | added per call (median of round differences) |")
    print("|---|---|---|---|")
    for k in kinds:
        diff = statistics.median(a - b for a, b in zip(rec[k], bare[k], strict=True))
        print(
            f"| {k} | {statistics.median(bare[k]):.1f} | {statistics.median(rec[k]):.1f} | {diff:+.1f} µs |"
        )


if __name__ == "__main__":
    main()
