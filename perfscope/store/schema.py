"""The store's schema: every table, column, type and unit. The contract between producers and consumers.

Units live in column names (`_ns`, `_bytes`, `_pct`, `_mw`, `_mj`, `_mhz`, `_kbps`). Every table is
hive-partitioned by `run_id`, so `run_id` is a column of every view but is never stored inside a file.
`python -m perfscope.store.schema` prints docs/schema.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

#: Bump when a column changes meaning or type; adding a nullable column needs no bump
#: (readers union columns by name and fill the missing ones with NULL).
#: Version 2: every torch.distributed call is recorded (`comm` gains peer, group_size, exposed_ns,
#: is_async, phase; `ranks` gains role), and a step's phase columns no longer hold the exposed
#: communication recorded inside them (`comm.exposed_ns` by `comm.phase` holds it).
#: Version 3: the parallel layout: `runs` gains dp/pp/tp/cp sizes, `ranks` each rank's coordinates
#: (dp_rank, pp_stage, tp_rank, cp_rank), `comm` the process group a call ran on (group_ranks) and the
#: framework's name for it (name). Older stores read them as NULL.
SCHEMA_VERSION = 3
#: Oldest version this reader can migrate: columns added since read as their `migrated` value.
MIN_READABLE_VERSION = 1

META_VERSION = b"perfscope.schema_version"
META_TABLE = b"perfscope.table"
META_REPLACES = b"perfscope.replaces"

PARTITION_KEY = "run_id"
#: a run id names folders (`run_id=<id>`, and '<id>-<8 hex digits>' when it is taken): with this many
#: bytes at most, every such name stays under the 255 bytes a file name may have
MAX_RUN_ID_BYTES = 200


def run_id_size_problem(run_id: str) -> str:
    """Why `run_id` is too long to name the store's folders, or ''. Checked when a run starts (profile,
    perfscope run, an import, the store writer): a longer id was accepted, then every write failed."""
    size = len(run_id.encode("utf-8", "surrogatepass"))
    if size <= MAX_RUN_ID_BYTES:
        return ""
    start = run_id[:40].encode("utf-8", "backslashreplace").decode()
    return (
        f"run id {start!r}... is {size:,} bytes long (in UTF-8); a run id names the store's folders "
        f"(a file name has at most 255 bytes) and may have at most {MAX_RUN_ID_BYTES} bytes"
    )


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    unit: str
    doc: str
    #: schema version that added the column; a producer may leave such trailing columns out
    since: int = 1
    #: SQL value of the column in segments written before `since` (NULL when None)
    migrated: str | None = None


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema(
            [pa.field(c.name, c.type) for c in self.columns],
            metadata={META_TABLE: self.name.encode(), META_VERSION: str(SCHEMA_VERSION).encode()},
        )

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def min_width(self) -> int:
        """Values a row must hold: trailing columns added after version 1 may be left out (NULL)."""
        width = len(self.columns)
        while width and self.columns[width - 1].since > 1:
            width -= 1
        return width


def _c(
    name: str, typ: pa.DataType, unit: str, doc: str, *, since: int = 1, migrated: str | None = None
) -> Column:
    return Column(name, typ, unit, doc, since, migrated)


i16, i32, i64, f32, f64, s, b = (
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.float32(),
    pa.float64(),
    pa.string(),
    pa.bool_(),
)

RANK = _c("rank", i32, "", "global rank of the process that recorded the row")
STEP = _c("step", i64, "", "optimizer step index, from 0, counted by the collector on each rank")
CLOCK = _c("clock", s, "", "clock the durations came from: 'host' (perf_counter) or 'cuda' (CUDA events)")

RUNS = Table(
    "runs",
    "One row per run, written by rank 0 when the run starts (and rewritten with final values at close).",
    (
        _c("experiment", s, "", "user label grouping runs of one study"),
        _c(
            "source",
            s,
            "",
            "'measured' (recorded by a collector) or 'simulated' (perfscope simulate)",
        ),
        _c("started_ns", i64, "ns since epoch", "wall-clock start of the run on rank 0"),
        _c("world_size", i32, "", "number of ranks (GPUs or processes) in the run"),
        _c("nodes", i32, "", "number of hosts"),
        _c("gpus_per_node", i32, "", "ranks per host (local world size)"),
        _c("backend", s, "", "collective backend: nccl, gloo, mpi, horovod-nccl, horovod-mpi, none"),
        _c("device_model", s, "", "accelerator model, e.g. 'NVIDIA H200', or 'cpu'"),
        _c(
            "device_peak_flops",
            f64,
            "FLOP/s",
            "peak FLOP/s of one device for the dtype used; NULL unknown",
        ),
        _c("cluster", s, "", "cluster or partition label"),
        _c("model", s, "", "model name (class name unless the user sets one)"),
        _c("batch_size_per_rank", i32, "samples", "samples per step on one rank"),
        _c("global_batch_size", i32, "samples", "samples per step over all ranks"),
        _c("param_count", i64, "", "trainable parameters"),
        _c("grad_bytes", i64, "bytes", "bytes of gradients synchronised per step"),
        _c("scaling_mode", s, "", "'strong', 'weak' or '' when the user did not say"),
        _c("flops_per_step", f64, "FLOP", "FLOPs of one step on one rank; NULL unknown"),
        _c(
            "dataset_samples",
            i64,
            "samples",
            "samples in one epoch of the training set; NULL unknown",
        ),
        _c("hostname", s, "", "host of rank 0"),
        _c("perfscope_version", s, "", "perfscope version that recorded the run"),
        _c("python_version", s, "", "Python version"),
        _c("torch_version", s, "", "torch version, '' without torch"),
        _c("cuda_version", s, "", "CUDA runtime version, '' without CUDA"),
        _c("nccl_version", s, "", "NCCL version, '' without NCCL"),
        _c("driver_version", s, "", "NVIDIA driver version, '' without NVML"),
        _c("tags", s, "JSON", "user tags as a JSON object"),
        _c(
            "ended_ns",
            i64,
            "ns since epoch",
            "wall-clock end on rank 0; NULL while running or killed",
        ),
        _c(
            "origin",
            s,
            "",
            "where a measured run came from: NULL for perfscope's collector, else the imported "
            "format ('kineto', 'nsys', 'horovod', 'nccl-tests', 'op-table')",
        ),
        _c("dp_size", i32, "", "data-parallel degree; NULL when the layout is unknown", since=3),
        _c("pp_size", i32, "", "pipeline stages; NULL when the layout is unknown", since=3),
        _c("tp_size", i32, "", "tensor-parallel degree; NULL when the layout is unknown", since=3),
        _c("cp_size", i32, "", "context-parallel degree; NULL when the layout is unknown", since=3),
        _c(
            "param_dtypes",
            s,
            "",
            "dtypes of the watched model's parameters, comma-separated, the one holding most parameters "
            "first ('float32', 'bfloat16,float32'); NULL when no model was seen, and in stores written "
            "before it was recorded (so for every setting below)",
            since=3,
        ),
        _c(
            "autocast",
            s,
            "",
            "autocast regions active in the model's first forward, as device:dtype ('cuda:bfloat16'); "
            "'' when none was; NULL when not seen",
            since=3,
        ),
        _c(
            "compiled",
            b,
            "",
            "the model was wrapped by torch.compile (OptimizedModule); NULL as above",
            since=3,
        ),
        _c(
            "ddp_bucket_cap_mb",
            f64,
            "MiB",
            "DistributedDataParallel's bucket_cap_mb (its bucket_bytes_cap / 2^20); NULL without DDP",
            since=3,
        ),
        _c("ddp_gradient_as_bucket_view", b, "", "DDP's gradient_as_bucket_view; NULL without DDP", since=3),
        _c("ddp_find_unused_parameters", b, "", "DDP's find_unused_parameters; NULL without DDP", since=3),
        _c("ddp_static_graph", b, "", "DDP's static_graph; NULL without DDP", since=3),
        _c(
            "env",
            s,
            "JSON",
            "rank 0's NCCL_* variables and OMP_NUM_THREADS / MKL_NUM_THREADS as set, a JSON object of "
            "at most 32 names, values cut at 64 characters; NULL when none is set",
            since=3,
        ),
    ),
)

RANKS = Table(
    "ranks",
    "One row per rank: where it ran and how its clock relates to rank 0's.",
    (
        RANK,
        _c("local_rank", i32, "", "rank within its host"),
        _c("node_rank", i32, "", "index of its host"),
        _c("hostname", s, "", "host name"),
        _c("pid", i64, "", "process id"),
        _c(
            "clock_offset_ns",
            i64,
            "ns",
            "add to this rank's timestamps to get rank 0's clock; NULL when the ranks could not "
            "meet at start to measure it (timestamps then assume 0)",
        ),
        _c("cpu_count", i32, "", "logical CPUs on the host"),
        _c("device_index", i32, "", "CUDA device index; NULL on CPU"),
        _c("device_name", s, "", "device model or 'cpu'"),
        _c("started_ns", i64, "ns since epoch", "wall-clock start of the rank (offset-corrected)"),
        _c(
            "role",
            s,
            "",
            "'worker', 'server' or 'stage:K' (pipeline stage K) as given to profile(role=...); "
            "NULL when not given (analyses infer it from the comm pattern)",
            since=2,
        ),
        _c(
            "torch_threads",
            i32,
            "threads",
            "torch intra-op threads of the rank (torch.get_num_threads()) when its metadata was written; "
            "NULL when torch was not imported",
            since=2,
        ),
        _c(
            "omp_num_threads",
            s,
            "",
            "OMP_NUM_THREADS as set in the rank's environment; NULL when unset",
            since=2,
        ),
        _c(
            "mkl_num_threads",
            s,
            "",
            "MKL_NUM_THREADS as set in the rank's environment; NULL when unset",
            since=2,
        ),
        _c(
            "affinity_cores",
            i32,
            "",
            "logical CPUs the rank's process may run on (its CPU affinity); NULL where the OS does not say",
            since=2,
        ),
        _c("dp_rank", i32, "", "data-parallel rank; NULL when the layout is unknown", since=3),
        _c("pp_stage", i32, "", "pipeline stage, from 0; NULL when the layout is unknown", since=3),
        _c("tp_rank", i32, "", "tensor-parallel rank; NULL when the layout is unknown", since=3),
        _c("cp_rank", i32, "", "context-parallel rank; NULL when the layout is unknown", since=3),
        _c(
            "clock_error_ns",
            i64,
            "ns",
            "bound on the error of clock_offset_ns: the true offset lies within clock_offset_ns ± this "
            "(half the round trip of the best clock exchange with rank 0's host); 0 on rank 0's host, "
            "which shares its clock; NULL when the offset was not measured, and in stores written "
            "before it was recorded",
            since=3,
        ),
        _c(
            "loader_workers",
            i32,
            "processes",
            "num_workers of the DataLoader given to prof.steps (0: the loader runs in the rank's own "
            "process); NULL when the loop had no DataLoader, and in stores written before it was recorded",
            since=3,
        ),
        _c(
            "loader_prefetch_factor",
            i32,
            "batches",
            "the DataLoader's prefetch_factor per worker; NULL as above",
            since=3,
        ),
        _c("loader_pin_memory", b, "", "the DataLoader's pin_memory; NULL as above", since=3),
        _c("loader_persistent_workers", b, "", "the DataLoader's persistent_workers; NULL as above", since=3),
        _c(
            "loader_batch_size",
            i32,
            "samples",
            "the DataLoader's batch_size (one micro-batch); NULL as above",
            since=3,
        ),
    ),
)

STEPS = Table(
    "steps",
    "One row per rank and optimizer step: the step's time split into canonical phases.",
    (
        RANK,
        STEP,
        _c("start_ns", i64, "ns since epoch", "step start, on rank 0's clock"),
        _c(
            "step_ns",
            i64,
            "ns",
            "step duration, from the end of the previous step to the end of this one",
        ),
        _c("data_ns", i64, "ns", "waiting on the data loader"),
        _c("forward_ns", i64, "ns", "forward phase, minus the exposed communication inside it"),
        _c("backward_ns", i64, "ns", "backward phase, minus the exposed sync inside it"),
        _c(
            "sync_exposed_ns",
            i64,
            "ns",
            "communication the step waited for (not overlapped): gradient synchronisation, and from "
            "version 2 the exposed time of every torch.distributed call made in another phase "
            "(comm.exposed_ns by comm.phase and op tells a pipeline's wait from gradient sync)",
        ),
        _c("optimizer_ns", i64, "ns", "optimizer phase"),
        _c("other_ns", i64, "ns", "rest of the step: step_ns minus the phases above"),
        _c(
            "comm_total_ns",
            i64,
            "ns",
            "sum of the durations of the step's collectives (overlapped or not)",
        ),
        _c("comm_count", i32, "", "collectives issued in the step"),
        _c("samples", i32, "samples", "samples processed by this rank in this step"),
        CLOCK,
    ),
)

SPANS = Table(
    "spans",
    "Every phase and user span, nested: canonical phases and arbitrary user-named ones.",
    (
        RANK,
        STEP,
        _c("name", s, "", "phase or span name"),
        _c("parent", s, "", "enclosing span's name; NULL at the top of the step"),
        _c("depth", i16, "", "nesting depth, 0 at the top"),
        _c("start_ns", i64, "ns since epoch", "span start, on rank 0's clock"),
        _c("dur_ns", i64, "ns", "span duration"),
        CLOCK,
        _c("error", s, "", "exception type raised inside the span; NULL when it ended normally"),
    ),
)

COMM = Table(
    "comm",
    "One row per collective or point-to-point transfer: a DDP bucket, a Horovod tensor group, a manual "
    "allreduce, or any torch.distributed call made inside `profile` (FSDP, pipelines, parameter "
    "servers ...).",
    (
        RANK,
        STEP,
        _c("seq", i32, "", "index of the collective within the step, same on every rank"),
        _c(
            "op",
            s,
            "",
            "'allreduce' (DDP, Horovod, manual and torch.distributed.all_reduce), else the "
            "torch.distributed function: all_gather_into_tensor, reduce_scatter_tensor, broadcast, "
            "all_to_all_single, barrier, send, recv, isend, irecv ...",
        ),
        _c("bucket", i32, "", "DDP bucket index; NULL outside DDP"),
        _c("bytes", i64, "bytes", "payload size of the collective"),
        _c(
            "start_ns",
            i64,
            "ns since epoch",
            "when this rank entered the collective, on rank 0's clock",
        ),
        _c("dur_ns", i64, "ns", "duration of the collective on this rank, issue to completion (total)"),
        CLOCK,
        _c(
            "peer",
            i32,
            "",
            "global rank of the other side of a point-to-point transfer; NULL for collectives",
            since=2,
        ),
        _c(
            "group_size",
            i32,
            "",
            "ranks in the call's process group; NULL in version-1 stores (the run's world size)",
            since=2,
        ),
        _c(
            "exposed_ns",
            i64,
            "ns",
            "time the calling thread waited for it: the call itself when synchronous, plus Work.wait() "
            "when asynchronous; NULL for DDP buckets (their exposed part is steps.sync_exposed_ns)",
            since=2,
        ),
        _c(
            "is_async",
            b,
            "",
            "issued with async_op=True (or isend/irecv/batch_isend_irecv)",
            since=2,
            migrated="bucket IS NOT NULL",
        ),
        _c(
            "phase",
            s,
            "",
            "canonical phase a torch.distributed call was issued in (data, forward, backward, sync, "
            "optimizer; 'other' outside them): its exposed time left that phase's steps column for "
            "sync_exposed_ns. NULL for DDP buckets and Horovod",
            since=2,
        ),
        _c(
            "group_ranks",
            s,
            "",
            "the process group the call ran on: its members' global ranks, ascending, comma-separated "
            "(a point-to-point transfer: both sides), in stores written before group_id; since then NULL, "
            "the members being in process_groups. NULL when not recorded (match by group_size then)",
            since=3,
        ),
        _c(
            "name",
            s,
            "",
            "the framework's name for the call (Megatron-LM's 'grads-reduce-scatter', 'forward-send' "
            "...); NULL when only the torch.distributed function is known",
            since=3,
        ),
        _c(
            "group_id",
            s,
            "",
            "the process group the call ran on, as its row in `process_groups` (its members listed once "
            "per run, not on every call); group_ranks is then NULL. NULL in stores written before it",
            since=3,
        ),
    ),
)

PROCESS_GROUPS = Table(
    "process_groups",
    "The process groups a run's calls ran on, each listed once per writer (a rank's recorder, an "
    "import): comm.group_id names one. The same group written by several writers is the same id. Every "
    "call with its members: `SELECT c.* REPLACE (coalesce(c.group_ranks, g.group_ranks) AS group_ranks) "
    "FROM comm c LEFT JOIN (SELECT run_id, group_id, min(group_ranks) AS group_ranks FROM process_groups "
    "GROUP BY run_id, group_id) g USING (run_id, group_id)` (process_groups.COMM_MEMBERS_SQL).",
    (
        _c(
            "rank",
            i32,
            "",
            "the first rank this writer saw calling on the group (a recorder: its own rank), so that "
            "the rows of several ranks' writers are never byte-identical copies of one segment",
        ),
        _c("group_id", s, "", "the group's id: 'g' and 16 hex digits of a hash of group_ranks"),
        _c("group_size", i32, "", "members of the group"),
        _c("group_ranks", s, "", "its members' global ranks, ascending, comma-separated"),
    ),
)

GPU_SAMPLES = Table(
    "gpu_samples",
    "NVML samples of every local GPU, one poller per host. NULL where the metric is unsupported.",
    (
        _c("ts_ns", i64, "ns since epoch", "sample time, on rank 0's clock"),
        _c("hostname", s, "", "host name"),
        _c("node_rank", i32, "", "index of the host"),
        _c("gpu_index", i16, "", "NVML device index"),
        _c("gpu_uuid", s, "", "NVML device UUID"),
        _c(
            "util_gpu_pct",
            f32,
            "%",
            "nvmlDeviceGetUtilizationRates().gpu: share of the last 1/6-1 s in "
            "which some kernel ran. Not an efficiency.",
        ),
        _c("util_mem_pct", f32, "%", "share of that period the memory controller was busy"),
        _c("mem_used_bytes", i64, "bytes", "device memory used"),
        _c("mem_total_bytes", i64, "bytes", "device memory total"),
        _c("power_mw", f64, "mW", "board power draw"),
        _c("energy_mj", f64, "mJ", "total energy counter since driver load (monotonic)"),
        _c("sm_clock_mhz", f32, "MHz", "SM clock"),
        _c("mem_clock_mhz", f32, "MHz", "memory clock"),
        _c("temp_c", f32, "°C", "GPU temperature"),
        _c("pcie_tx_kbps", f64, "KB/s", "PCIe transmit throughput"),
        _c("pcie_rx_kbps", f64, "KB/s", "PCIe receive throughput"),
        _c("nvlink_tx_kbps", f64, "KiB/s", "NVLink transmit throughput, all links"),
        _c("nvlink_rx_kbps", f64, "KiB/s", "NVLink receive throughput, all links"),
        _c("clocks_event_reasons", i64, "bitmask", "nvmlDeviceGetCurrentClocksEventReasons bitmask"),
        _c("gpm_sm_active_pct", f32, "%", "GPM SM activity (Hopper and newer)"),
        _c("gpm_tensor_active_pct", f32, "%", "GPM tensor-core activity (Hopper and newer)"),
    ),
)

HOST_SAMPLES = Table(
    "host_samples",
    "psutil samples of the host, one poller per host.",
    (
        _c("ts_ns", i64, "ns since epoch", "sample time, on rank 0's clock"),
        _c("hostname", s, "", "host name"),
        _c("node_rank", i32, "", "index of the host"),
        _c(
            "proc_cpu_pct",
            f32,
            "% of one core",
            "CPU of the training processes on this host, summed",
        ),
        _c("sys_cpu_pct", f32, "%", "system-wide CPU utilisation (100 = all cores busy)"),
        _c(
            "rss_bytes",
            i64,
            "bytes",
            "resident memory of the training processes on this host, summed",
        ),
        _c("sys_mem_used_bytes", i64, "bytes", "system memory in use"),
        _c("load1", f32, "", "1-minute load average"),
        _c("cpu_count", i32, "", "logical CPUs"),
    ),
)

PROC_MEMORY = Table(
    "proc_memory",
    "Resident memory of each training process, at the poller's rate (one poller per host); the rank is "
    "the `ranks` row of the same hostname and pid. Empty in stores written before it was recorded.",
    (
        _c("ts_ns", i64, "ns since epoch", "sample time, on rank 0's clock"),
        _c("hostname", s, "", "host name"),
        _c("node_rank", i32, "", "index of the host"),
        _c("pid", i64, "", "process id of the rank (ranks.pid)"),
        _c(
            "rss_bytes",
            i64,
            "bytes",
            "resident set size of the process (its DataLoader workers not included)",
        ),
        _c(
            "host_available_bytes",
            i64,
            "bytes",
            "memory the host could still give processes (psutil's available), read once a second",
        ),
        _c("host_total_bytes", i64, "bytes", "the host's physical memory"),
    ),
)

DEVICE_MEMORY = Table(
    "device_memory",
    "The CUDA caching allocator's peaks of each rank and step (torch.cuda.max_memory_allocated and "
    "max_memory_reserved, then reset_peak_memory_stats, at the end of every step); only ranks that "
    "use CUDA write it.",
    (
        RANK,
        STEP,
        _c("ts_ns", i64, "ns since epoch", "end of the step, on rank 0's clock"),
        _c("peak_allocated_bytes", i64, "bytes", "most memory held by tensors at once during the step"),
        _c("peak_reserved_bytes", i64, "bytes", "most memory the caching allocator reserved during the step"),
        _c(
            "device_total_bytes",
            i64,
            "bytes",
            "the device's memory (torch.cuda.mem_get_info's total), read once; NULL when unknown",
        ),
    ),
)

METRICS = Table(
    "metrics",
    "User metrics logged with prof.log(...), one row per name and step.",
    (
        RANK,
        STEP,
        _c("ts_ns", i64, "ns since epoch", "when it was logged, on rank 0's clock"),
        _c("name", s, "", "metric name (loss, accuracy ...)"),
        _c("value", f64, "", "metric value"),
    ),
)

EVENTS = Table(
    "events",
    "Things the collector noticed: a metric switched off, NVML missing, rows dropped on a full disk.",
    (
        RANK,
        _c("ts_ns", i64, "ns since epoch", "when"),
        _c("kind", s, "", "short machine-readable kind, e.g. 'nvml_unavailable'"),
        _c("message", s, "", "the warning shown to the user"),
    ),
)

REFERENCE_BW = Table(
    "reference_bw",
    "A cluster's reference bandwidth measured by nccl-tests (perfscope import nccl-tests): one row per "
    "collective, rank count and message size. The partition is the import, not a run.",
    (
        _c("cluster", s, "", "cluster or partition label the reference applies to; '' applies to every run"),
        _c("op", s, "", "collective as in comm.op: allreduce, allgather, reducescatter, broadcast ..."),
        _c("ranks", i32, "", "ranks (GPUs) the benchmark ran on"),
        _c("nodes", i32, "", "hosts the benchmark ran on"),
        _c("bytes", i64, "bytes", "message size (nccl-tests' size column)"),
        _c("count", i64, "elements", "elements per rank (nccl-tests' count column)"),
        _c("dtype", s, "", "element type, e.g. 'float'"),
        _c("redop", s, "", "reduction operator, 'none' for data movement"),
        _c("root", i32, "", "root rank; NULL or -1 without one"),
        _c("oop_time_ns", i64, "ns", "out-of-place: mean time of one collective"),
        _c("oop_algbw_gb_per_s", f64, "GB/s", "out-of-place: algorithm bandwidth bytes/t"),
        _c("oop_busbw_gb_per_s", f64, "GB/s", "out-of-place: bus bandwidth (algbw times the op's factor)"),
        _c("ip_time_ns", i64, "ns", "in-place: mean time of one collective"),
        _c("ip_algbw_gb_per_s", f64, "GB/s", "in-place: algorithm bandwidth"),
        _c("ip_busbw_gb_per_s", f64, "GB/s", "in-place: bus bandwidth"),
        _c("hostnames", s, "", "hosts of the ranks, comma-separated"),
        _c("device_model", s, "", "device model(s) the benchmark printed"),
        _c("source_file", s, "", "name of the imported file"),
    ),
)

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        RUNS,
        RANKS,
        STEPS,
        SPANS,
        COMM,
        PROCESS_GROUPS,
        GPU_SAMPLES,
        HOST_SAMPLES,
        PROC_MEMORY,
        DEVICE_MEMORY,
        METRICS,
        EVENTS,
        REFERENCE_BW,
    )
}


def table(name: str) -> Table:
    try:
        return TABLES[name]
    except KeyError:
        raise KeyError(f"unknown table {name!r}; tables are {', '.join(TABLES)}") from None


def markdown() -> str:
    """docs/schema.md, generated so the documentation cannot drift from the code."""
    out = [
        "# perfscope store schema",
        "",
        f"Schema version **{SCHEMA_VERSION}**. Generated by `python -m perfscope.store.schema`; do not edit.",
        "",
        "A store is one folder. Each table is a folder of immutable Parquet segments, hive-partitioned",
        "by run: `STORE/<table>/run_id=<run id>/<segment>.parquet`. `run_id` is therefore a column of",
        "every table when read with `read_parquet(..., hive_partitioning=true, union_by_name=true)`",
        "(or `perfscope.open_store`), though it is not stored inside the files.",
        "",
        "A running writer appends one Arrow IPC record batch per second to one live segment per table,",
        "`<host tag>-<writer>-<seq>.arrows` (an IPC stream: read up to its last complete batch, so a",
        "SIGKILL loses about a second), and seals it at 64 MiB, after 10 minutes and at close into",
        "`<same name>.parquet`, which from then on hides it. At close the writer merges the sealed",
        "segments its host wrote for the run into one file per table (`c-<host tag>-<hex>.parquet`, under",
        "the store's `.compact.lock`); `perfscope compact` seals the live segments of killed writers.",
        "",
        "Every file carries key-value metadata `perfscope.table` and `perfscope.schema_version`.",
        "A file without them is foreign and skipped with a warning. A file written by a newer schema is",
        "an error that names both versions; older versions are migrated by reading columns by name",
        "(columns added since are NULL). A compacted file lists the segments it replaces under",
        "`perfscope.replaces` (a JSON list of `{name, rows, size_bytes, blake2b}`); readers ignore those",
        "segments, so a compaction never doubles data, but only when the claim checks out (its rows equal",
        "their sum, each named file has that size and hash, and its rows are all in the compacted file).",
        "",
        "Timestamps (`*_ns` since epoch) are on rank 0's clock: each rank adds its estimated clock",
        "offset before writing. Durations (`*_ns`) are nanoseconds; `clock` says which clock measured them.",
        "",
    ]
    for t in TABLES.values():
        out += [
            f"## `{t.name}`",
            "",
            t.doc,
            "",
            "| column | type | unit | meaning |",
            "|---|---|---|---|",
        ]
        out.append("| `run_id` | string | | run identifier (hive partition key) |")
        for c in t.columns:
            out.append(f"| `{c.name}` | {c.type} | {c.unit} | {c.doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
