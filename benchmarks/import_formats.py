"""Time and peak RSS of `perfscope import horovod` and `perfscope import nsys` on files from a few MB
to hundreds of MB: memory should stay flat in the file's size.

    .venv/bin/python benchmarks/import_formats.py                   # 200, 2000, 6000 steps
    .venv/bin/python benchmarks/import_formats.py --steps 100,1000 --tensors 50 --kernels 100

A Horovod timeline is written as horovod/common/timeline.cc writes it (metadata lines, then every
event appended on one line, the array closed after the last): per step and tensor a negotiation with
one tick per rank, then ALLREDUCE with a nested NCCL_ALLREDUCE. An Nsight Systems export is built
with the documented tables (the DDL of tests/importers/test_import_nsys.py): per step a perfscope `step`
range, forward and backward ranges, compute kernels and one NCCL kernel. Each import runs as its own
process (benchmarks/analysis.py's timer): wall time, CPU time and peak RSS, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "importers"))  # tests/rooms.py
from analysis import _measure  # the benchmarks' one timer
from test_import_nsys import SCHEMA  # Nsight Systems' documented tables

MS = 1_000_000


def write_timeline(path: Path, steps: int, tensors: int, ranks: int) -> int:
    """Write the timeline; returns the number of collectives in it."""
    with open(path, "w") as f:
        f.write("[\n")
        meta = {
            "name": "process_name",
            "ph": "M",
            "pid": 0,
            "args": {"start_time_since_epoch_in_micros": 1 << 50},
        }
        f.write(json.dumps(meta) + ",\n")
        for t in range(tensors):
            f.write(
                json.dumps({"name": "process_name", "ph": "M", "pid": t + 1, "args": {"name": f"grad.{t}"}})
            )
            f.write(",\n")
        for k in range(steps):
            for t in range(tensors):
                pid, ready = t + 1, k * 100_000 + t * 10
                events = [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": ready, "pid": pid}]
                events += [
                    {"ph": "X", "name": str(r), "ts": ready + 50 * r, "pid": pid, "dur": 0}
                    for r in range(ranks)
                ]
                s = ready + 50 * ranks + 10
                events += [
                    {"ph": "E", "ts": s - 5, "pid": pid},
                    {"ph": "B", "name": "ALLREDUCE", "ts": s, "pid": pid},
                    {"ph": "B", "name": "NCCL_ALLREDUCE", "ts": s + 10, "pid": pid},
                    {"ph": "E", "ts": s + 900, "pid": pid},
                    {
                        "ph": "E",
                        "ts": s + 950,
                        "pid": pid,
                        "args": {"dtype": "float32", "shape": "[1024, 1024]"},
                    },
                ]
                f.write(",".join(json.dumps(e) for e in events) + ",")
        f.write(json.dumps({"ph": "i", "name": "CYCLE_START", "ts": steps * 100_000, "s": "g"}) + "]")
    return steps * tensors


def write_nsys(path: Path, steps: int, kernels: int) -> int:
    """Write an export of one rank; returns the number of kernels in it."""
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    con.executescript(SCHEMA)
    names = ["step", "forward", "backward", "sgemm", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(names, 1)))
    pid = 4242
    tid, gpid = (pid << 24) | pid, pid << 24
    nvtx = (
        "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId) "
        "VALUES (?,?,?,?,?,?,1)"
    )
    con.execute(nvtx, (0, None, 75, "perfscope", tid, None))
    kernel = (
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, globalPid, "
        "demangledName, shortName, registersPerThread, gridX, gridY, gridZ, blockX, blockY, blockZ, "
        "staticSharedMemory, dynamicSharedMemory, localMemoryPerThread, localMemoryTotal, gridId) "
        "VALUES (?,?,0,1,7,?,?,?,32,1,1,1,128,1,1,0,0,0,0,1)"
    )
    step_ns, d = 20 * MS, 16 * MS // kernels
    for k in range(steps):
        t0 = k * step_ns
        ranges = [(t0, t0 + step_ns, 60, 1), (t0, t0 + 8 * MS, 59, 2), (t0 + 8 * MS, t0 + 18 * MS, 59, 3)]
        con.executemany(nvtx, [(a, b, kind, None, tid, name) for a, b, kind, name in ranges])
        con.executemany(kernel, [(t0 + i * d, t0 + i * d + d // 2, gpid, 4, 4) for i in range(kernels)])
        con.execute(kernel, (t0 + 12 * MS, t0 + 17 * MS, gpid, 5, 5))
    con.commit()
    con.close()
    return steps * (kernels + 1)


def bench(base: Path, fmt: str, steps: int, args: argparse.Namespace) -> dict[str, Any]:
    store = base / f"store-{fmt}-{steps}"
    shutil.rmtree(store, ignore_errors=True)
    if fmt == "horovod":
        src = base / f"timeline-{steps}.json"
        events = write_timeline(src, steps, args.tensors, args.ranks)
    else:
        src = base / f"export-{steps}.sqlite"
        events = write_nsys(src, steps, args.kernels)
    load = os.getloadavg()[0]
    m = _measure([sys.executable, "-m", "perfscope", "import", fmt, str(src), "--store", str(store)])
    return {
        "format": fmt,
        "steps": steps,
        "collectives or kernels": events,
        "file_mb": round(src.stat().st_size / 2**20, 1),
        "wall_s": round(m["wall_s"], 1),
        "cpu_s": round(m["cpu_s"], 1),
        "peak_rss_mb": round(m["peak_rss_mb"]),
        "load1": round(load, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="200,2000,6000", help="comma-separated step counts")
    p.add_argument("--tensors", type=int, default=100, help="gradient tensors per step (default 100)")
    p.add_argument("--ranks", type=int, default=2, help="ranks ticking in each negotiation (default 2)")
    p.add_argument("--kernels", type=int, default=500, help="compute kernels per step in nsys (default 500)")
    p.add_argument("--formats", default="horovod,nsys", help="which importers (default horovod,nsys)")
    p.add_argument(
        "--dir", default="/tmp/perfscope-bench-import-horovod", help="where timelines and stores go"
    )
    p.add_argument("--keep", action="store_true", help="keep the timelines and stores")
    args = p.parse_args(argv)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    rows = [bench(base, f, int(s), args) for f in args.formats.split(",") for s in args.steps.split(",")]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in cols) + " |")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
