"""Several "nodes" on one machine, for multi-node tests: each node is a network namespace of its
own with its own hostname (a UTS namespace per process tree) and, if asked, its own monotonic clock (a
time namespace), and the nodes are joined by veth links to a bridge whose rate `tc ... tbf` shapes.
Only addresses inside namespaces made here are used; nothing leaves the machine, and every namespace
is deleted on exit (its links go with it), whatever the test did.

Needs root, `ip`, `tc` and `unshare`: `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str:
    """Why namespaced nodes cannot be made here, or ''."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian's iproute2 / util-linux)"
    probe = f"psprobe{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "del", probe)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"cannot make a network namespace here ({type(exc).__name__})"
    return ""


@dataclass(frozen=True)
class Node:
    netns: str
    hostname: str
    address: str
    #: the node's side of its link (GLOO_SOCKET_IFNAME)
    ifname: str
    #: seconds its monotonic (and boot-time) clock runs ahead of the machine's
    monotonic_offset_s: int = 0

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` run on this node: in its network namespace, under its hostname and clock."""
        clock = ["-T", f"--monotonic={self.monotonic_offset_s}", f"--boottime={self.monotonic_offset_s}"]
        return [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "-u",
            *(clock if self.monotonic_offset_s else []),
            "--fork",
            "sh",
            "-c",
            f'hostname {self.hostname} && exec "$@"',
            "sh",
            *args,
        ]

    def popen(self, args: Sequence[str], *, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
        env = {**env, "GLOO_SOCKET_IFNAME": self.ifname}
        return subprocess.Popen(
            self.command(args),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


class Nodes:
    """`with Nodes(2, rate="100mbit", offsets=(0, 3600)) as nodes:` ... nodes[0].popen(...)"""

    def __init__(
        self, n: int = 2, *, rate: str | None = "100mbit", offsets: Sequence[int] = (), burst: str = "64kb"
    ) -> None:
        tag = os.getpid() % 100000
        self._hub = f"ps{tag}hub"
        self._subnet = f"10.231.{tag % 250}"
        self.nodes = [
            Node(
                netns=f"ps{tag}n{i}",
                hostname=f"node{chr(ord('a') + i)}",
                address=f"{self._subnet}.{i + 1}",
                ifname=f"ps{tag}e{i}",
                monotonic_offset_s=offsets[i] if i < len(offsets) else 0,
            )
            for i in range(n)
        ]
        self._rate = rate
        self._burst = burst

    def __enter__(self) -> list[Node]:
        try:
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: every node resolves the
            # others' hostnames (torchrun's rendezvous resolves its own)
            hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in self.nodes)
            for node in self.nodes:
                folder = Path("/etc/netns") / node.netns
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text(hosts)
            _run("ip", "netns", "add", self._hub)
            _run("ip", "-n", self._hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self._hub, "link", "set", "br0", "up")
            for i, node in enumerate(self.nodes):
                _run("ip", "netns", "add", node.netns)
                peer = f"ps{os.getpid() % 100000}h{i}"
                _run("ip", "link", "add", node.ifname, "type", "veth", "peer", "name", peer)
                _run("ip", "link", "set", node.ifname, "netns", node.netns)
                _run("ip", "link", "set", peer, "netns", self._hub)
                _run("ip", "-n", self._hub, "link", "set", peer, "master", "br0")
                _run("ip", "-n", self._hub, "link", "set", peer, "up")
                _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
                _run("ip", "-n", node.netns, "link", "set", node.ifname, "up")
                _run("ip", "-n", node.netns, "link", "set", "lo", "up")
                if self._rate:
                    # what leaves each node is shaped: the link carries `rate` each way
                    _run(
                        "ip", "netns", "exec", node.netns, "tc", "qdisc", "add", "dev", node.ifname,
                        "root", "tbf", "rate", self._rate, "burst", self._burst, "latency", "400ms",
                    )  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self.nodes

    def __exit__(self, *exc: object) -> None:
        for ns in [n.netns for n in self.nodes] + [self._hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


#: a gloo DDP job with about 3.6 MB of gradients a step (about 0.3 s over 100 Mbit/s, tens of ms within
#: a node), `STEPS` steps: what a multi-node study records
DDP_JOB = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
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
print(f"rank {rank} done", flush=True)
"""

BIN = Path(sys.executable).parent


def job_script(folder: Path, steps: int) -> Path:
    script = folder / "train.py"
    script.write_text(f"STEPS = {steps}\n" + textwrap.dedent(DDP_JOB))
    return script


#: message sizes of the allreduce job: 16 KB to 4 MB, what an alpha-beta fit needs across a link
ALLREDUCE_BYTES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)

#: hand-written allreduces, one of each size a step (largest first: each one finds the link's token
#: bucket drained, as a stream of gradient buckets does), recorded by perfscope.profile into STORE.
#: The largest is also timed on the job's own clock (perf_counter around the call, after a barrier so
#: both ranks enter together); each rank writes its timings to its own file, OUT/rank<R>.json.
ALLREDUCE_JOB = """
import json
import os
import time

import torch
import torch.distributed as dist

import perfscope

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tensors = [torch.ones(n // 4) for n in sorted(SIZES, reverse=True)]  # float32: n bytes each
own_ns = []
with perfscope.profile(STORE, experiment="allreduce-sizes") as prof:
    for step in range(STEPS):
        with prof.step():
            dist.barrier()
            start = time.perf_counter_ns()
            dist.all_reduce(tensors[0])
            own_ns.append(time.perf_counter_ns() - start)
            for t in tensors[1:]:
                dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(OUT, f"rank{rank}.json.tmp"), "w") as f:
    json.dump({"rank": rank, "world_size": world, "bytes": max(SIZES), "own_ns": own_ns}, f)
os.replace(os.path.join(OUT, f"rank{rank}.json.tmp"), os.path.join(OUT, f"rank{rank}.json"))
"""


def allreduce_script(folder: Path, store: Path, steps: int, sizes: Sequence[int] = ALLREDUCE_BYTES) -> Path:
    """The allreduce job, recording into `store`, its own timings into `folder`."""
    script = folder / "allreduce.py"
    head = f"STEPS = {steps}\nSIZES = {list(sizes)!r}\nSTORE = {str(store)!r}\nOUT = {str(folder)!r}\n"
    script.write_text(head + textwrap.dedent(ALLREDUCE_JOB))
    return script


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def record(
    store: Path | str | None,
    script: Path,
    placement: list[tuple[Node, int]],
    rdzv: str,
    timeout_s: float,
    *,
    env: Callable[[Node], Mapping[str, str]] | None = None,
) -> None:
    """One run: `perfscope run -- torchrun` typed on each node of `placement` with its number of
    ranks, rendezvous on the first node; raises with every node's output if one fails. With no
    `store`, plain torchrun: the script records itself with perfscope.profile. `env`: what each node's
    environment adds (an S3 endpoint, its own cache folder)."""
    first = placement[0][0]
    procs = []
    for node, nproc in placement:
        torchrun = [str(BIN / "torchrun"), "--nnodes", str(len(placement)), "--nproc_per_node", str(nproc)]
        torchrun += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{first.address}:29531", "--rdzv_id", rdzv]
        torchrun += ["--local_addr", node.address, str(script)]
        run = [str(BIN / "perfscope"), "run", "--store", str(store), "--experiment", "two-nodes", "--"]
        node_env = {**_env(), **(env(node) if env is not None else {})}
        procs.append(
            node.popen([*(run if store is not None else []), *torchrun], cwd=script.parent, env=node_env)
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"run {rdzv} failed:\n" + "\n---\n".join(outs))


#: the credentials and region of a test S3 server (moto takes any)
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def s3_server(node: Node, log: Path, *, port: int = 29540) -> Iterator[str]:
    """moto's standalone S3 server run on `node`, bound to the node's own address (reachable from the
    other nodes over the bridge, from nowhere else): its endpoint URL. Stopped on exit, whatever the
    test did."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            node.command([sys.executable, "-m", "moto.server", "-H", node.address, "-p", str(port)]),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**_env(), **S3_TEST_ENV},
            start_new_session=True,
        )
    try:
        url = f"http://{node.address}:{port}"
        deadline = time.monotonic() + 60
        while not re.search(rf"Running on {re.escape(url)}\b", log.read_text(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto's server did not start on {node.hostname}: {log.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(30)


def on_node(node: Node, args: Sequence[str], *, env: Mapping[str, str], timeout_s: float = 120) -> str:
    """`args` run to their end on `node` (a reader of a store only that node can reach): their output;
    raises with it when they fail."""
    done = subprocess.run(
        node.command(args), env={**_env(), **env}, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"{list(args)} failed on {node.hostname}:\n{done.stdout}{done.stderr}")
    return done.stdout
