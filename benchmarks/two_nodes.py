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
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from nodes import Node, Nodes, unavailable

BIN = Path(sys.executable).parent

JOB = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(1024, 896), nn.ReLU(), nn.Linear(896, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
for step in range(STEPS):
    x, y = torch.randn(32, 1024), torch.randint(0, 8, (32,))
    loss = loss_fn(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.barrier()
del model, opt
dist.destroy_process_group()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _record(store: Path, script: Path, name: str, placement: list[tuple[Node, int]], port: int) -> None:
    """One run: `nproc` ranks on each (node, nproc), rendezvous on the first node."""
    first = placement[0][0]
    procs = []
    for node, nproc in placement:
        torchrun = [str(BIN / "torchrun"), "--nnodes", str(len(placement)), "--nproc_per_node", str(nproc)]
        torchrun += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{first.address}:{port}"]
        torchrun += ["--rdzv_id", name, "--local_addr", node.address, str(script)]
        run = [str(BIN / "perfscope"), "run", "--store", str(store), "--experiment", "two-nodes", "--"]
        procs.append(node.popen([*run, *torchrun], cwd=script.parent, env=_env()))
    for p in procs:
        out = p.communicate(timeout=600)[0]
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out}")


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
        script = Path(tmp) / "train.py"
        script.write_text(f"STEPS = {args.steps}\n" + textwrap.dedent(JOB))
        with Nodes(2, rate=args.rate) as (a, b):
            _record(store, script, "n1", [(a, 1)], 29541)
            _record(store, script, "n2-one-node", [(a, 2)], 29542)
            _record(store, script, "n2-two-nodes", [(a, 1), (b, 1)], 29543)
        analyze = [str(BIN / "perfscope"), "analyze", str(store), "--json"]
        out = subprocess.run(analyze, capture_output=True, text=True, check=True).stdout
        print(f"link {args.rate}, load {os.getloadavg()[0]:.1f}, store {store}")
        print(json.dumps(json.loads(out), indent=1)[:20000])


if __name__ == "__main__":
    main()
