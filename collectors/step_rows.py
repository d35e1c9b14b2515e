"""What one rank records of a step (spans, collectives, metrics) and the rows it becomes once its
timing marks are resolved: `steps`, `spans`, `comm`, `metrics`.

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
- A torch.distributed call recorded in another phase (an FSDP all-gather in `forward`, a pipeline's
  `recv`) moves its exposed time from that phase's column (or `other_ns`) to `sync_exposed_ns`; its
  `comm` row keeps the phase and the op, so analyses can tell gradient sync from a pipeline wait.
- Overlapped collectives (DDP buckets) add their exposed part; see `exposed_sync_ns`.
- `other_ns` is `step_ns` minus the five columns, never negative.
- `comm_total_ns` sums the durations of the step's collectives, overlapped or not; `comm_count`
  counts them. A collective's duration and `start_ns` begin at the later of its readiness and the
  completion of the collective issued before it on the same process group (time queued behind
  another bucket is not transfer); the exposed part still counts from readiness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: canonical phase name -> index of its column in the steps row (after rank, step, start_ns, step_ns)
CANONICAL: dict[str, int] = {"data": 0, "forward": 1, "backward": 2, "sync": 3, "optimizer": 4}
_BACKWARD = CANONICAL["backward"]
_SYNC = CANONICAL["sync"]
_FORWARD = CANONICAL["forward"]


def step_samples(samples: int | None, default_samples: int | None, forwards: int) -> int | None:
    """A step's samples: as given (the batch prof.steps inferred, or prof.step(samples=...)), else the
    loader's batch (`batch_size=`, one micro-batch) times the forward passes of the step (gradient
    accumulation runs several between two optimizer updates; DESIGN.md: a step is one update)."""
    if samples is not None or default_samples is None:
        return samples
    return default_samples * (forwards if forwards > 1 else 1)


Emit = Callable[[str, list[tuple[Any, ...]]], None]
#: `Collective.exposed` of a synchronous call: the caller waited for all of it
EXPOSED_ALL = -1


class Marks(Protocol):
    clock: str

    def mark(self) -> Any: ...
    def ready(self, mark: Any) -> bool: ...
    def elapsed_ns(self, start: Any, end: Any) -> int: ...
    def release(self, marks: Any) -> None: ...


# A span is a list, not an object: one is made on every phase entry, and a list costs a fifth of a
# slotted instance (about 65 against 320 ns). Its fields, by index:
NAME, PARENT, DEPTH, START_HOST, START, END, ERROR, CANON = range(8)
# [name, parent span or None, depth, host perf reading at start (becomes the wall-clock start),
#  start mark, end mark (of the timing clock), error type name or None, canonical column or -1]
Span = list


class Collective:
    """One collective as this rank saw it: ready at `start`, finished at `end` (set from whichever
    thread completes it). `overlapped` collectives (DDP buckets) run during backward. `after` is the
    collective issued before it on the same process group: its transfer cannot start before that
    one completes, so its recorded duration starts at the later of the two (DESIGN.md)."""

    __slots__ = (
        "after", "bucket", "end", "exposed", "group_ranks", "group_size", "is_async", "nbytes", "op",
        "overlapped", "peer", "phase", "seq", "start", "start_host",
    )  # fmt: skip

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
        self.after: Collective | None = None
        # set by the torch.distributed recorder (dist_recorder.py) and prof.collective:
        self.peer: int | None = None
        self.group_size: int | None = None
        self.group_ranks: str | None = None  # comm.group_ranks: the group's global ranks, '0,2'
        self.exposed: int | None = None  # ns waited (host clock), EXPOSED_ALL: the whole duration
        self.is_async = overlapped
        self.phase: str | None = None  # canonical phase it was issued in, 'other' outside them


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


#: finished host steps as plain values: see `flatten`
Frozen = Sequence[Any]
#: index, start_host, start, end, samples, number of spans, number of collectives; then 9 values per
#: span, 15 per collective, 3 per metric
_HEAD = 7


def flatten(rec: StepRecord) -> list[Any]:
    """A finished step on the host clock, its collectives done, as a list of plain values: its
    length less one, then what write_step reads of it (write_frozen's `at` skips the length). Held
    steps are these values, appended to one list (Timeline._hold): no object per step for the
    garbage collector (the 8 lists and the record of a step, kept alive until the writer builds its
    rows, were promoted to the old generation and made its full collections cost several µs per
    step; a tuple per step still made a gen-0 collection every ~700 steps, on the training thread).
    Of a span's parent only its name and the column of its nearest canonical ancestor (or -1) are
    kept; of the collective issued before one on its group, its end."""
    flat = [0, rec.index, rec.start_host, rec.start, rec.end, rec.samples, len(rec.spans), len(rec.comm)]
    for name, parent, depth, start_host, start, end, error, canon in rec.spans:
        if parent is None:
            flat += (name, None, -1, depth, start_host, start, end, error, canon)
            continue
        parent_name = parent[NAME]
        while parent is not None and parent[CANON] < 0:
            parent = parent[PARENT]
        column = -1 if parent is None else parent[CANON]
        flat += (name, parent_name, column, depth, start_host, start, end, error, canon)
    for c in rec.comm:
        after = None if c.after is None else c.after.end
        flat += (c.seq, c.op, c.bucket, c.nbytes, c.start_host, c.start, c.end, c.overlapped, after,
                 c.exposed, c.is_async, c.phase, c.peer, c.group_size, c.group_ranks)  # fmt: skip
    for metric in rec.metrics:
        flat += metric
    flat[0] = len(flat) - 1
    return flat


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


def write_step(
    rec: StepRecord,
    emit: Emit,
    marks: Marks,
    *,
    rank: int,
    shift_ns: int,
    default_samples: int | None,
    complete: bool,
    open_step: bool = False,
) -> bool:
    """Emit the rows of `rec` (see write_frozen)."""
    return write_frozen(
        flatten(rec), emit, marks, rank=rank, shift_ns=shift_ns, default_samples=default_samples,
        complete=complete, open_step=open_step, at=1,
    )  # fmt: skip


def write_frozen(
    frozen: Frozen,
    emit: Emit,
    marks: Marks,
    *,
    rank: int,
    shift_ns: int,
    default_samples: int | None,
    complete: bool,
    open_step: bool = False,
    flat: bool = False,
    at: int = 0,
    until: int | None = None,
) -> bool:
    """Emit the rows of a step (`flatten`'s values). `shift_ns` turns a host perf reading into ns
    since epoch on rank 0's clock. With `complete`, every mark is known to be resolved; without,
    marks not yet resolved are left out. An `open_step` (one that failed or never ended) gets no
    steps row. Returns whether a steps row was written.

    With `flat`, each table's rows are emitted as one flat list of their values, row after row
    (what the store writer buffers): no tuple per row is kept, so building many steps' rows makes
    no garbage-collector work (held as tuples until flattened, a pull's rows were several thousand
    tracked objects, a gen-0 collection every ~200 steps).

    The step's values are `frozen[at:until]` (`flatten`'s list holds many steps, each after its
    length)."""
    host = marks.clock == "host"
    el = marks.elapsed_ns
    ready = marks.ready
    shift = shift_ns
    clock = marks.clock
    index, step_start_host, s0, step_end, samples, n_spans, n_comm = frozen[at : at + _HEAD]
    cols = [0, 0, 0, 0, 0]
    span_rows: list[Any] = []
    put_span = span_rows.extend if flat else span_rows.append
    backward: list[tuple[int, int]] = []
    forwards = 0  # forward phases not inside another: the step's micro-batches
    i = at + _HEAD
    stop = len(frozen) if until is None else until
    for _ in range(n_spans):
        name, parent_name, column, depth, start_host, start, end, error, canon = frozen[i : i + 9]
        i += 9
        if end is None or not (host or complete or (ready(start) and ready(end))):
            continue
        dur = end - start if host else el(start, end)
        put_span((rank, index, name, parent_name, depth, start_host + shift, dur, clock, error))
        if canon >= 0:
            cols[canon] += dur
            if column >= 0:  # its nearest canonical ancestor's own time excludes it
                cols[column] -= dur
            if canon == _FORWARD and column != _FORWARD:
                forwards += 1
            if canon == _BACKWARD:
                start_rel = start - s0 if host else el(s0, start)
                backward.append((start_rel, start_rel + dur))
    comm_rows: list[Any] = []
    put_comm = comm_rows.extend if flat else comm_rows.append
    n_comm_rows = 0
    comm_total = 0
    ready_rel: list[int] = []
    done_rel: list[int] = []
    moved: list[tuple[int, int]] = []  # (canonical column or -1, exposed ns) of calls outside `sync`
    for _ in range(n_comm):
        seq, op, bucket, nbytes, start_host, start, end, overlapped, after_end, exposed, *rest = frozen[
            i : i + 15
        ]
        is_async, phase, peer, group_size, group_ranks = rest
        i += 15
        if end is None or not (host or complete or (ready(start) and ready(end))):
            continue
        dur = end - start if host else el(start, end)
        r = start - s0 if host else el(s0, start)
        if overlapped:
            ready_rel.append(r)
            done_rel.append(r + dur)
        queued = _queued_ns(start, end, after_end, marks, resolved=host or complete)
        comm_total += dur - queued
        if exposed == EXPOSED_ALL:
            exposed = dur
        elif exposed is not None and exposed > dur - queued:
            # a wait() that went on past the op's completion (the thread preempted, or the Work's
            # future fired late) waited for no transfer: what a call exposes is at most its own time
            exposed = dur - queued
        if exposed and phase is not None and phase != "sync":
            moved.append((CANONICAL.get(phase, -1), exposed))
        put_comm(
            (rank, index, seq, op, bucket, nbytes, start_host + shift + queued, dur - queued, clock, peer,
             group_size, exposed, is_async, phase, group_ranks, None, None)  # name, group_id: the writer's
        )  # fmt: skip
        n_comm_rows += 1
    if span_rows:
        emit("spans", span_rows)
    if comm_rows:
        emit("comm", comm_rows)
    if i < stop:
        if flat:
            metric_rows: list[Any] = []
            for j in range(i, stop, 3):
                metric_rows += (rank, index, frozen[j + 2] + shift, frozen[j], metric_value(frozen[j + 1]))
            emit("metrics", metric_rows)
        else:
            emit(
                "metrics",
                [
                    (rank, index, frozen[j + 2] + shift, frozen[j], metric_value(frozen[j + 1]))
                    for j in range(i, stop, 3)
                ],
            )
    if not open_step and (complete or ready(step_end)):
        step_ns = step_end - s0 if host else el(s0, step_end)
        if ready_rel:
            last_ready = max(ready_rel)
            window = next(((a, b) for a, b in backward if a <= last_ready <= b), None)
            if window is None and backward:
                window = backward[-1]
            exposed = exposed_sync_ns(ready_rel, done_rel, *(window or (0, step_ns)))
            cols[_SYNC] += exposed
            if window is not None:
                cols[_BACKWARD] -= exposed
        for col, waited in moved:  # an FSDP all-gather in forward is communication, not forward
            cols[_SYNC] += waited
            if col >= 0:
                cols[col] -= waited
        cols = [c if c > 0 else 0 for c in cols]
        other = step_ns - sum(cols)
        samples = step_samples(samples, default_samples, forwards)
        row = (rank, index, step_start_host + shift, step_ns, *cols, other if other > 0 else 0,
               comm_total, n_comm_rows, samples, clock)  # fmt: skip
        emit("steps", list(row) if flat else [row])
        return True
    return False


def write_held_flat(
    values: list[Any], out: dict[str, list[Any]], marks: Marks, *, rank: int, shift_ns: int,
    default_samples: int | None,
) -> int:  # fmt: skip
    """The rows of held steps (`flatten`'s values, one step after another, each after its length),
    complete, as flat value lists added to `out` by table: the store writer's pull. A host step
    without collectives (the common case) is built here in one loop over all the steps, with what
    write_frozen does for it (no collective: no exposed sync to move, comm_total and comm_count 0);
    any other step by write_frozen itself. Returns the number of steps."""
    spans = out.setdefault("spans", [])
    metrics = out.setdefault("metrics", [])
    steps = out.setdefault("steps", [])
    clock = marks.clock
    host = clock == "host"
    shift = shift_ns

    def gather(table: str, rows: list[Any]) -> None:
        out.setdefault(table, []).extend(rows)

    at, end, n = 0, len(values), 0
    while at < end:
        stop = at + 1 + values[at]
        i = at + 1
        index, step_start_host, s0, step_end, samples, n_spans, n_comm = values[i : i + _HEAD]
        n += 1
        if n_comm or not host:
            write_frozen(
                values, gather, marks, rank=rank, shift_ns=shift, default_samples=default_samples,
                complete=True, flat=True, at=i, until=stop,
            )  # fmt: skip
            at = stop
            continue
        cols = [0, 0, 0, 0, 0]
        forwards = 0
        i += _HEAD
        for _ in range(n_spans):
            name, parent_name, column, depth, start_host, start, span_end, error, canon = values[i : i + 9]
            i += 9
            if span_end is None:
                continue
            dur = span_end - start
            spans += (rank, index, name, parent_name, depth, start_host + shift, dur, clock, error)
            if canon >= 0:
                cols[canon] += dur
                if column >= 0:  # its nearest canonical ancestor's own time excludes it
                    cols[column] -= dur
                if canon == _FORWARD and column != _FORWARD:
                    forwards += 1
        for j in range(i, stop, 3):
            metrics += (rank, index, values[j + 2] + shift, values[j], metric_value(values[j + 1]))
        cols = [c if c > 0 else 0 for c in cols]
        step_ns = step_end - s0
        other = step_ns - sum(cols)
        steps += (rank, index, step_start_host + shift, step_ns, *cols, other if other > 0 else 0, 0, 0,
                  step_samples(samples, default_samples, forwards), clock)  # fmt: skip
        at = stop
    for table in ("spans", "metrics", "steps"):
        if not out[table]:
            del out[table]
    return n


def _queued_ns(start: Any, end: Any, after_end: Any, marks: Marks, *, resolved: bool) -> int:
    """Time a collective (ready at `start`, done at `end`) spent queued behind the collective
    issued before it on the same group, done at `after_end` (0 when there is none, or its
    completion came first or is not resolved)."""
    if after_end is None or end is None:
        return 0
    if marks.clock == "host":
        queued = min(after_end, end) - start
    elif resolved or marks.ready(after_end):
        queued = min(marks.elapsed_ns(start, after_end), marks.elapsed_ns(start, end))
    else:
        return 0
    return queued if queued > 0 else 0


def metric_value(value: Any) -> float | None:
    try:
        return float(value)  # a tensor's .item() is cheap here: its step has already finished
    except (TypeError, ValueError):
        return None
