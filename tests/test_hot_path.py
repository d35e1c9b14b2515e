"""The collector's hot path: what it leaves to the training thread and to the GIL per step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from perfscope.collectors import host_metrics
from perfscope.collectors.host_metrics import HostSampler


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
