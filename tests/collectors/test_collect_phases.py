"""The step arithmetic of the collector on a fake clock: step_ns, canonical columns, nesting,
exposed sync, other_ns, and CUDA-event marks resolved later without synchronising."""

from __future__ import annotations

from typing import Any

import pytest

from perfscope.collectors import phases
from perfscope.collectors.clocks import HostClock, HostMarks
from perfscope.collectors.cuda_timing import CudaMarks
from perfscope.collectors.phases import Timeline, infer_samples
from perfscope.collectors.step_rows import exposed_sync_ns
from perfscope.store.schema import TABLES


class FakeClock:
    """perf_counter_ns stand-in: time moves only when the test says so."""

    def __init__(self) -> None:
        self.t = 1_000_000

    def __call__(self) -> int:
        return self.t

    def advance(self, ns: int) -> None:
        self.t += ns


class FakeHostMarks(HostMarks):
    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock

    def mark(self) -> int:
        return self._clock()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(phases, "perf_ns", c)
    return c


def _timeline(clock: FakeClock, marks: Any = None) -> tuple[Timeline, dict[str, list[tuple[Any, ...]]]]:
    rows: dict[str, list[tuple[Any, ...]]] = {}

    def emit(table: str, batch: list[tuple[Any, ...]]) -> None:
        assert all(len(r) == len(TABLES[table].columns) for r in batch)  # schema order, no run_id
        rows.setdefault(table, []).extend(batch)

    return Timeline(3, marks or FakeHostMarks(clock), HostClock(), emit, default_samples=16), rows


def _phase(tl: Timeline, clock: FakeClock, name: str, ns: int) -> None:
    span = tl.enter(name)
    clock.advance(ns)
    tl.exit(span, None)


def _steps(rows: dict[str, list[tuple[Any, ...]]]) -> list[dict[str, Any]]:
    names = TABLES["steps"].column_names
    return [dict(zip(names, r, strict=True)) for r in rows.get("steps", [])]


def test_step_is_end_to_end_and_phases_fill_their_columns(clock: FakeClock) -> None:
    tl, rows = _timeline(clock)
    tl.begin_loop()
    for _ in range(3):
        _phase(tl, clock, "data", 100)
        _phase(tl, clock, "forward", 1_000)
        clock.advance(50)  # between phases: other
        _phase(tl, clock, "backward", 2_000)
        _phase(tl, clock, "optimizer", 300)
        clock.advance(25)
        tl.end_step()
    steps = _steps(rows)
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert (s["step_ns"], s["data_ns"], s["forward_ns"], s["backward_ns"]) == (3_475, 100, 1_000, 2_000)
        assert (s["sync_exposed_ns"], s["optimizer_ns"], s["other_ns"]) == (0, 300, 75)
        assert s["rank"] == 3 and s["samples"] == 16 and s["clock"] == "host"
    # consecutive steps tile the time line: each starts where the previous ended
    assert steps[1]["start_ns"] - steps[0]["start_ns"] == steps[0]["step_ns"]
    assert {r[2] for r in rows["spans"]} == {"data", "forward", "backward", "optimizer"}


def test_nested_canonical_phases_never_count_twice_and_user_spans_go_to_other(clock: FakeClock) -> None:
    tl, rows = _timeline(clock)
    tl.begin_loop()
    opt = tl.enter("optimizer")
    clock.advance(100)
    _phase(tl, clock, "sync", 400)  # Horovod: synchronize() inside step()
    clock.advance(100)
    tl.exit(opt, None)
    fwd = tl.enter("forward")
    _phase(tl, clock, "attention", 70)  # a user span inside a canonical phase belongs to it
    clock.advance(30)
    tl.exit(fwd, None)
    _phase(tl, clock, "checkpoint", 500)  # a user span on its own is 'other'
    tl.end_step(samples=5)
    (s,) = _steps(rows)
    assert (s["optimizer_ns"], s["sync_exposed_ns"], s["forward_ns"]) == (200, 400, 100)
    assert s["other_ns"] == 500 and s["step_ns"] == 1_200 and s["samples"] == 5
    spans = {r[2]: r for r in rows["spans"]}
    assert spans["sync"][3] == "optimizer" and spans["sync"][4] == 1  # parent, depth
    assert spans["attention"][3] == "forward" and spans["checkpoint"][3] is None


@pytest.mark.parametrize(
    ("ready", "done", "window", "expected"),
    [
        ([100, 300], [250, 420], (0, 500), 120),  # the tail after the last bucket was ready
        ([100, 300], [250, 900], (0, 500), 200),  # backward ended first (CUDA): clipped to it
        ([100, 300], [200, 300], (0, 500), 0),  # done the moment the last bucket was ready
        ([], [], (0, 500), 0),
        ([450], [2_000], (400, 480), 30),
    ],
)
def test_exposed_sync_definition(
    ready: list[int], done: list[int], window: tuple[int, int], expected: int
) -> None:
    got = exposed_sync_ns(ready, done, *window)
    assert got == expected
    assert got <= sum(d - r for r, d in zip(ready, done, strict=True))


def test_overlapped_buckets_move_exposed_time_from_backward_to_sync(clock: FakeClock) -> None:
    tl, rows = _timeline(clock)
    tl.begin_loop()
    bwd = tl.enter("backward")
    clock.advance(1_000)
    b0 = tl.begin_collective("allreduce", 0, 4_000, overlapped=True)
    clock.advance(800)
    b1 = tl.begin_collective("allreduce", 1, 6_000, overlapped=True)  # the last bucket is ready
    clock.advance(300)
    tl.end_collective(b0)
    clock.advance(200)
    tl.end_collective(b1)
    clock.advance(10)
    tl.exit(bwd, None)
    tl.end_step()
    (s,) = _steps(rows)
    assert s["comm_count"] == 2 and s["comm_total_ns"] == 1_100 + 500
    assert s["sync_exposed_ns"] == 500  # from b1 ready to the last completion
    assert s["backward_ns"] == 2_310 - 500
    assert s["sync_exposed_ns"] <= s["comm_total_ns"]
    comm = sorted(rows["comm"], key=lambda r: r[2])
    assert [(r[2], r[4], r[5]) for r in comm] == [(0, 0, 4_000), (1, 1, 6_000)]  # seq, bucket, bytes


def test_open_spans_and_failed_steps(clock: FakeClock) -> None:
    tl, rows = _timeline(clock)
    tl.begin_loop()
    _phase(tl, clock, "forward", 10)
    tl.end_step()
    fwd = tl.enter("forward")
    clock.advance(5)
    tl.exit(fwd, ValueError)
    tl.log("loss", 0.5)
    tl.close()
    assert [s["step"] for s in _steps(rows)] == [0]  # the failed step has no steps row ...
    failed = [r for r in rows["spans"] if r[1] == 1]
    assert [(r[2], r[8]) for r in failed] == [("forward", "ValueError")]  # ... but its spans
    assert rows["metrics"][0][1:2] == (1,) and rows["metrics"][0][3:] == ("loss", 0.5)


def test_infer_samples() -> None:
    torch = pytest.importorskip("torch")
    assert infer_samples(torch.zeros(7, 3)) == 7
    assert infer_samples((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert infer_samples({"x": torch.zeros(4, 1)}) == 4
    assert infer_samples([1, 2, 3]) is None and infer_samples(torch.tensor(3.0)) is None


class FakeCudaEvent:
    """torch.cuda.Event's timing surface: record(), query(), elapsed_time() in ms. It has no
    synchronize(): the collector must never block on the device."""

    device_time_ms = 0.0

    def __init__(self) -> None:
        self.t_ms: float | None = None
        self.done = False

    def record(self) -> None:
        self.t_ms = FakeCudaEvent.device_time_ms
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        assert self.done and end.done, "elapsed_time on an event the device has not reached"
        assert self.t_ms is not None and end.t_ms is not None
        return end.t_ms - self.t_ms


def test_cuda_marks_are_resolved_later_without_blocking(clock: FakeClock) -> None:
    made: list[FakeCudaEvent] = []

    def new_event() -> FakeCudaEvent:
        made.append(FakeCudaEvent())
        return made[-1]

    tl, rows = _timeline(clock, CudaMarks(new_event))
    tl.begin_loop()
    for _ in range(3):
        span = tl.enter("forward")
        FakeCudaEvent.device_time_ms += 2.0
        tl.exit(span, None)
        FakeCudaEvent.device_time_ms += 0.5
        tl.end_step()
    assert "steps" not in rows  # the device has not passed any event yet: nothing resolved, no wait
    for e in made[: len(made) // 2]:
        e.done = True
    tl.drain()
    assert 0 < len(rows.get("steps", [])) < 3
    for e in made:
        e.done = True
    tl.close()
    steps = _steps(rows)
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["clock"] == "cuda" and s["forward_ns"] == 2_000_000 for s in steps)
    assert [s["step_ns"] for s in steps[1:]] == [2_500_000, 2_500_000]
    created = len(made)
    tl2_marks = tl.marks
    tl2_marks.mark()
    assert len(made) == created  # resolved events return to the pool and are reused


def test_a_wait_past_the_ops_completion_exposes_at_most_the_ops_time(clock: FakeClock) -> None:
    """An async op that completed while the rank computed, then a wait() that took long anyway (the
    thread preempted on a loaded host): its comm row exposes at most its own duration, and only that
    much moves from backward to sync."""
    tl, rows = _timeline(clock)
    tl.begin_loop()
    bwd = tl.enter("backward")
    c = tl.begin_collective("allreduce", None, 4 << 20, overlapped=False, group=("pg", 1))
    c.is_async, c.phase = True, "backward"  # as the torch.distributed recorder issues it
    clock.advance(300)
    tl.end_collective(c)  # the Work's future: done after 300 ns
    clock.advance(5_000)  # compute
    c.exposed = 100 + 2_000  # the issuing call, then a wait() of 2,000 ns on a finished Work
    clock.advance(2_000)
    tl.exit(bwd, None)
    tl.end_step()
    (row,) = rows["comm"]
    dur_ns, exposed_ns = row[7], row[11]
    assert dur_ns == 300 and exposed_ns == 300
    (s,) = _steps(rows)
    assert s["sync_exposed_ns"] == 300 and s["backward_ns"] == 7_300 - 300
