"""The collector's hot path: what it leaves to the training thread and to the GIL per step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest

from perfscope.collectors import host_metrics, phases
from perfscope.collectors.clocks import HostClock, HostMarks
from perfscope.collectors.host_metrics import HostSampler
from perfscope.collectors.phases import Timeline
from perfscope.schema import TABLES
from perfscope.writer import StoreWriter


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_descendants_from_proc_children_match_psutil(grandchildren: object) -> None:
    me = psutil.Process()
    expected = sorted(c.pid for c in me.children(recursive=True))
    assert len(expected) >= 6
    assert host_metrics._PROC_CHILDREN
    assert sorted(host_metrics._descendants(me)) == expected


def test_descendants_without_proc_children_fall_back_to_psutil(
    grandchildren: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_metrics, "_PROC_CHILDREN", False)
    me = psutil.Process()
    assert sorted(host_metrics._descendants(me)) == sorted(c.pid for c in me.children(recursive=True))


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
