"""Export time of `perfscope report` on the bundled sample traces and on a large synthetic store.

    .venv/bin/python benchmarks/report.py                    # sample traces + a 1e7-row store
    .venv/bin/python benchmarks/report.py --rows 1e6 --keep --dir /tmp/bench-report

Each export runs as its own `perfscope report` process (HTML, then Markdown with PNGs); the table
gives wall time, CPU time (user + system, steadier under other load), peak RSS and output size. The
large store comes from the analysis benchmark's generator (benchmarks/analysis.py: 8 configurations
x world sizes 1..64, step rows only, 1M-row row groups).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis import _measure, generate  # the analysis benchmark's store and timer

from perfscope import sample_traces


def _size_mb(paths: list[Path]) -> float:
    total = 0
    for p in paths:
        if p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        elif p.exists():
            total += p.stat().st_size
    return total / 2**20


def export(store: Path, out: Path, fmt: str) -> dict[str, Any]:
    target = out / f"report.{fmt}"
    cmd = [sys.executable, "-m", "perfscope", "report", str(store), "-o", str(target), "--format", fmt]
    load = os.getloadavg()[0]
    m = _measure(cmd)
    outputs = [target, out / "report_files"] if fmt == "md" else [target]
    return {
        "format": fmt,
        "wall_s": round(m["wall_s"], 1),
        "cpu_s": round(m["cpu_s"], 1),
        "peak_rss_mb": round(m["peak_rss_mb"]),
        "output_mb": round(_size_mb(outputs), 2),
        "load1": round(load, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=float, default=1e7, help="step rows of the synthetic store (default 1e7)")
    p.add_argument("--dir", default="/tmp/perfscope-bench-report", help="where stores and reports go")
    p.add_argument("--keep", action="store_true", help="keep the generated store and reports")
    args = p.parse_args(argv)
    base = Path(args.dir)
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        bundled = sample_traces.bundled()
        for name, store in bundled.items():
            for fmt in ("html", "md"):
                out = base / f"out-{name}-{fmt}"
                out.mkdir()
                rows.append((f"bundled {name}", export(store, out, fmt)))
        big = base / "store"
        t = time.perf_counter()
        exact = generate(big, int(args.rows))
        print(f"generated {exact:,} step rows in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        for fmt in ("html", "md"):
            out = base / f"out-big-{fmt}"
            out.mkdir()
            rows.append((f"synthetic {exact / 1e6:.0f}M step rows", export(big, out, fmt)))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"`{' '.join(['.venv/bin/python', 'benchmarks/report.py', *(argv or sys.argv[1:])])}` "
          f"on {os.cpu_count()} cores\n")  # fmt: skip
    print("| store | format | wall s | CPU s | peak RSS MB | output MB | load avg |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for store, r in rows:
        print(
            f"| {store} | {r['format']} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_mb']} | "
            f"{r['output_mb']} | {r['load1']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
