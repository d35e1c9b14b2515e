"""A scaling study across a real node boundary on one machine (issue 24): namespaced nodes joined by
a link shaped to `--rate` (tests/nodes.py; needs root, ip, tc, unshare), one store holding a gloo DDP
job (about 3.6 MB of gradients a step) at N=1, N=2 on one node and N=2 with one rank on each node,
recorded with `perfscope run -- torchrun`. Prints what perfscope measured and concluded. Then a job of
hand-written allreduces of 16 KB to 4 MB with one rank on each node (its own store, a link with a
two-packet burst): perfscope's inter-node alpha-beta fit against the job's own clock.

    .venv/bin/python benchmarks/two_nodes.py [--rate 100mbit] [--steps 30] [--store DIR] [--burst 3kb]
        [--fit-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from nodes import BIN, Nodes, allreduce_script, job_script, record, unavailable

from perfscope.analysis import run_analysis
from perfscope.store.open import open_store

#: steps of the allreduce job (10 warm-up steps dropped)
FIT_STEPS = 20


def study(rate: str, steps: int, store: Path, tmp: Path) -> None:
    script = job_script(tmp, steps)
    with Nodes(2, rate=rate) as (a, b):
        record(store, script, [(a, 1)], "n1", 600)
        record(store, script, [(a, 2)], "n2-one-node", 600)
        record(store, script, [(a, 1), (b, 1)], "n2-two-nodes", 600)
    analyze = [str(BIN / "perfscope"), "analyze", str(store), "--json"]
    out = subprocess.run(analyze, capture_output=True, text=True, check=True).stdout
    print(f"link {rate}, load {os.getloadavg()[0]:.1f}, store {store}")
    print(json.dumps(json.loads(out), indent=1)[:20000])


def fit(rate: str, burst: str, tmp: Path) -> None:
    """The allreduce job with one rank on each node, then both ranks on node a, into one store:
    perfscope's inter- and intra-node fits, each against the job's own clock."""
    store = tmp / "sizes"
    placements = {"inter-node": lambda a, b: [(a, 1), (b, 1)], "intra-node": lambda a, b: [(a, 2)]}
    for scope, placed in placements.items():
        folder = tmp / scope
        folder.mkdir()
        with Nodes(2, rate=rate, burst=burst) as (a, b):
            record(None, allreduce_script(folder, store, FIT_STEPS), placed(a, b), scope, 600)
        load = os.getloadavg()[0]
        with open_store(store) as s:
            (f,) = [r for r in run_analysis("allreduce_fit", s).to_pylist() if r["scope"] == scope]
        own = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
        seconds = max(statistics.median(r["own_ns"][10:]) for r in own) / 1e9
        measured = own[0]["bytes"] / seconds  # busbw at p=2: bytes·2(p−1)/p = bytes
        alpha = "refused" if f["alpha_refused"] else f"{f['alpha_s'] * 1e6:.0f} us"
        bw, ceiling = f["bandwidth_gb_per_s"] * 1e3, f["alpha_ceiling_s"] * 1e6
        print(
            f"link {rate} (burst {burst}), load {load:.1f}: {scope} fit {bw:.2f} MB/s, "
            f"alpha {alpha} (ceiling {ceiling:.0f} us), SMAPE {f['smape_pct']:.1f}%, {f['points']} points; "
            f"job's own clock, {own[0]['bytes'] >> 20} MB allreduce: {seconds * 1e3:.1f} ms, "
            f"busbw {measured / 1e6:.2f} MB/s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--store", type=Path, help="keep the study's store here (default: a temporary folder)")
    ap.add_argument("--burst", default="3kb", help="the allreduce job's tbf burst (default: two packets)")
    ap.add_argument("--fit-only", action="store_true", help="only the allreduce job and its alpha-beta fit")
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"two_nodes: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.fit_only:
            study(args.rate, args.steps, args.store or Path(tmp) / "S", Path(tmp))
        fit(args.rate, args.burst, Path(tmp))


if __name__ == "__main__":
    main()
