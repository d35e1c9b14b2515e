"""Writer benchmark: step rows per second end to end, and the writer's memory over a long run.

    .venv/bin/python benchmarks/writer.py [--rows 10000000] [--short 1000000] [--repeats 3]

Throughput is measured from the first `append` to the return of `close()` (every row encoded and
renamed into place), against a baseline measured in the same run: the same loop building the same
tuples into a plain list. Memory is the process RSS sampled every million rows; a writer with a
bounded buffer keeps it flat however long the run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import psutil

from perfscope.store import open_store
from perfscope.writer import StoreWriter


def _row(i: int) -> tuple[object, ...]:
    return (0, i, 1_700_000_000_000_000_000 + i * 2_000_000, 2_000_000, 1, 2, 3, 4, 5, 6, 7, 1, 32, "host")


def baseline(n: int) -> float:
    sink: list[tuple[object, ...]] = []
    t0 = time.perf_counter()
    for i in range(n):
        sink.append(_row(i))
    return time.perf_counter() - t0


def writer_run(n: int, root: Path, *, sample_every: int = 1_000_000) -> tuple[float, list[tuple[int, int]]]:
    proc = psutil.Process()
    rss: list[tuple[int, int]] = [(0, proc.memory_info().rss)]
    w = StoreWriter(root, "bench", roll_interval_s=1.0)
    t0 = time.perf_counter()
    for i in range(n):
        w.append("steps", _row(i))
        if i and i % sample_every == 0:
            rss.append((i, proc.memory_info().rss))
    w.close()
    dt = time.perf_counter() - t0
    rss.append((n, proc.memory_info().rss))
    if w.stats.rows_written != n:
        raise SystemExit(f"wrote {w.stats.rows_written} of {n} rows")
    return dt, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--short", type=int, default=1_000_000, help="rows of the throughput runs")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="perfscope-bench-"))
    try:
        base, mine = [], []
        for r in range(args.repeats):  # interleaved so drift hits both alike
            base.append(baseline(args.short))
            dt, _ = writer_run(args.short, tmp / f"s{r}")
            mine.append(dt)
            shutil.rmtree(tmp / f"s{r}")
        b, m = min(base), min(mine)
        dt, rss = writer_run(args.rows, tmp / "long")
        with open_store(tmp / "long") as store:
            got = store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py()
        assert got == args.rows, got
        print("| measure | value |")
        print("|---|---|")
        print(f"| baseline: build {args.short:,} step tuples into a list | {args.short / b:,.0f} rows/s |")
        print(f"| StoreWriter.append + close, {args.short:,} step rows | {args.short / m:,.0f} rows/s |")
        print(f"| writer time / baseline time | {m / b:.2f}x |")
        print(f"| long run: {args.rows:,} rows, append + close | {args.rows / dt:,.0f} rows/s |")
        first = rss[1][1] if len(rss) > 2 else rss[0][1]
        print(f"| RSS after first 1M rows | {first / 2**20:,.0f} MiB |")
        print(f"| peak RSS over the long run | {max(v for _, v in rss) / 2**20:,.0f} MiB |")
        print(f"| RSS at end ({args.rows:,} rows) | {rss[-1][1] / 2**20:,.0f} MiB |")
        print()
        print("RSS by rows appended: " + ", ".join(f"{i / 1e6:.0f}M={v / 2**20:.0f}MiB" for i, v in rss))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
