"""The collector's hot path: what it leaves to the training thread and to the GIL per step."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest

from perfscope.collectors import host_metrics, phases
from perfscope.collectors.clocks import HostClock, HostMarks
from perfscope.collectors.host_metrics import HostSampler
from perfscope.collectors.phases import Timeline
from perfscope.collectors.step_rows import EXPOSED_ALL
from perfscope.store.open import open_store
from perfscope.store.schema import TABLES
from perfscope.store.writer import StoreWriter


@pytest.fixture
def grandchildren() -> object:
    """Three shells, each with a sleeping child of its own: six descendants of this process."""
    procs = [subprocess.Popen(["sh", "-c", "sleep 30 & wait"]) for _ in range(3)]
    deadline = time.monotonic() + 10
    me = psutil.Process()
    while len(me.children(recursive=True)) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    yield procs
    for p in procs:
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
        p.wait()


def _fixture_pids(procs: Any) -> set[int]:
    pids = {p.pid for p in procs}
    for p in procs:
        pids |= {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
    assert len(pids) == 6
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_descendants_from_proc_children_match_psutil(grandchildren: object) -> None:
    me = psutil.Process()
    ours = _fixture_pids(grandchildren)
    assert host_metrics._PROC_CHILDREN
    # other children (an earlier test's workers still exiting) may come and go between two listings
    assert ours <= set(host_metrics._descendants(me))
    assert ours <= {c.pid for c in me.children(recursive=True)}


def test_descendants_without_proc_children_fall_back_to_psutil(
    grandchildren: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_metrics, "_PROC_CHILDREN", False)
    me = psutil.Process()
    # the fixture's six: other children (an earlier test's workers still exiting) may come and go
    # between two listings, so only the ones this test made are compared
    ours = _fixture_pids(grandchildren)
    assert ours <= set(host_metrics._descendants(me))
    assert ours <= {c.pid for c in me.children(recursive=True)}


def test_descendants_of_a_process_that_ended_is_empty() -> None:
    p = subprocess.Popen(["true"])
    proc = psutil.Process(p.pid)
    p.wait()
    assert host_metrics._descendants(proc) == []


def test_host_sampler_counts_the_children_cpu(grandchildren: object, tmp_path: Path) -> None:
    """A busy child process (a DataLoader worker, say) is found by the rescan and its CPU counted."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    try:
        child = psutil.Process(busy.pid)
        sampler = HostSampler(lambda: [os.getpid()])
        assert sampler.sample() is None  # the baseline
        c0 = sum(child.cpu_times()[:2])
        time.sleep(1.0)
        c1 = sum(child.cpu_times()[:2])
        sample = sampler.sample()
        assert sample is not None
        assert busy.pid in sampler._children
        # what the child spun (whatever share of a core the loaded machine gave it) is counted
        assert c1 > c0 and sample["proc_cpu_pct"] >= 0.5 * 100.0 * (c1 - c0)
        sampler.close()
    finally:
        busy.kill()
        busy.wait()


def _timeline(hold_ns: int) -> tuple[Timeline, list[tuple[str, int]]]:
    calls: list[tuple[str, int]] = []
    tl = Timeline(0, HostMarks(), HostClock(), lambda table, rows: calls.append((table, len(rows))))
    tl.hold_ns = hold_ns
    return tl, calls


def _step(tl: Timeline) -> None:
    for name in ("forward", "backward"):
        tl.exit(tl.enter(name), None)
    tl.log("loss", 1.0)
    tl.end_step(8)


def test_rows_of_short_steps_are_handed_on_together() -> None:
    tl, calls = _timeline(hold_ns=10**12)
    for _ in range(5):
        _step(tl)
    assert calls == []  # held: five short steps
    tl.flush()
    assert sorted(calls) == [("metrics", 5), ("spans", 10), ("steps", 5)]


def test_held_rows_are_capped_in_steps_and_handed_on_at_close() -> None:
    tl, calls = _timeline(hold_ns=10**12)
    for _ in range(phases.MAX_HELD_STEPS + 3):
        _step(tl)
    assert ("steps", phases.MAX_HELD_STEPS) in calls
    tl.close()
    assert sum(n for table, n in calls if table == "steps") == phases.MAX_HELD_STEPS + 3


def test_a_step_longer_than_the_hold_is_handed_on_at_once() -> None:
    tl, calls = _timeline(hold_ns=1)  # every step is longer than 1 ns
    _step(tl)
    assert ("steps", 1) in calls


def test_writer_extend_fits_or_drops_rows_of_another_width(tmp_path: Path) -> None:
    width = len(TABLES["events"].columns)
    good = (0, 1, "kind", "message")
    assert len(good) == width
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with StoreWriter(tmp_path, "run1") as w:
            w.extend("events", [good, (1, 2), good])
    assert w.stats.rows_written == 2 and w.stats.rows_dropped == 1


class _CountMarks(HostMarks):
    """Host marks read from the same counter as the timeline's perf clock (patched below)."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter

    def mark(self) -> int:
        return next(self._counter)


class _Tensorish:
    """A logged value converted by float() (as a tensor is), changed in place after its step."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value


def _record_awkward_steps(tl: Timeline, logged: list[_Tensorish], *, comm: bool = True) -> None:
    """Steps with everything write_step distinguishes: a user span around a canonical phase, sync
    nested in optimizer, a failed phase, a phase exited out of order (its inner one never ends), a
    span open across step boundaries, overlapped collectives queued on one group (one finishing
    after its step ended), a collective in forward and one in sync, metrics of every kind. Without
    `comm`, the same steps without their collectives (the held steps' common case)."""
    epoch = tl.enter("epoch")  # open across all the steps
    late = None
    for i in range(5):
        tl.exit(tl.enter("data"), None)
        outer = tl.enter("model")
        fwd = tl.enter("forward")
        if comm:
            gather = tl.begin_collective("allgather", None, 64, overlapped=False, group="g")
            gather.exposed, gather.phase, gather.peer, gather.group_size = EXPOSED_ALL, "forward", None, 4
            tl.end_collective(gather)
        tl.exit(fwd, None)
        tl.exit(outer, None)
        bwd = tl.enter("backward")
        buckets = [
            tl.begin_collective("allreduce", b, 1000 * b, overlapped=True, group="g")
            for b in range(2 if comm else 0)
        ]
        if late is not None:
            tl.end_collective(late)  # the previous step's last bucket: that step resolves now
        for c in buckets[: 1 if i == 1 else 2]:
            tl.end_collective(c)
            c.exposed, c.phase = 7, "backward"
        late = buckets[1] if i == 1 and comm else None
        tl.exit(bwd, ZeroDivisionError if i == 2 else None)
        opt = tl.enter("optimizer")
        sync = tl.enter("sync")
        tl.exit(tl.enter("bucket"), None)
        if comm:
            c = tl.begin_collective("broadcast", None, 8, overlapped=False)
            c.exposed, c.phase, c.peer = EXPOSED_ALL, "sync", 0
            tl.end_collective(c)
        tl.exit(sync, None)
        tl.exit(opt, None)
        lost = tl.enter("left-open")
        tl.enter("inner")
        tl.exit(lost, None)  # out of order: "inner" is dropped from the stack unended
        value = _Tensorish(0.5 * i)
        logged.append(value)
        tl.log("loss", value)
        tl.log("tokens", 100 + i)
        tl.log("lr", 1e-3)
        tl.end_step(8 if i == 3 else None)
    tl.exit(epoch, None)
    tl.end_step()


@pytest.mark.parametrize("comm", [True, False])
@pytest.mark.parametrize("flat", [False, True])
def test_held_steps_give_the_rows_of_steps_written_at_once(
    monkeypatch: pytest.MonkeyPatch, comm: bool, flat: bool
) -> None:
    """Frozen, held and built later (by the writer's thread in a run: flat, write_held_flat) or
    written at the step's end: the same rows, value for value, with and without collectives."""
    got = {}
    for held in (False, True):
        counter = itertools.count(1_000_000, 37)
        monkeypatch.setattr(phases, "perf_ns", lambda counter=counter: next(counter))
        rows: dict[str, list[tuple[Any, ...]]] = {}
        clock = HostClock()
        clock.shift_ns = 1_700_000_000 * 10**9
        tl = Timeline(
            2, _CountMarks(counter), clock, lambda t, r, rows=rows: rows.setdefault(t, []).extend(r)
        )
        tl.default_samples = 16
        tl.hold_ns = 10**15 if held else 0
        if held and flat:  # handed on as flat value lists: cut back into rows of the table's width

            def cut(t: str, values: list[Any], rows: dict[str, list[tuple[Any, ...]]] = rows) -> None:
                w = len(TABLES[t].columns)
                assert len(values) % w == 0
                rows.setdefault(t, []).extend(tuple(values[k : k + w]) for k in range(0, len(values), w))

            tl.emit_flat = cut
        logged: list[_Tensorish] = []
        _record_awkward_steps(tl, logged, comm=comm)
        for value in logged:
            value.value = -1.0  # changed after its step: the value at the step's end is recorded
        if held:
            assert not rows  # all held
        tl.close()
        got[held] = rows
    assert set(got[True]) == {"steps", "spans", "metrics"} | ({"comm"} if comm else set())
    for table in got[False]:
        assert got[True][table] == got[False][table], table
    losses = [r[4] for r in got[True]["metrics"] if r[3] == "loss"]
    assert losses == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert len(got[True]["steps"]) == 6


def test_held_steps_are_plain_values_that_make_no_object_for_the_collector() -> None:
    """Held steps must cost the garbage collector nothing: lists kept alive for a second were
    promoted to the old generation (full collections several µs per step), and a tuple per step
    still made a gen-0 collection every ~700 steps, on the training thread. Counted with the
    collector off: what recording 2,000 held steps leaves tracked is the same few objects as 20."""
    tl, _ = _timeline(hold_ns=10**15)
    tl.max_held = 10**6
    for _ in range(20):  # warm: the open step's lists and the held list exist
        _step(tl)
    gc.collect()
    gc.disable()
    try:
        c0 = gc.get_count()[0]
        for _ in range(2_000):
            _step(tl)
        made = gc.get_count()[0] - c0
    finally:
        gc.enable()
    assert tl.held_steps() == 2_020
    assert made <= 16, made  # net tracked objects: none per step (9 here, whatever the steps)
    assert not any(gc.is_tracked(v) for v in tl._held)


def test_the_writer_builds_the_rows_of_held_steps_on_its_thread(tmp_path: Path) -> None:
    """In a run the training thread only freezes each step; the writer pulls and builds the rows
    (asked once enough gathered, else at its roll), and every step reaches the store."""
    builders: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import perfscope

        with perfscope.profile(tmp_path, experiment="pull", batch_size=4, poll_hz=0) as prof:
            tl = prof._timeline
            take = tl.take_rows

            def spying(**kw: Any) -> dict[str, list[Any]]:
                out = take(**kw)
                if out:
                    builders.append(threading.current_thread().name)
                return out

            tl.take_rows = spying
            for _ in range(3 * phases.PULL_AT_STEPS):
                with prof.phase("forward"):
                    pass
                prof.log(loss=1.0)
                prof.step()
            deadline = time.monotonic() + 30
            # held_steps() falls once a take has built what it took (_held empties before that)
            while (tl.held_steps() or "perfscope-writer" not in builders) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "perfscope-writer" in builders
            run_id = prof.run_id
    got = open_store(tmp_path).query(
        "SELECT count(*) AS n, min(step) AS lo, max(step) AS hi, sum(forward_ns > 0)::INT AS timed "
        "FROM steps WHERE run_id = $1",
        [run_id],
    )
    n = 3 * phases.PULL_AT_STEPS
    assert got.to_pylist() == [{"n": n, "lo": 0, "hi": n - 1, "timed": n}]


def test_a_writer_source_is_pulled_at_flush_and_when_asked(tmp_path: Path) -> None:
    ready: list[tuple[Any, ...]] = []
    calls: list[str] = []

    def pull() -> dict[str, list[tuple[Any, ...]]]:
        calls.append(threading.current_thread().name)
        got, ready[:] = ready[:], []
        return {"events": got} if got else {}

    with StoreWriter(tmp_path, "run1") as w:
        w.add_source(pull)
        ready.append((0, 1, "kind", "first"))
        w.flush()
        assert w.stats.rows_written == 1
        ready.append((0, 2, "kind", "second"))
        w.pull_soon()
        deadline = time.monotonic() + 30
        while ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "perfscope-writer" in calls
        w.flush()
        assert w.stats.rows_written == 2


def test_a_sources_rows_short_of_the_tables_width_are_fitted_not_dropped_with_the_batch(
    tmp_path: Path,
) -> None:
    """A producer built for an older schema (the collector's comm rows when the schema gained its
    process-group columns) gives rows without the columns added since: they are NULL. Added raw,
    one short row shifted every later value of the buffer and the whole batch failed to write
    ('values do not make whole rows'): the first steps' comm rows of real DDP runs were lost."""
    table = TABLES["comm"]
    assert table.min_width < len(table.columns), "the test needs a column added after version 1"
    full = (0, 1, 0, "allreduce", 0, 8, 1, 2, "host", None, 2, 1, False, "backward")
    full += (None,) * (len(table.columns) - len(full))
    width = table.min_width
    ready = [full, (0, 1, 1, *full[3:width]), (0, 1, 2, *full[3:width])]
    with StoreWriter(tmp_path, "run1") as w:
        w.add_source(lambda: {"comm": [ready.pop(0) for _ in range(len(ready))]} if ready else {})
        w.flush()
        assert w.stats.rows_written == 3 and w.stats.rows_dropped == 0 and w.stats.write_errors == 0
    names = ", ".join(c.name for c in table.columns)
    got = open_store(tmp_path).query(f"SELECT {names} FROM comm ORDER BY seq").to_pylist()
    nulls = (None,) * (len(table.columns) - width)
    assert [tuple(r.values()) for r in got] == [full] + [
        (0, 1, seq, *full[3:width], *nulls) for seq in (1, 2)
    ]


def test_the_rows_a_pull_builds_are_flat_and_make_no_tracked_object_per_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer's pull builds each table's rows as one flat list of values (what its buffer
    holds): no tuple per row, so building a second of steps makes no garbage-collector work (as
    tuples, kept until flattened, they were thousands of tracked objects per pull: a gen-0
    collection every ~200 steps, run on whichever thread allocated next, the training one too)."""
    steps = 2_000
    twins = []
    for _ in range(3):  # the same steps three times, on one counter as their clock
        counter = itertools.count(1_000_000, 37)
        monkeypatch.setattr(phases, "perf_ns", lambda counter=counter: next(counter))
        calls: list[tuple[str, int]] = []
        clock = HostClock()
        clock.shift_ns = 1_700_000_000 * 10**9
        tl = Timeline(0, _CountMarks(counter), clock, lambda t, r, calls=calls: calls.append((t, len(r))))
        tl.hold_ns = 10**15
        tl.max_held = 10 * steps  # all held: built below
        for _ in range(steps):
            _step(tl)
        assert calls == [] and tl.held_steps() == steps
        twins.append(tl)
    gc.collect()
    gc.disable()
    try:
        c0 = gc.get_count()[0]
        flat = twins[0].take_rows(flat=True)
        made_flat = gc.get_count()[0] - c0
        c0 = gc.get_count()[0]
        rows = twins[1].take_rows()
        made_rows = gc.get_count()[0] - c0
    finally:
        gc.enable()
    assert made_rows >= 2 * steps  # the row tuples (less the steps freed): what the bound tells apart
    assert made_flat <= 200, made_flat  # a list per table and temporaries: ~90 at 200 or 20,000 steps
    assert set(flat) == set(rows) == {"steps", "spans", "metrics"}
    for table, got in rows.items():
        assert flat[table] == list(itertools.chain.from_iterable(got)), table
        assert all(len(r) == len(TABLES[table].columns) for r in got)
    # flush on the training thread (the first rows, close) hands them on flat too, where it can
    handed: dict[str, list[Any]] = {}
    twins[2].emit_flat = lambda t, v: handed.setdefault(t, []).extend(v)
    twins[2].flush()
    assert handed == flat


def test_a_flat_source_adds_whole_rows_and_drops_a_list_that_is_not(tmp_path: Path) -> None:
    good = [0, 1, "kind", "first", 0, 2, "kind", "second"]
    ready = [{"events": good}]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with StoreWriter(tmp_path, "run1") as w:
            w.add_source(lambda: ready.pop(0) if ready else {}, flat=True)
            w.flush()
            assert w.stats.rows_written == 2 and w.stats.rows_dropped == 0
            ready.append({"events": good[:-1]})
            w.flush()
    assert w.stats.rows_written == 2 and w.stats.rows_dropped == 2
    assert any("whole rows" in str(x.message) for x in seen)
    got = open_store(tmp_path).query("SELECT message FROM events ORDER BY ts_ns").to_pylist()
    assert [r["message"] for r in got] == ["first", "second"]


def _recording_allocations(tmp_path: Path, steps: int) -> int:
    """Blocks allocated by perfscope's collector code (any thread) and still alive once `steps`
    more steps were recorded and the profile closed (its writer thread gone), after a warm-up."""
    import tracemalloc

    import perfscope

    here = str(Path(phases.__file__).parent / "*")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with perfscope.profile(tmp_path, experiment="alloc", batch_size=4, poll_hz=0) as prof:
            phase = prof.phase
            for n in (1_000, steps):
                for _ in range(n):
                    with phase("data"):
                        pass
                    with phase("forward"):
                        pass
                    with phase("backward"):
                        pass
                    with phase("optimizer"):
                        pass
                    prof.log(loss=1.0)
                    prof.step()
                if n == 1_000:  # warmed up: every cache filled, the first rows written
                    prof.flush()
                    gc.collect()
                    tracemalloc.start(1)
    gc.collect()
    alive = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, here)])
    tracemalloc.stop()
    return len(alive.traces)


def test_the_recording_calls_keep_nothing_per_step(tmp_path: Path) -> None:
    """Phases, a log and prof.step() over 10,000 steps, their rows pulled and written by the store
    writer: what the collector allocated and still holds afterwards is a small constant, not a
    block per step (a record, span or value kept per step would be 10,000 blocks or more)."""
    few = _recording_allocations(tmp_path / "few", 1_000)
    many = _recording_allocations(tmp_path / "many", 10_000)
    assert many <= 200, (few, many)
    assert many - few <= 100, (few, many)
