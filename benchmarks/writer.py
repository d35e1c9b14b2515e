"""Writer benchmark: step rows per second end to end and the writer's memory over a long run, for
today's writer (live Arrow IPC segments) and the one of commit fc72bec (a Parquet segment per roll),
loaded from git beside it and run interleaved in one process.

    .venv/bin/python benchmarks/writer.py [--rows 10000000] [--short 1000000] [--repeats 3]
    .venv/bin/python benchmarks/writer.py --encoding   # Parquet encoding CPU by dictionary choice

Throughput is measured from the first `append` to the return of `close()` (every row on disk,
sealed into Parquet and merged where the writer does that), against a baseline measured in the same
run: the same loop building the same tuples into a plain list. The long run is split: rows/s until
`flush()` returns (every row on disk and readable, what a SIGKILL would keep), then `close()`.
Memory is the process RSS sampled every million rows; a writer with a bounded buffer keeps it flat
however long the run. Files: what
each writer left in the store.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pyarrow.parquet as pq

from perfscope.store import writer as new_writer
from perfscope.store.live import ROW_GROUP_ROWS, dictionary_columns
from perfscope.store.open import open_store

OLD_COMMIT = "fc72bec"


def old_writer_module() -> ModuleType:
    """perfscope/writer.py of OLD_COMMIT, imported as a module of the perfscope package."""
    src = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:perfscope/writer.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="perfscope-old-writer-")) / "writer_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"perfscope._writer_{OLD_COMMIT}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row(i: int) -> tuple[object, ...]:
    return (0, i, 1_700_000_000_000_000_000 + i * 2_000_000, 2_000_000, 1, 2, 3, 4, 5, 6, 7, 1, 32, "host")


def _varied_row(i: int, rnd: random.Random) -> tuple[object, ...]:
    """A step row as a job writes it: phase times that vary from step to step."""
    phases = [rnd.randrange(lo, lo + 100_000) for lo in (50_000, 800_000, 1_500_000, 0, 200_000, 10_000)]
    start = 1_700_000_000_000_000_000 + i * 2_900_000 + rnd.randrange(1000)
    return (3, i, start, sum(phases), *phases, rnd.randrange(100_000, 200_000), 12, 64, "host")


def encoding(rows: int, repeats: int) -> None:
    """CPU time of one Parquet row group of `rows` step rows (snappy), every column offered a
    dictionary (pyarrow's default) against the writer's choice (perfscope.store.live.dictionary_columns)."""
    rnd = random.Random(1)
    tables = {
        "benchmark rows": new_writer.rows_to_table("steps", [_row(i) for i in range(rows)]),
        "varied phase times": new_writer.rows_to_table("steps", [_varied_row(i, rnd) for i in range(rows)]),
    }
    choices: dict[str, Any] = {"every column": True, "dictionary_columns": None}
    print(f"| rows | dictionaries | CPU ns per row (best of {repeats}) | bytes per row |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="perfscope-bench-") as tmp:
        out = Path(tmp) / "group.parquet"
        for kind, table in tables.items():
            for label, use in choices.items():
                use = dictionary_columns(table.schema) if use is None else use
                best = float("inf")
                for _ in range(repeats):
                    c0 = time.process_time()
                    pq.write_table(table, out, compression="snappy", use_dictionary=use)
                    best = min(best, time.process_time() - c0)
                size = out.stat().st_size
                print(f"| {kind} | {label} | {best / rows * 1e9:,.0f} | {size / rows:.1f} |")


def baseline(n: int) -> float:
    sink: list[tuple[object, ...]] = []
    t0 = time.perf_counter()
    for i in range(n):
        sink.append(_row(i))
    return time.perf_counter() - t0


def writer_run(
    module: Any, n: int, root: Path, *, sample_every: int = 1_000_000
) -> tuple[float, float, list[tuple[int, int]], float]:
    """Seconds from the first append until every row is on disk and readable (`flush`), seconds of
    `close` after that (sealing, merging), the RSS samples, and the process's CPU seconds until
    `flush` returned (both threads: what a loaded machine inflates least)."""
    proc = psutil.Process()
    rss: list[tuple[int, int]] = [(0, proc.memory_info().rss)]
    w = module.StoreWriter(root, "bench", roll_interval_s=1.0)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        w.append("steps", _row(i))
        if i and i % sample_every == 0:
            rss.append((i, proc.memory_info().rss))
    w.flush()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    w.close()
    close_s = time.perf_counter() - t0 - dt
    rss.append((n, proc.memory_info().rss))
    if w.stats.rows_written != n:
        raise SystemExit(f"wrote {w.stats.rows_written} of {n} rows")
    return dt, close_s, rss, cpu


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--short", type=int, default=1_000_000, help="rows of the throughput runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--encoding",
        action="store_true",
        help="only the Parquet encoding of a 131,072-row group, by dictionary choice",
    )
    args = ap.parse_args()
    if args.encoding:
        print(f"load average: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")
        encoding(ROW_GROUP_ROWS, max(args.repeats, 5))
        return
    writers = {f"{OLD_COMMIT} (Parquet per roll)": old_writer_module(), "live IPC segments": new_writer}
    tmp = Path(tempfile.mkdtemp(prefix="perfscope-bench-"))
    load = os.getloadavg()
    try:
        base: list[float] = []
        short: dict[str, list[float]] = {k: [] for k in writers}
        for r in range(args.repeats):  # interleaved, order alternating, so drift hits all alike
            base.append(baseline(args.short))
            for name in list(writers)[:: 1 if r % 2 == 0 else -1]:
                dt, close_s, _, _ = writer_run(writers[name], args.short, tmp / f"s{r}")
                short[name].append(dt + close_s)
                shutil.rmtree(tmp / f"s{r}")
        b = min(base)
        print(f"load average at the start: {' / '.join(f'{x:.1f}' for x in load)} (1, 5, 15 min)")
        print(f"baseline: build {args.short:,} step tuples into a list: {args.short / b:,.0f} rows/s")
        print()
        print(
            f"| writer | rows/s to close, {args.short:,} rows (best of {args.repeats}) | x baseline time "
            f"| rows/s to durable, {args.rows:,} rows | CPU µs per row to durable | close after that "
            "| RSS first 1M / peak / end | files left |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, module in writers.items():
            dt, close_s, rss, cpu = writer_run(module, args.rows, tmp / "long")
            with open_store(tmp / "long") as store:
                got = store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py()
            assert got == args.rows, got
            m = min(short[name])
            first = rss[1][1] if len(rss) > 2 else rss[0][1]
            peak, end = max(v for _, v in rss), rss[-1][1]
            mib = f"{first / 2**20:,.0f} / {peak / 2**20:,.0f} / {end / 2**20:,.0f} MiB"
            print(
                f"| {name} | {args.short / m:,.0f} | {m / b:.2f}x | {args.rows / dt:,.0f} "
                f"| {cpu / args.rows * 1e6:.2f} | {close_s:.1f} s | {mib} | {_files(tmp / 'long')} |"
            )
            shutil.rmtree(tmp / "long")
        print()
        print(f"load average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
