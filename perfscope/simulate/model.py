"""The cost model behind `perfscope simulate`: hardware and backend parameters, and one run's step timeline.

A step on one rank is: data loading, forward and backward (a fixed host overhead plus GPU kernel time
that grows with the batch), the gradient allreduce (waiting for the slowest rank, a per-collective
coordination cost, then an alpha-beta ring), the optimizer and a little bookkeeping. Every rank leaves
the allreduce at the same moment, so the step of a run is paced by its slowest rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

# The forward pass takes about a third of forward+backward for dense and convolutional layers.
FORWARD_SHARE = 1.0 / 3.0
#: durations are whole microseconds, about the resolution of CUDA event timings
TIMER_RESOLUTION_NS = 1000
#: the first steps are slow (graph tracing, autotuning): step 0 takes 1 + WARMUP_EXTRA times longer,
#: decaying by e every step, so the steady state (after step 10) no longer sees it
WARMUP_EXTRA = 20.0


@dataclass(frozen=True)
class Backend:
    """Collective library parameters. The ring: T = 2(p-1)·α + 2(p-1)/p·n·β with β = 1/bandwidth;
    a ring that crosses a node boundary moves at the pace of the inter-node link."""

    name: str
    #: per-collective cost paid once per step when p > 1, on the host (Horovod's negotiation and
    #: cycle wait before the collective is launched)
    coord_us: float
    intra_alpha_us: float
    intra_gb_per_s: float
    inter_alpha_us: float
    inter_gb_per_s: float
    #: NCCL runs the ring inside a GPU kernel that spins while data crosses the link, so NVML counts
    #: the ring as kernel time; MPI reduces on the host and the GPU sits idle.
    ring_in_gpu_kernel: bool

    def ring_ns(self, world_size: int, nodes: int, nbytes: float) -> float:
        """Alpha-beta cost of one ring allreduce of `nbytes` over `world_size` ranks on `nodes` hosts."""
        if world_size <= 1:
            return 0.0
        alpha_us, gb_per_s = (
            (self.intra_alpha_us, self.intra_gb_per_s)
            if nodes <= 1
            else (self.inter_alpha_us, self.inter_gb_per_s)
        )
        p = world_size
        beta_ns_per_byte = 1.0 / gb_per_s  # 1 GB/s moves one byte per ns
        return 2 * (p - 1) * alpha_us * 1e3 + 2 * (p - 1) / p * nbytes * beta_ns_per_byte

    def allreduce_ns(self, world_size: int, nodes: int, nbytes: float) -> float:
        """Coordination plus ring, once the last rank has arrived; 0 on one rank."""
        if world_size <= 1:
            return 0.0
        return self.coord_us * 1e3 + self.ring_ns(world_size, nodes, nbytes)


@dataclass(frozen=True)
class Partition:
    """One cluster partition: its nodes, its GPUs, the per-step cost model and its backends."""

    name: str
    device_model: str
    gpus_per_node: int
    cpus_per_node: int  # logical CPUs of one node
    hostname_pattern: str  # str.format pattern with {node}
    first_node: int
    device_mem_bytes: int
    device_peak_flops: float  # FP32 peak of one device; 0 when unknown
    idle_power_w: float
    max_power_w: float
    sm_clock_mhz: float
    mem_clock_mhz: float
    has_nvlink: bool
    #: GPU kernel time per sample once the batch fills the GPU
    kernel_us_per_sample: float
    #: batch at which the GPU is busy enough that kernel time grows linearly with the batch
    fill_samples: float
    #: host time per step in forward and backward (Python, framework, kernel launches), GPU idle
    step_overhead_us: float
    #: extra host time per additional rank sharing the node, as a fraction of step_overhead_us:
    #: in exclusive mode each rank gets cpus_per_node / ranks_on_node CPUs
    cpu_share_penalty: float
    optimizer_us: float
    other_us: float
    data_fixed_us: float
    data_us_per_sample: float
    #: coefficient of variation of one rank's step-to-step compute time
    step_cv: float
    #: spread of the persistent speed of ranks (a slightly slower GPU or host)
    rank_cv: float
    #: step-to-step variation of the collective's duration
    comm_cv: float
    backends: Mapping[str, Backend] = field(default_factory=dict)
    software: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""
    #: False for a partition fitted from runs without NVML samples (CPU runs): no gpu_samples rows
    gpu_telemetry: bool = True

    def hostname(self, node_rank: int) -> str:
        return self.hostname_pattern.format(node=self.first_node + node_rank)

    def kernel_ns(self, batch: float) -> float:
        """GPU kernel time of forward+backward: flat while the batch under-fills the GPU, then linear."""
        fill = self.fill_samples
        g = batch + fill * math.exp(-batch / fill) if fill > 0 else batch
        return self.kernel_us_per_sample * 1e3 * g

    def host_ns(self, ranks_on_node: int) -> float:
        return self.step_overhead_us * 1e3 * (1.0 + self.cpu_share_penalty * (ranks_on_node - 1))

    def data_ns(self, batch: float) -> float:
        return (self.data_fixed_us + self.data_us_per_sample * batch) * 1e3

    def fixed_step_ns(self) -> float:
        """Per-step cost that does not depend on the batch, for one rank alone on its node."""
        return (self.step_overhead_us + self.optimizer_us + self.other_us) * 1e3


@dataclass(frozen=True)
class Workload:
    """The model being trained (the seed's stress-strain regressor by default)."""

    name: str = "stress-strain-regressor"
    param_count: int = 153_441
    bytes_per_param: int = 4
    dataset_samples: int = 750_000  # 0 when unknown
    input_bytes_per_sample: int = 200 * 3 * 4  # 200 points of (strain, stress, flag) as float32

    @property
    def grad_bytes(self) -> int:
        return self.param_count * self.bytes_per_param

    def flops_per_sample(self) -> float:
        # The usual 6·parameters estimate (forward 2, backward 4); a lower bound for convolutions.
        return 6.0 * self.param_count


@dataclass(frozen=True)
class Convergence:
    """Loss against samples seen: loss = final + (initial - final)·(1 + s/(half·(1 + b/critical)))^-exponent.

    Samples needed for a given loss grow with the batch as 1 + b/critical_batch (the critical-batch
    model of large-batch training, with hyperparameters tuned at the small batch), so a larger batch
    reaches a worse loss after the same number of epochs."""

    initial_loss: float = 1.0
    final_loss: float = 0.02
    half_samples: float = 20_000.0
    exponent: float = 0.7
    critical_batch: float = 400.0
    noise_cv_at_batch_75: float = 0.08

    def loss(self, samples_seen: np.ndarray, batch: float) -> np.ndarray:
        scale = self.half_samples * (1.0 + batch / self.critical_batch)
        decay = (1.0 + samples_seen / scale) ** (-self.exponent)
        return self.final_loss + (self.initial_loss - self.final_loss) * decay


#: a GPU held by a running job idles in a higher power state than an unused one
ACTIVE_IDLE_FACTOR = 1.3
#: small kernels draw about half of the board's headroom while they run
KERNEL_POWER_SHARE = 0.55


def board_power_w(partition: Partition, util: np.ndarray) -> np.ndarray:
    """Board power for a kernel-active share `util` (0-1)."""
    active_idle = partition.idle_power_w * ACTIVE_IDLE_FACTOR
    return active_idle + (partition.max_power_w - active_idle) * KERNEL_POWER_SHARE * util


def nodes_for(world_size: int, gpus_per_node: int) -> int:
    return -(-world_size // gpus_per_node)


def ranks_on_nodes(world_size: int, gpus_per_node: int) -> np.ndarray:
    """Sequential placement: fill a node before the next. Element i is the rank count of node i."""
    nodes = nodes_for(world_size, gpus_per_node)
    counts = np.full(nodes, gpus_per_node, dtype=np.int64)
    counts[-1] = world_size - gpus_per_node * (nodes - 1)
    return counts


@dataclass
class Timeline:
    """One run's steps, arrays of shape (steps, ranks), int64 nanoseconds on rank 0's clock."""

    start_ns: np.ndarray
    step_ns: np.ndarray
    data_ns: np.ndarray
    forward_ns: np.ndarray
    backward_ns: np.ndarray
    sync_ns: np.ndarray
    optimizer_ns: np.ndarray
    other_ns: np.ndarray
    enter_ns: np.ndarray  # when the rank entered the allreduce
    compute_kernel_ns: np.ndarray  # GPU kernel time of forward and backward
    kernel_busy_ns: np.ndarray  # all GPU kernel time in the step (with an NCCL ring), as NVML sees it
    node_of_rank: np.ndarray
    ranks_per_node: np.ndarray

    @property
    def end_ns(self) -> np.ndarray:
        return self.start_ns + self.step_ns


def _lognormal(rng: np.random.Generator, cv: float, shape: tuple[int, ...]) -> np.ndarray:
    """Multiplicative noise with median 1, so medians of the simulated phases are the model's values."""
    if cv <= 0:
        return np.ones(shape)
    return np.exp(rng.normal(0.0, math.log1p(cv), shape))


def _ticks(ns: np.ndarray | float) -> np.ndarray:
    return (np.rint(np.asarray(ns) / TIMER_RESOLUTION_NS) * TIMER_RESOLUTION_NS).astype(np.int64)


def simulate_timeline(
    partition: Partition,
    backend: Backend,
    world_size: int,
    batch_per_rank: int,
    steps: int,
    grad_bytes: int,
    t0_ns: int,
    rng: np.random.Generator,
) -> Timeline:
    """Every rank's phases for `steps` steps. Ranks wait in the allreduce for the slowest one."""
    p, k = world_size, steps
    per_node = ranks_on_nodes(p, partition.gpus_per_node)
    node_of_rank = np.repeat(np.arange(len(per_node)), per_node)
    sharing = per_node[node_of_rank]  # ranks sharing each rank's node (and its CPUs)

    rank_speed = _lognormal(rng, partition.rank_cv, (1, p))
    kernel = partition.kernel_ns(batch_per_rank)
    host = np.array([partition.host_ns(int(s)) for s in sharing])[None, :]
    warmup = 1.0 + WARMUP_EXTRA * np.exp(-np.arange(k, dtype=np.float64))[:, None]
    fb = (kernel + host) * rank_speed * warmup * _lognormal(rng, partition.step_cv, (k, p))
    forward = _ticks(fb * FORWARD_SHARE)
    backward = _ticks(fb) - forward
    kernel_fb = _ticks(fb * (kernel / (kernel + host)))
    data = _ticks(partition.data_ns(batch_per_rank) * _lognormal(rng, partition.step_cv, (k, p)))
    cpu = (1.0 + partition.cpu_share_penalty * (sharing - 1))[None, :]
    post_noise = _lognormal(rng, partition.step_cv, (k, p))
    optimizer = _ticks(partition.optimizer_us * 1e3 * cpu * post_noise)
    other = _ticks(partition.other_us * 1e3 * cpu * post_noise)

    nodes = len(per_node)
    comm_noise = _lognormal(rng, partition.comm_cv, (k,))
    ring = _ticks(backend.ring_ns(p, nodes, grad_bytes) * comm_noise)
    coord = _ticks((backend.coord_us * 1e3 if p > 1 else 0.0) * comm_noise)

    pre = data + forward + backward  # from step start to entering the allreduce
    post = optimizer + other
    post_prev = np.vstack([np.zeros((1, p), dtype=np.int64), post[:-1]])
    # All ranks leave allreduce k-1 together at exit[k-1]; allreduce k starts when the last arrives.
    exit_gap = (post_prev + pre).max(axis=1) + coord + ring
    exits = t0_ns + np.cumsum(exit_gap)
    exits_prev = np.concatenate([[t0_ns], exits[:-1]])[:, None]
    start = exits_prev + post_prev
    enter = start + pre
    sync = exits[:, None] - enter
    step = exits[:, None] + post - start
    kernel_busy = kernel_fb + (ring[:, None] if backend.ring_in_gpu_kernel else 0)
    return Timeline(
        start_ns=start,
        step_ns=step,
        data_ns=data,
        forward_ns=forward,
        backward_ns=backward,
        sync_ns=sync,
        optimizer_ns=optimizer,
        other_ns=other,
        enter_ns=enter,
        compute_kernel_ns=kernel_fb,
        kernel_busy_ns=np.broadcast_to(kernel_busy, (k, p)).astype(np.int64),
        node_of_rank=node_of_rank,
        ranks_per_node=per_node,
    )


def amount_in_windows(
    start_ns: np.ndarray, step_ns: np.ndarray, per_step: np.ndarray, sample_ns: np.ndarray, window_ns: int
) -> np.ndarray:
    """How much of a per-step quantity (busy ns, bytes) falls in each window (t - window, t], spreading
    each step's amount evenly over the step. Inputs are one rank's consecutive steps."""
    edges = np.concatenate([[start_ns[0]], start_ns + step_ns])
    cumulative = np.concatenate([[0.0], np.cumsum(per_step, dtype=np.float64)])
    return np.interp(sample_ns, edges, cumulative) - np.interp(sample_ns - window_ns, edges, cumulative)


def busy_share_in_windows(
    start_ns: np.ndarray, step_ns: np.ndarray, busy_ns: np.ndarray, sample_ns: np.ndarray, window_ns: int
) -> np.ndarray:
    """Share of each window a GPU (or a core) was busy: what nvmlDeviceGetUtilizationRates().gpu reports."""
    amount = amount_in_windows(start_ns, step_ns, busy_ns, sample_ns, window_ns)
    return np.clip(amount / window_ns, 0.0, 1.0)
