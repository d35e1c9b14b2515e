"""A Horovod timeline (HOROVOD_TIMELINE) into a run: per tensor and step one `comm` row per rank, its
phases as `spans`, and per rank and step a `steps` row whose exposed sync is the negotiation wait.

Horovod's format (horovod/common/timeline.cc): a Chrome-trace JSON array written by rank 0 alone, in
which every tensor is a "process" (`process_name` metadata gives its name) and pid 0's metadata
holds `start_time_since_epoch_in_micros`. Per tensor and collective: a `NEGOTIATE_<OP>` B/E range
with one `X` tick per rank, named by the rank, at the moment that rank reported the tensor ready;
then a top-level `<OP>` range (ALLREDUCE ...) whose nested ranges are the activities (QUEUE,
MEMCPY_IN_FUSION_BUFFER, NCCL_ALLREDUCE, MPI_ALLREDUCE ...), its `E` carrying dtype and shape.
Horovod closes the array after every event, but a job still running or killed leaves it open or cut
mid-event: the file is streamed, at most one event in memory, and read up to its last whole event.

How the rows are made: the k-th collective of a tensor belongs to step k. A rank enters a collective
at its ready tick and leaves when the collective ends (all ranks finish a ring together), so the
collectives' wait analysis sees the negotiation wait per rank, the straggler signal. A step runs
from the end of the previous step's last collective to the end of its own; its exposed sync on a
rank is the time from that rank's last ready tick to the end of the last collective (collectors'
`exposed_sync_ns`); compute is not in the timeline and stays in `other_ns`.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from ..collectors.step_rows import exposed_sync_ns
from ..errors import PerfscopeError
from .common import (
    MAX_RANKS,
    MAX_TRACE_US,
    ImportOptions,
    ImportResult,
    RunImport,
    StepTimes,
    default_run_id,
    ranks_in_range,
    shown,
)
from .jsonguard import JsonGuard

CHUNK_BYTES = 1 << 20
#: one event larger than this is not Horovod's (they are a few hundred bytes)
MAX_EVENT_BYTES = 1 << 20
_DTYPE_BYTES = {"uint8": 1, "int8": 1, "bool": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
                "int32": 4, "float32": 4, "int64": 8, "float64": 8}  # fmt: skip
_BACKENDS = (("NCCL_", "horovod-nccl"), ("MPI_", "horovod-mpi"), ("GLOO_", "horovod-gloo"),
             ("CCL_", "horovod-ccl"), ("DDL_", "horovod-ddl"))  # fmt: skip
_NEGOTIATE = "NEGOTIATE_"
#: a negotiation tick is named by its rank: ASCII digits (str.isdigit would take '²')
_TICK = re.compile(r"[0-9]{1,7}")
MAX_DEPTH = 64
#: Horovod's response types: the top-level range of a tensor's collective
OPS = frozenset(
    {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "ADASUM", "BARRIER", "JOIN"}
)


class Truncated(Exception):
    """The array ends inside an event: everything before it was read."""


def json_array(path: Path, what: str) -> Iterator[dict[str, Any]]:
    """The objects of the top-level JSON array in `path`, one at a time, in bounded memory. An array
    left open, or cut inside its last object, ends the iteration with `Truncated` after the last
    whole object. Anything else malformed is a one-line PerfscopeError."""
    decoder = json.JSONDecoder()
    guard = JsonGuard(str(path))  # the decoder recurses: nesting is refused before it sees it
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof, started, offset = "", 0, False, False, 0
    with open(path, "rb") as f:

        def more() -> bool:
            nonlocal buf, pos, eof, offset
            if eof:
                return False
            raw = f.read(CHUNK_BYTES)
            if b"\0" in raw:
                raise PerfscopeError(f"{path}: binary data; not {what}")
            guard.feed(raw)
            eof = not raw
            offset += pos
            buf = buf[pos:] + utf8.decode(raw, final=eof)
            pos = 0
            return not eof

        more()
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(buf):
                if more():
                    continue
                if not started:
                    raise PerfscopeError(f"{path}: empty; not {what}")
                raise Truncated
            c = buf[pos]
            if not started:
                if c != "[":
                    raise PerfscopeError(f"{path}: does not start with a JSON array; not {what}")
                started, pos = True, pos + 1
                continue
            if c == "]":
                return
            if c != "{":
                raise PerfscopeError(f"{path}: malformed JSON near byte {offset + pos}; not {what}")
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if len(buf) - pos > MAX_EVENT_BYTES:
                    raise PerfscopeError(
                        f"{path}: malformed JSON or an event over {MAX_EVENT_BYTES >> 20} MiB near byte "
                        f"{offset + pos}; not {what}"
                    ) from None
                if not eof:
                    more()
                    continue
                # a cut file fails where its text runs out (or inside a string); else it is malformed
                if exc.msg.startswith("Unterminated string") or exc.pos >= len(buf.rstrip()):
                    raise Truncated from None
                raise PerfscopeError(
                    f"{path}: malformed JSON near byte {offset + exc.pos}; not {what}"
                ) from None
            if not isinstance(obj, dict):
                raise PerfscopeError(f"{path}: an array element is not an object near byte {offset + pos}")
            pos = end
            yield obj
            if pos > CHUNK_BYTES:
                offset += pos
                buf, pos = buf[pos:], 0


@dataclass
class Collective:
    """One collective of one tensor, as rank 0's timeline shows it (times in µs since the start)."""

    tensor: str
    op: str  # the top-level range name, e.g. ALLREDUCE
    start_us: float
    end_us: float | None = None
    negotiate_start_us: float | None = None
    ready_us: dict[int, float] = field(default_factory=dict)
    activities: list[tuple[str, float, float]] = field(default_factory=list)
    nbytes: int | None = None


@dataclass
class Timeline:
    start_epoch_us: float | None = None
    collectives: list[Collective] = field(default_factory=list)
    truncated: bool = False
    events: int = 0


def _nbytes(args: Any) -> int | None:
    if not isinstance(args, dict):
        return None
    size = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower().removeprefix("horovod_"))
    dims = re.findall(r"\d+", str(args.get("shape", ""))[:1000])
    if size is None or "shape" not in args or any(len(d) > 18 for d in dims):
        return None
    nbytes = size * math.prod(int(d) for d in dims)
    return nbytes if nbytes < 1 << 62 else None  # no tensor is that large: a damaged shape


def collectives(path: Path, tl: Timeline) -> Iterator[Collective]:
    """The finished collectives of a timeline in the order they end, one at a time; `tl` gets the
    file's start time, event count and whether it was cut. Refuses a file that is not a timeline."""
    names: dict[int, str] = {}
    # per tensor (pid): the open ranges, outermost first, and the collective being built
    stack: dict[int, list[tuple[str, float]]] = defaultdict(list)
    current: dict[int, Collective] = {}
    pending_ready: dict[int, tuple[float, dict[int, float]]] = {}
    what = "a Horovod timeline"
    found = False
    try:
        for ev in json_array(path, what):
            tl.events += 1
            ph, pid, ts = ev.get("ph"), ev.get("pid"), ev.get("ts")
            if not isinstance(pid, int) or isinstance(pid, bool):
                if ph == "i":
                    continue  # CYCLE_START markers
                raise PerfscopeError(f"{path}: an event without an integer pid; not {what}")
            if ph == "M":
                meta = ev.get("args")
                args: dict[str, Any] = meta if isinstance(meta, dict) else {}
                if ev.get("name") == "process_name" and "name" in args:
                    names[pid] = str(args["name"])[:1000]
                if "start_time_since_epoch_in_micros" in args:
                    start = args["start_time_since_epoch_in_micros"]
                    if not _time(start) or start < 0:
                        raise PerfscopeError(
                            f"{path}: start_time_since_epoch_in_micros {shown(json.dumps(start))} is not a "
                            f"time; not {what}"
                        )
                    tl.start_epoch_us = float(start)
                continue
            if not _time(ts):
                raise PerfscopeError(
                    f"{path}: an event's ts {shown(json.dumps(ts))} is not a time (a number of µs); "
                    f"not {what}"
                )
            name = str(ev.get("name", ""))
            open_ = stack[pid]
            if ph == "B":
                if len(open_) >= MAX_DEPTH:
                    raise PerfscopeError(f"{path}: ranges nested {MAX_DEPTH} deep for one tensor; not {what}")
                if not open_ and name in OPS:
                    neg = pending_ready.pop(pid, None)
                    c = Collective(names.get(pid, f"tensor-{pid}"), name, float(ts))
                    if neg is not None:
                        c.negotiate_start_us, c.ready_us = neg
                    current[pid] = c
                open_.append((name, float(ts)))
            elif ph == "X" and open_ and open_[-1][0].startswith(_NEGOTIATE):
                if not _TICK.fullmatch(name) or int(name) >= MAX_RANKS:
                    raise PerfscopeError(
                        f"{path}: a negotiation tick named {shown(name)!r} is not a rank (0 to "
                        f"{MAX_RANKS - 1:,}); not {what}"
                    )
                pending_ready.setdefault(pid, (open_[-1][1], {}))[1].setdefault(int(name), float(ts))
            elif ph == "E":
                if not open_:
                    continue  # an end whose begin was cut off before the file starts
                began_name, began = open_.pop()
                if began_name.startswith(_NEGOTIATE):
                    pending_ready.setdefault(pid, (began, {}))
                    continue
                done = current.get(pid)
                if done is None:
                    continue
                if open_:
                    done.activities.append((began_name, began, float(ts)))
                else:
                    done.end_us = float(ts)
                    done.nbytes = _nbytes(ev.get("args"))
                    del current[pid]
                    found = True
                    yield done
    except Truncated:
        tl.truncated = True
    if tl.events == 0:
        raise PerfscopeError(f"{path}: an empty JSON array; not {what} with events")
    if not found:
        raise PerfscopeError(
            f"{path}: no finished collective (NEGOTIATE_* / ALLREDUCE ... ranges per tensor); not {what}"
        )


def _time(v: Any) -> TypeGuard[float]:
    """A number of µs a timeline can hold: finite, and within a trace's range."""
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and -MAX_TRACE_US <= v <= MAX_TRACE_US
    )


def parse(path: Path) -> Timeline:
    """The whole timeline in memory (for a look at a small one; the import streams)."""
    tl = Timeline()
    tl.collectives = list(collectives(path, tl))
    return tl


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


class _Steps:
    """Collectives grouped into steps as they end; a step is complete once a collective two steps
    later has ended (a step's collectives all end before the next step's begin), so at most a few
    steps are held in memory."""

    def __init__(self) -> None:
        self.count: dict[str, int] = defaultdict(int)
        self.open: dict[int, list[Collective]] = defaultdict(list)

    def add(self, c: Collective) -> list[tuple[int, list[Collective]]]:
        k = self.count[c.tensor]
        self.count[c.tensor] += 1
        self.open[k].append(c)
        return self.flush(below=k - 1)

    def flush(self, below: int | None = None) -> list[tuple[int, list[Collective]]]:
        done = sorted(k for k in self.open if below is None or k < below)
        return [(k, self.open.pop(k)) for k in done]


def import_files(paths: Sequence[Path], opts: ImportOptions) -> ImportResult:
    if len(paths) != 1:
        raise PerfscopeError("a Horovod timeline is one file (rank 0 writes it for every rank); give one")
    (path,) = paths
    tl = Timeline()
    stream = collectives(path, tl)
    first = next(stream)  # a file that is no timeline is refused before the store is touched
    run_id = opts.run_id or default_run_id("horovod", opts.experiment, paths)
    with RunImport(opts, "horovod", run_id) as run:
        writer = _RunWriter(run, path, tl, opts.world_size)
        grouper = _Steps()
        for c in itertools.chain([first], stream):
            for k, ops in grouper.add(c):
                writer.step(k, ops)
        for k, ops in grouper.flush():
            writer.step(k, ops)
        if tl.truncated:
            run.warn(f"{path.name}: the timeline ends inside an event (job still running or killed); "
                     "read up to the last whole event")  # fmt: skip
        if not writer.ticks:
            run.warn(f"{path.name}: no negotiation recorded (Horovod's response cache skips it): no "
                     "per-rank wait; set HOROVOD_CACHE_CAPACITY=0 to record it")  # fmt: skip
        return run.finish(
            started_ns=writer.epoch_ns,
            ended_ns=writer.prev_end,
            world_size=writer.world,
            backend=writer.backend,
            tags={"source_file": path.name, "tensors": len(grouper.count)},
        )


class _RunWriter:
    """Writes one step's rows at a time (see the module's docstring for how they are made)."""

    def __init__(self, run: RunImport, path: Path, tl: Timeline, world_size: int | None) -> None:
        self.run, self.path, self.tl = run, path, tl
        self.world = world_size
        self.ticks = False
        self.prev_end: int | None = None
        self.backend = "horovod"
        self._epoch: int | None = None

    @property
    def epoch_ns(self) -> int:
        if self._epoch is None:
            if self.tl.start_epoch_us is not None:
                self._epoch = round(self.tl.start_epoch_us * 1000)
            else:  # older Horovod: anchor the run at the file's last write
                self._epoch = self.path.stat().st_mtime_ns
                self.run.warn(f"{self.path.name}: no start time in the timeline; times anchored at the "
                              "file's last write")  # fmt: skip
        return self._epoch

    def ns(self, us: float) -> int:
        return self.epoch_ns + round(us * 1000)

    def _ranks(self, ops: list[Collective]) -> int:
        seen = {r for c in ops for r in c.ready_us}
        self.ticks = self.ticks or bool(seen)
        top = max(seen, default=-1)
        if self.world is None:
            if top < 0:
                raise PerfscopeError(
                    f"{self.path}: the timeline has no negotiation ticks to count the ranks from; "
                    "give --world-size"
                )
            # every rank ticks when it negotiates: ranks that never tick are not there (a tick named
            # 1048575 among two ranks would make a million ranks of rows out of one line)
            if len(seen) * 2 < top + 1:
                raise PerfscopeError(
                    f"{self.path}: the ticks name rank {top:,} but only {len(seen):,} ranks tick; "
                    "not a plausible count of ranks (give --world-size if the timeline is right)"
                )
            self.world = ranks_in_range(top + 1, f"{self.path}: the world size the ticks claim")
            for r in range(self.world):
                self.run.rank(r, started_ns=self.epoch_ns)
        elif self.prev_end is None:
            for r in range(self.world):
                self.run.rank(r, started_ns=self.epoch_ns)
        if top >= self.world:
            raise PerfscopeError(f"{self.path}: a tick names rank {top}, beyond the world size {self.world}")
        return self.world

    def step(self, k: int, ops: list[Collective]) -> None:
        run, ns = self.run, self.ns
        world = self._ranks(ops)
        ops.sort(key=lambda c: c.start_us)
        if self.backend == "horovod":
            self.backend = next((b for prefix, b in _BACKENDS for c in ops for a, _, _ in c.activities
                                 if a.startswith(prefix)), "horovod")  # fmt: skip
        ends = [ns(c.end_us if c.end_us is not None else c.start_us) for c in ops]
        neg = [ns(c.negotiate_start_us if c.negotiate_start_us is not None else c.start_us) for c in ops]
        start = self.prev_end if self.prev_end is not None else min(neg)
        end = max(ends)
        self.prev_end = end
        for r in range(world):
            ready, busy = [], []
            for seq, (c, done) in enumerate(zip(ops, ends, strict=True)):
                enter = ns(c.ready_us[r]) if r in c.ready_us else ns(c.start_us)
                ready.append(enter - start)
                busy.append((enter, done))
                run.comm(r, k, seq, c.op.lower(), c.nbytes, enter, max(0, done - enter), clock="host")
            exposed = exposed_sync_ns(ready, [e - start for e in ends], 0, end - start)
            times = StepTimes(start_ns=start, step_ns=end - start, sync_exposed_ns=exposed,
                              comm_total_ns=_union_ns(busy), comm_count=len(ops))  # fmt: skip
            run.step(r, k, times, clock="host")
        for c, done in zip(ops, ends, strict=True):
            run.span(0, k, c.op, ns(c.start_us), done - ns(c.start_us), clock="host")
            if c.negotiate_start_us is not None:
                neg_end = max(c.ready_us.values(), default=c.start_us)
                run.span(0, k, f"{_NEGOTIATE}{c.op}", ns(c.negotiate_start_us),
                         ns(neg_end) - ns(c.negotiate_start_us), clock="host")  # fmt: skip
            for name, a, b in c.activities:
                run.span(0, k, name, ns(a), ns(b) - ns(a), clock="host", parent=c.op, depth=1)
