"""Two nodes for real (issue 24): a gloo DDP job launched with `perfscope run -- torchrun --nnodes 2` on
two namespaced nodes (tests/nodes.py: own network, hostname and, on node b, a monotonic clock an hour
ahead), joined by a 100 Mbit/s link, recording into one shared store folder."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from nodes import Node, Nodes, unavailable

from perfscope.store import open_store
from perfscope.writer import host_tag

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "nodes available")

BIN = Path(sys.executable).parent
TIMEOUT_S = 300
STEPS = 24

# about 1 MB of gradients a step: a few hundred ms over 100 Mbit/s, a few ms within a node
DDP_JOB = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.MSELoss()
for step in range(STEPS):
    x = torch.randn(16, 256)
    loss = loss_fn(model(x), torch.zeros(16, 256))
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.barrier()
del model, opt
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _launch(store: Path, script: Path, first: Node, node: Node) -> list[str]:
    """`perfscope run -- torchrun --nnodes 2 ...` as typed on `node`, rendezvous on `first`."""
    torchrun = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d"]
    torchrun += [
        "--rdzv_endpoint",
        f"{first.address}:29531",
        "--rdzv_id",
        "job1",
        "--local_addr",
        node.address,
    ]
    perfscope = [str(BIN / "perfscope"), "run", "--store", str(store), "--experiment", "two-nodes", "--"]
    return [*perfscope, *torchrun, str(script)]


def test_a_job_across_two_nodes_is_one_run_on_two_hosts_with_aligned_clocks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"STEPS = {STEPS}\n" + textwrap.dedent(DDP_JOB))
    store = tmp_path / "S"
    with Nodes(2, rate="100mbit", offsets=(0, 3600)) as (a, b):
        procs = [node.popen(_launch(store, script, a, node), cwd=tmp_path, env=_env()) for node in (a, b)]
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=TIMEOUT_S)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(outs)
    with open_store(store) as s:
        runs = s.query("SELECT run_id, world_size, nodes FROM runs").to_pylist()
        ranks = s.query("SELECT rank, hostname, node_rank FROM ranks ORDER BY rank").to_pylist()
        hosts_sampled = s.query("SELECT DISTINCT hostname FROM host_samples ORDER BY 1").column(0).to_pylist()
        # the same step starts on both nodes within a few ms in a synchronous job (node b's monotonic
        # clock is an hour ahead: only the wall clock and the measured offset may place its steps)
        skew = s.query(
            "SELECT max(abs(a.start_ns - b.start_ns)) AS worst, median(abs(a.start_ns - b.start_ns)) AS mid "
            "FROM steps a JOIN steps b ON a.step = b.step AND a.rank = 0 AND b.rank = 1 WHERE a.step > 2"
        ).to_pylist()[0]
    assert len(runs) == 1 and runs[0]["world_size"] == 2 and runs[0]["nodes"] == 2
    assert [r["hostname"] for r in ranks] == ["nodea", "nodeb"]
    assert hosts_sampled == ["nodea", "nodeb"]  # one poller per host, each on its own node
    assert skew["mid"] < 20e6, skew
    # each host's writers leave their own files, named by the host's tag, merged per host at close
    tags = {host_tag("nodea"), host_tag("nodeb")}
    for table in ("steps", "host_samples"):
        names = [f.name for f in (store / table).rglob("*.parquet")]
        by_host = {t: [n for n in names if n.startswith((f"{t}-", f"c-{t}-"))] for t in tags}
        assert all(len(files) == 1 for files in by_host.values()), names
        assert sorted(n for files in by_host.values() for n in files) == sorted(names)
