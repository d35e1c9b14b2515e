"""Kineto (torch.profiler) JSON traces, one file per rank, plain or gzip, into a measured run.

The file is streamed: the `traceEvents` array cut into pieces of whole events, each decoded by msgspec
into only the few fields that matter (any file of another shape by ijson, event by event), and those
kept in flat arrays, so memory stays far below the file's size. A truncated file is read up to its
last complete event, with a warning. Several files are read and analysed at once, one process per
core (PERFSCOPE_IMPORT_WORKERS=1: one after another), each returning only its per-step results; the
rows are written in rank order by the importing process.

Per `ProfilerStep#N` range (DESIGN.md, "Imported traces"):

- compute = the union of the step's compute intervals: on a GPU trace its GPU kernels other than
  communication kernels (a kernel belongs to the step whose range holds its launch on the CPU); on a
  CPU-only trace (gloo) the busy time of the thread that ran the step, less data loading and
  communication calls. It is split into forward, backward (from the first autograd
  `evaluate_function` range of the step on) and optimizer (`Optimizer.step#`/`zero_grad#` ranges).
- comm = one row per communication kernel (`nccl*Kernel*`, `rccl*`) or, without GPU kernels, per
  gloo/nccl collective range (`gloo:all_reduce` ...): op, bytes where the trace says, duration;
  exposed = the part not overlapped by compute. `sync_exposed_ns` is the union of exposed parts.
- data = dataloader ranges (`enumerate(DataLoader)#...`); other = the rest of the step.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import multiprocessing as mp
import os
import re
import sys
import zlib
from array import array
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import msgspec
import numpy as np

from ..errors import PerfscopeError
from .common import (
    MAX_DIGITS,
    MAX_EPOCH_NS,
    MAX_TRACE_US,
    ImportOptions,
    ImportResult,
    RunImport,
    StepTimes,
    default_run_id,
    ranks_in_range,
    shown,
)
from .intervals import clip, length, merge, subtract
from .jsonguard import JsonGuard

ORIGIN = "kineto"

_STEP_RE = re.compile(rf"^ProfilerStep#(\d{{1,{MAX_DIGITS}}})$")
_COMM_KERNEL_RE = re.compile(r"^[nr]ccl\w*Kernel", re.IGNORECASE)
_COMM_CPU_PREFIXES = ("nccl:", "gloo:", "c10d::", "record_param_comms", "mpi:", "ucc:")
_COMM_RANGE_PREFIXES = ("gloo:", "mpi:", "ucc:")  # the transfer itself, on the backend's thread
_DATA_PREFIXES = ("enumerate(DataLoader)", "DataLoader.__next__")
_OPT_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
_BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
# Categories of every schema Kineto has written (compared lower-case, as TensorBoard's profiler
# plugin does): PyTorch 1.8 wrote `Operator`, `Runtime`, `Kernel`, `Memcpy`, `Memset` (and `Python`);
# 1.9 on `cpu_op`, `cuda_runtime`, `kernel`, `gpu_memcpy`, `gpu_memset`, `user_annotation`,
# `python_function`; 2.x adds `cuda_driver` and other runtimes. `gpu_user_annotation` ranges are
# the GPU-side copies of CPU ranges (ProfilerStep#N included): never steps, never compute.
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_LAUNCH_CATS = frozenset(
    {"cuda_runtime", "cuda_driver", "runtime", "driver", "xpu_runtime", "mtia_runtime", "privateuse1_runtime"}
)
_CPU_CATS = frozenset({"cpu_op", "operator", "user_annotation", "python_function", "python"})
#: operators, with `--ops`: each becomes a span (depth 2, parent "ops") of the step it starts in,
#: named by the op, so `perfscope compare` can say which op types were added, removed, more frequent or slower
_OP_CATS = frozenset({"cpu_op", "operator"})
_OP_NAME_CHARS = 200
#: the parent of those spans
OPS_PARENT = "ops"
#: µs since the Unix epoch from 2001 to 2100: Kineto before `baseTimeNanoseconds` (PyTorch < 2.0)
#: wrote wall-clock µs, later versions µs from an origin that `baseTimeNanoseconds` names
_EPOCH_US = (1.0e15, 4.1e15)
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 4 * 2,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1,
    "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
_OPS = (
    ("allreduce", "allreduce"), ("reducescatter", "reduce_scatter"), ("allgather", "allgather"),
    ("alltoall", "alltoall"), ("broadcast", "broadcast"), ("sendrecv", "sendrecv"), ("barrier", "barrier"),
    ("send", "send"), ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
)  # fmt: skip
_HEAD_BYTES = 1 << 18
_TAIL_BYTES = 1 << 16
#: a piece of the events decoded at once (a few thousand events), and the most of the document
#: outside the events the fast reader holds (Kineto writes a few KB there)
_BLOCK_BYTES = 1 << 17
_SKELETON_MAX_BYTES = 4 << 20


class _Args(msgspec.Struct):
    """The args the import reads; msgspec skips the others without building them."""

    correlation: Any = None
    collective_name: Any = msgspec.field(default=None, name="Collective name")
    group_size: Any = msgspec.field(default=None, name="Group size")
    dtype: Any = None
    in_msg_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    input_dims: Any = msgspec.field(default=None, name="Input Dims")
    input_type: Any = msgspec.field(default=None, name="Input type")

    def get(self, key: str, default: Any = None) -> Any:
        """As dict.get on the event's args, for the keys above."""
        value = getattr(self, _ARG_FIELDS.get(key, "-"), None)
        return default if value is None else value


_ARG_FIELDS = {
    "correlation": "correlation", "Collective name": "collective_name", "Group size": "group_size",
    "dtype": "dtype", "In msg nelems": "in_msg_nelems", "Input Dims": "input_dims",
    "Input type": "input_type",
}  # fmt: skip


class _Ev(msgspec.Struct):
    """The fields of an event the import reads, of any JSON type (args: an object, else not this path)."""

    ph: Any = None
    ts: Any = None
    dur: Any = None
    cat: Any = None
    name: Any = None
    tid: Any = None
    args: _Args | None = None


_EVENTS_DECODER = msgspec.json.Decoder(list[_Ev])


def op_name(raw: str) -> str:
    """'ncclDevKernel_AllReduce_Sum_f32_RING_LL', 'gloo:all_reduce', '_allgather_base' -> 'allreduce' ..."""
    key = raw.split("(")[0].lower().replace("_", "").replace(":", "")
    for prefix in ("ncclkernel", "ncclDevKernel".lower(), "rcclkernel", "nccl", "gloo", "c10d", "mpi", "ucc"):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    for needle, op in _OPS:
        if needle in key:
            return op
    return key or "unknown"


def _nbytes(args: dict[str, Any] | _Args) -> int | None:
    """Payload bytes of a collective from the args Kineto records, None where it does not say (or
    says something no tensor is: a negative, non-finite or beyond-2^62 count is a damaged shape)."""
    dtype = str(args.get("dtype") or "").lower()
    nelems = _whole(args.get("In msg nelems"))
    if nelems is not None and dtype in _DTYPE_BYTES:
        return _bounded(nelems * _DTYPE_BYTES[dtype])
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and isinstance(types, list) and dims and types:
        total = 0
        for d, t in zip(dims, types, strict=False):
            size = _DTYPE_BYTES.get(str(t).lower())
            if size and isinstance(d, list):
                whole = [_whole(x) for x in d]
                if any(w is None for w in whole):
                    return None
                total += math.prod(cast(list[int], whole)) * size
                if _bounded(total) is None:
                    return None
        return total or None
    return None


_MAX_BYTES = 1 << 62


def _whole(v: Any) -> int | None:
    """A count from a trace: a finite non-negative number below 2^62, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return int(v) if 0 <= v < _MAX_BYTES else None


def _bounded(n: int) -> int | None:
    return n if 0 <= n < _MAX_BYTES else None


class _Tail:
    """A binary reader that remembers the first and the last bytes it handed out, and refuses JSON
    shaped to exhaust the parser (see JsonGuard)."""

    def __init__(self, raw: IO[bytes], source: str) -> None:
        self.raw = raw
        self.guard = JsonGuard(source)
        self.head = bytearray()
        self.tail = bytearray()
        self.read_bytes = 0

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n)
        self.guard.feed(b)
        self.read_bytes += len(b)
        if len(self.head) < _HEAD_BYTES:
            self.head += b[: _HEAD_BYTES - len(self.head)]
        self.tail += b
        if len(self.tail) > 2 * _TAIL_BYTES:
            del self.tail[:-_TAIL_BYTES]
        return b


@dataclass
class _Step:
    index: int
    start: float  # µs on the trace's clock
    end: float
    tid: Any


@dataclass
class _Comm:
    op: str
    nbytes: int | None
    start: float
    end: float
    anchor: float  # CPU time that places it in a step
    group_size: int | None = None


@dataclass
class RankTrace:
    """What one file holds, reduced to what the import needs. Times in µs of the trace's clock."""

    path: Path
    rank: int | None = None
    world_size: int | None = None
    backend: str = ""
    hostname: str = ""
    device_model: str = ""
    base_ns: int | None = None
    truncated: str | None = None
    events: int = 0
    last_us: float = -math.inf  # end of the latest event
    # ProfilerStep#N ranges: N, start, end, thread index (arrays: a file of millions of them stays small)
    st_index: array = field(default_factory=lambda: array("q"))
    st_start: array = field(default_factory=lambda: array("d"))
    st_end: array = field(default_factory=lambda: array("d"))
    st_tid: array = field(default_factory=lambda: array("i"))
    # data-loading and optimizer ranges: start, end, start, end, ...
    data: array = field(default_factory=lambda: array("d"))
    optimizer: array = field(default_factory=lambda: array("d"))
    backward_start: array = field(default_factory=lambda: array("d"))
    backward_end: array = field(default_factory=lambda: array("d"))
    # GPU compute kernels: start, end, correlation id
    k_start: array = field(default_factory=lambda: array("d"))
    k_end: array = field(default_factory=lambda: array("d"))
    k_corr: array = field(default_factory=lambda: array("q"))
    comm_kernels: list[tuple[_Comm, int]] = field(default_factory=list)  # with correlation id
    comm_ranges: list[_Comm] = field(default_factory=list)  # CPU-side transfers (gloo ...)
    # c10d::/nccl: ... calls on the CPU: thread index, start, end
    cc_tid: array = field(default_factory=lambda: array("i"))
    cc_start: array = field(default_factory=lambda: array("d"))
    cc_end: array = field(default_factory=lambda: array("d"))
    # CPU launches: correlation id and CPU time
    l_corr: array = field(default_factory=lambda: array("q"))
    l_ts: array = field(default_factory=lambda: array("d"))
    # busy intervals of each CPU thread (for CPU-only traces), merged as they stream in: thread
    # index, start, end; `_open` holds each thread's interval still growing
    threads: dict[Any, int] = field(default_factory=dict)
    cpu_tid: array = field(default_factory=lambda: array("i"))
    cpu_start: array = field(default_factory=lambda: array("d"))
    cpu_end: array = field(default_factory=lambda: array("d"))
    _open: dict[int, list[float]] = field(default_factory=dict)
    # operators (cpu_op), kept only when asked (`perfscope import kineto --ops`): name index, start,
    # end; names by index (perfscope compare's op types)
    keep_ops: bool = False
    op_names: dict[str, int] = field(default_factory=dict)
    op_id: array = field(default_factory=lambda: array("i"))
    op_start: array = field(default_factory=lambda: array("d"))
    op_end: array = field(default_factory=lambda: array("d"))

    def thread(self, tid: Any) -> int:
        """The index of a thread id (any JSON value: one that is not a number or a string counts by its
        text, cut short)."""
        if isinstance(tid, bool) or not isinstance(tid, (int, float, str, type(None))):
            tid = str(tid)[:64]
        return self.threads.setdefault(tid, len(self.threads))

    def op(self, name: str, start: float, end: float) -> None:
        names = self.op_names
        i = names.get(name)
        if i is None:
            i = names[name] = len(names)
        self.op_id.append(i)
        self.op_start.append(start)
        self.op_end.append(end)

    def step(self, index: int, start: float, end: float, tid: Any) -> None:
        self.st_index.append(index)
        self.st_start.append(start)
        self.st_end.append(end)
        self.st_tid.append(self.thread(tid))

    @property
    def has_steps(self) -> bool:
        return len(self.st_start) > 0

    def busy(self, tid: Any, start: float, end: float) -> None:
        i = self.thread(tid)
        cur = self._open.get(i)
        if cur is not None and cur[0] <= start <= cur[1]:
            cur[1] = max(cur[1], end)
            return
        if cur is not None:
            self._close(i, cur)
        self._open[i] = [start, end]

    def _close(self, i: int, iv: list[float]) -> None:
        self.cpu_tid.append(i)
        self.cpu_start.append(iv[0])
        self.cpu_end.append(iv[1])

    def flush(self) -> None:
        for i, iv in self._open.items():
            self._close(i, iv)
        self._open.clear()

    @property
    def has_gpu(self) -> bool:
        return len(self.k_start) > 0 or bool(self.comm_kernels)

    def to_ns(self, ts_us: float) -> int:
        return _to_ns(ts_us, self.base_ns)


def _to_ns(ts_us: float, base_ns: int | None) -> int:
    # whole µs and the fraction apart: µs since the epoch (older traces) times 1000 is past
    # float64's 2^53 and would lose the last digits
    whole = math.floor(ts_us)
    return whole * 1000 + round((ts_us - whole) * 1000.0) + (base_ns or 0)


def _open(path: Path) -> IO[bytes]:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return cast(IO[bytes], gzip.GzipFile(path, "rb"))
    return open(path, "rb")


def _events(path: Path, trace: RankTrace, reader: _Tail) -> Iterator[dict[str, Any]]:
    import ijson

    try:
        for ev in ijson.items(reader, "traceEvents.item", use_float=True):
            if isinstance(ev, dict):
                yield ev
    except ijson.IncompleteJSONError as exc:
        trace.truncated = f"the JSON stops or breaks after byte {reader.read_bytes:,} ({_short(exc)})"
    except ijson.JSONError as exc:
        trace.truncated = f"malformed JSON near byte {reader.read_bytes:,} ({_short(exc)})"
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        trace.truncated = f"the gzip stream ends early or is corrupt ({_short(exc)})"
    except UnicodeDecodeError:
        trace.truncated = "the file is not UTF-8 text"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:120]


def _metadata(trace: RankTrace, head: bytes, tail: bytes) -> None:
    """distributedInfo, host and device from the JSON before `traceEvents`; baseTimeNanoseconds
    (written after the events) from the end."""
    meta: dict[str, Any] = {}
    end = head.find(b'"traceEvents"')
    text = head[: end if end > 0 else len(head)].decode("utf-8", "replace")
    cut = len(text) if end > 0 else -1
    if cut > 0:
        prefix = text[:cut].rstrip().rstrip(",")
        try:
            loaded = json.loads(prefix + "}")
            meta = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            meta = {}
    tail_text = tail.decode("utf-8", "replace")
    if "distributedInfo" not in meta:
        i = tail_text.find('"distributedInfo"')
        if i >= 0:
            j = tail_text.find("{", i)
            with contextlib.suppress(ValueError):
                meta["distributedInfo"] = json.JSONDecoder().raw_decode(tail_text[j:])[0]
    m = re.search(r'"baseTimeNanoseconds"\s*:\s*(\d{1,20})', tail_text) or re.search(
        r'"baseTimeNanoseconds"\s*:\s*(\d{1,20})', text[: cut if cut > 0 else len(text)]
    )
    if m:
        trace.base_ns = int(m.group(1))
        if trace.base_ns > MAX_EPOCH_NS:
            raise PerfscopeError(
                f"{trace.path}: baseTimeNanoseconds {shown(m.group(1))} is out of range (after the "
                "year 2100); not a trace this tool reads"
            )
    info = meta.get("distributedInfo")
    if isinstance(info, dict):
        rank, world = info.get("rank"), info.get("world_size")
        trace.rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
        trace.world_size = world if isinstance(world, int) and not isinstance(world, bool) else None
        if trace.world_size is not None:
            ranks_in_range(trace.world_size, f"{trace.path}: distributedInfo.world_size")
        trace.backend = str(info.get("backend") or "")[:40]
    host = meta.get("host_name") or meta.get("hostname")
    trace.hostname = str(host)[:200] if host else ""
    props = meta.get("deviceProperties") or meta.get("computeProperties")  # the latter before 1.9
    if isinstance(props, list) and props and isinstance(props[0], dict):
        trace.device_model = str(props[0].get("name") or "")[:200]


def read_trace(path: Path, ops: bool = False) -> RankTrace:
    """Stream one Kineto file into a RankTrace.

    The common case, a JSON object whose `traceEvents` array holds objects, is cut at its events'
    ends into pieces of about `_BLOCK_BYTES` and each piece decoded at once by msgspec into structs of
    the few fields the import reads (other keys are skipped, not built): memory stays that of a piece.
    Anything else (a truncated or malformed file, an event of an unusual shape, a file no gzip reader
    can finish) is read again from its first byte by the streaming parser (ijson), which says where
    it breaks. Both see every byte through the same JsonGuard first. With `ops`, every operator is kept
    (name, start, end: memory then grows with the operators) for perfscope compare's op types."""
    trace = _read_fast(path, ops)
    if trace is not None:
        return trace
    trace = RankTrace(path, keep_ops=ops)
    raw = _open_or_refuse(path)
    reader = _Tail(raw, str(path))
    with raw:
        for ev in _events(path, trace, reader):
            trace.events += 1
            _take(trace, ev.get("ph"), ev.get("ts"), ev.get("dur"), ev.get("cat"), ev.get("name"),
                  ev.get("tid"), ev.get("args"))  # fmt: skip
    trace.flush()
    _metadata(trace, bytes(reader.head), bytes(reader.tail))
    return trace


def _open_or_refuse(path: Path) -> IO[bytes]:
    try:
        return _open(path)
    except OSError as exc:
        raise PerfscopeError(f"{path}: cannot read ({exc.strerror or exc})") from None


class _NotCommon(Exception):
    """The file is not of the shape the fast reader takes: read it with the streaming parser."""


def _read_fast(path: Path, ops: bool = False) -> RankTrace | None:
    """The file read piece by piece with msgspec, None where it is not of the common shape."""
    trace = RankTrace(path, keep_ops=ops)
    raw = _open_or_refuse(path)
    reader = _Tail(raw, str(path))
    guard = reader.guard
    guard.track_shallow = True
    skeleton = bytearray()  # the document without the bytes of its events
    pend = bytearray()  # bytes of the events array not decoded yet
    in_events = False
    first_piece = True
    try:
        with raw:
            offset = 0  # of the block's first byte
            while True:
                try:
                    block = reader.read(_BLOCK_BYTES)
                except (EOFError, zlib.error, gzip.BadGzipFile, OSError):
                    return None
                if not block:
                    break
                pos, byte, depth = guard.shallow_pos, guard.shallow_byte, guard.shallow_depth
                # the top-level arrays opening and closing: a handful in a file
                tops = np.flatnonzero(((byte == 91) & (depth == 2)) | ((byte == 93) & (depth == 1)))
                cur = 0
                for j in tops.tolist():
                    at = int(pos[j]) - offset
                    if byte[j] == 91:  # [
                        skeleton += block[cur : at + 1]
                        cur = at + 1
                        in_events = _opens_events(skeleton)
                        first_piece = True
                    elif in_events:  # ] ending the events
                        pend += block[cur:at]
                        cur = at
                        _decode(trace, pend, len(pend), first_piece)
                        pend.clear()
                        in_events = False
                if in_events:
                    pend += block[cur:]
                    ends = pos[(byte == 125) & (depth == 2)] - offset
                    ends = ends[ends >= cur]
                    if len(ends):  # cut after the block's last complete event
                        cut = len(pend) - (len(block) - int(ends[-1]) - 1)
                        _decode(trace, pend, cut, first_piece)
                        del pend[:cut]
                        first_piece = False
                else:
                    skeleton += block[cur:]
                if len(skeleton) > _SKELETON_MAX_BYTES:
                    return None
                offset += len(block)
    except _NotCommon:
        return None
    if in_events or not isinstance(_decode_any(skeleton), dict):
        return None  # cut short, or malformed outside the events: the streaming parser says where
    trace.flush()
    _metadata(trace, bytes(reader.head), bytes(reader.tail))
    return trace


def _opens_events(skeleton: bytearray) -> bool:
    """Whether the top-level array whose `[` ends `skeleton` is the value of the `traceEvents` key."""
    before = bytes(skeleton[-256:-1]).rstrip()
    if not before.endswith(b":"):
        return False
    key = before[:-1].rstrip()
    if not key.endswith(b'"traceEvents"'):
        return False
    return key[:-13].rstrip()[-1:] in (b"{", b",")


def _decode_any(doc: bytearray) -> Any:
    try:
        return msgspec.json.decode(doc)
    except msgspec.DecodeError:
        return None


def _decode(trace: RankTrace, pend: bytearray, end: int, first: bool) -> None:
    """Take the events of `pend[:end]`, a run of whole events of the array (after a comma unless
    `first`), copied once into a buffer of its own; raise _NotCommon where it is not one."""
    i = _skip_space(pend, 0, end)
    if not first and i < end:
        if pend[i] != 44:  # ,
            raise _NotCommon
        i = _skip_space(pend, i + 1, end)
        if i == end:
            raise _NotCommon  # a comma before the `]`
    if i == end:
        return
    buf = bytearray(b"[")
    with memoryview(pend) as view:
        buf += view[i:end]
    buf.append(93)  # ]
    try:
        events = _EVENTS_DECODER.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise _NotCommon from None
    del buf
    trace.events += len(events)
    take = _take
    for ev in events:
        if ev.ph == "X":  # about 40% are flow and metadata events: not even a call for them
            take(trace, "X", ev.ts, ev.dur, ev.cat, ev.name, ev.tid, ev.args)


def _skip_space(b: bytearray, i: int, end: int) -> int:
    while i < end and b[i] in b" \t\r\n":
        i += 1
    return i


def _num(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _correlation(t: RankTrace, v: Any) -> int:
    """A correlation id (an int64 in Kineto), -1 for none; a number beyond int64 is refused."""
    if (
        not isinstance(v, (int, float))
        or isinstance(v, bool)
        or (isinstance(v, float) and not math.isfinite(v))
    ):
        return -1
    if not 0 <= v < 1 << 63:
        raise PerfscopeError(
            f"{t.path}: a correlation id {shown(v)} is out of range (ids are 64-bit); "
            "not a trace this tool reads"
        )
    return int(v)


def _take(t: RankTrace, ph: Any, ts: Any, dur: Any, cat: Any, name: Any, tid: Any, args: Any) -> None:
    """Keep what one event says (its fields as the JSON gave them: any type)."""
    if ph != "X":
        return
    tt, td = type(ts), type(dur)
    if (tt is float or tt is int) and (td is float or td is int) and ts - ts == 0 and dur - dur == 0:
        ts, dur = float(ts), float(dur)  # the common case, _num's answer without its calls
    else:
        ts, dur = _num(ts), _num(dur)
        if ts is None or dur is None:
            return
    if dur < 0:
        return
    if not (-MAX_TRACE_US <= ts <= MAX_TRACE_US and dur <= MAX_TRACE_US):
        raise PerfscopeError(
            f"{t.path}: an event's time is out of range (ts {shown(ts)} µs, dur {shown(dur)} µs); "
            "not a trace this tool reads"
        )
    cat = cat.lower() if isinstance(cat, str) else None
    if not isinstance(name, str):
        return
    args = args if isinstance(args, (dict, _Args)) else {}
    end = ts + dur
    if end > t.last_us:
        t.last_us = end
    if cat in _GPU_CATS:
        if cat != "kernel":
            return  # memcpy/memset are neither compute nor communication (as in HTA)
        corr = _correlation(t, args.get("correlation"))
        if _COMM_KERNEL_RE.match(name):
            raw_op = str(args.get("Collective name") or name)
            group = args.get("Group size")
            group = group if isinstance(group, int) and 0 < group < 1 << 24 else None
            t.comm_kernels.append((_Comm(op_name(raw_op), _nbytes(args), ts, end, math.nan, group), corr))
        else:
            t.k_start.append(ts)
            t.k_end.append(end)
            t.k_corr.append(corr)
        return
    if cat in _LAUNCH_CATS:
        corr = _correlation(t, args.get("correlation"))
        if corr >= 0:
            t.l_corr.append(corr)
            t.l_ts.append(ts)
        return
    if cat not in _CPU_CATS:
        return
    m = _STEP_RE.match(name)
    if m:
        t.step(int(m.group(1)), ts, end, tid)
        return
    if name.startswith(_COMM_CPU_PREFIXES):
        if name.startswith(_COMM_RANGE_PREFIXES):
            t.comm_ranges.append(_Comm(op_name(name), _nbytes(args), ts, end, ts))
        t.cc_tid.append(t.thread(tid))
        t.cc_start.append(ts)
        t.cc_end.append(end)
        return
    if t.keep_ops and cat in _OP_CATS:
        t.op(name[:_OP_NAME_CHARS], ts, end)
    if name.startswith(_DATA_PREFIXES):
        t.data.extend((ts, end))
    elif name.startswith(_OPT_PREFIXES):
        t.optimizer.extend((ts, end))
    elif name.startswith(_BACKWARD_PREFIX):
        t.backward_start.append(ts)
        t.backward_end.append(end)
    t.busy(tid, ts, end)


# ---- per-step arithmetic ---------------------------------------------------------------------------


def _step_of(anchors: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the step whose [start, end) holds each anchor, -1 for none (steps are disjoint)."""
    if not len(starts):
        return np.full(len(anchors), -1)
    i = np.searchsorted(starts, anchors, side="right") - 1
    ok = (i >= 0) & (anchors < ends[np.clip(i, 0, None)])
    return np.where(ok, i, -1)


@dataclass
class StepResult:
    """One step of one rank as imported: the steps row and its comm rows (start, dur, exposed in µs)."""

    index: int
    start_us: float
    step_us: float
    data_us: float
    forward_us: float
    backward_us: float
    optimizer_us: float
    compute_us: float
    sync_exposed_us: float
    comm: list[tuple[_Comm, float]]  # (collective, exposed µs)
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # CPU ranges: name, start, end
    ops: list[tuple[str, float, float]] = field(default_factory=list)  # operators: name, start, end


def analyse(t: RankTrace) -> list[StepResult]:
    """Per-step compute, phases and collectives of one rank (pure: tests check it directly)."""
    steps = _kept_steps(t)
    s_start = np.array([s.start for s in steps])
    s_end = np.array([s.end for s in steps])
    main_idx = {s.tid for s in steps}
    bwd_s = np.frombuffer(t.backward_start, dtype=np.float64) if t.backward_start else np.empty(0)
    bwd_e = np.frombuffer(t.backward_end, dtype=np.float64) if t.backward_end else np.empty(0)
    order = np.argsort(bwd_s, kind="stable")
    bwd, bwd_e = bwd_s[order], bwd_e[order]
    data_all = merge(_pairs(t.data))
    opt_all = merge(_pairs(t.optimizer))

    gpu = t.has_gpu
    if gpu:
        k_s = np.frombuffer(t.k_start, dtype=np.float64)
        k_e = np.frombuffer(t.k_end, dtype=np.float64)
        corr = np.frombuffer(t.k_corr, dtype=np.int64)
        anchors = _launch_times(t, corr, k_s)
        k_step = _step_of(anchors, s_start, s_end)
        all_compute = merge(np.stack([k_s, k_e], axis=1)) if len(k_s) else np.empty((0, 2))
        comms = [c for c, _ in t.comm_kernels]
        c_corr = np.array([cid for _, cid in t.comm_kernels], dtype=np.int64)
        for c, a in zip(comms, _launch_times(t, c_corr, np.array([c.start for c in comms])), strict=True):
            c.anchor = float(a)
    else:
        cpu_s = np.frombuffer(t.cpu_start, dtype=np.float64)
        cpu_e = np.frombuffer(t.cpu_end, dtype=np.float64)
        on_main = np.isin(np.frombuffer(t.cpu_tid, dtype=np.int32), list(main_idx))
        busy = merge(np.stack([cpu_s[on_main], cpu_e[on_main]], axis=1))
        cc_main = np.isin(np.frombuffer(t.cc_tid, dtype=np.int32), list(main_idx))
        calls = merge(
            np.stack(
                [np.frombuffer(t.cc_start, dtype=np.float64), np.frombuffer(t.cc_end, dtype=np.float64)],
                axis=1,
            )[cc_main]
        )
        all_compute = subtract(subtract(busy, data_all), calls)
        comms = list(t.comm_ranges)
    c_anchor = np.array([c.anchor for c in comms])
    c_step = _step_of(c_anchor, s_start, s_end) if comms else np.empty(0, dtype=int)
    # each step's kernels and collectives, found by one sort (a mask per step was steps x events)
    c_of = _by_step(c_step, len(steps))
    k_of = _by_step(k_step, len(steps)) if gpu else []
    b_lo = np.searchsorted(bwd, s_start, side="left")
    b_hi = np.searchsorted(bwd, s_end, side="left")
    # operators: each in the step it starts in
    op_s = np.frombuffer(t.op_start, dtype=np.float64) if t.op_start else np.empty(0)
    op_e = np.frombuffer(t.op_end, dtype=np.float64) if t.op_end else np.empty(0)
    op_i = np.frombuffer(t.op_id, dtype=np.int32) if t.op_id else np.empty(0, dtype=np.int32)
    op_of = _by_step(_step_of(op_s, s_start, s_end), len(steps)) if len(op_s) else []
    op_name = list(t.op_names)  # by index: a dict keeps its insertion order

    out = []
    for i, s in enumerate(steps):
        data_us = length(clip(data_all, s.start, s.end))
        in_step = slice(int(b_lo[i]), int(b_hi[i]))
        b_in = bwd[in_step]
        bwd_start = float(b_in[0]) if len(b_in) else math.inf
        opt = clip(opt_all, s.start, s.end)
        spans = [("data", float(a), float(b)) for a, b in clip(data_all, s.start, s.end)]
        if len(b_in):
            spans.append(("backward", bwd_start, min(s.end, float(bwd_e[in_step].max()))))
        spans += [("optimizer", float(a), float(b)) for a, b in opt]
        if gpu:
            mine = k_of[i]
            ks, ke, ka = k_s[mine], k_e[mine], anchors[mine]
            compute = merge(np.stack([ks, ke], axis=1))
            compute_us = length(compute)
            durs = ke - ks
            in_opt = _inside(ka, opt)
            in_bwd = (ka >= bwd_start) & ~in_opt
            total = float(durs.sum())
            scale = compute_us / total if total > 0 else 0.0  # kernels on several streams overlap
            optimizer_us = float(durs[in_opt].sum()) * scale
            backward_us = float(durs[in_bwd].sum()) * scale
            forward_us = compute_us - optimizer_us - backward_us
        else:
            compute = clip(all_compute, s.start, s.end)
            compute_us = length(compute)
            optimizer_us = length(_intersect(compute, opt))
            rest = subtract(compute, opt)
            backward_us = length(clip(rest, bwd_start, s.end)) if bwd_start < s.end else 0.0
            forward_us = compute_us - optimizer_us - backward_us
        step_comms = [comms[j] for j in c_of[i]]
        step_comms.sort(key=lambda c: c.start)
        rows = []
        exposed_parts = []
        for c in step_comms:
            iv = np.array([[c.start, c.end]])
            # only the compute inside the collective (found by bisection): never a walk from the start
            exposed = subtract(iv, clip(all_compute, c.start, c.end))
            rows.append((c, length(exposed)))
            exposed_parts.append(exposed)
        sync_us = length(merge(np.concatenate(exposed_parts))) if exposed_parts else 0.0
        out.append(
            StepResult(
                s.index, s.start, s.end - s.start, data_us, max(0.0, forward_us), backward_us,
                optimizer_us, compute_us, sync_us, rows, sorted(spans, key=lambda x: x[1]),
            )
        )  # fmt: skip
        if op_of:
            mine = op_of[i]
            out[-1].ops = [
                (op_name[k], a, b)
                for k, a, b in zip(op_i[mine].tolist(), op_s[mine].tolist(), op_e[mine].tolist(), strict=True)
            ]
    return out


def _kept_steps(t: RankTrace) -> list[_Step]:
    """The file's steps by start; of nested or overlapping ProfilerStep ranges, which cannot both be
    steps, the earlier (a file of 4 M copies of one range keeps one, without holding 4 M objects)."""
    starts = np.frombuffer(t.st_start, dtype=np.float64) if t.st_start else np.empty(0)
    ends = np.frombuffer(t.st_end, dtype=np.float64) if t.st_end else np.empty(0)
    order = np.argsort(starts, kind="stable")
    kept: list[_Step] = []
    end = -math.inf
    for chunk in np.array_split(order, max(1, len(order) // 65536)):  # never millions of ints at once
        for i in chunk.tolist():
            if starts[i] >= end:
                end = float(ends[i])
                kept.append(_Step(int(t.st_index[i]), float(starts[i]), end, int(t.st_tid[i])))
    return kept


def _pairs(flat: array) -> np.ndarray:
    return np.frombuffer(flat, dtype=np.float64).reshape(-1, 2) if flat else np.empty((0, 2))


def _by_step(step_of: np.ndarray, n: int) -> list[np.ndarray]:
    """The indices of the items of each of `n` steps, in item order (`step_of`: each item's step, -1
    for none): one stable sort, then a slice per step."""
    order = np.argsort(step_of, kind="stable")
    bounds = np.searchsorted(step_of[order], np.arange(n + 1), side="left")
    return [order[bounds[i] : bounds[i + 1]] for i in range(n)]


def _launch_times(t: RankTrace, corr: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """CPU time of the launch of each GPU event by correlation id; its own start where none."""
    if not len(corr):
        return np.empty(0)
    lc = np.frombuffer(t.l_corr, dtype=np.int64)
    order = np.argsort(lc, kind="stable")
    lc, lt = lc[order], np.frombuffer(t.l_ts, dtype=np.float64)[order]
    i = np.clip(np.searchsorted(lc, corr), 0, max(len(lc) - 1, 0))
    found = (len(lc) > 0) & (lc[i] == corr) & (corr >= 0) if len(lc) else np.zeros(len(corr), dtype=bool)
    return np.where(found, lt[i] if len(lc) else fallback, fallback)


def _inside(points: np.ndarray, intervals: np.ndarray) -> np.ndarray:
    if not len(intervals) or not len(points):
        return np.zeros(len(points), dtype=bool)
    i = np.searchsorted(intervals[:, 0], points, side="right") - 1
    return (i >= 0) & (points < intervals[np.clip(i, 0, None), 1])


def _intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return subtract(a, subtract(a, b))


# ---- the import ---------------------------------------------------------------------------------------

#: how many processes read the files at once (1: one after another, in this process)
WORKERS_ENV = "PERFSCOPE_IMPORT_WORKERS"


@dataclass
class RankFile:
    """What the import keeps of one file once read and analysed: its per-step results and the few
    facts about the file the run needs, never the event arrays (a worker returns only this)."""

    path: Path
    rank: int | None
    world_size: int | None
    backend: str
    hostname: str
    device_model: str
    base_ns: int | None
    truncated: str | None
    events: int
    last_us: float
    has_gpu: bool
    talks: bool
    step_starts: tuple[float, float] | None  # the first and the last ProfilerStep start, µs
    last_end_us: float
    results: list[StepResult]
    pid: int = field(default_factory=os.getpid)  # of the process that read it

    def to_ns(self, ts_us: float) -> int:
        return _to_ns(ts_us, self.base_ns)


def read_file(path: Path, ops: bool = False) -> RankFile:
    """One file read and analysed (what a worker process runs)."""
    t = read_trace(path, ops)
    starts = np.frombuffer(t.st_start, dtype=np.float64) if t.st_start else np.empty(0)
    ends = np.frombuffer(t.st_end, dtype=np.float64) if t.st_end else np.empty(0)
    return RankFile(
        path=path, rank=t.rank, world_size=t.world_size, backend=t.backend, hostname=t.hostname,
        device_model=t.device_model, base_ns=t.base_ns, truncated=t.truncated, events=t.events,
        last_us=t.last_us, has_gpu=t.has_gpu, talks=_talks(t),
        step_starts=(float(starts.min()), float(starts.max())) if len(starts) else None,
        last_end_us=float(ends.max()) if len(ends) else -math.inf,
        results=analyse(t) if t.has_steps else [],
    )  # fmt: skip


def _workers(n_files: int) -> int:
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise PerfscopeError(f"{WORKERS_ENV}={shown(value)} is not a number of processes (1 or more)")
        wanted = int(value)
    else:
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(n_files, wanted, os.cpu_count() or 1))


def _main_can_be_reimported() -> bool:
    """Whether worker processes may start: forkserver and spawn children import the parent's main
    script again (as `__mp_main__`). Safe for `perfscope` itself (its console script and
    `python -m perfscope` guard their work), an interactive session (no script), `python -m pkg`, or a
    script with an `if __name__ == "__main__":` guard; not for an unguarded script calling perfscope's
    `main()` in-process (Streamlit's AppTest runs one: its workers died re-running it), which reads
    its files one after another instead."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and str(getattr(spec, "name", "")).endswith("__main__"):
        return True
    path = getattr(main, "__file__", None)
    if not path:
        return True
    try:
        with open(path, "rb") as f:
            source = f.read(1 << 20)
    except OSError:
        return False
    return re.search(rb"""__name__\s*==\s*['"]__main__['"]""", source) is not None


def read_files(paths: Sequence[Path], ops: bool = False) -> Iterator[RankFile]:
    """Each file read and analysed, in the order given: in a pool of processes (one per core, at most
    one per file) when there are several, each returning only its per-step results, so memory stays
    that of a few files however many there are. A PerfscopeError in a worker is the same one line."""
    workers = _workers(len(paths))
    if workers == 1 or not _main_can_be_reimported():
        yield from (read_file(p, ops) for p in paths)
        return
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(read_file, p, ops) for p in paths]
        try:
            for p, f in zip(paths, futures, strict=True):
                try:
                    yield f.result()
                except PerfscopeError as exc:
                    raise PerfscopeError(exc.message, exit_code=exc.exit_code, detail=exc.detail) from None
                except BrokenProcessPool:
                    raise PerfscopeError(
                        f"{p}: the process reading it died (out of memory?); {WORKERS_ENV}=1 reads the "
                        "files one at a time"
                    ) from None
        finally:
            for f in futures:
                f.cancel()


def _ns(us: float) -> int:
    return round(us * 1000.0)


def _assign_ranks(traces: list[RankFile], opts: ImportOptions) -> int:
    """Fill in missing ranks from the flags; returns the world size."""
    missing = [t for t in traces if t.rank is None]
    if missing and opts.rank is None and opts.world_size is None and len(traces) == 1 and not traces[0].talks:
        # one file, no distributedInfo (PyTorch before 1.10 never wrote it) and no collective in
        # it: a single-process job, rank 0 of 1
        traces[0].rank, traces[0].world_size = 0, 1
        missing = []
    if missing:
        if opts.rank is None or len(traces) != 1:
            names = ", ".join(t.path.name for t in missing[:3])
            raise PerfscopeError(
                f"{names}: no distributedInfo.rank in the trace; give --rank N --world-size N "
                "(one file at a time)"
            )
        missing[0].rank = opts.rank
    worlds = {t.world_size for t in traces if t.world_size is not None}
    if opts.world_size is not None:
        world = opts.world_size
    elif len(worlds) == 1:
        world = worlds.pop()
    elif worlds:
        raise PerfscopeError(
            f"the traces disagree on the world size ({sorted(worlds)}): they are not one job"
        )
    elif len(traces) == 1 and traces[0].rank == 0:
        world = 1
    else:
        raise PerfscopeError("no distributedInfo.world_size in the traces; give --world-size N")
    ranks = [t.rank for t in traces]
    if len(set(ranks)) != len(ranks):
        raise PerfscopeError(f"two files are the same rank ({ranks}); give one file per rank")
    bad = [r for r in ranks if r is None or not 0 <= r < world]
    if bad:
        raise PerfscopeError(f"rank {bad[0]} is outside a world of size {world}")
    return world


def _talks(t: RankTrace) -> bool:
    """Whether the trace holds any communication: kernels, transfers or collective calls."""
    return bool(t.comm_kernels or t.comm_ranges or t.cc_start)


def _anchor_clocks(traces: list[RankFile]) -> str:
    """Kineto's timestamps count from an arbitrary origin; `baseTimeNanoseconds` (newer traces)
    makes them wall-clock. Traces without it are anchored so that the lowest rank's last event ends
    when its file was last written (the profiler writes at the end), one offset for all of them, so
    ranks that shared a clock stay aligned. Returns which base was used."""
    missing = [t for t in traces if t.base_ns is None]
    if not missing:
        return "baseTimeNanoseconds"
    epoch = [
        t
        for t in missing
        if t.step_starts and _EPOCH_US[0] <= t.step_starts[0] and t.step_starts[1] <= _EPOCH_US[1]
    ]
    if len(epoch) == len(missing):  # traces before baseTimeNanoseconds: the timestamps are wall-clock
        for t in missing:
            t.base_ns = 0
        return "trace timestamps (µs since the epoch)" if len(missing) == len(traces) else "mixed"
    first = missing[0]
    offset = first.path.stat().st_mtime_ns - round(first.last_us * 1000.0)
    for t in missing:
        t.base_ns = offset
    return "file modification time" if len(missing) == len(traces) else "mixed"


def import_files(paths: Sequence[Path], opts: ImportOptions) -> ImportResult:
    traces = []
    warnings = []
    for t in read_files(paths, opts.ops):
        p = t.path
        if t.truncated:
            if not t.events:
                raise PerfscopeError(f"{p}: not a Kineto JSON trace: {t.truncated}")
            warnings.append(f"{p}: {t.truncated}; imported the {t.events:,} events before it")
        if not t.step_starts:
            raise PerfscopeError(
                f"{p}: no ProfilerStep#N ranges, so no steps to import; record with "
                "torch.profiler.profile(schedule=...) and call prof.step() once per step"
            )
        traces.append(t)
    world = _assign_ranks(traces, opts)
    traces.sort(key=lambda t: t.rank or 0)
    time_base = _anchor_clocks(traces)
    run_id = opts.run_id or default_run_id(ORIGIN, opts.experiment, paths)
    gpu = any(t.has_gpu for t in traces)
    clock = "cuda" if gpu else "host"
    started = ended = None
    with RunImport(opts, ORIGIN, run_id) as run:
        for t in traces:
            rank = t.rank or 0
            first = t.to_ns(t.step_starts[0]) if t.step_starts else 0
            run.rank(rank, hostname=t.hostname, device_name=t.device_model or ("cuda" if gpu else "cpu"),
                     device_index=None, started_ns=first)  # fmt: skip
            for r in t.results:
                _write_step(run, rank, t, r, clock, world)
            last = t.to_ns(t.last_end_us)
            started = first if started is None else min(started, first)
            ended = last if ended is None else max(ended, last)
        for w in warnings:
            run.warn(w)
        t0 = traces[0]
        backends = {t.backend for t in traces if t.backend}
        return run.finish(
            world_size=world,
            backend=backends.pop() if len(backends) == 1 else ("mixed" if backends else ""),
            device_model=t0.device_model or ("" if gpu else "cpu"),
            hostname=t0.hostname,
            started_ns=started,
            ended_ns=ended,
            tags={
                "imported_files": [str(p.name) for p in paths],
                "ranks_imported": len(traces),
                "time_base": time_base,
            },
        )


def _write_step(run: RunImport, rank: int, t: RankFile, r: StepResult, clock: str, world: int) -> None:
    comm_total = 0
    for seq, (c, exposed_us) in enumerate(r.comm):
        dur = _ns(c.end - c.start)
        comm_total += dur
        extra = {"exposed_ns": _ns(exposed_us), "group_size": c.group_size or world, "phase": "sync"}
        run.comm(rank, r.index, seq, c.op, c.nbytes, t.to_ns(c.start), dur, clock=clock, extra=extra)
    run.step(
        rank,
        r.index,
        StepTimes(
            start_ns=t.to_ns(r.start_us),
            step_ns=_ns(r.step_us),
            data_ns=_ns(r.data_us),
            forward_ns=_ns(r.forward_us),
            backward_ns=_ns(r.backward_us),
            sync_exposed_ns=_ns(r.sync_exposed_us),
            optimizer_ns=_ns(r.optimizer_us),
            comm_total_ns=comm_total,
            comm_count=len(r.comm),
        ),
        clock=clock,
    )
    run.span(rank, r.index, "step", t.to_ns(r.start_us), _ns(r.step_us), clock="host")
    for name, a, b in r.spans:
        run.span(rank, r.index, name, t.to_ns(a), _ns(b - a), clock="host", parent="step", depth=1)
    for name, a, b in r.ops:
        run.span(rank, r.index, name, t.to_ns(a), _ns(b - a), clock="host", parent=OPS_PARENT, depth=2)
