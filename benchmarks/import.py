"""HTA against `perfscope import kineto` + `perfscope analyze --json` on the same N-rank Kineto traces.

    .venv/bin/python benchmarks/import.py                          # sizes 2x1, 2x4, 4x8 under /tmp
    .venv/bin/python benchmarks/import.py --sizes 2x1,8x4 --hta-max-mb 400 --dir /tmp/bench --keep

A size RxK is R rank files, each the real 2-GPU NCCL trace (tests/data/kineto-w2-allreduce-rank0.json.gz,
3 steps, about 40k events and 9.8 MB of JSON) repeated K times later and later in time, with its steps,
correlation ids and `distributedInfo` rank renumbered, written as plain JSON. For each size, each in
fresh processes: HTA (`TraceAnalysis` + `get_temporal_breakdown` + `get_comm_comp_overlap`) and
perfscope (`perfscope import kineto` then `perfscope analyze --json`), with the files read in a pool of
processes (one per core, the default) and, with `--serial`, also in one process (PERFSCOPE_IMPORT_WORKERS=1).
Wall time is the processes'
elapsed time; CPU time is user + system of every process of the tree, sampled (steadier than
wall time on a shared machine); peak memory is the largest sum of RSS over the whole process
tree (HTA parses ranks in a process pool), sampled every 20 ms with psutil.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REAL = Path(__file__).resolve().parent.parent / "tests" / "data" / "kineto-w2-allreduce-rank0.json.gz"
STEPS_PER_COPY = 3
EVENTS_PER_COPY = 40_573

HTA_CHILD = """
import logging, sys
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
tb = ta.get_temporal_breakdown(visualize=False)
ov = ta.get_comm_comp_overlap(visualize=False)
print(tb["compute_time(us)"].sum(), ov["comp_comm_overlap_pctg"].mean())
"""


def write_traces(folder: Path, ranks: int, copies: int) -> int:
    """R files of K copies of the real trace; returns the bytes written."""
    doc = json.loads(gzip.decompress(REAL.read_bytes()))
    events = doc.pop("traceEvents")
    xs = [e for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(e["ts"] + e.get("dur", 0) for e in xs) - min(e["ts"] for e in xs) + 1000.0
    first_step = min(
        int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")
    )
    total = 0
    for rank in range(ranks):
        head = {**doc, "distributedInfo": {**doc["distributedInfo"], "rank": rank, "world_size": ranks}}
        path = folder / f"rank{rank}.json"
        with open(path, "w") as f:
            f.write(json.dumps(head)[:-1] + ', "traceEvents": [')
            sep = ""
            for k in range(copies):
                for e in events:
                    e2 = dict(e)
                    if "ts" in e2:
                        e2["ts"] = e["ts"] + k * span
                    name = e.get("name", "")
                    if name.startswith("ProfilerStep#"):
                        n = int(name.split("#")[1]) - first_step
                        e2["name"] = f"ProfilerStep#{first_step + k * STEPS_PER_COPY + n}"
                    args = e.get("args")
                    if isinstance(args, dict) and ("correlation" in args or "External id" in args):
                        a2 = dict(args)
                        for key in ("correlation", "External id"):
                            if isinstance(a2.get(key), int):
                                a2[key] = a2[key] + k * 10_000_000
                        e2["args"] = a2
                    if "id" in e2 and isinstance(e2["id"], int):  # flow events
                        e2["id"] = e2["id"] + k * 10_000_000
                    f.write(sep + json.dumps(e2))
                    sep = ","
            f.write("]}")
        total += path.stat().st_size
    return total


def measure(cmds: list[list[str]], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """Run `cmds` one after another; (elapsed s, CPU s of the process tree, peak RSS of the tree in MB).
    CPU is each process's last sampled user + system time, summed over every process seen."""
    peak = 0
    cpu: dict[int, float] = {}
    t0 = time.perf_counter()
    for cmd in cmds:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        root = psutil.Process(p.pid)
        while p.poll() is None:
            rss = 0
            try:
                for proc in [root, *root.children(recursive=True)]:
                    with proc.oneshot():
                        rss += proc.memory_info().rss
                        t = proc.cpu_times()
                        cpu[proc.pid] = t.user + t.system
            except psutil.Error:
                pass
            peak = max(peak, rss)
            time.sleep(0.02)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:4])} ... failed with status {p.returncode}")
    return time.perf_counter() - t0, sum(cpu.values()), peak / 1e6


def time_perfscope(
    files: list[str], store: Path, env: dict[str, str], workers: str | None
) -> tuple[float, float, float]:
    """`perfscope import kineto` of the files into a fresh store, then `analyze --json` (see measure)."""
    shutil.rmtree(store, ignore_errors=True)
    py = sys.executable
    return measure(
        [
            [py, "-m", "perfscope", "import", "kineto", *files, "--store", str(store)],
            [py, "-m", "perfscope", "analyze", str(store), "--json"],
        ],
        {**env, "PERFSCOPE_IMPORT_WORKERS": workers} if workers else env,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2x1,2x4,4x8", help="RANKSxCOPIES,... (default 2x1,2x4,4x8)")
    ap.add_argument("--hta-max-mb", type=float, default=1e9, help="skip HTA above this many MB of JSON")
    ap.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the traces and stores")
    ap.add_argument("--serial", action="store_true", help="also time perfscope reading in one process")
    args = ap.parse_args(argv)
    work = args.dir or Path(tempfile.mkdtemp(prefix="perfscope-import-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = {**os.environ, "HTA_DISABLE_NS_ROUNDING": "1", "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} CPUs, load average {load:.1f} at start; python {sys.version.split()[0]}")
    print(
        "| ranks x copies | events | JSON MB | HTA wall s | HTA CPU s | HTA peak MB "
        "| perfscope wall s | perfscope CPU s | perfscope peak MB | perfscope / HTA wall "
        + ("| perfscope 1 process wall s | 1 process CPU s | 1 process peak MB |" if args.serial else "|")
    )
    print("|---" * (13 if args.serial else 10) + "|")
    try:
        for size in args.sizes.split(","):
            ranks, copies = (int(x) for x in size.lower().split("x"))
            folder = work / f"traces-{ranks}x{copies}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            nbytes = write_traces(folder, ranks, copies)
            files = sorted(str(p) for p in folder.glob("rank*.json"))
            store = work / f"store-{ranks}x{copies}"

            ps = time_perfscope(files, store, env, None)
            mb = nbytes / 1e6
            hta = measure([[py, "-c", HTA_CHILD, str(folder)]], env) if mb <= args.hta_max_mb else None
            hta_cols = f"{hta[0]:.1f} | {hta[1]:.1f} | {hta[2]:.0f}" if hta else "skipped | skipped | skipped"
            ratio = f"{ps[0] / hta[0]:.2f}x" if hta else "-"
            one = ""
            if args.serial:
                s1 = time_perfscope(files, store, env, "1")
                one = f" {s1[0]:.1f} | {s1[1]:.1f} | {s1[2]:.0f} |"
            print(
                f"| {ranks} x {copies} | {ranks * copies * EVENTS_PER_COPY:,} | {mb:.1f} | {hta_cols} | "
                f"{ps[0]:.1f} | {ps[1]:.1f} | {ps[2]:.0f} | {ratio} |{one}",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
                shutil.rmtree(store, ignore_errors=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
