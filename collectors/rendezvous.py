"""The one exchange between ranks at start: a shared run id, who runs on which host, each rank's
clock offset. Over torch.distributed or Horovod, whichever the job has initialised; never at close.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

from . import identity as ids
from .faults import Faults
from .identity import Identity


@dataclass(frozen=True)
class Peer:
    """What each rank tells the others once."""

    rank: int
    hostname: str
    pid: int
    cpu_count: int
    env_local_rank: int | None
    run_id: str


@dataclass(frozen=True)
class Placement:
    """What the ranks agreed on; for a process alone, what its environment says."""

    run_id: str
    rank: int
    world_size: int
    local_rank: int | None
    node_rank: int
    nodes: int
    ranks_per_node: int
    local_pids: tuple[int, ...]
    clock_offset_ns: int
    backend: str
    exchanged: bool


class Exchange(Protocol):
    backend: str
    rank: int
    world_size: int

    def barrier(self) -> None: ...
    def all_gather(self, obj: Any) -> list[Any]: ...


class TorchExchange:
    """torch.distributed: on the default group when it is a CPU backend (gloo, mpi), else on a gloo
    group made for this (an NCCL group would need each rank's CUDA device set to gather objects)."""

    def __init__(self, dist: Any) -> None:
        self.dist = dist
        self.backend = str(dist.get_backend())
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = None if self.backend in ("gloo", "mpi") else dist.new_group(backend="gloo")
        if self.backend.startswith("cpu:") or "," in self.backend:
            # "cpu:gloo,cuda:nccl": the device that matters for gradients is the accelerator's
            parts = dict(p.split(":", 1) for p in self.backend.split(",") if ":" in p)
            self.backend = parts.get("cuda", parts.get("cpu", self.backend))

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out


class HorovodExchange:
    """Horovod (module horovod.torch), through its object collectives."""

    def __init__(self, hvd: Any, *, on_gpu: bool = False) -> None:
        self.hvd = hvd
        self.rank = int(hvd.rank())
        self.world_size = int(hvd.size())
        self.backend = horovod_backend(hvd, on_gpu=on_gpu)

    def barrier(self) -> None:
        barrier = getattr(self.hvd, "barrier", None)
        if barrier is not None:
            barrier()
        else:  # older Horovod: any collective is a barrier
            self.hvd.allgather_object(None)

    def all_gather(self, obj: Any) -> list[Any]:
        return list(self.hvd.allgather_object(obj))


def horovod_backend(hvd: Any, *, on_gpu: bool) -> str:
    """horovod-nccl, horovod-mpi or horovod-gloo: the library moving the gradients."""

    def flag(name: str) -> bool:
        fn = getattr(hvd, name, None)
        try:
            return bool(fn()) if fn is not None else False
        except Exception:
            return False

    if on_gpu and flag("nccl_built"):
        return "horovod-nccl"
    if flag("mpi_enabled"):
        return "horovod-mpi"
    if flag("gloo_enabled"):
        return "horovod-gloo"
    return "horovod"


def find_exchange(*, on_gpu: bool = False) -> Exchange | None:
    """The collective layer the job has already initialised. Nothing is imported: a job that has
    not imported torch.distributed or horovod.torch has no group to talk over."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return TorchExchange(dist)
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None:
        try:
            initialised = bool(hvd.is_initialized())
        except Exception:
            initialised = False
        if initialised:
            return HorovodExchange(hvd, on_gpu=on_gpu)
    return None


def agree(exchange: Exchange, me: Peer, *, rounds: int = 3) -> Placement:
    """Gather every rank's Peer, take rank 0's run id, place ranks on hosts, estimate clock offsets.

    Clock offset: after a barrier every rank reads its wall clock at (nearly) the same instant and
    the readings are gathered; offset = rank 0's reading minus this rank's. Ranks on one host share
    one clock, so ranks on rank 0's host get exactly 0 and the others the median over all rounds and
    all ranks of their host (the barrier's exit skew, tens of microseconds, is the error)."""
    peers: list[Peer] = exchange.all_gather(me)
    hosts: list[str] = []
    for p in sorted(peers, key=lambda p: p.rank):
        if p.hostname not in hosts:
            hosts.append(p.hostname)
    on_host = sorted((p for p in peers if p.hostname == me.hostname), key=lambda p: p.rank)
    local_rank = me.env_local_rank
    if local_rank is None:
        local_rank = [p.rank for p in on_host].index(me.rank)
    per_host = [sum(1 for p in peers if p.hostname == h) for h in hosts]
    host_of = {p.rank: p.hostname for p in peers}
    same_host: list[int] = []  # offset samples of every rank on this host
    # every rank sees the same host list, so all skip the rounds together on a single host
    for _ in range(rounds if len(hosts) > 1 else 0):
        exchange.barrier()
        now = time.time_ns()
        readings = exchange.all_gather(now)
        same_host += [int(readings[0]) - int(t) for r, t in enumerate(readings) if host_of[r] == me.hostname]
    # ranks of one host share one clock: rank 0's host is exact, others pool their samples
    on_rank0_host = me.hostname == host_of[0]
    offset = 0 if on_rank0_host else int(statistics.median(same_host))
    return Placement(
        run_id=peers[0].run_id,
        rank=exchange.rank,
        world_size=exchange.world_size,
        local_rank=local_rank,
        node_rank=hosts.index(me.hostname),
        nodes=len(hosts),
        ranks_per_node=max(per_host),
        local_pids=tuple(p.pid for p in on_host),
        clock_offset_ns=offset,
        backend=exchange.backend,
        exchanged=True,
    )


def alone(identity: Identity, run_id: str) -> Placement:
    """No group to talk over: the environment's word, no clock offset."""
    return Placement(
        run_id=run_id,
        rank=identity.rank,
        world_size=identity.world_size,
        local_rank=identity.local_rank,
        node_rank=identity.node_rank or 0,
        nodes=identity.nodes or 1,
        ranks_per_node=identity.local_world_size or 1,
        local_pids=(identity.pid,),
        clock_offset_ns=0,
        backend="none",
        exchanged=False,
    )


def place(me: Identity, requested_run_id: str | None, faults: Faults, *, on_gpu: bool = False) -> Placement:
    """This rank's placement and the run id shared by all ranks, in this order of preference:
    `run_id=` or PERFSCOPE_RUN_ID; else rank 0's generated id over the process group (or Horovod);
    else an id derived from the launcher (torchelastic, SLURM); else a generated one. An id from the
    environment is reused by every profile() of a process, so later runs get '-2', '-3' ..."""
    proposed = requested_run_id or ids.explicit_run_id()
    if proposed is not None:
        proposed = ids.claim_run_id(ids.safe_run_id(proposed))
    exchange = find_exchange(on_gpu=on_gpu)
    if exchange is not None:
        local_rank = me.local_rank if me.launcher != "single" else None  # mp.spawn: the exchange decides
        peer = Peer(exchange.rank, me.hostname, me.pid, os.cpu_count() or 1, local_rank,
                    proposed or ids.generate_run_id())  # fmt: skip
        return agree(exchange, peer)
    launcher = ids.launcher_run_id()
    if proposed is None and launcher is not None:
        proposed = ids.claim_run_id(ids.safe_run_id(launcher))
    if proposed is None:
        proposed = ids.generate_run_id()
        if me.world_size > 1:
            faults.report(
                "run_id_not_shared",
                f"perfscope: rank {me.rank} of {me.world_size} cannot agree on a run id with the others "
                "(no process group yet, no launcher id); each rank records its own run. Initialise "
                "torch.distributed before perfscope.profile(), or set PERFSCOPE_RUN_ID.",
            )
    return alone(me, proposed)
