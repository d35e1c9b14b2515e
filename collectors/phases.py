"""The steps of one rank: the open step's phase stack, spans and collectives, and the rows a finished
step becomes (`steps`, `spans`, `comm`, `metrics`).

How a step's columns are computed (DESIGN.md's definitions):

- `step_ns` runs from the end of the previous step (for the first step of a loop: the loop's start)
  to the end of this one.
- `data_ns`, `forward_ns`, `backward_ns`, `sync_exposed_ns`, `optimizer_ns` hold each canonical
  phase's own time: a canonical phase nested inside another canonical phase is subtracted from the
  enclosing one (Horovod's `sync` inside `optimizer`, say), so no time counts twice. Phases with
  other names are written to `spans` only; their time stays in `other_ns` unless a canonical phase
  encloses them.
- A `sync` phase (hand-written allreduce, parameter averaging, Horovod's synchronize) is exposed
  sync by definition: the step waits for all of it.
- Overlapped collectives (DDP buckets) add their exposed part; see `exposed_sync_ns`.
- `other_ns` is `step_ns` minus the five columns, never negative.
- `comm_total_ns` sums the durations of the step's collectives, overlapped or not; `comm_count`
  counts them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .clocks import HostClock, perf_ns

#: canonical phase name -> index of its column in the steps row (after rank, step, start_ns, step_ns)
CANONICAL: dict[str, int] = {"data": 0, "forward": 1, "backward": 2, "sync": 3, "optimizer": 4}
_BACKWARD = CANONICAL["backward"]
_SYNC = CANONICAL["sync"]

Emit = Callable[[str, list[tuple[Any, ...]]], None]


class Marks(Protocol):
    clock: str

    def mark(self) -> Any: ...
    def ready(self, mark: Any) -> bool: ...
    def elapsed_ns(self, start: Any, end: Any) -> int: ...
    def release(self, marks: Any) -> None: ...


class Span:
    """One phase or user span. `start`/`end` are marks of the timing clock; `start_host` is the
    host perf reading that becomes the span's wall-clock start."""

    __slots__ = ("canon", "depth", "end", "error", "name", "parent", "start", "start_host")

    def __init__(self, name: str, parent: Span | None, depth: int, start_host: int, start: Any) -> None:
        self.name = name
        self.parent = parent
        self.depth = depth
        self.start_host = start_host
        self.start = start
        self.end: Any = None
        self.error: str | None = None
        self.canon = CANONICAL.get(name, -1)


class Collective:
    """One collective as this rank saw it: entered at `start`, finished at `end` (set from whichever
    thread completes it). `overlapped` collectives (DDP buckets) run during backward."""

    __slots__ = ("bucket", "end", "nbytes", "op", "overlapped", "seq", "start", "start_host")

    def __init__(
        self,
        seq: int,
        op: str,
        bucket: int | None,
        nbytes: int,
        start_host: int,
        start: Any,
        overlapped: bool,
    ) -> None:
        self.seq = seq
        self.op = op
        self.bucket = bucket
        self.nbytes = nbytes
        self.start_host = start_host
        self.start = start
        self.end: Any = None
        self.overlapped = overlapped


class StepRecord:
    __slots__ = ("comm", "end", "index", "metrics", "samples", "spans", "start", "start_host")

    def __init__(self, index: int, start_host: int, start: Any) -> None:
        self.index = index
        self.start_host = start_host
        self.start = start
        self.end: Any = None
        self.spans: list[Span] = []
        self.comm: list[Collective] = []
        self.metrics: list[tuple[str, Any, int]] = []
        self.samples: int | None = None

    def empty(self) -> bool:
        return not (self.spans or self.comm or self.metrics)


def exposed_sync_ns(ready_ns: list[int], done_ns: list[int], window_start_ns: int, window_end_ns: int) -> int:
    """Exposed part of overlapped collectives (DDP buckets), all times relative to one origin.

    DDP launches a bucket's allreduce the moment its last gradient is computed (`ready_ns`, the
    comm hook's entry) and overlaps it with the rest of backward; the reducer then makes backward
    wait until every bucket's collective has finished (`done_ns`, the completion callback). Once the
    last bucket is ready, all gradients exist, so what backward still spends after that moment until
    the last collective is done is waiting on communication:

        exposed = min(window_end, max(done)) - max(ready), clamped to [0, window length]

    where the window is the backward phase that contains the last ready time (the whole step when
    there is no backward phase). This is never more than the duration of one collective (the one
    finishing last began no later than the last ready time), hence never more than the total.
    """
    if not ready_ns or not done_ns:
        return 0
    last_ready = max(ready_ns)
    end = min(window_end_ns, max(done_ns))
    return max(0, min(end - last_ready, window_end_ns - window_start_ns))


def infer_samples(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of the first tensor-like found (a tensor, or the
    first element of a tuple/list/dict holding one); None when there is none."""
    shape = getattr(batch, "shape", None)
    if shape is None:
        if isinstance(batch, (list, tuple)) and batch:
            shape = getattr(batch[0], "shape", None)
        elif isinstance(batch, dict) and batch:
            shape = getattr(next(iter(batch.values())), "shape", None)
    if shape is None or len(shape) == 0:
        return None
    try:
        return int(shape[0])
    except (TypeError, ValueError):
        return None


class Timeline:
    """Records one rank's steps and turns each finished step into rows, once its timing marks are
    resolved (at once on the host; CUDA events when the device has passed them)."""

    def __init__(
        self, rank: int, marks: Marks, clock: HostClock, emit: Emit, *, default_samples: int | None = None
    ) -> None:
        self.rank = rank
        self.marks = marks
        self.host = marks.clock == "host"  # host marks are the perf reading itself: one clock read
        self.clock = clock
        self.emit = emit
        self.default_samples = default_samples
        self.opened_host = perf_ns()
        self.opened = marks.mark()
        self.index = 0
        self.cur: StepRecord | None = None
        self.stack: list[Span] = []
        self.seq = 0
        self.pending: deque[StepRecord] = deque()
        self.steps_written = 0
        self.unresolved = 0
        self.nvtx = False
        self.nvtx_push: Callable[[str], None] = _noop1
        self.nvtx_pop: Callable[[], None] = _noop0
        self.nvtx_step_begin: Callable[[int], Any] = _noop1
        self.nvtx_step_end: Callable[[Any], None] = _noop1
        self._step_range: Any = None

    def use_marks(self, marks: Marks) -> bool:
        """Switch the timing clock (to CUDA events once the model is on a GPU); only before anything
        was recorded, so one step never mixes clocks."""
        if self.steps_written or self.pending or (self.cur is not None and not self.cur.empty()):
            return False
        self.marks = marks
        self.host = marks.clock == "host"
        self.opened = marks.mark()
        self.cur = None
        return True

    # -- the open step ---------------------------------------------------------------------------
    def _open(self, start_host: int, start: Any) -> StepRecord:
        if self.cur is not None:
            self.nvtx_step_end(self._step_range)
        self.cur = StepRecord(self.index, start_host, start)
        self._step_range = self.nvtx_step_begin(self.index)
        return self.cur

    def current(self) -> StepRecord:
        cur = self.cur
        if cur is None:
            cur = self._open(perf_ns(), self.marks.mark())
        return cur

    def begin_loop(self) -> None:
        """A loop over the data starts: its first step starts now unless something is recorded."""
        cur = self.cur
        if cur is None or cur.empty():
            self._open(perf_ns(), self.marks.mark())

    def enter(self, name: str) -> Span:
        t = perf_ns()
        cur = self.cur or self.current()
        stack = self.stack
        span = Span(name, stack[-1] if stack else None, len(stack), t, t if self.host else self.marks.mark())
        stack.append(span)
        cur.spans.append(span)
        if self.nvtx:
            self.nvtx_push(name)
        return span

    def exit(self, span: Span, error: type[BaseException] | None) -> None:
        span.end = perf_ns() if self.host else self.marks.mark()
        if self.nvtx:
            self.nvtx_pop()
        if error is not None:
            span.error = error.__name__
        stack = self.stack
        if stack and stack[-1] is span:
            stack.pop()
        elif span in stack:  # exited out of order (a generator left open): drop what it enclosed
            del stack[stack.index(span) :]

    def cancel(self, span: Span) -> None:
        """Forget a span that turned out not to belong to a step (the loader's final StopIteration)."""
        if self.nvtx:
            self.nvtx_pop()
        if self.stack and self.stack[-1] is span:
            self.stack.pop()
        if self.cur is not None and span in self.cur.spans:
            self.cur.spans.remove(span)

    def abandon_open_step(self) -> None:
        """The open step failed: write what it recorded (spans with their error, collectives,
        metrics) but no steps row, and start afresh."""
        cur = self.cur
        self.discard_open_step()
        if cur is not None:
            self.index += 1  # its index stays taken: the rows written here carry it
            cur.spans = [s for s in cur.spans if s.end is not None]
            self._write(cur, complete=False, open_step=True)

    def discard_open_step(self) -> None:
        """Forget the open step (a loop left before its body ran); the next one starts afresh."""
        if self.cur is not None:
            self.nvtx_step_end(self._step_range)
        self.cur = None
        self.stack.clear()
        self.seq = 0

    def in_phase(self, name: str) -> bool:
        return any(s.name == name for s in self.stack)

    def begin_collective(self, op: str, bucket: int | None, nbytes: int, *, overlapped: bool) -> Collective:
        cur = self.cur or self.current()
        t = perf_ns()
        c = Collective(self.seq, op, bucket, nbytes, t, t if self.host else self.marks.mark(), overlapped)
        self.seq += 1
        cur.comm.append(c)
        return c

    def end_collective(self, c: Collective) -> None:
        c.end = perf_ns() if self.host else self.marks.mark()

    def log(self, name: str, value: Any) -> None:
        (self.cur or self.current()).metrics.append((name, value, perf_ns()))

    def set_samples(self, samples: int | None) -> None:
        (self.cur or self.current()).samples = samples

    def end_step(self, samples: int | None = None) -> None:
        """Close the open step now; the next one starts at this instant."""
        end_host = perf_ns()
        end = end_host if self.host else self.marks.mark()
        cur = self.cur
        if cur is None:
            cur = StepRecord(self.index, self.opened_host, self.opened)
        cur.end = end
        if samples is not None:
            cur.samples = samples
        nxt = self._open_next(end_host, end, cur)
        self.pending.append(cur)
        self.cur = nxt
        self.drain()

    def _open_next(self, start_host: int, start: Any, done: StepRecord) -> StepRecord:
        self.index += 1
        self.seq = 0
        self.nvtx_step_end(self._step_range)
        nxt = StepRecord(self.index, start_host, start)
        self._step_range = self.nvtx_step_begin(self.index)
        if self.stack:  # phases still open across the boundary are counted in the step they end in
            open_spans = set(map(id, self.stack))
            nxt.spans = [s for s in done.spans if id(s) in open_spans]
            done.spans = [s for s in done.spans if id(s) not in open_spans]
        return nxt

    # -- resolution --------------------------------------------------------------------------------
    def _ready(self, rec: StepRecord) -> bool:
        ready = self.marks.ready
        if not ready(rec.end):
            return False
        return all(not (c.end is None or not ready(c.end)) for c in rec.comm)

    def drain(self) -> None:
        pending = self.pending
        while pending and self._ready(pending[0]):
            self._write(pending.popleft(), complete=True)

    def close(self, wait_s: float = 2.0) -> None:
        """Resolve what is pending (waiting at most `wait_s` for the device or late collectives),
        then write the spans, collectives and metrics of the step left open (no steps row: it did
        not finish)."""
        deadline = perf_ns() + int(wait_s * 1e9)
        while self.pending and perf_ns() < deadline:
            self.drain()
            if self.pending:
                _sleep_briefly()
        while self.pending:
            self.unresolved += 1
            self._write(self.pending.popleft(), complete=False)
        if self.cur is not None and not self.cur.empty():
            self.abandon_open_step()
        else:
            self.discard_open_step()

    def _write(self, rec: StepRecord, *, complete: bool, open_step: bool = False) -> None:
        marks = self.marks
        host = self.host
        el = marks.elapsed_ns
        ready = marks.ready
        shift = self.clock.shift_ns  # perf reading -> ns since epoch on rank 0's clock
        rank, index, clock = self.rank, rec.index, marks.clock
        s0 = rec.start
        cols = [0, 0, 0, 0, 0]
        span_rows = []
        backward: list[tuple[int, int]] = []
        for sp in rec.spans:
            end = sp.end
            if end is None or not (host or complete or (ready(sp.start) and ready(end))):
                continue
            dur = end - sp.start if host else el(sp.start, end)
            parent = sp.parent
            span_rows.append(
                (rank, index, sp.name, parent.name if parent is not None else None, sp.depth,
                 sp.start_host + shift, dur, clock, sp.error)
            )  # fmt: skip
            canon = sp.canon
            if canon >= 0:
                cols[canon] += dur
                while parent is not None and parent.canon < 0:
                    parent = parent.parent
                if parent is not None:
                    cols[parent.canon] -= dur
                if canon == _BACKWARD:
                    start_rel = sp.start - s0 if host else el(s0, sp.start)
                    backward.append((start_rel, start_rel + dur))
        comm_rows = []
        comm_total = 0
        ready_rel: list[int] = []
        done_rel: list[int] = []
        for c in rec.comm:
            end = c.end
            if end is None or not (host or complete or (ready(c.start) and ready(end))):
                continue
            dur = end - c.start if host else el(c.start, end)
            comm_total += dur
            comm_rows.append((rank, index, c.seq, c.op, c.bucket, c.nbytes, c.start_host + shift, dur, clock))
            if c.overlapped:
                r = c.start - s0 if host else el(s0, c.start)
                ready_rel.append(r)
                done_rel.append(r + dur)
        emit = self.emit
        if span_rows:
            emit("spans", span_rows)
        if comm_rows:
            emit("comm", comm_rows)
        if rec.metrics:
            emit("metrics", [(rank, index, t + shift, n, _number(v)) for n, v, t in rec.metrics])
        if not open_step and (complete or ready(rec.end)):
            step_ns = rec.end - s0 if host else el(s0, rec.end)
            if ready_rel:
                last_ready = max(ready_rel)
                window = next(((a, b) for a, b in backward if a <= last_ready <= b), None)
                if window is None and backward:
                    window = backward[-1]
                exposed = exposed_sync_ns(ready_rel, done_rel, *(window or (0, step_ns)))
                cols[_SYNC] += exposed
                if window is not None:
                    cols[_BACKWARD] -= exposed
            cols = [c if c > 0 else 0 for c in cols]
            other = step_ns - sum(cols)
            samples = rec.samples if rec.samples is not None else self.default_samples
            emit(
                "steps",
                [(rank, index, rec.start_host + shift, step_ns, *cols, other if other > 0 else 0,
                  comm_total, len(comm_rows), samples, clock)],
            )  # fmt: skip
            self.steps_written += 1
        if not host:
            marks.release([s0] + [x for sp in rec.spans for x in (sp.start, sp.end)])
            marks.release([x for c in rec.comm for x in (c.start, c.end)])


def _number(value: Any) -> float | None:
    try:
        return float(value)  # a tensor's .item() is cheap here: its step has already finished
    except (TypeError, ValueError):
        return None


def _noop0() -> None:
    pass


def _noop1(_: Any) -> None:
    pass


def _sleep_briefly() -> None:
    import time

    time.sleep(0.001)
