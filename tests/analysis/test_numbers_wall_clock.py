"""Step time and throughput against the job's own wall clock (issue 21): real 2-rank gloo jobs on
the CPU, recorded by perfscope.profile, that time themselves with time.perf_counter_ns around the
same steps. The job's elapsed time over the steady steps is the latest end of the last steady step
on any rank minus the earliest start of the first (the end of the step before it) on any rank; both
ranks run on this host, where perf_counter_ns is one clock for every process, so the ranks' readings
compare directly. perfscope's step time must be that elapsed time / steps, and its samples/s the
job's samples over it.

Every job has per-rank jitter placed where it misaligns the ranks' step boundaries (random sleeps
after the step's communication): the sum over steps of the slowest rank's step, perfscope's old
elapsed time, then overstates the window by well over 5% (checked here from the recorded rows), so
these tests fail on it.

Tolerance: perfscope's step boundaries are readings of the same clock taken inside `prof.step()`,
which the job's readings bracket (just before and just after the call); perfscope's one-time mapping
of that clock to the epoch adds under 2 us (printed per rank). So perfscope must lie within
TOLERANCE (2%, the issue's figure on a quiet machine) of the job's elapsed time wherever inside the
brackets it read the clock. Measured on the shared 2-core machine at load 9-20: 30 of 30 runs of the
four tests passed; the midpoint of the brackets agreed with perfscope within 0.011% except once
(1.0%: a prof.step() call that took about 23 ms at an edge of the window), which the brackets cover.
The sum of maxima overstated the job's elapsed time by 11-44% (DDP 13-27%, averaging 18-35%,
pipeline 11-44%); the parameter server's single stepping rank makes both the same."""

from __future__ import annotations

import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from perfscope import open_store
from perfscope.analysis import Selection, run_analysis

pytest.importorskip("torch")
from collect_helpers import results_ok, run_ranks

#: 10 warm-up steps (perfscope's default cut for runs this short), then 32 steady steps.
STEPS = 42
BATCH = 32
FEATURES = 64
#: Jitter: a uniform sleep of up to JITTER_S at the end of every step of every rank.
JITTER_S = 0.02
TOLERANCE = 0.02
#: The old elapsed time (sum of the per-step slowest rank) must overstate the job's by more than this.
OLD_OVERSTATES = 0.05


def _init(rank: int, world_size: int) -> Any:
    import torch
    import torch.distributed as dist

    torch.manual_seed(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    return dist


class _Clock:
    """The job's own step boundaries: perf_counter_ns just before and just after each prof.step()."""

    def __init__(self, rank: int, *, alternate: bool = False) -> None:
        self.ends: list[tuple[int, int]] = []
        self.rng = random.Random(1000 + rank)
        self.rank = rank
        self.alternate = alternate
        self.mapping_err_ns = 0

    def jitter(self) -> None:
        """A random sleep; `alternate` adds JITTER_S on every other step, out of phase between the
        ranks (a rank's long steps then never line up with the other's, whatever the load adds)."""
        extra = JITTER_S if self.alternate and (self.rank + len(self.ends)) % 2 == 0 else 0.0
        time.sleep(self.rng.uniform(0.0, JITTER_S) + extra)

    def step(self, prof: Any) -> None:
        before = time.perf_counter_ns()
        prof.step()
        self.ends.append((before, time.perf_counter_ns()))
        if len(self.ends) == 1:
            self.mapping_err_ns = _mapping_err_ns(prof)


def _mapping_err_ns(prof: Any) -> int:
    """How far perfscope's mapping of perf_counter_ns to the epoch (its timestamps) is from the
    tightest of many readings of the two clocks here (diagnostics: a rank whose mapping is off
    shifts its timestamps against the other rank's)."""
    best = (1 << 62, 0)
    for _ in range(50):
        before, mid, after = time.time_ns(), time.perf_counter_ns(), time.time_ns()
        if after - before < best[0]:
            best = (after - before, (before + after) // 2 - mid)
    return int(prof.clock.shift_ns - prof.clock.offset_ns - best[1])


def _mlp() -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def ddp_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """DDP; after the synchronised update every rank does a random amount of other work."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    net = nn.parallel.DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    clock = _Clock(rank)
    with perfscope.profile(
        store, experiment="wall-ddp", batch_size=BATCH, poll_hz=0, gpu_telemetry=False
    ) as prof:
        prof.watch(net)
        for _ in range(STEPS):
            x, y = torch.randn(BATCH, FEATURES), torch.randint(0, 10, (BATCH,))
            with prof.phase("forward"):
                loss = nn.functional.cross_entropy(net(x), y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            clock.jitter()
            clock.step(prof)
        run_id = prof.run_id
    dist.destroy_process_group()
    return {"run_id": run_id, "ends": clock.ends, "mapping_err_ns": clock.mapping_err_ns}


def paramavg_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Local SGD: every rank trains alone (with jitter) and averages the parameters every 4th step.
    Random jitter alone drifts the ranks apart less than in DDP (the sum of maxima read 9-25% high
    on a loaded machine): alternating jitter keeps that well above OLD_OVERSTATES."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = _Clock(rank, alternate=True)
    with perfscope.profile(
        store, experiment="wall-avg", batch_size=BATCH, poll_hz=0, gpu_telemetry=False
    ) as prof:
        prof.watch(model)
        for i in range(STEPS):
            x, y = torch.randn(BATCH, FEATURES), torch.randint(0, 10, (BATCH,))
            with prof.phase("forward"):
                loss = nn.functional.cross_entropy(model(x), y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            clock.jitter()
            if i % 4 == 3:
                with torch.no_grad():
                    for p in model.parameters():
                        dist.all_reduce(p.data)
                        p.data /= world_size
            clock.step(prof)
        run_id = prof.run_id
    dist.destroy_process_group()
    return {"run_id": run_id, "ends": clock.ends, "mapping_err_ns": clock.mapping_err_ns}


def pipeline_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Two stages, one batch a step: stage 0 sends activations, stage 1 computes the loss and sends
    the gradients back; then each stage updates and does a random amount of other work."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    stage = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(), nn.Linear(FEATURES, FEATURES))
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    clock = _Clock(rank)
    with perfscope.profile(store, experiment="wall-pipe", batch_size=BATCH, global_batch_size=BATCH,
                           role=f"stage:{rank}", poll_hz=0, gpu_telemetry=False) as prof:  # fmt: skip
        for _ in range(STEPS):
            with prof.phase("forward"):
                if rank == 0:
                    x = torch.randn(BATCH, FEATURES)
                else:
                    x = torch.empty(BATCH, FEATURES)
                    dist.recv(x, 0)
                    x.requires_grad_(True)
                y = stage(x)
                if rank == 0:
                    dist.send(y.detach(), 1)
            with prof.phase("backward"):
                if rank == 0:
                    g = torch.empty_like(y)
                    dist.recv(g, 1)
                    y.backward(g)
                else:
                    y.square().mean().backward()
                    dist.send(x.grad, 0)
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            clock.jitter()
            clock.step(prof)
        run_id = prof.run_id
    dist.destroy_process_group()
    return {"run_id": run_id, "ends": clock.ends, "mapping_err_ns": clock.mapping_err_ns}


def ps_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Rank 0 serves (receives the gradients, updates, sends the parameters back; no steps of its
    own); rank 1 pushes its gradients and pulls the parameters every step, with jitter."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    model = _mlp()
    flat = nn.utils.parameters_to_vector(model.parameters()).detach()
    clock = _Clock(rank)
    role = "server" if rank == 0 else "worker"
    with perfscope.profile(store, experiment="wall-ps", batch_size=BATCH, role=role, poll_hz=0,
                           gpu_telemetry=False) as prof:  # fmt: skip
        if rank == 0:
            grad = torch.empty_like(flat)
            for _ in range(STEPS):
                dist.recv(grad, 1)
                flat -= 0.01 * grad
                dist.send(flat, 1)
        else:
            prof.watch(model)
            for _ in range(STEPS):
                x, y = torch.randn(BATCH, FEATURES), torch.randint(0, 10, (BATCH,))
                with prof.phase("forward"):
                    loss = nn.functional.cross_entropy(model(x), y)
                with prof.phase("backward"):
                    loss.backward()
                g = nn.utils.parameters_to_vector(p.grad for p in model.parameters())
                dist.send(g, 0)  # push
                dist.recv(flat, 0)  # pull
                nn.utils.vector_to_parameters(flat, model.parameters())
                model.zero_grad()
                clock.jitter()
                clock.step(prof)
        run_id = prof.run_id
    dist.destroy_process_group()
    return {"run_id": run_id, "ends": clock.ends, "mapping_err_ns": clock.mapping_err_ns}


def _job_elapsed_ns(
    ends: dict[int, list[tuple[int, int]]], first: int, last: int
) -> tuple[float, float, float]:
    """The job's wall clock over steps first..last: from the earliest end of step first-1 (the start
    of step first) to the latest end of step last. Each end is known to lie between the readings
    just before and just after prof.step(), which is where perfscope reads it: returns the least
    and the greatest elapsed time those brackets allow, and the one from their midpoints."""

    def pick(i: int, which: int) -> list[int]:
        return [e[i][which] for e in ends.values()]

    lo = max(pick(last, 0)) - min(pick(first - 1, 1))
    hi = max(pick(last, 1)) - min(pick(first - 1, 0))
    mid = max((a + b) / 2 for a, b in zip(pick(last, 0), pick(last, 1), strict=True)) - min(
        (a + b) / 2 for a, b in zip(pick(first - 1, 0), pick(first - 1, 1), strict=True)
    )
    return lo, hi, mid


def _check(tmp_path: Path, worker: Any, global_samples: int, *, old_fails: bool = True) -> dict[str, float]:
    values = results_ok(run_ranks(worker, 2, str(tmp_path)))
    ends = {r: v["ends"] for r, v in values.items() if v["ends"]}
    with open_store(tmp_path) as store:
        (r,) = run_analysis("run_summary", store, Selection()).to_pylist()
        first = r["steps_total"] - r["steady_steps"]
        # perfscope's old elapsed time: the sum over steady steps of the slowest rank's step
        per_step = f"SELECT max(step_ns) AS m FROM steps WHERE step >= {first} GROUP BY step"
        (old,) = store.query(f"SELECT sum(m)::DOUBLE AS s FROM ({per_step})").column("s").to_pylist()
    assert (r["steps_total"], r["steady_steps"]) == (STEPS, STEPS - 10)
    assert all(len(e) == STEPS for e in ends.values())
    lo, hi, job = _job_elapsed_ns(ends, first, STEPS - 1)
    steps = STEPS - first
    job_step_ns, job_rate = job / steps, global_samples * steps / (job / 1e9)
    got = {
        "step": r["step_ns"] / job_step_ns - 1,
        "rate": r["throughput_samples_per_s"] / job_rate - 1,
        "old": old / job - 1,
    }
    widths = [max(b - a for a, b in e) for e in ends.values()]
    mapping = [v["mapping_err_ns"] for v in values.values()]
    print(f"{worker.__name__}: step {r['step_ns'] / 1e6:.3f} ms vs job {job_step_ns / 1e6:.3f} ms, {got}, "
          f"widest prof.step() {max(widths) / 1e6:.3f} ms, clock mapping errors {mapping} ns")  # fmt: skip
    assert r["samples_per_step"] == global_samples
    # within TOLERANCE of the job's clock, wherever inside the job's brackets perfscope read it (a
    # prof.step() call took 12-23 ms now and then on the loaded 2 cores: half of that, at an edge of
    # the window, is 1% of it)
    assert lo / steps * (1 - TOLERANCE) <= r["step_ns"] <= hi / steps * (1 + TOLERANCE), got
    rate = r["throughput_samples_per_s"]
    assert global_samples * steps / (hi / 1e9) * (1 - TOLERANCE) <= rate, got
    assert rate <= global_samples * steps / (lo / 1e9) * (1 + TOLERANCE), got
    if old_fails:  # the jitter is large enough that the sum of maxima cannot pass
        assert old > job * (1 + OLD_OVERSTATES), got
    return got


def test_ddp_with_per_rank_jitter_matches_the_jobs_wall_clock(tmp_path: Path) -> None:
    _check(tmp_path, ddp_worker, 2 * BATCH)


def test_parameter_averaging_every_4th_step_matches_the_jobs_wall_clock(tmp_path: Path) -> None:
    _check(tmp_path, paramavg_worker, 2 * BATCH)


def test_a_two_stage_pipeline_matches_the_jobs_wall_clock(tmp_path: Path) -> None:
    _check(tmp_path, pipeline_worker, BATCH)  # one global batch passes through both stages


def test_a_parameter_server_matches_the_jobs_wall_clock(tmp_path: Path) -> None:
    # one worker: the server records no steps, so the old sum over the worker's steps was its span
    _check(tmp_path, ps_worker, BATCH, old_fails=False)
