"""Memory over the run: a real CPU job whose RSS grows by a known amount per step gets a memory-creep
finding with that rate, the same job without the leak gets none; the CUDA path runs against a fake
allocator shaped after torch.cuda's documented counters (max_memory_allocated, max_memory_reserved,
reset_peak_memory_stats, mem_get_info), since this machine has no GPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import perfscope
from perfscope import open_store
from perfscope.analysis import run_analysis
from perfscope.explain import explain

torch = pytest.importorskip("torch")

LEAK_BYTES = 2 << 20  # 2 MiB per step
STEPS = 60
STEP_S = 0.05  # at 20 Hz polling: about one RSS sample per step


def _job(store: Path, *, leak: bool) -> None:
    kept: list[bytes] = []
    with perfscope.profile(store, experiment="memory", poll_hz=20, gpu_telemetry=False) as prof:
        for _ in range(STEPS):
            with prof.phase("forward"):
                block = b"\x01" * LEAK_BYTES  # written, so resident
                if leak:
                    kept.append(block)
                del block
                time.sleep(STEP_S)
            prof.step()


def _creep(store: Path) -> list[Any]:
    with open_store(store) as s:
        return [f for f in explain(s) for g in f.flatten() if g.rule == "memory-creep" for f in [g]]


def test_a_real_rss_leak_is_a_creep_with_its_rate(tmp_path: Path) -> None:
    _job(tmp_path, leak=True)
    with open_store(tmp_path) as s:
        (row,) = run_analysis("memory", s).to_pylist()
    assert row["kind"] == "host" and row["samples"] >= 20
    (f,) = _creep(tmp_path)
    # the fitted rate is the leak's, whatever the machine's load did to the steps' length
    assert f.numbers["slope_bytes_per_step"] == pytest.approx(LEAK_BYTES, rel=0.2)
    assert f.numbers["kind"] == "host" and "per step" in f.title
    assert f.numbers["exhaust_step"] is not None and f.numbers["exhaust_step"] > STEPS
    assert f"about step {f.numbers['exhaust_step']:,}" in f.text


def test_the_same_job_without_a_leak_has_no_creep(tmp_path: Path) -> None:
    _job(tmp_path, leak=False)
    with open_store(tmp_path) as s:
        (row,) = run_analysis("memory", s).to_pylist()
    assert row["samples"] >= 20  # measured, and flat
    assert _creep(tmp_path) == []


class FakeAllocator:
    """torch.cuda's allocator counters as documented: max_memory_allocated(device) returns
    memory_stats' "allocated_bytes.all.peak", max_memory_reserved(device) "reserved_bytes.all.peak",
    reset_peak_memory_stats(device) sets both peaks to the current values; mem_get_info(device)
    returns (free, total) bytes. Each step allocates `per_step` more bytes that are never freed."""

    def __init__(self, total: int, base: int, per_step: int) -> None:
        self.total, self.current, self.per_step = total, base, per_step
        self.peak = base
        self.resets = 0

    def forward(self) -> None:
        self.current += self.per_step
        self.peak = max(self.peak, self.current + (64 << 20))  # activations, freed by the step's end

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.peak + (128 << 20)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak = self.current
        self.resets += 1

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.total - self.current, self.total


def test_the_cuda_path_records_a_peak_per_step_and_finds_the_creep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeAllocator(total=80 << 30, base=70 << 30, per_step=64 << 20)  # ends above 90%
    cuda = torch.cuda
    for name in ("max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats", "mem_get_info"):
        monkeypatch.setattr(cuda, name, getattr(fake, name))
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_name", lambda i=None: "Fake GPU")
    with perfscope.profile(tmp_path, experiment="fake", poll_hz=0, timing="host", nvtx=False) as prof:
        for _ in range(40):
            with prof.phase("forward"):
                fake.forward()
            prof.step()
    with open_store(tmp_path) as s:
        rows = s.query("SELECT * FROM device_memory ORDER BY step").to_pylist()
        (mem,) = run_analysis("memory", s).to_pylist()
        found = [g for f in explain(s) for g in f.flatten()]
    assert len(rows) >= 38 and fake.resets >= len(rows)
    # each step's row holds that step's peak: the leak so far plus the step's activations
    steps = {r["step"]: r for r in rows}
    assert steps[20]["peak_allocated_bytes"] - steps[19]["peak_allocated_bytes"] == 64 << 20
    assert {r["device_total_bytes"] for r in rows} == {80 << 30}
    assert mem["kind"] == "device" and mem["slope_bytes_per_step"] == pytest.approx(64 << 20)
    (creep,) = [f for f in found if f.rule == "memory-creep"]
    # 80 GiB less the last peak reserved, at 64 MiB a step
    left = (80 << 30) - steps[39]["peak_reserved_bytes"]
    assert creep.numbers["exhaust_step"] == 39 + -(-left // (64 << 20))
    (room,) = [f for f in found if f.rule == "memory-headroom"]
    assert room.numbers["share_of_device"] == pytest.approx(steps[39]["peak_reserved_bytes"] / (80 << 30))


def test_a_failing_allocator_is_one_warning_and_the_loop_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeAllocator(total=80 << 30, base=1 << 30, per_step=0)
    cuda = torch.cuda
    for name in ("max_memory_reserved", "reset_peak_memory_stats", "mem_get_info"):
        monkeypatch.setattr(cuda, name, getattr(fake, name))

    def broken(device: Any = None) -> int:
        raise RuntimeError("allocator gone")

    monkeypatch.setattr(cuda, "max_memory_allocated", broken)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_name", lambda i=None: "Fake GPU")
    warned = pytest.warns(perfscope.PerfscopeWarning, match="allocator's peaks could not be read")
    with warned, perfscope.profile(tmp_path, experiment="fake", poll_hz=0, timing="host", nvtx=False) as prof:
        for _ in range(5):
            with prof.phase("forward"):
                pass
            prof.step()
    with open_store(tmp_path) as s:
        assert s.query("SELECT count(*) FROM steps").column(0)[0].as_py() == 5
        kinds = s.query("SELECT kind FROM events").column(0).to_pylist()
    assert kinds.count("device_memory_off") == 1
