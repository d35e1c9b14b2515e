"""Time and peak RSS of `perfscope analyze` (the real process) as a pipeline op table's ranks and ops
double (issue 33: "the replay linear in ops, its memory from the ranks and steps present").

    .venv/bin/python benchmarks/what_if_scaling.py                       # 1,000 to 16,000 ranks
    .venv/bin/python benchmarks/what_if_scaling.py --ranks 1000,2000 --steps 8 --dir /tmp/b --keep

Each size is a GPipe job of --pp stages (dp = ranks / pp) and --micro micro-batches, --steps steps, written
vectorised (numpy) as an op table: per rank, step and micro-batch a forward and a backward compute and
their point-to-point transfers to the neighbouring stages (Megatron-LM's op names), times from the GPipe
schedule with a little noise, the last stage's compute 20% longer. Only point-to-point transfers (a
collective's members are stored once since issue 33's item 4, tested on its own). The steps are the same
at every size, so ops grow with the ranks.

    .venv/bin/python benchmarks/what_if_scaling.py --ranks 1064,2128,4256,8512,17024

reaches 1,021,440 ops at 17,024 ranks, under the what-if's MAX_OPS (2^20), past which steps are sampled.

Per size, `perfscope import op-table` and then `perfscope analyze --json` (every analysis and the
findings), each the only child of a fresh Python (benchmarks/analysis.py's `_measure`): wall time, CPU
time (user + system) and peak RSS. The table gives ops, time and memory at each size and each one's
ratio to the size before: linear growth is a ratio of about 2 per doubling. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis import _measure  # the benchmarks' one timer

FWD = 0.010  # s, a micro-batch's forward; its backward takes twice that
XFER = 0.001  # s, a point-to-point transfer
SLOW = 1.2  # the last stage's compute, against the others'


def op_table(dp: int, pp: int, micro: int, steps: int, seed: int = 0) -> pa.Table:
    """The GPipe op table (columns of the straggler study's schema); one row per op."""
    rng = np.random.default_rng(seed)
    keys = ("dp_rank", "stage", "rank", "step", "op", "start", "dur")
    cols: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    names = np.array(["forward-compute", "backward-compute", "forward-send", "forward-recv", "backward-send",
                      "backward-recv"])  # fmt: skip
    step_len = 3 * FWD * SLOW * (micro + pp) + 4 * XFER * (micro + pp)
    d, s, j, k = (a.reshape(-1) for a in np.meshgrid(np.arange(dp), np.arange(pp), np.arange(micro),
                                                      np.arange(steps), indexing="ij"))  # fmt: skip
    rank = s * dp + d
    f = FWD * np.where(s == pp - 1, SLOW, 1.0)
    t0 = k * step_len
    f_start = t0 + (j + s) * (f + XFER)
    b_start = t0 + (micro + pp) * (FWD * SLOW + XFER) + (j + (pp - 1 - s)) * (2 * f + XFER)

    def add(mask: np.ndarray, op: int, start: np.ndarray, dur: np.ndarray) -> None:
        n = int(mask.sum())
        for key, v in (("dp_rank", d), ("stage", s), ("rank", rank), ("step", k)):
            cols[key].append(v[mask])
        cols["op"].append(np.full(n, op))
        cols["start"].append(start[mask])
        cols["dur"].append(dur[mask] * (1 + 0.01 * rng.standard_normal(n)).clip(0.5))

    every = np.ones(len(d), dtype=bool)
    add(s > 0, 3, f_start - XFER, np.full(len(d), XFER))  # forward-recv
    add(every, 0, f_start, f)  # forward-compute
    add(s < pp - 1, 2, f_start + f, np.full(len(d), XFER))  # forward-send
    add(s < pp - 1, 5, b_start - XFER, np.full(len(d), XFER))  # backward-recv
    add(every, 1, b_start, 2 * f)  # backward-compute
    add(s > 0, 4, b_start + 2 * f, np.full(len(d), XFER))  # backward-send
    out = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.lexsort((out["start"], out["step"], out["rank"]))
    seq = np.arange(len(order))
    return pa.table(
        {
            "dp_rank": out["dp_rank"][order], "stage": out["stage"][order], "rank": out["rank"][order],
            "step": out["step"][order], "optype": names[out["op"][order]], "start_ts": out["start"][order],
            "duration": out["dur"][order], "seq_id": seq,
        }
    )  # fmt: skip


def bench(work: Path, ranks: int, pp: int, micro: int, steps: int) -> dict[str, Any]:
    dp = max(ranks // pp, 1)
    src = work / f"ops-{ranks}.parquet"
    store = work / f"store-{ranks}"
    shutil.rmtree(store, ignore_errors=True)
    table = op_table(dp, pp, micro, steps, seed=ranks)
    pq.write_table(table, src, compression="zstd")
    del table
    py = sys.executable
    imp = _measure([py, "-m", "perfscope", "import", "op-table", str(src), "--dp", str(dp), "--pp", str(pp),
                    "--store", str(store)])  # fmt: skip
    ana = _measure([py, "-m", "perfscope", "analyze", str(store), "--json"])
    out = json.loads(ana["stdout"])
    (w,) = out["what_if"]
    return {
        "ranks": dp * pp,
        "ops": pq.ParquetFile(src).metadata.num_rows,
        "import_s": imp["wall_s"],
        "import_mb": imp["peak_rss_mb"],
        "analyze_s": ana["wall_s"],
        "analyze_cpu_s": ana["cpu_s"],
        "analyze_mb": ana["peak_rss_mb"],
        "cause": w["cause"],
        "slowdown": w["slowdown"],
        "steps": w["steps"],
        "note": w.get("note"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1000,2000,4000,8000,16000", help="comma-separated rank counts")
    ap.add_argument("--pp", type=int, default=4, help="pipeline stages")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="perfscope-what-if-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    rows = []
    try:
        for n in (int(x) for x in args.ranks.split(",")):
            r = bench(work, n, args.pp, args.micro, args.steps)
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print(
        "| ranks | ops | import s | analyze s (CPU s) | analyze peak RSS MiB | x ops | x analyze CPU s "
        "| x RSS "
        "| what-if |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    prev: dict[str, Any] | None = None
    for r in rows:
        ratio = (
            (f"{r['ops'] / prev['ops']:.2f}", f"{r['analyze_cpu_s'] / prev['analyze_cpu_s']:.2f}",
             f"{r['analyze_mb'] / prev['analyze_mb']:.2f}")
            if prev else ("", "", "")
        )  # fmt: skip
        print(
            f"| {r['ranks']:,} | {r['ops']:,} | {r['import_s']:.1f} | {r['analyze_s']:.1f} "
            f"({r['analyze_cpu_s']:.1f}) | {r['analyze_mb']:.0f} | {' | '.join(ratio)} "
            f"| {r['cause']}, {r['slowdown']:.3f}, {r['steps']} steps |"
        )
        prev = r


if __name__ == "__main__":
    main()
