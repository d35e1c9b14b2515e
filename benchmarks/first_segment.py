"""First-segment latency: how long after the first step ends its row is on disk, readable.

    .venv/bin/python benchmarks/first_segment.py [--repeats 10] [--step-ms 10]

Each repeat opens `perfscope.profile` (everything on: poller at 10 Hz, store writer) in a fresh
store, sleeps a little before the loop (a job's set-up), runs steps of `--step-ms` sleeps, and
checks the step table's partition folder after every step (the step length is the
resolution) until the first `steps` segment
appears. The latency is from the end of step 0 (when its row was appended) to the segment's
rename into place, as this process saw it. A job killed with SIGKILL keeps what is on disk, so
this is the time a killed job needs to have left a trace of its first step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import perfscope
from perfscope.store.writer import segment_dir


def one_run(root: Path, step_s: float, setup_s: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with perfscope.profile(root, experiment="first-segment", batch_size=1, gpu_telemetry=False) as prof:
            assert prof.run_id is not None
            folder = segment_dir(root, "steps", prof.run_id)
            time.sleep(setup_s)
            first_end = 0.0
            landed = 0.0
            for i in prof.steps(range(10_000)):
                if i == 1:
                    first_end = time.perf_counter()  # step 0 ended when the loop asked for batch 1
                time.sleep(step_s)
                if i >= 1 and folder.is_dir() and any(n.endswith(".parquet") for n in os.listdir(folder)):
                    landed = time.perf_counter()
                    break
    return landed - first_end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--setup-s", type=float, default=0.3, help="pause between profile() and the loop")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="perfscope-bench-"))
    try:
        lat = [one_run(tmp / f"r{r}", args.step_ms / 1e3, args.setup_s) for r in range(args.repeats)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| measure | value |")
    print("|---|---|")
    print(f"| repeats | {args.repeats} |")
    print(f"| first steps segment after step 0, median | {statistics.median(lat):.3f} s |")
    print(f"| first steps segment after step 0, max | {max(lat):.3f} s |")
    print(f"| resolution (one step) | {args.step_ms / 1e3:.3f} s |")


if __name__ == "__main__":
    main()
