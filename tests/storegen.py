"""Hand-made stores for tests: runs written through the real StoreWriter, with known numbers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from perfscope.store.schema import TABLES
from perfscope.store.writer import StoreWriter

T0_NS = 1_700_000_000_000_000_000
MS = 1_000_000

#: Phase durations (ns) of every rank and step unless overridden.
DEFAULT_PHASES: dict[str, float] = {
    "data": 1 * MS,
    "forward": 10 * MS,
    "backward": 20 * MS,
    "sync_exposed": 2 * MS,
    "optimizer": 1 * MS,
    "other": 1 * MS,
}
PHASE_ORDER = ("data", "forward", "backward", "sync_exposed", "optimizer", "other")

PhaseFn = Callable[[int, int], Mapping[str, float | None]]


@dataclass
class Comm:
    """Collectives of every step: one allreduce per bucket, each entered when the rank's forward
    phase ends plus `delay_ns(rank, step)`. Every rank leaves when the last one has entered and
    `transfer_ns(bucket_bytes)` has passed, so a rank's dur_ns includes its wait. Buckets of one
    step are entered together (what matters here is who waits, not the bucket pipeline).
    """

    bucket_bytes: list[int]
    transfer_ns: Callable[[int], float]
    delay_ns: Callable[[int, int], float] = lambda rank, step: 0.0


@dataclass
class Gpu:
    """NVML-like samples every `interval_ns` for each rank's GPU over the run's time span."""

    util_pct: Callable[[int], float] = lambda rank: 80.0
    power_w: float = 300.0
    sm_clock_mhz: float = 1980.0
    clocks_event_reasons: int = 0
    mem_used_bytes: int = 20 * 2**30
    interval_ns: int = 100 * MS
    with_energy: bool = True


@dataclass
class Host:
    proc_cpu_pct: float = 100.0
    sys_cpu_pct: float | None = None  # None: the job's processes only (proc_cpu_pct / cpu_count)
    interval_ns: int = 200 * MS


@dataclass
class RunSpec:
    world_size: int = 1
    steps: int = 40
    experiment: str = "exp"
    source: str = "measured"
    cluster: str = "c1"
    backend: str = "nccl"
    model: str = "mlp"
    device_model: str = "NVIDIA H100"
    batch_size_per_rank: int | None = 32  # None: not recorded (zero-code recording of an unknown batch)
    global_batch_size: int | None = None
    scaling_mode: str = ""
    gpus_per_node: int = 8  # GPUs of a node; ranks fill a node before the next (sequential placement)
    cpu_count: int = 64
    device: bool = True  # ranks have a CUDA device_index
    phases: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_PHASES))
    phase_fn: PhaseFn | None = None  # (rank, step) -> overrides
    ranks_present: set[int] | None = None
    comm: Comm | None = None
    gpu: Gpu | None = None
    host: Host | None = None
    metrics: Mapping[str, Callable[[int], float]] = field(default_factory=dict)
    grad_bytes: int | None = None
    param_count: int | None = None
    flops_per_step: float | None = None
    device_peak_flops: float | None = None
    dataset_samples: int | None = None
    comm_total_from_comm: bool = True
    start_ns: int = T0_NS
    write_runs_row: bool = True
    clock: str = "cuda"
    tags: Mapping[str, object] = field(default_factory=dict)
    torch_threads: int | None = None  # per rank, as recorded in `ranks` (NULL: not recorded)
    affinity_cores: int | None = None  # logical CPUs each rank may use (NULL: not recorded)
    #: (rank, step) -> the rank's RSS: with `host`, a proc_memory sample at each step's start (default 1 GiB)
    rss_fn: Callable[[int, int], float] | None = None
    #: (rank, step) -> the CUDA allocator's peak allocated bytes of the step: device_memory rows
    #: (none when None)
    cuda_peak_fn: Callable[[int, int], float] | None = None
    device_total_bytes: int = 80 * 2**30
    runs_extra: Mapping[str, object] = field(default_factory=dict)  # more runs columns (the job's settings)


def _nodes(spec: RunSpec) -> int:
    return max(1, -(-spec.world_size // spec.gpus_per_node))


def row(table: str, **values: object) -> tuple[object, ...]:
    """A row tuple in the table's schema order; columns not named are NULL, so appending a nullable
    column to the schema never breaks a store built here."""
    unknown = set(values) - set(TABLES[table].column_names)
    if unknown:
        raise TypeError(f"{table} has no column(s) {sorted(unknown)}")
    return tuple(values.get(c) for c in TABLES[table].column_names)


def make_run(root: str | os.PathLike[str], run_id: str, spec: RunSpec | None = None, **kw: object) -> RunSpec:
    """Write one run into the store at `root`; keyword arguments override RunSpec fields."""
    spec = spec or RunSpec()
    for k, v in kw.items():
        if not hasattr(spec, k):
            raise TypeError(f"make_run: unknown field {k}")
        setattr(spec, k, v)
    n = spec.world_size
    local = min(n, spec.gpus_per_node)
    nodes = _nodes(spec)
    present = spec.ranks_present if spec.ranks_present is not None else set(range(n))
    per_rank = spec.batch_size_per_rank
    gbs = spec.global_batch_size or (per_rank * n if per_rank is not None else None)  # None: unrecorded
    w = StoreWriter(root, run_id, writer_id=f"gen-{run_id}")
    end_ns = spec.start_ns
    steps_rows, comm_rows = [], []
    mem_rows: list[tuple[str, tuple[object, ...]]] = []
    t = spec.start_ns
    for step in range(spec.steps):
        per_rank = {}
        for r in sorted(present):
            ph: dict[str, float | None] = dict(spec.phases)
            if spec.phase_fn is not None:
                ph.update(spec.phase_fn(r, step))
            per_rank[r] = ph
        step_len = 0.0
        enters: dict[int, int] = {}
        if spec.comm is not None:
            for r, ph in per_rank.items():
                before = (ph.get("data") or 0) + (ph.get("forward") or 0)
                enters[r] = t + int(before + spec.comm.delay_ns(r, step))
        last_enter = max(enters.values(), default=0)
        for r, ph in per_rank.items():
            durs = {p: ph.get(p) for p in PHASE_ORDER}
            step_ns = int(sum(v or 0 for v in durs.values()))
            step_len = max(step_len, step_ns)
            comm_total = None
            comm_count = None
            if spec.comm is not None:
                comm_total = 0
                for seq, nbytes in enumerate(spec.comm.bucket_bytes):
                    # every rank leaves once the last one has entered and the transfer is done
                    dur = int(last_enter - enters[r] + spec.comm.transfer_ns(nbytes))
                    comm_rows.append(
                        row(
                            "comm",
                            rank=r,
                            step=step,
                            seq=seq,
                            op="allreduce",
                            bucket=seq,
                            bytes=nbytes,
                            start_ns=enters[r],
                            dur_ns=dur,
                            clock=spec.clock,
                        )
                    )
                    comm_total += dur
                comm_count = len(spec.comm.bucket_bytes)
                if not spec.comm_total_from_comm:
                    comm_total = None
            phase_ns = {f"{p}_ns": None if durs[p] is None else int(durs[p] or 0) for p in PHASE_ORDER}
            if spec.host is not None:
                rss = spec.rss_fn(r, step) if spec.rss_fn is not None else 2**30
                node = r // spec.gpus_per_node
                mem_rows.append(("proc_memory", row("proc_memory", ts_ns=t + 1, hostname=f"node{node}",
                    node_rank=node, pid=1000 + r, rss_bytes=int(rss),
                    host_available_bytes=2**36, host_total_bytes=2**37)))  # fmt: skip
            if spec.cuda_peak_fn is not None:
                peak = int(spec.cuda_peak_fn(r, step))
                mem_rows.append(("device_memory", row("device_memory", rank=r, step=step, ts_ns=t + step_ns,
                    peak_allocated_bytes=peak, peak_reserved_bytes=peak + 2**28,
                    device_total_bytes=spec.device_total_bytes)))  # fmt: skip
            steps_rows.append(
                row(
                    "steps",
                    rank=r,
                    step=step,
                    start_ns=t,
                    step_ns=step_ns,
                    **phase_ns,
                    comm_total_ns=comm_total,
                    comm_count=comm_count,
                    samples=spec.batch_size_per_rank,
                    clock=spec.clock,
                )
            )
        t += int(step_len)
    end_ns = t
    w.extend("steps", steps_rows)
    if comm_rows:
        w.extend("comm", comm_rows)
    for table, mem in mem_rows:
        w.append(table, mem)
    for r in sorted(present):
        node = r // spec.gpus_per_node
        w.append(
            "ranks",
            row(
                "ranks",
                rank=r,
                local_rank=r % spec.gpus_per_node,
                node_rank=node,
                hostname=f"node{node}",
                pid=1000 + r,
                clock_offset_ns=0,
                cpu_count=spec.cpu_count,
                device_index=(r % spec.gpus_per_node) if spec.device else None,
                device_name=spec.device_model if spec.device else "cpu",
                started_ns=spec.start_ns,
                torch_threads=spec.torch_threads,
                affinity_cores=spec.affinity_cores,
            ),
        )
    if spec.gpu is not None:
        g = spec.gpu
        for r in sorted(present):
            node = r // spec.gpus_per_node
            energy = 0.0
            ts = spec.start_ns
            while ts <= end_ns:
                w.append(
                    "gpu_samples",
                    row(
                        "gpu_samples",
                        ts_ns=ts,
                        hostname=f"node{node}",
                        node_rank=node,
                        gpu_index=r % spec.gpus_per_node,
                        gpu_uuid=f"GPU-{node}-{r}",
                        util_gpu_pct=g.util_pct(r),
                        util_mem_pct=10.0,
                        mem_used_bytes=g.mem_used_bytes,
                        mem_total_bytes=80 * 2**30,
                        power_mw=g.power_w * 1000,
                        energy_mj=energy if g.with_energy else None,
                        sm_clock_mhz=g.sm_clock_mhz,
                        mem_clock_mhz=2600.0,
                        temp_c=60.0,
                        clocks_event_reasons=g.clocks_event_reasons,
                    ),
                )
                energy += g.power_w * 1000 * g.interval_ns / 1e9  # mJ
                ts += g.interval_ns
    if spec.host is not None:
        for node in range(nodes):
            ts = spec.start_ns
            while ts <= end_ns:
                w.append(
                    "host_samples",
                    row(
                        "host_samples",
                        ts_ns=ts,
                        hostname=f"node{node}",
                        node_rank=node,
                        proc_cpu_pct=spec.host.proc_cpu_pct,
                        sys_cpu_pct=spec.host.proc_cpu_pct / spec.cpu_count
                        if spec.host.sys_cpu_pct is None
                        else spec.host.sys_cpu_pct,
                        rss_bytes=2**30,
                        sys_mem_used_bytes=2**34,
                        load1=1.0,
                        cpu_count=spec.cpu_count,
                    ),
                )
                ts += spec.host.interval_ns
    low = min(present) if present else 0
    for name, fn in spec.metrics.items():
        for step in range(spec.steps):
            frac = (step + 1) / spec.steps
            ts = int(spec.start_ns + frac * (end_ns - spec.start_ns))
            w.append("metrics", row("metrics", rank=low, step=step, ts_ns=ts, name=name, value=fn(step)))
    if spec.write_runs_row:
        w.append(
            "runs",
            row(
                "runs",
                experiment=spec.experiment,
                source=spec.source,
                started_ns=spec.start_ns,
                world_size=n,
                nodes=nodes,
                gpus_per_node=local,
                backend=spec.backend,
                device_model=spec.device_model,
                device_peak_flops=spec.device_peak_flops,
                cluster=spec.cluster,
                model=spec.model,
                batch_size_per_rank=spec.batch_size_per_rank,
                global_batch_size=gbs,
                param_count=spec.param_count,
                grad_bytes=spec.grad_bytes,
                scaling_mode=spec.scaling_mode,
                flops_per_step=spec.flops_per_step,
                dataset_samples=spec.dataset_samples,
                hostname="node0",
                perfscope_version="0.1.0",
                python_version="3.11",
                torch_version="2.13",
                tags=json.dumps(dict(spec.tags)),
                ended_ns=end_ns,
                **spec.runs_extra,
            ),
        )
    w.close()
    return spec


def ring_transfer_ns(p: int, nbytes: float, alpha_s: float, beta_s_per_byte: float) -> float:
    """Ring allreduce time (DESIGN's alpha-beta model) in ns."""
    return 1e9 * (2 * (p - 1) * alpha_s + 2 * (p - 1) / p * nbytes * beta_s_per_byte)


def healthy_study(
    root: str | os.PathLike[str], sizes: tuple[int, ...] = (1, 2, 4, 8, 16), **kw: object
) -> None:
    """A study that scales well: small constant exposed sync, overlapped comm over a fast link,
    little data loading, busy GPUs, one rank per GPU and plenty of cores. Explains to no finding."""
    for n in sizes:
        phases = {**DEFAULT_PHASES, "sync_exposed": 1 * MS if n > 1 else 0}
        make_run(
            root,
            f"healthy-n{n}",
            world_size=n,
            gpus_per_node=16,
            grad_bytes=2**25,
            phases=phases,
            gpu=Gpu(util_pct=lambda r: 85.0),
            host=Host(),
            comm=Comm([2**24, 2**24], lambda nb, n=n: ring_transfer_ns(n, nb, 5e-6, 1 / 100e9)),
            **kw,
        )
