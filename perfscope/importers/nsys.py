"""An Nsight Systems SQLite export (`nsys export --type sqlite`) into a run: NVTX step ranges as
`steps`, phase ranges as `spans` and phase columns, NCCL kernels as `comm`, GPU metrics as
`gpu_samples` where the export has them.

Tables read (Nsight Systems' documented export schema; all times ns since the session start, host and
GPU on one timeline): `NVTX_EVENTS` (eventType 59/70 push-pop and 60/71 start-end ranges; 75 names a
domain: its `text` is the name of `domainId` in that process), `StringIds` (registered strings, via
`textId`, and kernel names, via `shortName`/`demangledName`), `CUPTI_ACTIVITY_KIND_KERNEL`,
`TARGET_INFO_SESSION_START_TIME` (utcEpochNs), `TARGET_INFO_GPU_METRICS` + `GPU_METRICS`,
`TARGET_INFO_SYSTEM_ENV` (Hostname) and `TARGET_INFO_GPU` (name) where present.

Steps are the `step` ranges of domain `perfscope` (what perfscope's collector emits), else
`ProfilerStep#N` ranges. Every process with steps is one rank (files in the order given, processes by
pid). A step's own phase times follow the collector's rules; its exposed sync is the `sync` phase plus
the NCCL kernel time that no compute kernel overlaps (taken out of the phase it fell in).

Only the ranges that can be steps or phases are held in memory; kernels and GPU metrics are streamed
from SQLite in time order, one step's worth at a time.
"""

from __future__ import annotations

import re
import sqlite3
import urllib.parse
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..collectors.step_rows import CANONICAL
from ..errors import PerfscopeError
from ..store.schema import TABLES
from .common import (
    MAX_EPOCH_NS,
    ImportOptions,
    ImportResult,
    RunImport,
    StepTimes,
    default_run_id,
    shown,
)

_SQLITE_MAGIC = b"SQLite format 3\0"
_RANGE_TYPES = (59, 60, 70, 71)
_DOMAIN_CREATE = 75
_PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)$")
#: NCCL kernels under both namings: ncclKernel_AllReduce_RING_LL_Sum_float, ncclDevKernel_AllGather_RING_LL
_NCCL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
#: nsys metric name prefix -> gpu_samples column
_METRICS = {"GPU Active": "util_gpu_pct", "GR Active": "util_gpu_pct", "SMs Active": "gpm_sm_active_pct",
            "Tensor Active": "gpm_tensor_active_pct"}  # fmt: skip
_PID = "((({col}) >> 24) & 16777215)"  # Nsight serialises ids as (.. << 48) | (pid << 24) | tid

Interval = tuple[int, int]


@dataclass
class Range:
    name: str
    start: int
    end: int
    domain: str


@dataclass
class Process:
    """One profiled process: its NVTX ranges that may be steps or phases (ns since the session start)."""

    pid: int
    ranges: list[Range] = field(default_factory=list)


@dataclass
class Export:
    path: Path
    epoch_ns: int | None
    hostname: str
    device_model: str
    processes: dict[int, Process]
    kernel_name_column: str | None  # None: no kernels with names in the export
    has_gpu_metrics: bool


@contextmanager
def _opened(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection whose errors, and those of values of the wrong type, become one line."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
        if head != _SQLITE_MAGIC:
            raise PerfscopeError(
                f"{path}: not an SQLite file; export the report with `nsys export --type sqlite`"
            )
        # the path quoted: '#' and '?' end a URI's path and '%' starts an escape (rank#0.sqlite
        # opened "rank" and created it; rank%3F.sqlite could not be opened)
        uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
        con = sqlite3.connect(uri, uri=True)
        try:
            con.execute("PRAGMA query_only = ON")
            yield con
        finally:
            con.close()
    except sqlite3.OperationalError as exc:  # a table or column the documented schema has is missing
        raise PerfscopeError(f"{path}: not Nsight Systems' export schema ({exc})") from None
    except sqlite3.DatabaseError as exc:
        raise PerfscopeError(f"{path}: unreadable SQLite ({exc}); truncated or corrupt export") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise PerfscopeError(f"{path}: a value of the wrong type in the export ({exc})") from None


def _time(path: Path, v: Any) -> int:
    """A time of the export (ns since the session, or the session's start since the epoch) that
    stays inside int64 once added up, or a one-line refusal."""
    t = int(v)
    if not 0 <= t <= MAX_EPOCH_NS:
        raise PerfscopeError(
            f"{path}: a time of {shown(v)} ns is out of range; not an export this tool reads"
        )
    return t


def _pid(global_id: int | None) -> int:
    return ((global_id or 0) >> 24) & 0xFFFFFF


def _one(con: sqlite3.Connection, tables: set[str], table: str, sql: str) -> Any:
    if table not in tables:
        return None
    row = con.execute(sql).fetchone()
    return row[0] if row else None


def _refuse_computed(path: Path, con: sqlite3.Connection) -> None:
    """nsys writes stored values. A virtual table, or a column generated when read, makes every read
    run the file's own expression: a 28 KB file whose step names were `hex(zeroblob(2e7))` took 2.4 GB
    and 29 s to import. Refused before any row is read."""
    for name, sql in con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall():
        if str(sql or "").lstrip()[:20].upper().startswith("CREATE VIRTUAL"):
            raise PerfscopeError(f"{path}: table {shown(name)} is a virtual table; not an export nsys wrote")
        # table_xinfo's `hidden`: 2 is a column generated when read (3: generated and stored, read as stored)
        for col in con.execute("SELECT name, hidden FROM pragma_table_xinfo(?)", (name,)).fetchall():
            if col[1] == 2:
                raise PerfscopeError(
                    f"{path}: column {shown(name)}.{shown(col[0])} is computed when read (a generated "
                    "column); not an export nsys wrote"
                )


def parse(path: Path) -> Export:
    """The export's processes with their step and phase ranges, and what it says about the machine;
    refuses a file that is no Nsight Systems export."""
    with _opened(path) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        _refuse_computed(path, con)
        if "NVTX_EVENTS" not in tables:
            raise PerfscopeError(
                f"{path}: no NVTX_EVENTS table; not an Nsight Systems export with NVTX ranges "
                "(profile with `nsys profile --trace=cuda,nvtx`)"
            )
        strings = "StringIds" in tables
        perfscope_domains: set[tuple[int, int]] = set()
        for dom, name, gtid in con.execute(
            f"SELECT domainId, text, globalTid FROM NVTX_EVENTS WHERE eventType = {_DOMAIN_CREATE}"
        ):
            if name == "perfscope":
                perfscope_domains.add((_pid(gtid), dom or 0))
        text = "coalesce(e.text, s.value)" if strings else "e.text"
        join = "LEFT JOIN StringIds s ON s.id = e.textId" if strings else ""
        kinds = ", ".join(map(str, _RANGE_TYPES))
        canon = ", ".join(f"'{c}'" for c in CANONICAL)
        procs: dict[int, Process] = {}
        # only ranges that can be steps or phases: those of a domain named perfscope, ProfilerStep#N,
        # and canonical phase names in any domain
        doms = {d for _, d in perfscope_domains}
        for start, end, name, gtid, dom in con.execute(
            f"SELECT e.start, e.end, {text} AS name, e.globalTid, e.domainId FROM NVTX_EVENTS e {join} "
            f"WHERE e.eventType IN ({kinds}) AND e.end IS NOT NULL AND e.end >= e.start "
            f"AND (coalesce(e.domainId, 0) IN ({', '.join(map(str, doms)) or 'NULL'}) "
            f"     OR {text} LIKE 'ProfilerStep#%' OR {text} IN ({canon})) ORDER BY e.start"
        ):
            pid = _pid(gtid)
            domain = "perfscope" if (pid, dom or 0) in perfscope_domains else ""
            proc = procs.setdefault(pid, Process(pid))
            proc.ranges.append(Range(str(name or ""), _time(path, start), _time(path, end), domain))
        name_col = None
        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables and strings:
            cols = {r[1] for r in con.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
            name_col = next((c for c in ("shortName", "demangledName") if c in cols), None)
        epoch = _one(con, tables, "TARGET_INFO_SESSION_START_TIME",
                     "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")  # fmt: skip
        host = _one(con, tables, "TARGET_INFO_SYSTEM_ENV",
                    "SELECT value FROM TARGET_INFO_SYSTEM_ENV WHERE name = 'Hostname'")  # fmt: skip
        model = _one(con, tables, "TARGET_INFO_GPU", "SELECT name FROM TARGET_INFO_GPU")
        return Export(
            path,
            _time(path, epoch) if epoch is not None else None,
            str(host or ""),
            str(model or ""),
            procs,
            name_col,
            {"GPU_METRICS", "TARGET_INFO_GPU_METRICS"} <= tables,
        )


def kernels(ex: Export, pid: int) -> Iterator[tuple[int, int, str | None, int | None]]:
    """The process's kernels in start order, streamed: (start, end, NCCL op or None, device id)."""
    if ex.kernel_name_column is None:
        return
    with _opened(ex.path) as con:
        for start, end, kname, dev in con.execute(
            f"SELECT k.start, k.end, s.value, k.deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL k "
            f"LEFT JOIN StringIds s ON s.id = k.{ex.kernel_name_column} "
            f"WHERE {_PID.format(col='k.globalPid')} = ? ORDER BY k.start",
            (pid,),
        ):
            m = _NCCL.match(str(kname or ""))
            if dev is not None and not 0 <= int(dev) < 1 << 16:
                raise PerfscopeError(
                    f"{ex.path}: a kernel on device {shown(dev)}; not an export this tool reads"
                )
            yield _time(ex.path, start), _time(ex.path, end), m.group(1).lower() if m else None, dev


def gpu_samples(ex: Export) -> Iterator[dict[str, Any]]:
    """GPU metrics (nsys --gpu-metrics-devices) as gpu_samples values by column, one per GPU and
    time, streamed in time order."""
    if not ex.has_gpu_metrics:
        return
    with _opened(ex.path) as con:
        wanted = {}
        for type_id, metric_id, name in con.execute(
            "SELECT DISTINCT typeId, metricId, metricName FROM TARGET_INFO_GPU_METRICS"
        ):
            col = next((c for prefix, c in _METRICS.items() if str(name).startswith(prefix)), None)
            if col is not None:
                wanted[(type_id, metric_id)] = col
        gpus = {t: i for i, t in enumerate(sorted({t for t, _ in wanted}))}
        row: dict[str, Any] = {}
        for ts, type_id, metric_id, value in con.execute(
            "SELECT timestamp, typeId, metricId, value FROM GPU_METRICS ORDER BY timestamp, typeId"
        ):
            col = wanted.get((type_id, metric_id))
            if col is None or ts is None:
                continue
            if row and (row["ts"], row["gpu_index"]) != (int(ts), gpus[type_id]):
                yield row
                row = {}
            row = row or {"ts": int(ts), "gpu_index": gpus[type_id]}
            row[col] = float(value)
            if not 0 <= row[col] <= 1e6 or not 0 <= int(ts) <= MAX_EPOCH_NS:
                raise PerfscopeError(
                    f"{ex.path}: a GPU metric sample out of range (value {shown(value)} at "
                    f"{shown(ts)} ns); not a metric Nsight Systems records"
                )
        if row:
            yield row


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(intervals: list[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def _minus(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Parts of the union `a` not covered by the union `b`."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _clip(intervals: list[Interval], lo: int, hi: int) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _steps_of(proc: Process) -> list[Range]:
    steps = [r for r in proc.ranges if r.domain == "perfscope" and r.name == "step"]
    if not steps:
        steps = [r for r in proc.ranges if _PROFILER_STEP.match(r.name)]
    return sorted(steps, key=lambda r: r.start)


def import_files(paths: Sequence[Path], opts: ImportOptions) -> ImportResult:
    exports = [parse(p) for p in paths]
    ranked: list[tuple[Export, Process, list[Range]]] = []
    for ex in exports:
        found = [(ex, p, _steps_of(p)) for _, p in sorted(ex.processes.items())]
        found = [f for f in found if f[2]]
        if not found:
            raise PerfscopeError(
                f"{ex.path}: no step ranges (NVTX 'step' in domain perfscope, or ProfilerStep#N); "
                "perfscope cannot split this job into training steps"
            )
        ranked += found
    if opts.rank is not None and len(ranked) != 1:
        raise PerfscopeError("--rank applies to one export of one process; these hold several")
    world = opts.world_size or len(ranked)
    if len(ranked) > world:
        raise PerfscopeError(
            f"the exports hold {len(ranked)} processes with steps, more than --world-size {world}"
        )
    run_id = opts.run_id or default_run_id("nsys", opts.experiment, paths)
    with RunImport(opts, "nsys", run_id) as run:
        starts, ends, has_nccl = [], [], False
        for i, (ex, proc, steps) in enumerate(ranked):
            rank = opts.rank if opts.rank is not None else i
            epoch = ex.epoch_ns
            if epoch is None:
                epoch = 0
                run.warn(f"{ex.path.name}: no session start time; timestamps are relative to the session")
            device, nccl = _write_rank(run, rank, epoch, proc, steps, kernels(ex, proc.pid))
            has_nccl = has_nccl or nccl
            run.rank(rank, hostname=ex.hostname, pid=proc.pid, device_index=device,
                     device_name=ex.device_model, started_ns=epoch + steps[0].start)  # fmt: skip
            starts.append(epoch + steps[0].start)
            ends.append(epoch + steps[-1].end)
        names = TABLES["gpu_samples"].column_names
        for ex in exports:
            fixed = {"hostname": ex.hostname}
            run.rows(
                "gpu_samples",
                (tuple({**fixed, **s, "ts_ns": (ex.epoch_ns or 0) + s["ts"]}.get(n) for n in names)
                 for s in gpu_samples(ex)),
            )  # fmt: skip
        hosts = sorted({ex.hostname for ex, _, _ in ranked})
        return run.finish(
            started_ns=min(starts),
            ended_ns=max(ends),
            world_size=world,
            nodes=len(hosts),
            gpus_per_node=max(1, world // max(1, len(hosts))),
            backend="nccl" if has_nccl else "",
            device_model=next((ex.device_model for ex in exports if ex.device_model), ""),
            hostname=ranked[0][0].hostname,
            tags={"source_files": [p.name for p in paths]},
        )


def _write_rank(
    run: RunImport,
    rank: int,
    epoch: int,
    proc: Process,
    steps: list[Range],
    kernel_stream: Iterator[tuple[int, int, str | None, int | None]],
) -> tuple[int | None, bool]:
    """One rank's steps, spans and comm rows, reading its kernels once in time order. Returns its
    device id and whether it ran NCCL kernels."""
    phases = sorted(
        (r for r in proc.ranges if r.name != "step" and not _PROFILER_STEP.match(r.name)
         and (r.domain == "perfscope" or r.name in CANONICAL)),
        key=lambda r: (r.start, -r.end),
    )  # fmt: skip
    pending = next(kernel_stream, None)
    device: int | None = pending[3] if pending else None
    carry: list[Interval] = []  # compute kernels reaching into the next step
    any_nccl = False
    next_phase = 0
    prev_end: int | None = None
    for k, st in enumerate(steps):
        lo = prev_end if prev_end is not None and prev_end <= st.start else st.start
        hi = st.end
        prev_end = hi
        nccl: list[tuple[str, int, int]] = []
        compute = [iv for iv in carry if iv[1] > lo]
        while pending is not None and pending[0] < hi:
            start, end, op, _ = pending
            if start >= lo and op is not None:
                nccl.append((op, start, end))
            elif op is None and end > lo:
                compute.append((start, end))
            pending = next(kernel_stream, None)
        carry = [iv for iv in compute if iv[1] > hi]
        any_nccl = any_nccl or bool(nccl)
        cols = dict.fromkeys(CANONICAL, 0)
        canon_windows: dict[str, list[Interval]] = defaultdict(list)
        stack: list[Range] = []
        while next_phase < len(phases) and phases[next_phase].start < st.start:
            next_phase += 1
        i = next_phase
        while i < len(phases) and phases[i].start < hi:
            r = phases[i]
            i += 1
            if r.end > hi:
                continue
            while stack and stack[-1].end <= r.start:
                stack.pop()
            parent = stack[-1] if stack else None
            run.span(rank, k, r.name, epoch + r.start, r.end - r.start, clock="host",
                     parent=parent.name if parent else None, depth=len(stack))  # fmt: skip
            if r.name in CANONICAL:
                cols[r.name] += r.end - r.start
                canon_windows[r.name].append((r.start, r.end))
                outer = next((p for p in reversed(stack) if p.name in CANONICAL), None)
                if outer is not None:
                    cols[outer.name] -= r.end - r.start
            stack.append(r)
        next_phase = i
        for seq, (op, a, b) in enumerate(nccl):
            run.comm(rank, k, seq, op, None, epoch + a, b - a, clock="cuda")
        # NCCL time no compute kernel overlaps is waited for; outside a `sync` phase it is charged
        # to sync and taken out of the phase it fell in
        exposed = _minus(_union((a, b) for _, a, b in nccl), _clip(_union(compute), lo, hi))
        exposed = _minus(exposed, _union(canon_windows["sync"]))
        for name in ("data", "forward", "backward", "optimizer"):
            inside = _length(_minus(exposed, _minus(exposed, _union(canon_windows[name]))))
            cols[name] -= inside
        cols["sync"] += _length(exposed)
        t = StepTimes(
            start_ns=epoch + lo,
            step_ns=hi - lo,
            **{f"{n}_ns" if n != "sync" else "sync_exposed_ns": max(0, v) for n, v in cols.items()},
            comm_total_ns=sum(b - a for _, a, b in nccl),
            comm_count=len(nccl),
        )
        run.step(rank, k, t, clock="host")
    return device, any_nccl
