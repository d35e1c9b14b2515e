"""A scaling study across a real node boundary on one machine (issue 24): namespaced nodes joined by
a link shaped to `--rate` (tests/nodes.py; needs root, ip, tc, unshare), one store holding a gloo DDP
job (about 3.6 MB of gradients a step) at N=1, N=2 on one node and N=2 with one rank on each node,
recorded with `perfscope run -- torchrun`. Prints what perfscope measured and concluded.

    .venv/bin/python benchmarks/two_nodes.py [--rate 100mbit] [--steps 30] [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from nodes import BIN, Nodes, job_script, record, unavailable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--store", type=Path, help="keep the store here (default: a temporary folder)")
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"two_nodes: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or Path(tmp) / "S"
        script = job_script(Path(tmp), args.steps)
        with Nodes(2, rate=args.rate) as (a, b):
            record(store, script, [(a, 1)], "n1", 600)
            record(store, script, [(a, 2)], "n2-one-node", 600)
            record(store, script, [(a, 1), (b, 1)], "n2-two-nodes", 600)
        analyze = [str(BIN / "perfscope"), "analyze", str(store), "--json"]
        out = subprocess.run(analyze, capture_output=True, text=True, check=True).stdout
        print(f"link {args.rate}, load {os.getloadavg()[0]:.1f}, store {store}")
        print(json.dumps(json.loads(out), indent=1)[:20000])


if __name__ == "__main__":
    main()
