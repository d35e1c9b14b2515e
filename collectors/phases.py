"""One rank's timeline: the open step's phase stack, its spans and collectives as they happen, and
the queue of finished steps waiting for their timing marks before they become rows (step_rows.py
says how)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .clocks import HostClock, HostMarks, perf_ns
from .step_rows import (
    CANONICAL,
    END,
    ERROR,
    NAME,
    START,
    Collective,
    Emit,
    Marks,
    Span,
    StepRecord,
    flatten,
    metric_value,
    write_frozen,
    write_held_flat,
    write_step,
)

#: steps kept waiting for their timing marks before the oldest is written incomplete
MAX_PENDING_STEPS = 64
#: never: a timeline that does not watch for a step that never ends
_NEVER = 1 << 62
#: most steps whose rows a holding timeline keeps before handing them on
MAX_HELD_STEPS = 64
#: steps a pulled timeline lets gather before it asks the writer to take them (`wake`) ...
PULL_AT_STEPS = 512
#: ... and how many it keeps at most when the writer does not, before building them itself
MAX_PULLED_STEPS = 8192


def infer_samples(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of the first tensor-like found (a tensor, or the
    first element of a tuple/list/dict holding one); None when there is none."""
    cls = batch.__class__
    if (cls is tuple or cls is list) and batch:  # (inputs, targets): the common case first
        shape = getattr(batch[0], "shape", None)
    else:
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
        #: host marks and no NVTX ranges: a phase is a perf reading at each end (Phase's fast path)
        self.quick = self.host
        self.clock = clock
        self.emit = emit
        #: where `flush` hands the held steps' rows as one flat list of values per table, if set
        #: (StoreWriter.extend_flat: no tuple per row); else `emit` gets them as rows
        self.emit_flat: Callable[[str, list[Any]], None] | None = None
        self.default_samples = default_samples
        self.opened_host = perf_ns()
        self.opened = marks.mark()
        self.index = 0
        self.cur: StepRecord | None = None
        self.stack: list[Span] = []
        self.seq = 0
        self.group_last: dict[object, Collective] = {}
        self.pending: deque[StepRecord] = deque()
        self.steps_written = 0
        self.unresolved = 0
        self.nvtx = False
        self.nvtx_push: Callable[[str], None] = _noop1
        self.nvtx_pop: Callable[[], None] = _noop0
        self.nvtx_step_begin: Callable[[int], Any] = _noop1
        self.nvtx_step_end: Callable[[Any], None] = _noop1
        self._step_range: Any = None
        #: `on_long_step(ns)` is called once when a phase starts this long after its step began
        #: (a loop that never ends a step: prof.step() forgotten)
        self.long_step_ns = _NEVER
        self.on_long_step: Callable[[int], None] = _noop1
        #: a phase entered at or before this perf reading takes the quick path (Profiler's Phase,
        #: prof.steps' data phase): the open step's start plus long_step_ns while the timeline is
        #: quick and `live`; -1 otherwise. One comparison on the hot path stands for four checks.
        self.deadline = -1
        #: False once the profile stops recording: no quick path any more
        self.live = True
        #: rows of finished steps are built and handed to `emit` once this much step time has
        #: gathered (or `max_held` steps): one call per table for many short steps. 0 hands on every
        #: step. The steps are held as they were recorded; their rows are built when handed on.
        self.hold_ns = 0
        self.max_held = MAX_HELD_STEPS
        #: with `wake` set, after the first hand-over the held steps wait for the store writer,
        #: which builds their rows on its own thread (`take_rows`, at each roll, or soon after
        #: `wake()` once PULL_AT_STEPS gathered): the training thread only appends each step
        self.wake: Callable[[], None] | None = None
        #: the held steps' values (step_rows.flatten: each step after its length), extended here in
        #: one C call per step, taken (copied, then deleted) by whichever thread builds their rows
        self._held: list[Any] = []
        self._held_steps = 0  # steps appended to _held, ever (the training thread's count) ...
        self._taken_steps = 0  # ... and taken from it (under _taking)
        self._taking = threading.Lock()  # takers only: an append never waits on it
        self._held_since = 0  # start (host perf) of the first held step
        self._convert = False  # a metric of the open step is not a plain number (a tensor, say)

    def use_marks(self, marks: Marks) -> bool:
        """Switch the timing clock (to CUDA events once the model is on a GPU); only before anything
        was recorded, so one step never mixes clocks."""
        if self.steps_written or self.pending or (self.cur is not None and not self.cur.empty()):
            return False
        self.marks = marks
        self.host = marks.clock == "host"
        self.quick = self.host and not self.nvtx
        self.opened = marks.mark()
        self.cur = None
        self.refresh_deadline()
        return True

    def use_nvtx(self, ranges: Any) -> None:
        """Push an NVTX range per phase and per step (collectors/nvtx_ranges.py's NvtxRanges)."""
        self.nvtx, self.quick = True, False
        self.nvtx_push, self.nvtx_pop = ranges.push, ranges.pop
        self.nvtx_step_begin, self.nvtx_step_end = ranges.step_begin, ranges.step_end
        self.refresh_deadline()

    def watch_long_steps(self, ns: int) -> None:
        """Call on_long_step once a phase starts `ns` after its step began."""
        self.long_step_ns = ns
        self.refresh_deadline()

    def stop_live(self) -> None:
        """Recording stopped: the quick path is closed (every phase asks its profile again)."""
        self.live = False
        self.deadline = -1

    def refresh_deadline(self) -> None:
        cur = self.cur
        quick = cur is not None and self.quick and self.live
        self.deadline = cur.start_host + self.long_step_ns if quick else -1  # type: ignore[union-attr]

    # -- the open step ---------------------------------------------------------------------------
    def _open(self, start_host: int, start: Any) -> StepRecord:
        if self.nvtx and self.cur is not None:
            self.nvtx_step_end(self._step_range)
        self.cur = StepRecord(self.index, start_host, start)
        if self.nvtx:
            self._step_range = self.nvtx_step_begin(self.index)
        self.refresh_deadline()
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
        if t - cur.start_host > self.long_step_ns:
            self.long_step_ns = _NEVER
            self.refresh_deadline()
            self.on_long_step(t - cur.start_host)
        stack = self.stack
        span = [
            name,
            stack[-1] if stack else None,
            len(stack),
            t,
            t if self.host else self.marks.mark(),
            None,
            None,
            CANONICAL.get(name, -1),
        ]
        stack.append(span)
        cur.spans.append(span)
        if self.nvtx:
            self.nvtx_push(name)
        return span

    def exit(self, span: Span, error: type[BaseException] | None) -> None:
        span[END] = perf_ns() if self.host else self.marks.mark()
        if self.nvtx:
            self.nvtx_pop()
        if error is not None:
            span[ERROR] = error.__name__
        stack = self.stack
        if stack and stack[-1] is span:
            stack.pop()
        elif span in stack:  # exited out of order (a generator left open): drop what it enclosed
            del stack[stack.index(span) :]

    def exit_named(self, name: str, error: type[BaseException] | None) -> None:
        """End the innermost open span called `name` (what a `with prof.phase(name)` block leaves)."""
        stack = self.stack
        if stack and stack[-1][NAME] == name:
            self.exit(stack[-1], error)
            return
        for span in reversed(stack):
            if span[NAME] == name:
                self.exit(span, error)
                return

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
            cur.spans = [s for s in cur.spans if s[END] is not None]
            self._write(cur, complete=False, open_step=True)

    def open_step_state(self) -> tuple[bool, bool]:
        """(whether the open step's body ran: a phase other than 'data', a collective or a metric;
        whether one of its phases raised)."""
        cur = self.cur
        if cur is None:
            return False, False
        ran = bool(cur.comm or cur.metrics) or any(sp[NAME] != "data" for sp in cur.spans)
        return ran, any(sp[ERROR] for sp in cur.spans)

    def discard_open_step(self) -> None:
        """Forget the open step (a loop left before its body ran); the next one starts afresh."""
        if self.nvtx and self.cur is not None:
            self.nvtx_step_end(self._step_range)
        self.cur = None
        self.deadline = -1
        self.stack.clear()
        self.seq = 0
        self.group_last.clear()

    def in_phase(self, name: str) -> bool:
        return any(s[NAME] == name for s in self.stack)

    def begin_collective(
        self, op: str, bucket: int | None, nbytes: int, *, overlapped: bool, group: object = None
    ) -> Collective:
        """A collective ready now. `group` (any key naming its process group) orders it behind the
        previous collective of the same group in this step: it transfers only once that one is done."""
        cur = self.cur or self.current()
        t = perf_ns()
        c = Collective(self.seq, op, bucket, nbytes, t, t if self.host else self.marks.mark(), overlapped)
        self.seq += 1
        if group is not None:
            c.after = self.group_last.get(group)
            self.group_last[group] = c
        cur.comm.append(c)
        return c

    def end_collective(self, c: Collective) -> None:
        c.end = perf_ns() if self.host else self.marks.mark()

    def log(self, name: str, value: Any) -> None:
        self.log_values({name: value})

    def log_values(self, values: dict[str, Any]) -> None:
        """User metrics of the open step, all at this instant."""
        t = perf_ns()
        metrics = (self.cur or self.current()).metrics
        for name, value in values.items():
            if value.__class__ is not float and value.__class__ is not int:
                self._convert = True  # read at the step's end, as its rows may be built later
            metrics.append((name, value, t))

    def end_step(self, samples: int | None = None) -> None:
        """Close the open step now; the next one starts at this instant."""
        end_host = perf_ns()
        cur = self.cur
        if (
            self.deadline >= 0  # quick: host clock, no NVTX, recording, a step open
            and not self.stack
            and not cur.comm  # type: ignore[union-attr]
            and not self._convert
            and not self.pending
            and self.hold_ns
        ):  # the common case of a short step, as below with nothing to check: one call less
            cur.end = end_host  # type: ignore[union-attr]
            if samples is not None:
                cur.samples = samples  # type: ignore[union-attr]
            self.index += 1
            self.seq = 0
            if self.group_last:
                self.group_last.clear()
            self.cur = StepRecord(self.index, end_host, end_host)
            self.deadline = end_host + self.long_step_ns
            self._hold(cur)  # type: ignore[arg-type]
            return
        end = end_host if self.host else self.marks.mark()
        cur = self.cur
        if cur is None:
            cur = StepRecord(self.index, self.opened_host, self.opened)
        cur.end = end
        if samples is not None:
            cur.samples = samples
        self.cur = self._open_next(end_host, end, cur)
        self.deadline = end_host + self.long_step_ns if self.quick and self.live else -1
        if self._convert:  # a tensor logged may change in place after its step: read it now
            self._convert = False
            cur.metrics = [(n, metric_value(v), t) for n, v, t in cur.metrics]
        if self.host and not cur.comm and not self.pending:
            # nothing to wait for: the common case, kept short
            if not self.hold_ns:
                self._write(cur, complete=True)
                return
            self._hold(cur)
        else:
            self.pending.append(cur)
            self.drain()

    def open_since_start(self) -> StepRecord:
        """The step in progress; when none is, one open since the timeline opened (as end_step sees it)."""
        if self.cur is None:
            self.cur = StepRecord(self.index, self.opened_host, self.opened)
            self.refresh_deadline()
        return self.cur

    def end_step_at(self, end_host: int, end: Any, samples: int | None) -> None:
        """End the step in progress at an earlier instant (a host perf reading and a timing mark),
        before which nothing now in it was recorded: it ends there, empty, and what it holds moves to
        the next step, which starts there."""
        cur = self.open_since_start()
        done = StepRecord(self.index, cur.start_host, cur.start)
        done.end = end
        done.samples = samples
        self.index += 1
        cur.index, cur.start_host, cur.start = self.index, end_host, end
        self.refresh_deadline()
        self.pending.append(done)
        self.drain()

    def _open_next(self, start_host: int, start: Any, done: StepRecord) -> StepRecord:
        self.index += 1
        self.seq = 0
        self.group_last.clear()  # ordering is within a step: DDP waits for every bucket before it ends
        nxt = StepRecord(self.index, start_host, start)
        if self.nvtx:
            self.nvtx_step_end(self._step_range)
            self._step_range = self.nvtx_step_begin(self.index)
        if self.stack:  # phases still open across the boundary are counted in the step they end in
            open_spans = set(map(id, self.stack))
            nxt.spans = [s for s in done.spans if id(s) in open_spans]
            done.spans = [s for s in done.spans if id(s) not in open_spans]
        return nxt

    # -- resolution --------------------------------------------------------------------------------
    def _ready(self, rec: StepRecord) -> bool:
        if self.host:  # host marks are final at once; only collectives may still be running
            return all(c.end is not None for c in rec.comm)
        ready = self.marks.ready
        # a phase may have run on a side stream: each of its events must be passed, not only the step's
        return (
            ready(rec.end)
            and all(c.end is not None and ready(c.end) for c in rec.comm)
            and all(ready(sp[END]) for sp in rec.spans if sp[END] is not None)
        )

    def drain(self) -> None:
        pending = self.pending
        while pending:
            if self._ready(pending[0]):
                rec = pending.popleft()
                if self.host and self.hold_ns:  # its collectives are done: held as the others
                    self._hold(rec)
                else:
                    self._write(rec, complete=True)
            elif len(pending) > MAX_PENDING_STEPS:
                # a collective that never completed (its hook failed) must not hold back every
                # later step: write the oldest step with what has resolved
                self.unresolved += 1
                self._write(pending.popleft(), complete=False)
            else:
                return

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
        self.flush()

    def take_rows(self, *, flat: bool = False) -> dict[str, list[Any]]:
        """The rows of the held steps, by table, built now by the calling thread (the store writer
        pulls them at each roll; flush hands them to `emit`). Safe beside the training thread:
        finished steps are not changed any more, and each is taken once (a copy of the held values,
        then a delete of exactly those, each one C call: what the training thread appends meanwhile
        stays for the next take; one taker at a time). With `flat`,
        each table's rows come as one flat list of their values (write_frozen's `flat`)."""
        out: dict[str, list[Any]] = {}

        def gather(table: str, rows: list[Any]) -> None:
            got = out.get(table)
            if got is None:
                out[table] = rows
            else:
                got += rows

        held, marks, shift = self._held, self.marks, self.clock.shift_ns
        if self.hold_ns == _NEVER:
            self.max_held = PULL_AT_STEPS
        with self._taking:
            values = held[:]
            del held[: len(values)]
        at, end, steps = 0, len(values), 0
        if flat:  # the common case of a pull, in one call (write_held_flat)
            steps = write_held_flat(
                values, out, marks, rank=self.rank, shift_ns=shift, default_samples=self.default_samples
            )
            end = 0
        while at < end:
            stop = at + 1 + values[at]
            write_frozen(
                values, gather, marks, rank=self.rank, shift_ns=shift, default_samples=self.default_samples,
                complete=True, flat=flat, at=at + 1, until=stop,
            )  # fmt: skip
            at = stop
            steps += 1
        if steps:
            with self._taking:
                self._taken_steps += steps
        return out

    def held_steps(self) -> int:
        """Steps held, their rows not yet built (as the training thread sees it)."""
        return self._held_steps - self._taken_steps

    def _hold(self, rec: StepRecord) -> None:
        """Hold a finished, resolved host step; hand the held ones on when enough gathered."""
        held = self._held
        if not held:
            self._held_since = rec.start_host
        held += flatten(rec)  # one C call: a taker sees the whole step or none of it
        self._held_steps += 1
        self.steps_written += 1  # a complete host step always gets its steps row
        if (
            rec.end - self._held_since >= self.hold_ns
            or self._held_steps - self._taken_steps >= self.max_held
        ):
            self._hand_on()

    def _hand_on(self) -> None:
        if self.hold_ns != _NEVER or self.max_held >= MAX_PULLED_STEPS:
            self.flush()
            if self.wake is not None:  # the first rows went out at once; from now on the writer pulls
                self.hold_ns, self.max_held = _NEVER, PULL_AT_STEPS
        else:
            self.max_held += PULL_AT_STEPS  # asked once per PULL_AT_STEPS (take_rows lowers it again)
            self.wake()  # type: ignore[misc]  # hold_ns is _NEVER only with wake set

    def flush(self) -> None:
        """Build the rows of the held steps and hand them on to `emit` (or `emit_flat`)."""
        emit_flat = self.emit_flat
        if emit_flat is not None:
            for table, values in self.take_rows(flat=True).items():
                emit_flat(table, values)
            return
        for table, rows in self.take_rows().items():
            self.emit(table, rows)

    def _write(self, rec: StepRecord, *, complete: bool, open_step: bool = False) -> None:
        if self._held:
            self.flush()  # in order: what is held first
        marks = self.marks
        if write_step(
            rec, self.emit, marks, rank=self.rank, shift_ns=self.clock.shift_ns,
            default_samples=self.default_samples, complete=complete, open_step=open_step,
        ):  # fmt: skip
            self.steps_written += 1
        if not self.host:
            marks.release([rec.start] + [x for sp in rec.spans for x in (sp[START], sp[END])])
            marks.release([x for c in rec.comm for x in (c.start, c.end)])


def _noop0() -> None:
    pass


def _drop(table: str, rows: list[Any]) -> None:
    pass


def _noop1(_: Any) -> None:
    pass


def _sleep_briefly() -> None:
    import time

    time.sleep(0.001)


#: the timeline of a profile not recording (yet): never quick, never written to
IDLE = Timeline(-1, HostMarks(), HostClock(), _drop)
IDLE.stop_live()
