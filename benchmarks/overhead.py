"""Collector overhead: the same small CPU training step (about 2.8 ms) bare, under perfscope.profile and
under torch.profiler (CPU activities), plus the cost of an NVTX range and of the telemetry poller.

    .venv/bin/python benchmarks/overhead.py [--rounds 25] [--block-s 1.0] [--poll-s 10]
    .venv/bin/python benchmarks/overhead.py --rows             # the per-tree table, this tree alone
    .venv/bin/python benchmarks/overhead.py --old /tmp/wt_old  # this tree against others (repeatable)

`--old TREE` (a git worktree of an older commit: `git worktree add /tmp/wt_old fc72bec`) runs the
bare/perfscope.profile comparison of both trees in subprocesses, alternating, and prints one Markdown
table: the median wall ratio over the block pairs, the recording calls per step, and the training
thread's time blocked per step (off the CPU without being preempted: waiting for the GIL held by
perfscope's writer or poller thread; from /proc/<tid>/schedstat, so other processes' load does not
count in it).

Whole processes differ by about +-5 % on a shared machine, blocks inside one process by about
+-0.5 %, so the variants run interleaved in blocks in this one process, each round in a rotated
order, and every variant is reported as the median over rounds of its ratio to the bare block of
the same round. perfscope's block includes everything it runs: phases, NVTX ranges, the store
writer's thread and the 10 Hz poller (started before the block, stopped after it). Besides wall
time, each block's process CPU time (all threads) is compared, which other processes on a shared
machine disturb far less (the CPU ratio column). Two more variants bound what any instrumentation
can cost: the floor (the same calls doing nothing: empty `with` blocks, a generator over the data)
and hand-written timers (the same phases, the wait for each batch and the loss appended to a list
with perf_counter_ns, nothing else: the cheapest code that records what perfscope records). The
result is a Markdown table on stdout.

`--breakdown` (with `--old TREE`: of each tree, in its own process, alternating) says where the
recording path's time goes, part by part, in loops with nothing else (a real profile: writer thread,
10 Hz poller): the training thread's CPU per phase (enter and exit), per `prof.log`, per step end
(`prof.step()`), from the differences of loops that add one part at a time; the writer thread's
pull (building the held steps' rows, timed where it runs) and its whole CPU per step (the pull, the
Arrow encoding, the Parquet writes); the poller thread's CPU per step; the garbage collections
per 1,000 steps and their CPU per step (gc.callbacks, by the thread they ran on); the wall time per
step against the training thread's CPU (the difference is time spent waiting for the GIL); and the
blocks perfscope's code allocated and still holds after 10,000 more steps (tracemalloc).

`--cold` (with `--old TREE`: of each tree, in its own process, alternating) times each recording
call where it runs in a real job: right after a torch training step, whose kernels have filled the
CPU's caches with weights and activations (cold), and again at once (hot, as an empty loop sees it),
each the median of many such pairs less the timer's own cost measured the same way. A `with` on an
empty class is the floor any instrumentation pays there. The gap between the two columns is why the
calls cost a real step several times what `--breakdown`'s empty loops say.

`--blocked` says which of perfscope's threads the training thread waits for: its time blocked per
step (off the CPU and not runnable: waiting for the GIL, from /proc/<tid>/schedstat) in blocks of
real recorded steps, with and without the poller, and with and without the writer being asked to
pull early (it still pulls at each roll), 6 rounds interleaved, medians.

`--parts` says which part of perfscope.profile costs the step what: blocks of real steps with parts of
it switched off, interleaved with bare and floor blocks in a rotated order (60 rounds of 300 steps;
the medians of the block ratios move by about +-1 % between runs, so many short blocks): the whole
profile; without the poller; without the poller and with the writer idle after the first rows
(the steps of its first 50 ms, or 64 steps, are written at once, as in every profile; the rest wait
until the profile closes); the profile open but the calls doing nothing (the writer and poller
threads alone); and, with the poller off, `prof.steps` alone, with the phases, with the
log (the other calls doing nothing).

`--ddp-rounds R` adds the collector's cost on a saturated host: bare and instrumented 1- and
2-rank DDP jobs on gloo (about 40 ms steps, one thread per rank, so 2 ranks fill a 2-core host),
interleaved in one run in a rotated order, R rounds; each job's throughput is its samples over the
elapsed time of its steady steps, the efficiency E(2) = X(2)/(2·X(1)) is computed bare and
instrumented from the same round, and the CPU of perfscope's own threads (writer, poller with the
host sampler) is read per rank from /proc (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import perfscope
from perfscope.collectors.faults import Faults
from perfscope.collectors.host_metrics import HostSampler
from perfscope.collectors.nvml import open_gpus
from perfscope.collectors.nvtx_ranges import NvtxRanges
from perfscope.collectors.poller import Poller

BATCH = 64


def make_step(width: int) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [(torch.randn(BATCH, 256), torch.randint(0, 10, (BATCH,))) for _ in range(64)]
    return model, opt, batches


def batches_for(batches: list[Any], n: int) -> list[Any]:
    return [batches[i % len(batches)] for i in range(n)]


Clock = tuple[float, float]  # (wall s, process CPU s of all threads)


def now() -> Clock:
    return time.perf_counter(), time.process_time()


def since(t0: Clock) -> Clock:
    t1 = now()
    return t1[0] - t0[0], t1[1] - t0[1]


def train_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()


def bare(model: nn.Module, opt: Any, data: list[Any]) -> Clock:
    t0 = now()
    for x, y in data:
        train_step(model, opt, x, y)
    return since(t0)


def recorded_step(prof: Any, model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """train_step as a user instruments it: its phases and its loss."""
    with prof.phase("forward"):
        loss = nn.functional.cross_entropy(model(x), y)
    with prof.phase("backward"):
        loss.backward()
    with prof.phase("optimizer"):
        opt.step()
        opt.zero_grad()
    prof.log(loss=loss.item())


class _Empty:
    """The floor: a `with` that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


EMPTY = _Empty()


def blocked_ns() -> int:
    """ns this thread has spent off the CPU without being preempted (waiting for a lock: the GIL),
    so far: wall time less time on the CPU less time waiting in the run queue (/proc schedstat)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, run_queue, _ = f.read().split()
    except OSError:
        return 0
    return time.perf_counter_ns() - int(on_cpu) - int(run_queue)


#: ns per step the training thread was blocked, per variant block (bare and perfscope.profile)
BLOCKED: dict[str, list[float]] = {"bare": [], "perfscope.profile": []}


def bare_blocked(model: nn.Module, opt: Any, data: list[Any]) -> Clock:
    b0 = blocked_ns()
    out = bare(model, opt, data)
    BLOCKED["bare"].append((blocked_ns() - b0) / len(data))
    return out


def with_perfscope(model: nn.Module, opt: Any, data: list[Any], store: Path) -> Clock:
    with perfscope.profile(store, experiment="overhead", batch_size=BATCH, poll_hz=10) as prof:
        prof.watch(model)
        t0 = now()
        b0 = blocked_ns()
        for x, y in prof.steps(data):
            recorded_step(prof, model, opt, x, y)
        BLOCKED["perfscope.profile"].append((blocked_ns() - b0) / len(data))
        return since(t0)


class _Floor:
    """perfscope.profile's calls doing nothing: empty `with` blocks, a generator over the data. What
    any instrumentation at those points costs a real step (see --cold)."""

    def phase(self, name: str) -> _Empty:
        return EMPTY

    def log(self, **values: Any) -> None:
        return None

    def steps(self, data: list[Any]) -> Any:
        yield from data


def with_calls(calls: Any, model: nn.Module, opt: Any, data: list[Any]) -> Clock:
    """The recorded loop with `calls` (an object with phase, log and steps) instead of a profile."""
    t0 = now()
    for x, y in calls.steps(data):
        recorded_step(calls, model, opt, x, y)
    return since(t0)


def with_floor(model: nn.Module, opt: Any, data: list[Any]) -> Clock:
    return with_calls(_Floor(), model, opt, data)


class _Timer:
    """One phase of _Timers: its name and the clock at entry and exit, appended to a list."""

    __slots__ = ("name", "out")

    def __init__(self, name: str, out: list[Any]) -> None:
        self.name, self.out = name, out

    def __enter__(self) -> None:
        self.out.append(time.perf_counter_ns())

    def __exit__(self, *exc: object) -> None:
        self.out += (self.name, time.perf_counter_ns())


class _Timers:
    """Hand-written timers: the same phases, the wait for each batch, the loss and each step's end,
    appended to one list (what a user's own timing code does, with no store, thread or check): the
    cheapest instrumentation that records what perfscope's calls record."""

    def __init__(self) -> None:
        self.out: list[Any] = []
        self._timers: dict[str, _Timer] = {}

    def phase(self, name: str) -> _Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(name, self.out)
        return timer

    def log(self, **values: Any) -> None:
        self.out.append(values)

    def steps(self, data: list[Any]) -> Any:
        out, clock = self.out, time.perf_counter_ns
        for batch in data:
            out.append(clock())  # the batch arrived: the data phase ends (and the step before)
            yield batch
            out.append(clock())


def with_timers(model: nn.Module, opt: Any, data: list[Any]) -> Clock:
    return with_calls(_Timers(), model, opt, data)


def with_torch_profiler(model: nn.Module, opt: Any, data: list[Any]) -> Clock:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        t0 = now()
        for x, y in data:
            train_step(model, opt, x, y)
            p.step()
        return since(t0)


def with_perfscope_run(model: nn.Module, opt: Any, data: list[Any], store: Path) -> Clock:
    """The bare loop, unchanged, under the global hooks `perfscope run` installs when torch is
    imported (collectors/auto.py); its profile opens at the first forward, before the clock starts."""
    from perfscope.collectors.auto import AutoRecorder

    recorder = AutoRecorder(
        torch, str(store), {"experiment": "overhead-run", "batch_size": BATCH, "poll_hz": 10}
    )
    recorder.install()
    try:
        train_step(model, opt, *data[0])  # opens the profile (rendezvous, writer, poller)
        t0 = now()
        for x, y in data:
            train_step(model, opt, x, y)
        return since(t0)
    finally:
        recorder.close()


def paired_steps_us(model: nn.Module, opt: Any, data: list[Any], store: Path) -> tuple[float, float]:
    """Instrumented and bare steps alternating one by one inside one open profile: the difference
    of their medians in us, by wall clock and by the training thread's own CPU time. Load that
    drifts over seconds hits both kinds alike, and CPU time does not grow while another process has
    the core, so this isolates the cost of the recording calls (the background threads run during
    both kinds and are measured apart)."""
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    clock, thread_clock = time.perf_counter_ns, time.thread_time_ns
    with perfscope.profile(store, experiment="overhead-paired", batch_size=BATCH, poll_hz=10) as prof:
        for i, (x, y) in enumerate(data):
            t0, c0 = clock(), thread_clock()
            if i % 2:
                train_step(model, opt, x, y)
            else:
                with prof.phase("data"):
                    pass
                recorded_step(prof, model, opt, x, y)
                prof.step()
            wall[i % 2].append(clock() - t0)
            cpu[i % 2].append(thread_clock() - c0)

    def diff_us(pair: tuple[list[float], list[float]]) -> float:
        return (statistics.median(pair[0]) - statistics.median(pair[1])) / 1e3

    return diff_us(wall), diff_us(cpu)


def _loop_steps(prof: Any, items: list[int]) -> None:
    """`for batch in prof.steps(loader)` (its 'data' phase and step end) with three phases and a log."""
    for _ in prof.steps(items):
        with prof.phase("forward"):
            pass
        with prof.phase("backward"):
            pass
        with prof.phase("optimizer"):
            pass
        prof.log(loss=1.0)


def _loop_step(prof: Any, items: list[int]) -> None:
    """The four phases, a log and prof.step(), as a loop without prof.steps writes them."""
    phase = prof.phase
    for _ in items:
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


def _loop_step_comm(prof: Any, items: list[int]) -> None:
    """_loop_step with a hand-written collective in the optimizer (its own sync phase and comm row):
    what a step with communication adds (it has no process group here; nothing is sent)."""
    phase = prof.phase
    for _ in items:
        with phase("data"):
            pass
        with phase("forward"):
            pass
        with phase("backward"):
            pass
        with phase("optimizer"), prof.collective("allreduce", 4096):
            pass
        prof.log(loss=1.0)
        prof.step()


#: the loops `recording_only_us` times, by the name of their figure
LOOPS: dict[str, Callable[[Any, list[int]], None]] = {
    "calls": _loop_steps,
    "calls_step": _loop_step,
    "calls_comm": _loop_step_comm,
}


def recording_only_us(
    store: Path, loop: Callable[[Any, list[int]], None], n: int = 20_000
) -> tuple[float, float]:
    """The recording calls of `n` steps with nothing to record between them: us per step of the
    training thread's CPU, and of the whole process's CPU (adds the writer thread building and
    encoding the rows, and the poller). The steady figure on a shared machine; the rows arrive far
    faster than in training, so the writer's share is an upper bound."""
    empty = list(range(n))
    t0, p0 = time.thread_time_ns(), time.process_time_ns()
    for _ in empty:
        pass
    base_thread, base_process = time.thread_time_ns() - t0, time.process_time_ns() - p0
    with perfscope.profile(store, experiment="overhead-calls", batch_size=BATCH, poll_hz=10) as prof:
        loop(prof, list(range(500)))  # the first rows go out at once: the steady state after them
        t0, p0 = time.thread_time_ns(), time.process_time_ns()
        loop(prof, empty)
        thread = time.thread_time_ns() - t0 - base_thread
        prof.flush()  # the writer's building and encoding of these rows counts too
        process = time.process_time_ns() - p0 - base_process
    return thread / n / 1e3, process / n / 1e3


def recording_figures(tmp: Path, repeats: int = 5) -> dict[str, float]:
    """Every loop of LOOPS timed `repeats` times, interleaved: medians as `<name>_us` (training
    thread) and `<name>_process_us` (all threads)."""
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in LOOPS}
    for k in range(repeats):
        for name, loop in LOOPS.items():
            got[name].append(recording_only_us(tmp / f"{name}{k}", loop))
    out = {}
    for name, pairs in got.items():
        out[f"{name}_us"] = statistics.median(t for t, _ in pairs)
        out[f"{name}_process_us"] = statistics.median(p for _, p in pairs)
    return out


def calibrate(target_s: float = 0.0028) -> int:
    """The MLP width whose bare step takes about `target_s` of CPU on this machine (CPU time: other
    processes on a shared machine would make a wall-clock calibration pick too small a model)."""
    best = 64
    for width in (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096):
        model, opt, batches = make_step(width)
        bare(model, opt, batches_for(batches, 20))
        per = bare(model, opt, batches_for(batches, 100))[1] / 100
        best = width
        if per >= target_s:
            break
    return best


def _loop_parts(prof: Any, items: range, phases: int, log: bool) -> None:
    """`phases` empty phases, a log if `log`, and prof.step(), per item: the loops --breakdown compares."""
    phase = prof.phase
    names = ("data", "forward", "backward", "optimizer")[:phases]
    for _ in items:
        for name in names:
            with phase(name):
                pass
        if log:
            prof.log(loss=1.0)
        prof.step()


def _thread_cpu_ns(prefix: str) -> int:
    """CPU ns of this process's first thread named `prefix...` (/proc schedstat), 0 when none."""
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            try:
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    return int(f.read().split()[0])
            except OSError:
                return 0
    return 0


def breakdown_run(store: Path, phases: int, log: bool, n: int = 20_000) -> dict[str, float]:
    """One loop of `n` steps in a real profile (writer, 10 Hz poller), after 500 warm steps: us per
    step of the training thread's CPU and wall, the writer's pull and whole thread, the poller's
    thread, and the garbage collections (count per 1,000 steps, CPU us per step)."""
    import gc

    gcs: list[int] = []
    started: dict[int, int] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            started[me] = time.thread_time_ns()
        else:
            gcs.append(time.thread_time_ns() - started.pop(me, time.thread_time_ns()))

    with perfscope.profile(store, experiment="overhead-parts", batch_size=BATCH, poll_hz=10) as prof:
        _loop_parts(prof, range(500), phases, log)
        prof.flush()
        tl = prof._timeline
        take = tl.take_rows
        pulled = [0]

        def timed_take(**kw: Any) -> Any:  # the older trees' take_rows takes no keyword
            c0 = time.thread_time_ns()
            out = take(**kw)
            pulled[0] += time.thread_time_ns() - c0
            return out

        tl.take_rows = timed_take
        w0, p0 = _thread_cpu_ns("perfscope-writer"), _thread_cpu_ns("perfscope-poll")
        gc.callbacks.append(on_gc)
        t0, s0 = time.thread_time_ns(), time.perf_counter_ns()
        _loop_parts(prof, range(n), phases, log)
        train, wall = time.thread_time_ns() - t0, time.perf_counter_ns() - s0
        prof.flush()  # the writer's building and encoding of these steps counts too
        gc.callbacks.remove(on_gc)
        w1, p1 = _thread_cpu_ns("perfscope-writer"), _thread_cpu_ns("perfscope-poll")
    return {
        "train_us": train / n / 1e3,
        "wall_us": wall / n / 1e3,
        "pull_us": pulled[0] / n / 1e3,
        "writer_us": (w1 - w0) / n / 1e3,
        "poller_us": (p1 - p0) / n / 1e3,
        "gc_per_1000": len(gcs) * 1000 / n,
        "gc_us": sum(gcs) / n / 1e3,
    }


def kept_blocks(store: Path, n: int = 10_000) -> int:
    """Blocks allocated by perfscope's code (any thread) during `n` steps of 4 phases, a log and
    prof.step() after 1,000 warm ones, still alive once the profile closed (tracemalloc)."""
    import gc
    import tracemalloc

    here = str(Path(perfscope.__file__).parent / "*")
    collectors = str(Path(sys.modules["perfscope.collectors"].__file__ or "").parent / "*")
    with perfscope.profile(store, experiment="overhead-alloc", batch_size=BATCH, poll_hz=0) as prof:
        _loop_parts(prof, range(1_000), 4, True)
        prof.flush()
        gc.collect()
        tracemalloc.start(1)
        _loop_parts(prof, range(n), 4, True)
    gc.collect()
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    return len(
        snap.filter_traces([tracemalloc.Filter(True, here), tracemalloc.Filter(True, collectors)]).traces
    )


def breakdown(tmp: Path, repeats: int = 3) -> dict[str, float]:
    """The parts of the recording path, medians of `repeats` interleaved runs (see the docstring)."""
    loops = {"step": (1, False), "phases4": (4, False), "phases4_log": (4, True)}
    got: dict[str, list[dict[str, float]]] = {k: [] for k in loops}
    for r in range(repeats):
        for name, (phases, log) in loops.items():
            got[name].append(breakdown_run(tmp / f"{name}{r}", phases, log))
    med = {name: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for name, runs in got.items()}
    full = med["phases4_log"]
    phase_us = (med["phases4"]["train_us"] - med["step"]["train_us"]) / 3
    return {
        "phase_us": phase_us,  # one phase, entry and exit
        "log_us": full["train_us"] - med["phases4"]["train_us"],
        "step_end_us": med["step"]["train_us"] - phase_us,
        "train_us": full["train_us"],
        "wall_us": full["wall_us"],
        "pull_us": full["pull_us"],
        "writer_us": full["writer_us"],
        "poller_us": full["poller_us"],
        "gc_per_1000": full["gc_per_1000"],
        "gc_us": full["gc_us"],
        "kept_blocks": kept_blocks(tmp / "alloc"),
    }


BREAKDOWN_COLUMNS = {
    "phase_us": "a phase (enter + exit)",
    "log_us": "prof.log",
    "step_end_us": "prof.step()",
    "train_us": "training thread: 4 phases, a log, the step end",
    "wall_us": "wall per step",
    "pull_us": "writer: its pull (building the rows)",
    "writer_us": "writer thread in all",
    "poller_us": "poller thread",
    "gc_per_1000": "GC collections per 1,000 steps",
    "gc_us": "GC CPU",
    "kept_blocks": "blocks kept after 10,000 steps",
}


def print_breakdown(rows: dict[str, list[dict[str, float]]]) -> None:
    """One Markdown table, a row per tree (medians over its processes), µs per step unless named."""
    print("| tree | " + " | ".join(BREAKDOWN_COLUMNS.values()) + " |")
    print("|---|" + "---|" * len(BREAKDOWN_COLUMNS))
    for label, runs in rows.items():
        cells = []
        for key in BREAKDOWN_COLUMNS:
            v = statistics.median(r[key] for r in runs)
            cells.append(f"{v:.0f}" if key == "kept_blocks" else f"{v:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


#: the calls --cold times, in the order its table shows them
COLD_PARTS = {
    "timer": "the timer alone (subtracted from the others)",
    "empty_with": "`with` on an empty class (the floor)",
    "phase": "a phase: `with prof.phase(...)`, enter and exit",
    "log": "`prof.log(loss=...)`",
    "step": "the step's end: `prof.step()`",
    "steps_next": "`prof.steps`: end the step, time the wait for the next batch",
}


def cold_parts(tmp: Path, width: int, pairs: int = 3_000) -> dict[str, float]:
    """µs per call of each recording call, cold (right after an unrecorded training step) and hot
    (at once after the cold call), medians over `pairs` training steps per call (see --cold)."""
    model, opt, batches = make_step(width)
    clock = time.perf_counter_ns
    empty = EMPTY
    cold: dict[str, list[int]] = {k: [] for k in COLD_PARTS}
    hot: dict[str, list[int]] = {k: [] for k in COLD_PARTS}
    bare(model, opt, batches_for(batches, 50))
    with perfscope.profile(tmp / "cold", experiment="overhead-cold", batch_size=BATCH, poll_hz=10) as prof:
        phase = prof.phase("forward")

        def p_timer() -> None:
            pass

        def p_empty() -> None:
            with empty:
                pass

        def p_phase() -> None:
            with phase:
                pass

        def p_log() -> None:
            prof.log(loss=1.0)

        parts = {"timer": p_timer, "empty_with": p_empty, "phase": p_phase, "log": p_log, "step": prof.step}
        names = list(parts)
        for i in range(pairs * len(names)):
            x, y = batches[i % len(batches)]
            train_step(model, opt, x, y)
            name = names[i % len(names)]
            fn = parts[name]
            if name == "step":
                p_phase()  # a step with something in it (an empty one is no step)
                train_step(model, opt, x, y)
            t0 = clock()
            fn()
            cold[name].append(clock() - t0)
            if name == "step":
                p_phase()
            t0 = clock()
            fn()
            hot[name].append(clock() - t0)
            if name != "step":
                prof.step()
    store = tmp / "cold-steps"
    with perfscope.profile(store, experiment="overhead-cold", batch_size=BATCH, poll_hz=10) as prof:
        it = prof.steps(batches_for(batches, pairs + 1))
        x, y = next(it)
        for _ in range(pairs):
            with prof.phase("forward"):
                train_step(model, opt, x, y)
            t0 = clock()
            x, y = next(it)
            cold["steps_next"].append(clock() - t0)
        it.close()
    timer_cold, timer_hot = statistics.median(cold["timer"]), statistics.median(hot["timer"])
    out: dict[str, float] = {}
    for name in COLD_PARTS:
        less_cold, less_hot = (0.0, 0.0) if name == "timer" else (timer_cold, timer_hot)
        out[f"{name}_cold_us"] = (statistics.median(cold[name]) - less_cold) / 1e3
        if hot[name]:
            out[f"{name}_hot_us"] = (statistics.median(hot[name]) - less_hot) / 1e3
    out["width"] = width
    return out


class _Some:
    """perfscope.profile's calls, those not in `real` ("steps", "phases", "log") doing nothing."""

    def __init__(self, prof: Any, real: set[str]) -> None:
        floor = _Floor()
        self.phase = prof.phase if "phases" in real else floor.phase
        self.log = prof.log if "log" in real else floor.log
        self.steps = prof.steps if "steps" in real else floor.steps


ALL_CALLS = {"steps", "phases", "log"}
#: --parts: variant -> (poll_hz, the writer pulls during the block, the calls that record)
PARTS: dict[str, tuple[int, bool, set[str]]] = {
    "perfscope.profile, all of it": (10, True, ALL_CALLS),
    "no poller": (0, True, ALL_CALLS),
    "no poller, the writer idle during the block": (0, False, ALL_CALLS),
    "the threads alone: the profile open, the calls doing nothing": (10, True, set()),
    "no poller, prof.steps alone": (0, True, {"steps"}),
    "no poller, prof.steps and the phases": (0, True, {"steps", "phases"}),
    "no poller, prof.steps and prof.log": (0, True, {"steps", "log"}),
}


def parts_table(tmp: Path, width: int, rounds: int = 60, n: int = 300) -> tuple[float, dict[str, float]]:
    """The bare step (s) and each --parts variant's median wall ratio to the bare block of its round."""
    from perfscope.collectors import phases

    model, opt, batches = make_step(width)
    data = batches_for(batches, n)
    default_pull = phases.PULL_AT_STEPS

    def part(label: str) -> Callable[[], Clock]:
        poll_hz, pulls, real = PARTS[label]

        def run() -> Clock:
            phases.PULL_AT_STEPS = default_pull if pulls else 10**9
            try:
                with perfscope.profile(
                    tmp / f"p{time.monotonic_ns()}", experiment="overhead-parts", batch_size=BATCH,
                    poll_hz=poll_hz, roll_interval_s=1.0 if pulls else 3600.0,
                ) as prof:  # fmt: skip
                    return with_calls(_Some(prof, real), model, opt, data)
            finally:
                phases.PULL_AT_STEPS = default_pull

        return run

    variants: dict[str, Callable[[], Clock]] = {
        "bare": lambda: bare(model, opt, data),
        "the floor: the same calls doing nothing": lambda: with_floor(model, opt, data),
        **{label: part(label) for label in PARTS},
    }
    for fn in variants.values():  # warm every path once
        fn()
    names = list(variants)
    ratios: dict[str, list[float]] = {k: [] for k in names}
    steps: list[float] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {name: variants[name]()[0] for name in order}
        steps.append(got["bare"] / n)
        for name in names:
            ratios[name].append(got[name] / got["bare"])
    return statistics.median(steps), {k: statistics.median(v) for k, v in ratios.items() if k != "bare"}


BLOCKED_VARIANTS = {
    "default (writer, 10 Hz poller)": (10, None),
    "no poller": (0, None),
    "no poller, the writer not asked to pull early (it still pulls at each 1 s roll)": (0, 10**9),
    "poller, the writer not asked to pull early": (10, 10**9),
}


def blocked_by_thread(tmp: Path, width: int, rounds: int = 6, n: int = 500) -> dict[str, tuple[float, float]]:
    """µs per step the training thread was blocked, and wall µs per step, by variant (see --blocked)."""
    from perfscope.collectors import phases

    model, opt, batches = make_step(width)
    data = batches_for(batches, n)
    default_pull = phases.PULL_AT_STEPS

    def block(label: str, k: int) -> tuple[float, float]:
        poll_hz, pull = BLOCKED_VARIANTS[label]
        phases.PULL_AT_STEPS = default_pull if pull is None else pull
        try:
            store = tmp / f"b{k}-{len(label)}"
            with perfscope.profile(
                store, experiment="overhead-blocked", batch_size=BATCH, poll_hz=poll_hz
            ) as prof:
                b0, t0 = blocked_ns(), time.perf_counter_ns()
                for x, y in prof.steps(data):
                    recorded_step(prof, model, opt, x, y)
                return (blocked_ns() - b0) / n / 1e3, (time.perf_counter_ns() - t0) / n / 1e3
        finally:
            phases.PULL_AT_STEPS = default_pull

    for label in BLOCKED_VARIANTS:  # warm every path once
        block(label, -1)
    got: dict[str, list[tuple[float, float]]] = {label: [] for label in BLOCKED_VARIANTS}
    for r in range(rounds):
        for label in BLOCKED_VARIANTS:
            got[label].append(block(label, r))
    return {
        label: (statistics.median(b for b, _ in runs), statistics.median(w for _, w in runs))
        for label, runs in got.items()
    }


def print_cold(rows: dict[str, list[dict[str, float]]]) -> None:
    """One Markdown table, a row per call, a cold and a hot column per tree (medians over processes)."""
    labels = list(rows)
    print("| call | " + " | ".join(f"{label}: cold | hot" for label in labels) + " |")
    print("|---|" + "---|---|" * len(labels))
    for name, words in COLD_PARTS.items():
        cells = []
        for label in labels:
            for kind in ("cold", "hot"):
                vals = [r[f"{name}_{kind}_us"] for r in rows[label] if f"{name}_{kind}_us" in r]
                cells.append(f"{statistics.median(vals):.2f} µs" if vals else "")
        print(f"| {words} | " + " | ".join(cells) + " |")


def _per_call_ns(fn: Callable[[], None], n: int = 200_000) -> float:
    """ns per call of fn, less the empty loop."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    empty = time.perf_counter_ns() - t0
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0 - empty) / n


def nvtx_pair_ns() -> tuple[float, float, bool]:
    """ns per push/pop pair: through perfscope (which skips the calls when no tool is attached)
    and on the nvtx domain directly with cached attributes; and whether a tool is attached."""
    import nvtx

    ranges = NvtxRanges()
    domain = nvtx.get_domain("perfscope")
    attrs = domain.get_event_attributes(message=domain.get_registered_string("forward"), color="green")
    push, pop = domain.push_range, domain.pop_range

    def ours() -> None:
        ranges.push("forward")
        ranges.pop()

    def raw() -> None:
        push(attrs)
        pop()

    return _per_call_ns(ours), _per_call_ns(raw), type(domain).__name__ == "Domain"


class _Discard:
    def append(self, table: str, row: tuple[Any, ...]) -> None:
        pass


def poller_cpu(seconds: float) -> tuple[float, int, int]:
    """CPU of the poller thread at 10 Hz in % of one core, samples taken, GPUs seen."""
    faults = Faults(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpus = open_gpus(faults)
    p = Poller(
        _Discard(),
        gpus=gpus,
        host=HostSampler(lambda: [os.getpid()]),
        hz=10,
        hostname="bench",
        node_rank=0,
        wall_ns=time.time_ns,
        faults=faults,
    )
    t0 = time.perf_counter()
    p.start()
    time.sleep(seconds)
    p.stop()
    return 100.0 * p.cpu_ns / 1e9 / (time.perf_counter() - t0), p.samples, len(gpus.device_names)


DDP_STEPS = 60
DDP_WARMUP = 10
DDP_BATCH = 256
DDP_WIDTH = 1024


def _perfscope_threads_cpu_s() -> float:
    """CPU seconds of this process's perfscope threads (by their Python names), from /proc."""
    import threading

    total = 0.0
    for t in threading.enumerate():
        if not t.name.startswith("perfscope") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def ddp_job(rank: int, world_size: int, port: int, store: str | None, q: Any) -> None:
    """One rank of a DDP job on gloo: DDP_STEPS steps of an MLP, bare (store None) or under
    perfscope.profile; puts (rank, steady samples/s, steady elapsed s, perfscope threads' CPU s
    over the steady steps)."""
    import contextlib
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    model = nn.Sequential(nn.Linear(256, DDP_WIDTH), nn.ReLU(), nn.Linear(DDP_WIDTH, DDP_WIDTH), nn.ReLU(),
                          nn.Linear(DDP_WIDTH, 10))  # fmt: skip
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(DDP_BATCH, 256), torch.randint(0, 10, (DDP_BATCH,))
    prof = None
    with contextlib.ExitStack() as stack:
        if store is not None:
            prof = stack.enter_context(
                perfscope.profile(store, experiment="ddp-overhead", batch_size=DDP_BATCH)
            )
            prof.watch(net)
        t0 = cpu0 = 0.0
        for i in range(DDP_STEPS):
            if i == DDP_WARMUP:  # the threads' start-up (first segment, clock exchange) is not steady cost
                t0, cpu0 = time.perf_counter(), _perfscope_threads_cpu_s()
            if prof is not None:
                recorded_step(prof, net, opt, x, y)
                prof.step()
            else:
                train_step(net, opt, x, y)
        elapsed = time.perf_counter() - t0
        threads_cpu = _perfscope_threads_cpu_s() - cpu0
    dist.destroy_process_group()
    q.put((rank, DDP_BATCH * world_size * (DDP_STEPS - DDP_WARMUP) / elapsed, elapsed, threads_cpu))


def run_ddp(world_size: int, store: str | None) -> list[tuple[int, float, float, float]]:
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "perfscope"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    q = ctx.Queue()
    procs = [ctx.Process(target=ddp_job, args=(r, world_size, port, store, q)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    out = [q.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(60)
    return sorted(out)


def ddp_overhead(rounds: int, tmp: Path) -> None:
    """Bare and instrumented 1- and 2-rank jobs interleaved; Markdown on stdout."""
    kinds = [(1, False), (1, True), (2, False), (2, True)]
    x: dict[tuple[int, bool], list[float]] = {k: [] for k in kinds}
    eff: dict[bool, list[float]] = {False: [], True: []}
    threads_pct: list[float] = []
    for r in range(rounds):
        got = {}
        for n, inst in kinds[r % 4 :] + kinds[: r % 4]:
            res = run_ddp(n, str(tmp / f"ddp{r}-{n}") if inst else None)
            got[(n, inst)] = res[0][1]  # every rank reports the job's samples/s; rank 0's clock
            if inst:
                threads_pct += [100.0 * cpu / elapsed for _, _, elapsed, cpu in res]
        for k in kinds:
            x[k].append(got[k])
        for inst in (False, True):
            eff[inst].append(got[(2, inst)] / (2 * got[(1, inst)]))
    med = statistics.median
    load = os.getloadavg()[0]
    print(
        f"\n## Collector cost on a saturated host ({rounds} rounds, 1- and 2-rank DDP on gloo, MLP width "
        f"{DDP_WIDTH}, batch {DDP_BATCH} per rank, one thread per rank, {os.cpu_count()} cores, load "
        f"average {load:.1f} after the run)\n"
    )
    print("| job | bare samples/s (median) | instrumented samples/s (median) | instrumented / bare |")
    print("|---|---|---|---|")
    for n in (1, 2):
        ratios = [i / b for b, i in zip(x[(n, False)], x[(n, True)], strict=True)]
        print(f"| {n} rank(s) | {med(x[(n, False)]):.0f} | {med(x[(n, True)]):.0f} | {med(ratios):.3f}x |")
    print()
    print(
        f"- efficiency E(2) = X(2)/(2·X(1)), per round: bare {med(eff[False]):.3f} "
        f"(range {min(eff[False]):.3f}-{max(eff[False]):.3f}), instrumented {med(eff[True]):.3f} "
        f"(range {min(eff[True]):.3f}-{max(eff[True]):.3f})"
    )
    print(
        f"- perfscope's threads (writer, poller + host sampler on rank 0) per rank: median "
        f"{med(threads_pct):.2f}% of one core, max {max(threads_pct):.2f}% (target under 1%)"
    )


#: runs this script with the perfscope of the source tree argv[1] (perfscope.collectors included,
#: which an editable install would otherwise take from this checkout)
_WITH_TREE = """
import importlib.util, runpy, sys
tree, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import perfscope
here = tree + "/collectors"
spec = importlib.util.spec_from_file_location(
    "perfscope.collectors", here + "/__init__.py", submodule_search_locations=[here]
)
module = importlib.util.module_from_spec(spec)
sys.modules["perfscope.collectors"] = module
spec.loader.exec_module(module)
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def _commit(tree: str) -> str:
    done = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "?"


def _each_tree_twice(trees: dict[str, str], got: dict[str, list[dict[str, float]]], args: list[str]) -> None:
    """This script with `args` in its own process per tree (its perfscope), twice each, alternating;
    each process's JSON line added to `got` under its tree's label."""
    for rep in range(2):
        for label in list(trees)[rep % 2 :] + list(trees)[: rep % 2]:
            cmd = [sys.executable, "-c", _WITH_TREE, trees[label], __file__, *args]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            got[label].append(json.loads(done.stdout.strip().splitlines()[-1]))


def compare_trees(args: argparse.Namespace) -> None:
    """This tree and each of `args.old` (none: this tree alone), each measured in its own process
    (bare and perfscope.profile interleaved inside it), twice, alternating; one Markdown table of
    the medians, a row per tree."""
    here = str(Path(__file__).resolve().parent.parent)
    trees = {f"this tree ({_commit(here)})": here}
    for old in args.old or []:
        trees[f"{old} ({_commit(old)})"] = str(Path(old).resolve())
    got: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    torch.set_num_threads(1)
    if args.cold:
        width = args.width or calibrate(args.step_ms / 1e3)
        load_before = os.getloadavg()
        _each_tree_twice(trees, got, ["--cold", "--json", f"--width={width}"])
        load_after = os.getloadavg()
        print(
            f"## Each recording call cold (right after a training step, MLP width {width}) and hot, µs "
            f"(2 processes per tree, each the median of 3,000 pairs per call; {os.cpu_count()} cores; "
            f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after)\n"
        )
        print_cold(got)
        return
    if args.breakdown:
        load_before = os.getloadavg()
        _each_tree_twice(trees, got, ["--breakdown", "--json"])
        load_after = os.getloadavg()
        print(
            f"## The recording path by part, µs per step unless named (2 processes per tree, each the "
            f"median of 3 interleaved runs of 20,000 steps; {os.cpu_count()} cores; load average "
            f"{load_before[0]:.1f} before, {load_after[0]:.1f} after)\n"
        )
        print_breakdown(got)
        return
    width = args.width or calibrate(args.step_ms / 1e3)  # once: both trees run the same step
    load_before = os.getloadavg()
    sizes = [f"--rounds={args.rounds}", f"--block-s={args.block_s}", f"--poll-s={args.poll_s}"]
    _each_tree_twice(trees, got, ["--json", *sizes, f"--width={width}"])
    load_after = os.getloadavg()

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in got[label])

    first = next(iter(got.values()))[0]
    print(
        f"## perfscope.profile against bare, by tree ({args.rounds} interleaved block pairs per process, "
        f"2 processes per tree, MLP width {first['width']:.0f}, batch {BATCH}, "
        f"{first['steps_per_block']:.0f} steps per block, 1 thread, {os.cpu_count()} cores; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after)\n"
    )
    print(
        "Recording calls per step: the training thread's CPU (all threads' in brackets: the writer "
        "builds and encodes the rows), in a loop with nothing else: `prof.steps` with 3 phases and a log; "
        "4 phases, a log and `prof.step()`; the same with a hand-written collective.\n"
    )
    print(
        "| tree | bare step | wall ratio (median) | wall p10-p90 | CPU ratio | the floor's wall ratio "
        "| recording calls: prof.steps "
        "| 4 phases + prof.step() | with a collective | training thread blocked per step "
        "(bare: blocked) | poller CPU at 10 Hz |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def calls(label: str, name: str) -> str:
        return f"{med(label, name + '_us'):.1f} µs ({med(label, name + '_process_us'):.1f})"

    for label in trees:
        print(
            f"| {label} | {med(label, 'step_ms'):.3f} ms | {med(label, 'wall_ratio'):.3f}x | "
            f"{med(label, 'wall_p10'):.3f}-{med(label, 'wall_p90'):.3f} | {med(label, 'cpu_ratio'):.3f}x | "
            f"{med(label, 'floor_ratio'):.3f}x | "
            f"{calls(label, 'calls')} | {calls(label, 'calls_step')} | {calls(label, 'calls_comm')} | "
            f"{med(label, 'blocked_us'):.1f} µs ({med(label, 'blocked_bare_us'):.1f} µs) | "
            f"{med(label, 'poller_pct'):.3f} % |"
        )


def _setup(args: argparse.Namespace) -> tuple[Path, int]:
    """One torch thread, warnings off (no NVML here is expected), a scratch folder, the MLP width."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    tmp = Path(tempfile.mkdtemp(prefix="perfscope-overhead-"))
    return tmp, args.width or calibrate(args.step_ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25, help="block pairs (rounds of every variant)")
    ap.add_argument("--width", type=int, default=0, help="MLP width (0: the one whose step takes --step-ms)")
    ap.add_argument("--step-ms", type=float, default=2.8, help="CPU time of the step the width is picked for")
    ap.add_argument("--breakdown", action="store_true", help="the recording path part by part (see above)")
    ap.add_argument("--cold", action="store_true", help="each recording call cold and hot (see above)")
    ap.add_argument("--blocked", action="store_true", help="the training thread's GIL waits by thread")
    ap.add_argument("--parts", action="store_true", help="perfscope.profile with parts of it off (see above)")
    ap.add_argument(
        "--old",
        metavar="TREE",
        action="append",
        help="compare with the perfscope of another source tree (repeatable)",
    )
    ap.add_argument(
        "--rows", action="store_true", help="the per-tree table for this tree alone (and any --old)"
    )
    ap.add_argument("--json", action="store_true", help="bare and perfscope.profile only, figures as JSON")
    ap.add_argument("--block-s", type=float, default=1.0, help="length of one block of steps")
    ap.add_argument("--poll-s", type=float, default=10.0, help="how long to measure the poller")
    ap.add_argument(
        "--ddp-rounds",
        type=int,
        default=0,
        help="rounds of bare/instrumented 1- and 2-rank DDP jobs (0: skip)",
    )
    ap.add_argument("--only-ddp", action="store_true", help="run only the DDP comparison")
    args = ap.parse_args()
    if args.parts:
        tmp, width = _setup(args)
        load_before = os.getloadavg()
        step_s, got = parts_table(tmp, width)
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"## perfscope.profile by part (MLP width {width}, bare step {step_s * 1e3:.3f} ms, 60 rounds "
            f"of 300 steps per variant; load average {load_before[0]:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after)\n"
        )
        print("| variant | wall ratio to bare (median) | µs per step over bare |")
        print("|---|---|---|")
        for label, ratio in got.items():
            print(f"| {label} | {ratio:.3f}x | {(ratio - 1) * step_s * 1e6:+.1f} |")
        return
    if args.blocked:
        tmp, width = _setup(args)
        load_before = os.getloadavg()
        rows = blocked_by_thread(tmp, width)
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"## The training thread's time blocked per step (MLP width {width}, 6 rounds of 500 steps per "
            f"variant; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after)\n"
        )
        print("| variant | blocked per step | wall per step |")
        print("|---|---|---|")
        for label, (b, w) in rows.items():
            print(f"| {label} | {b:.1f} µs | {w:,.0f} µs |")
        return
    if args.cold and not (args.old or args.rows):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        tmp = Path(tempfile.mkdtemp(prefix="perfscope-overhead-"))
        got = cold_parts(tmp, args.width or calibrate(args.step_ms / 1e3))
        shutil.rmtree(tmp, ignore_errors=True)
        if args.json:
            print(json.dumps(got))
        else:
            print_cold({"this tree": [got]})
        return
    if args.breakdown and not (args.old or args.rows):
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        tmp = Path(tempfile.mkdtemp(prefix="perfscope-overhead-"))
        parts = breakdown(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if args.json:
            print(json.dumps(parts))
        else:
            print_breakdown({"this tree": [parts]})
        return
    if args.old or args.rows:
        compare_trees(args)
        return
    if args.only_ddp:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        tmp = Path(tempfile.mkdtemp(prefix="perfscope-overhead-"))
        ddp_overhead(max(1, args.ddp_rounds), tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # NVML missing on a CPU machine is expected here

    width = args.width or calibrate(args.step_ms / 1e3)
    model, opt, batches = make_step(width)
    bare(model, opt, batches_for(batches, 50))
    per_step = bare(model, opt, batches_for(batches, 200))[1] / 200
    n = max(100, int(args.block_s / per_step))
    data = batches_for(batches, n)
    tmp = Path(tempfile.mkdtemp(prefix="perfscope-overhead-"))
    variants: dict[str, Callable[[], Clock]] = {
        "bare": lambda: bare_blocked(model, opt, data),
        "perfscope.profile": lambda: with_perfscope(model, opt, data, tmp / f"s{time.monotonic_ns()}"),
        "the floor: the same calls doing nothing": lambda: with_floor(model, opt, data),
        "hand-written timers: the same phases into a list": lambda: with_timers(model, opt, data),
    }
    if not args.json:
        variants["perfscope run (no code change)"] = lambda: with_perfscope_run(
            model, opt, data, tmp / f"r{time.monotonic_ns()}"
        )
        variants["torch.profiler (CPU)"] = lambda: with_torch_profiler(model, opt, data)
    for fn in variants.values():  # warm every path once
        fn()
    for kept in BLOCKED.values():
        kept.clear()
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    cpu_ratios: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        clocks = {name: variants[name]() for name in order}
        for name in names:
            times[name].append(clocks[name][0] / n)
            ratios[name].append(clocks[name][0] / clocks["bare"][0])
            cpu_ratios[name].append(clocks[name][1] / clocks["bare"][1])

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=10)[int(p * 10) - 1] if len(xs) >= 2 else xs[0]

    if args.json:
        calls = recording_figures(tmp)
        cpu_pct, _, _ = poller_cpu(args.poll_s)
        ps = "perfscope.profile"
        print(
            json.dumps(
                {
                    "step_ms": statistics.median(times["bare"]) * 1e3,
                    "wall_ratio": statistics.median(ratios[ps]),
                    "floor_ratio": statistics.median(ratios["the floor: the same calls doing nothing"]),
                    "timers_ratio": statistics.median(
                        ratios["hand-written timers: the same phases into a list"]
                    ),
                    "wall_p10": q(ratios[ps], 0.1),
                    "wall_p90": q(ratios[ps], 0.9),
                    "cpu_ratio": statistics.median(cpu_ratios[ps]),
                    **calls,
                    "blocked_us": statistics.median(BLOCKED[ps]) / 1e3,
                    "blocked_bare_us": statistics.median(BLOCKED["bare"]) / 1e3,
                    "poller_pct": cpu_pct,
                    "width": width,
                    "steps_per_block": n,
                }
            )
        )
        shutil.rmtree(tmp, ignore_errors=True)
        return
    load = os.getloadavg()[0]
    print(
        f"## Collector overhead ({args.rounds} rounds of {n} steps per variant, MLP width {width}, "
        f"batch {BATCH}, 1 thread, {os.cpu_count()} cores, load average {load:.1f})\n"
    )
    print("| variant | time per step (median) | wall ratio to bare (median) | wall p10-p90 | CPU ratio |")
    print("|---|---|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        rat = statistics.median(ratios[name])
        spread = "" if name == "bare" else f"{q(ratios[name], 0.1):.3f}-{q(ratios[name], 0.9):.3f}"
        cpu = statistics.median(cpu_ratios[name])
        print(f"| {name} | {med * 1e3:.3f} ms | {rat:.3f}x | {spread} | {cpu:.3f}x |")
    extra_us = (statistics.median(ratios["perfscope.profile"]) - 1) * statistics.median(times["bare"]) * 1e6
    calls = recording_figures(tmp)
    paired = [paired_steps_us(model, opt, data, tmp / f"p{k}") for k in range(3)]
    paired_wall_us = statistics.median(w for w, _ in paired)
    paired_cpu_us = statistics.median(c for _, c in paired)
    ours_ns, raw_ns, attached = nvtx_pair_ns()
    cpu_pct, samples, gpus = poller_cpu(args.poll_s)
    print()
    print(
        f"- recording calls alone, us per step of the training thread's CPU (with the writer and poller "
        f"threads): prof.steps loop with 3 phases and a log {calls['calls_us']:.1f} "
        f"({calls['calls_process_us']:.1f}); 4 phases, a log and prof.step() {calls['calls_step_us']:.1f} "
        f"({calls['calls_step_process_us']:.1f}); the same with a collective {calls['calls_comm_us']:.1f} "
        f"({calls['calls_comm_process_us']:.1f})"
    )
    print(
        f"- recording calls per step, paired with bare steps one by one: {paired_wall_us:+.1f} us wall, "
        f"{paired_cpu_us:+.1f} us CPU of the training thread (median of 3 x {n // 2} pairs)"
    )
    print(
        f"- perfscope per step: {extra_us:+.1f} us over bare "
        f"(target: at most 1.01x, about {10 * args.step_ms:.0f} us of a {args.step_ms} ms step)"
    )
    tool = (
        "a tool is attached"
        if attached
        else "no tool attached: nvtx's stand-in domain, which perfscope skips"
    )
    print(
        f"- NVTX push/pop pair: {ours_ns:.0f} ns through perfscope, {raw_ns:.0f} ns on the domain with cached"
    )
    print(f"  attributes ({tool})")
    seen = f"host metrics and {gpus} GPUs" if gpus else "host metrics only, no NVML"
    print(
        f"- poller at 10 Hz: {cpu_pct:.3f} % of one core ({samples} samples in {args.poll_s:.0f} s, "
        f"{seen}; target under 0.5 %)"
    )
    if args.ddp_rounds:
        ddp_overhead(args.ddp_rounds, tmp)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
