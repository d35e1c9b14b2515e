"""Writes simulated runs into a store through the real schema and writer: runs, ranks, steps, comm,
gpu_samples, host_samples, metrics and events, every run marked `source = 'simulated'`.

`write_study(store, parse_config(seed_study_config()))` writes the bundled seed study; the config
format is described in perfscope.simulate.presets. The same seed gives the same data.
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .. import __version__
from ..errors import PerfscopeError
from ..output import is_store_folder, store_target
from ..store.schema import TABLES, run_id_size_problem
from ..store.writer import StoreWriter
from .model import (
    Backend,
    Convergence,
    Partition,
    Timeline,
    Workload,
    amount_in_windows,
    board_power_w,
    busy_share_in_windows,
    simulate_timeline,
)
from .presets import StudyConfig

#: simulated runs follow each other with this much idle time in between (a job queue)
RUN_GAP_NS = 30_000_000_000
#: NVML and host poll period; NVML's own utilisation window is 1/6 s to 1 s
SAMPLE_PERIOD_NS = 100_000_000
WRITER_ID = "simulate"
_GIB = 1024**3
_CUDA_CONTEXT_BYTES = int(0.55 * _GIB)  # CUDA context plus framework workspace
_ACTIVATION_BYTES_PER_SAMPLE = 64 * 1024
_PROCESS_BASE_RSS_BYTES = 2 * _GIB
_HELPER_THREADS_CPU_PCT = 30.0  # Horovod's background thread and framework helpers, per rank
#: the per-rank tables (steps, comm, gpu_samples) are built and written this many ranks at a time,
#: so a 4,096-rank run holds one block of rows in memory, not the whole run (9.4 GB at 4,096 x 1,000)
RANKS_PER_BLOCK = 512


@dataclass(frozen=True)
class RunSpec:
    """One simulated run: where, how and how long."""

    run_id: str
    experiment: str
    partition: Partition
    backend: Backend
    workload: Workload
    world_size: int
    batch_per_rank: int
    steps: int
    scaling_mode: str
    convergence: Convergence | None = None
    extra_tags: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.partition.gpus_per_node)


def run_id_for(experiment: str, partition: str, backend: str, world_size: int, batch: int, seed: int) -> str:
    """Readable and deterministic, so the same study twice is the same data (and a clash is caught)."""
    return f"sim-{experiment}-{partition}-{backend}-n{world_size:03d}-b{batch}-s{seed}"


def plan_runs(cfg: StudyConfig, extra_tags: Mapping[str, Any] | None = None) -> list[RunSpec]:
    """Every run of a study: each experiment's partitions × backends × batch sizes × world sizes."""
    return [
        RunSpec(
            run_id=run_id_for(exp.name, part.name, backend, n, batch, cfg.seed),
            experiment=exp.name,
            partition=part,
            backend=part.backends[backend],
            workload=cfg.workload,
            world_size=n,
            batch_per_rank=batch,
            steps=exp.steps,
            scaling_mode=exp.scaling_mode,
            convergence=cfg.convergence if exp.convergence else None,
            extra_tags=dict(extra_tags or {}),
        )
        for exp in cfg.experiments
        for part, backend, batch, n in itertools.product(
            exp.partitions, exp.backends, exp.batch_sizes, exp.world_sizes
        )
    ]


# ---- one run's tables ---------------------------------------------------------------------------


def _rank_major(a: np.ndarray) -> np.ndarray:
    """(steps, ranks) -> flat, all steps of rank 0 first: rows sorted like a rank's own segments."""
    return np.ascontiguousarray(a.T).ravel()


def _table(name: str, columns: Mapping[str, Any]) -> pa.Table:
    schema = TABLES[name].arrow_schema
    n = max((len(v) for v in columns.values() if not np.isscalar(v) and v is not None), default=0)
    arrays = []
    for f in schema:
        v = columns.get(f.name)
        if v is None:
            arrays.append(pa.nulls(n, f.type))
        elif isinstance(v, str | int | float) or np.isscalar(v):
            arrays.append(pa.array([v] * n, type=f.type))
        else:
            arrays.append(pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _rank_blocks(world_size: int) -> list[range]:
    return [range(lo, min(lo + RANKS_PER_BLOCK, world_size)) for lo in range(0, world_size, RANKS_PER_BLOCK)]


def _steps_table(spec: RunSpec, tl: Timeline, ranks: range) -> pa.Table:
    k, p = tl.step_ns.shape
    comm = p > 1
    cols = slice(ranks.start, ranks.stop)
    n = k * len(ranks)
    return _table(
        "steps",
        {
            "rank": np.repeat(np.arange(ranks.start, ranks.stop, dtype=np.int32), k),
            "step": np.tile(np.arange(k, dtype=np.int64), len(ranks)),
            "start_ns": _rank_major(tl.start_ns[:, cols]),
            "step_ns": _rank_major(tl.step_ns[:, cols]),
            "data_ns": _rank_major(tl.data_ns[:, cols]),
            "forward_ns": _rank_major(tl.forward_ns[:, cols]),
            "backward_ns": _rank_major(tl.backward_ns[:, cols]),
            "sync_exposed_ns": _rank_major(tl.sync_ns[:, cols]),
            "optimizer_ns": _rank_major(tl.optimizer_ns[:, cols]),
            "other_ns": _rank_major(tl.other_ns[:, cols]),
            "comm_total_ns": _rank_major(tl.sync_ns[:, cols]) if comm else np.zeros(n, dtype=np.int64),
            "comm_count": np.full(n, 1 if comm else 0, dtype=np.int32),
            "samples": np.full(n, spec.batch_per_rank, dtype=np.int32),
            "clock": "cuda",
        },
    )


def _comm_table(spec: RunSpec, tl: Timeline, grad_bytes: int, ranks: range) -> pa.Table:
    k = tl.step_ns.shape[0]
    cols = slice(ranks.start, ranks.stop)
    n = k * len(ranks)
    return _table(
        "comm",
        {
            "rank": np.repeat(np.arange(ranks.start, ranks.stop, dtype=np.int32), k),
            "step": np.tile(np.arange(k, dtype=np.int64), len(ranks)),
            "seq": np.zeros(n, dtype=np.int32),
            "op": "allreduce",
            "bytes": np.full(n, grad_bytes, dtype=np.int64),
            "start_ns": _rank_major(tl.enter_ns[:, cols]),
            "dur_ns": _rank_major(tl.sync_ns[:, cols]),
            # NCCL durations come from CUDA events on its stream; MPI's are host timers.
            "clock": "cuda" if spec.backend.ring_in_gpu_kernel else "host",
        },
    )


def _sample_times(t0_ns: int, end_ns: int) -> np.ndarray:
    return np.arange(t0_ns + SAMPLE_PERIOD_NS, end_ns + SAMPLE_PERIOD_NS, SAMPLE_PERIOD_NS, dtype=np.int64)


def _rate_in_windows(tl: Timeline, rank: int, per_step: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Per-second rate of a per-step quantity (bytes) over each sample window of one rank."""
    amount = amount_in_windows(tl.start_ns[:, rank], tl.step_ns[:, rank], per_step, ts, SAMPLE_PERIOD_NS)
    return amount / (SAMPLE_PERIOD_NS / 1e9)


def _gpu_table(
    spec: RunSpec, tl: Timeline, workload: Workload, ts: np.ndarray, rng: np.random.Generator, ranks: range
) -> pa.Table:
    part, backend = spec.partition, spec.backend
    k, p = tl.step_ns.shape
    ring_bytes = 2 * (p - 1) / p * workload.grad_bytes if p > 1 else 0.0
    over_nvlink = part.has_nvlink and backend.ring_in_gpu_kernel
    input_bytes = float(workload.input_bytes_per_sample * spec.batch_per_rank)
    pcie_rx_step = np.full(k, input_bytes + (0.0 if over_nvlink else ring_bytes))
    pcie_tx_step = np.full(k, 0.0 if over_nvlink else ring_bytes)
    mem_used = min(
        part.device_mem_bytes,
        _CUDA_CONTEXT_BYTES + 4 * workload.grad_bytes + _ACTIVATION_BYTES_PER_SAMPLE * spec.batch_per_rank,
    )
    cols: dict[str, list[Any]] = {name: [] for name in TABLES["gpu_samples"].column_names}
    for rank in ranks:
        node = int(tl.node_of_rank[rank])
        local = rank - int(tl.ranks_per_node[:node].sum())
        util = busy_share_in_windows(
            tl.start_ns[:, rank], tl.step_ns[:, rank], tl.kernel_busy_ns[:, rank], ts, SAMPLE_PERIOD_NS
        )
        n = len(ts)
        power_w = board_power_w(part, util) * np.exp(rng.normal(0.0, 0.01, n))
        energy_mj = rng.uniform(1e8, 1e10) + np.cumsum(power_w * 1e3 * SAMPLE_PERIOD_NS / 1e9)
        heat = (power_w - part.idle_power_w) / max(part.max_power_w - part.idle_power_w, 1.0)
        nvlink = _rate_in_windows(tl, rank, np.full(k, ring_bytes), ts) / 1024 if over_nvlink else None
        cols["ts_ns"].append(ts)
        cols["hostname"].append([part.hostname(node)] * n)
        cols["node_rank"].append(np.full(n, node, dtype=np.int32))
        cols["gpu_index"].append(np.full(n, local, dtype=np.int16))
        cols["gpu_uuid"].append([_gpu_uuid(part.hostname(node), local)] * n)
        cols["util_gpu_pct"].append(np.round(util * 100.0, 1))
        cols["util_mem_pct"].append(np.round(util * 35.0, 1))
        cols["mem_used_bytes"].append(np.full(n, mem_used, dtype=np.int64))
        cols["mem_total_bytes"].append(np.full(n, part.device_mem_bytes, dtype=np.int64))
        cols["power_mw"].append(np.round(power_w * 1e3))
        cols["energy_mj"].append(np.round(energy_mj))
        cols["sm_clock_mhz"].append(np.full(n, part.sm_clock_mhz))
        cols["mem_clock_mhz"].append(np.full(n, part.mem_clock_mhz))
        cols["temp_c"].append(np.round(32.0 + 40.0 * heat + rng.normal(0.0, 0.3, n), 1))
        cols["pcie_tx_kbps"].append(np.round(_rate_in_windows(tl, rank, pcie_tx_step, ts) / 1e3))
        cols["pcie_rx_kbps"].append(np.round(_rate_in_windows(tl, rank, pcie_rx_step, ts) / 1e3))
        nv = np.round(nvlink) if nvlink is not None else [None] * n
        cols["nvlink_tx_kbps"].append(nv)
        cols["nvlink_rx_kbps"].append(nv)
        cols["clocks_event_reasons"].append(np.zeros(n, dtype=np.int64))
        cols["gpm_sm_active_pct"].append([None] * n)
        cols["gpm_tensor_active_pct"].append([None] * n)
    return _table("gpu_samples", {c: _concat(v) for c, v in cols.items()})


def _concat(parts: list[Any]) -> list[Any] | np.ndarray:
    if all(isinstance(x, np.ndarray) for x in parts):
        return np.concatenate(parts)
    return [v for x in parts for v in (x.tolist() if isinstance(x, np.ndarray) else x)]


def _gpu_uuid(hostname: str, index: int) -> str:
    h = f"{zlib.crc32(f'{hostname}/{index}'.encode()):08x}"
    return f"GPU-{h}-{h[:4]}-{h[4:]}-0000-{index:012x}"


def _host_table(spec: RunSpec, tl: Timeline, workload: Workload, ts: np.ndarray) -> pa.Table:
    part = spec.partition
    host_busy = (
        tl.data_ns + tl.forward_ns + tl.backward_ns - tl.compute_kernel_ns + tl.optimizer_ns + tl.other_ns
    )
    if not spec.backend.ring_in_gpu_kernel:
        host_busy = host_busy + tl.sync_ns  # MPI progresses the ring by polling on the host
    dataset_bytes = workload.dataset_samples * workload.input_bytes_per_sample / 0.75  # train is 75%
    rss_per_rank = _PROCESS_BASE_RSS_BYTES + int(dataset_bytes)
    rows: dict[str, list[Any]] = {name: [] for name in TABLES["host_samples"].column_names}
    for node, count in enumerate(tl.ranks_per_node.tolist()):
        ranks = np.flatnonzero(tl.node_of_rank == node)
        proc = np.zeros(len(ts))
        for r in ranks:
            share = busy_share_in_windows(
                tl.start_ns[:, r], tl.step_ns[:, r], host_busy[:, r], ts, SAMPLE_PERIOD_NS
            )
            proc += 100.0 * share + _HELPER_THREADS_CPU_PCT
        n = len(ts)
        rows["ts_ns"].append(ts)
        rows["hostname"].append([part.hostname(node)] * n)
        rows["node_rank"].append(np.full(n, node, dtype=np.int32))
        rows["proc_cpu_pct"].append(np.round(proc, 1))
        rows["sys_cpu_pct"].append(np.round(np.minimum(100.0, proc / part.cpus_per_node + 1.0), 1))
        rows["rss_bytes"].append(np.full(n, count * rss_per_rank, dtype=np.int64))
        rows["sys_mem_used_bytes"].append(np.full(n, count * rss_per_rank + 6 * _GIB, dtype=np.int64))
        rows["load1"].append(np.full(n, round(count * 1.6 + 0.3, 2)))
        rows["cpu_count"].append(np.full(n, part.cpus_per_node, dtype=np.int32))
    return _table("host_samples", {c: _concat(v) for c, v in rows.items()})


def _metrics_table(spec: RunSpec, tl: Timeline, rng: np.random.Generator) -> pa.Table | None:
    conv = spec.convergence
    if conv is None:
        return None
    k = tl.step_ns.shape[0]
    global_batch = spec.batch_per_rank * spec.world_size
    seen = (np.arange(k) + 1.0) * global_batch
    # Minibatch noise on the logged training loss shrinks with the square root of the batch.
    cv = conv.noise_cv_at_batch_75 * math.sqrt(75.0 / global_batch)
    loss = conv.loss(seen, global_batch) * np.exp(rng.normal(0.0, cv, k))
    return _table(
        "metrics",
        {
            "rank": np.zeros(k, dtype=np.int32),
            "step": np.arange(k, dtype=np.int64),
            "ts_ns": tl.end_ns[:, 0],
            "name": "loss",
            "value": loss,
        },
    )


def _tags(spec: RunSpec, seed: int) -> str:
    part = asdict(spec.partition)
    part.pop("backends")
    part.pop("software")
    tags: dict[str, Any] = {
        "simulated": True,
        "generator": "perfscope simulate",
        "seed": seed,
        "node_gpus": spec.partition.gpus_per_node,
        "partition_model": part,
        "backend_model": asdict(spec.backend),
        "workload": asdict(spec.workload),
    }
    if spec.convergence is not None:
        tags["convergence"] = asdict(spec.convergence)
    tags.update(spec.extra_tags)
    return json.dumps(tags, sort_keys=True, separators=(",", ":"))


def simulate_run(spec: RunSpec, seed: int, t0_ns: int) -> Iterator[tuple[str, pa.Table]]:
    """Every table of one run, starting at wall clock `t0_ns`, as (table, rows) pieces in writing
    order: `runs` first, the per-rank tables in blocks of RANKS_PER_BLOCK ranks. Pieces are made
    as they are asked for, in the order the seeded generator is drawn, so a run of any size
    holds one block in memory and the same seed gives the same rows."""
    part, p, workload = spec.partition, spec.world_size, spec.workload
    # Seeded per run id, so adding or removing other runs never changes this one.
    rng = np.random.default_rng([seed, zlib.crc32(spec.run_id.encode())])
    tl = simulate_timeline(
        part, spec.backend, p, spec.batch_per_rank, spec.steps, workload.grad_bytes, t0_ns, rng
    )
    end_ns = int(tl.end_ns.max())
    ts = _sample_times(t0_ns, end_ns)
    node_rank = tl.node_of_rank.astype(np.int32)
    local_rank = np.concatenate([np.arange(c) for c in tl.ranks_per_node]).astype(np.int32)
    hosts = [part.hostname(int(n)) for n in node_rank]
    # Ranks on other nodes start a little apart; their timestamps are already corrected.
    offsets = np.where(node_rank == 0, 0, rng.integers(-80_000, 80_000, p))
    yield (
        "runs",
        _table(
            "runs",
            {
                "experiment": [spec.experiment],
                "source": "simulated",
                "started_ns": t0_ns,
                "world_size": p,
                "nodes": spec.nodes,
                # the local world size of the fullest host, as a collector would record it
                "gpus_per_node": min(p, part.gpus_per_node),
                "backend": spec.backend.name,
                "device_model": part.device_model,
                "device_peak_flops": part.device_peak_flops or None,
                "cluster": part.name,
                "model": workload.name,
                "batch_size_per_rank": spec.batch_per_rank,
                "global_batch_size": spec.batch_per_rank * p,
                "param_count": workload.param_count,
                "grad_bytes": workload.grad_bytes,
                "scaling_mode": spec.scaling_mode,
                "flops_per_step": workload.flops_per_sample() * spec.batch_per_rank,
                "dataset_samples": workload.dataset_samples or None,
                "hostname": hosts[0],
                "perfscope_version": __version__,
                **{key: part.software.get(key, "") for key in _SOFTWARE_COLUMNS},
                "tags": _tags(spec, seed),
                "ended_ns": end_ns,
            },
        ),
    )
    yield (
        "ranks",
        _table(
            "ranks",
            {
                "rank": np.arange(p, dtype=np.int32),
                "local_rank": local_rank,
                "node_rank": node_rank,
                "hostname": hosts,
                "pid": 4000 + 17 * np.arange(p) + rng.integers(0, 9, p),
                "clock_offset_ns": offsets,
                "cpu_count": np.full(p, part.cpus_per_node, dtype=np.int32),
                "device_index": local_rank,
                "device_name": [part.device_model] * p,
                "started_ns": np.full(p, t0_ns, dtype=np.int64) - 2_000_000_000,
            },
        ),
    )
    for ranks in _rank_blocks(p):
        yield "steps", _steps_table(spec, tl, ranks)
    if p > 1:  # a ring of one moves nothing: Horovod returns the tensor as it is
        for ranks in _rank_blocks(p):
            yield "comm", _comm_table(spec, tl, workload.grad_bytes, ranks)
    if part.gpu_telemetry:
        for ranks in _rank_blocks(p):
            yield "gpu_samples", _gpu_table(spec, tl, workload, ts, rng, ranks)
    yield "host_samples", _host_table(spec, tl, workload, ts)
    metrics = _metrics_table(spec, tl, rng)
    if metrics is not None:
        yield "metrics", metrics
    yield (
        "events",
        _table(
            "events",
            {
                "rank": [0],
                "ts_ns": t0_ns,
                "kind": "simulated",
                "message": "run generated by perfscope simulate from a cost model; nothing was measured",
            },
        ),
    )


_SOFTWARE_COLUMNS = ("python_version", "torch_version", "cuda_version", "nccl_version", "driver_version")


# ---- the store ----------------------------------------------------------------------------------


def existing_run_ids(root: Path) -> set[str]:
    """Run ids already in the store, or an error when `root` is neither a store nor empty."""
    store_target(root)
    if not is_store_folder(root):
        return set()
    found: set[str] = set()
    for name in TABLES:
        for d in (root / name).glob("run_id=*"):
            found.add(d.name.split("=", 1)[1])
    return found


def write_runs(root: str | Path, specs: Sequence[RunSpec], seed: int, start_ns: int) -> list[str]:
    """Simulate `specs` one after another from `start_ns` and write them; returns the run ids."""
    root = Path(root)
    clash = sorted(existing_run_ids(root) & {s.run_id for s in specs})
    if clash:
        raise PerfscopeError(
            f"{root} already holds {len(clash)} of these runs (e.g. {clash[0]}); the same seed gives "
            "the same runs. Pick another --seed or another store."
        )
    if len({s.run_id for s in specs}) != len(specs):
        raise PerfscopeError("two simulated runs would get the same id; make experiment names differ")
    for spec in specs:  # before any run is written
        if problem := run_id_size_problem(spec.run_id):
            raise PerfscopeError(f"{problem}: shorten the experiment, partition or backend names")
    store_target(root, create=True)
    t0 = start_ns
    for spec in specs:
        writer = StoreWriter(root, spec.run_id, writer_id=WRITER_ID)
        end_ns = t0
        for name, table in simulate_run(spec, seed, t0):
            if name == "runs":
                end_ns = table.column("ended_ns")[0].as_py()
            writer.write_arrow(name, table)
        stats = writer.close()
        if stats.rows_dropped:
            raise PerfscopeError(
                f"could not write run {spec.run_id} to {root} ({stats.write_errors} failed writes); "
                "check that the folder is writable and the disk has space"
            )
        t0 = end_ns + RUN_GAP_NS
    return [s.run_id for s in specs]


def write_study(root: str | Path, cfg: StudyConfig, extra_tags: Mapping[str, Any] | None = None) -> list[str]:
    """Write every run of a parsed config into the store at `root`."""
    return write_runs(root, plan_runs(cfg, extra_tags), cfg.seed, cfg.start_ns)
