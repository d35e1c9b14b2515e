"""The hardware, backend and topology a finding's runs used, and the words and advice that fit them.

A finding about a gloo job on one CPU host must not speak of GPUs, NCCL, InfiniBand or hierarchical
allreduce across nodes, and a Horovod-over-MPI group must not be told to check NCCL. Rules ask
`setup_of(ctx, run_ids)` for a `Setup` and take their words ("GPU" or "rank", "GPU time" or "CPU
time") and their backend- and topology-specific advice from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .context import Context


@dataclass(frozen=True)
class Setup:
    """What the runs ran on: GPUs or CPUs, which backends (lower case), one host or several."""

    gpu: bool
    backends: frozenset[str]
    multi_node: bool

    @property
    def unit(self) -> str:
        """What one rank's work runs on: 'GPU' or 'rank'."""
        return "GPU" if self.gpu else "rank"

    @property
    def units(self) -> str:
        return f"{self.unit}s"

    @property
    def time(self) -> str:
        """The time a lost step costs: 'GPU time' or 'CPU time'."""
        return "GPU time" if self.gpu else "CPU time"

    def uses(self, name: str) -> bool:
        """Whether any backend is (or runs on) `name`: 'nccl', 'mpi', 'gloo', 'horovod'."""
        return any(name in b for b in self.backends)


def setup_of(ctx: Context, run_ids: Iterable[str]) -> Setup:
    """The Setup of these runs, from run_summary (device_model, backend, nodes). A run whose device is
    unknown counts as a GPU run only when its backend is NCCL (NCCL runs on GPUs only)."""
    runs = ctx.by_run("run_summary")
    rows = [runs[r] for r in run_ids if r in runs]
    backends = frozenset(str(r["backend"] or "").lower() for r in rows) - {""}
    gpu = any(_device_is_gpu(r["device_model"], str(r["backend"] or "")) for r in rows)
    return Setup(gpu=gpu, backends=backends, multi_node=any((r["nodes"] or 1) > 1 for r in rows))


def _device_is_gpu(device_model: object, backend: str) -> bool:
    model = str(device_model or "").strip().lower()
    if not model:
        return "nccl" in backend.lower()
    return model != "cpu"


def transport_check(s: Setup) -> str:
    """How to see which transport the collectives took, for this backend."""
    parts = []
    if s.uses("nccl"):
        parts.append(
            "rerun with NCCL_DEBUG=INFO and check the transport NCCL picks (NET/IB vs NET/Socket), "
            "NCCL_SOCKET_IFNAME / NCCL_IB_HCA"
        )
    if s.uses("mpi"):
        parts.append(
            "check the transport the MPI library uses (Open MPI: `--mca pml ucx` or the btl list, "
            "UCX_NET_DEVICES; `ompi_info`) and that it is the fast fabric, not TCP"
        )
    if s.uses("gloo") or not parts:
        parts.append("check that GLOO_SOCKET_IFNAME names the fastest network interface (gloo uses TCP)")
    where = "the nodes the job landed on" if s.multi_node else "what else ran on the host"
    return "; ".join(parts) + f"; and {where}"


def fewer_hops(s: Setup) -> str:
    """Advice when one or two messages per step are latency-bound: cut the hops per message."""
    if s.uses("nccl"):
        algo = "an algorithm with fewer hops (NCCL_ALGO=Tree" + (
            ", and HOROVOD_HIERARCHICAL_ALLREDUCE=1 to reduce inside each node first)"
            if s.multi_node and s.uses("horovod")
            else ", or NCCL_PROTO=LL for small messages)"
        )
    elif s.uses("mpi"):
        algo = (
            "the MPI library's small-message allreduce (Open MPI: coll_tuned_allreduce_algorithm "
            "recursive doubling, log2(p) hops instead of 2(p−1))"
            + (
                ", and HOROVOD_HIERARCHICAL_ALLREDUCE=1 to reduce inside each node first"
                if s.multi_node and s.uses("horovod")
                else ""
            )
        )
    elif not s.gpu and not s.multi_node:
        algo = (
            "fewer ranks with more threads each (each gloo hop is a TCP round trip through the "
            "host's loopback, so fewer ranks means fewer hops)"
        )
    else:
        algo = "fewer ranks per job, or a backend with a lower per-message latency"
    return (
        "The gradients already travel in one or two messages, so the latency is per ring hop: use "
        f"{algo}, or synchronise less often per sample (a larger batch, gradient accumulation)."
    )


def cheaper_network_hop(s: Setup) -> str:
    """Advice for a knee where the job leaves one node."""
    parts = []
    if s.uses("nccl"):
        parts.append(
            "check that NCCL uses InfiniBand/RoCE with GPUDirect (NCCL_DEBUG=INFO) and try its tree algorithm"
        )
    if s.uses("mpi"):
        parts.append("check that the MPI library uses the fast fabric (UCX/verbs), not TCP")
    if s.uses("gloo"):
        parts.append(
            "put gloo on the fastest interface (GLOO_SOCKET_IFNAME); gloo only speaks TCP, so across "
            + ("many nodes NCCL usually does better" if s.gpu else "many nodes MPI usually does better")
        )
    if s.uses("horovod"):
        parts.append("reduce inside each node first (HOROVOD_HIERARCHICAL_ALLREDUCE=1)")
    return (
        "Make the inter-node step cheaper: "
        + "; ".join(
            [
                "check that the nodes talk over the fastest interconnect, through the right NIC",
                *parts,
                "compress gradients for the network hop (a bf16/fp16 or PowerSGD comm hook)",
                "hide it behind backward with larger buckets that start early (bucket_cap_mb, static_graph)",
                "reduce inside each node first, then across nodes (hierarchical allreduce)",
                "keep tensor- and pipeline-parallel groups inside a node so only data-parallel gradients "
                "cross it",
            ]
        )
        + "; or scale by filling whole nodes and accept the knee as the price of the network."
    )
