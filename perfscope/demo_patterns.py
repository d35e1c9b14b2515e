"""Training jobs that communicate other than through DDP, instrumented only with `profile`, `steps`,
`phase` and `watch` as a new user would: FSDP2, a two-stage send/recv pipeline, a parameter server,
and local SGD (parameter averaging every k steps). `perfscope demo --pattern` records them; the
collector tests run them. Each rank returns what it measured itself around its communication calls
(perf_counter), so a test can hold the recording against it."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

PATTERNS = ("fsdp", "pipeline", "ps", "paramavg")
FEATURES = 64
HIDDEN = 256


def _init(rank: int, world_size: int) -> Any:
    import torch
    import torch.distributed as dist

    torch.manual_seed(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    return dist


class _Timer:
    """perf_counter around the job's own communication calls, summed per step."""

    def __init__(self) -> None:
        self.per_step_ns: list[int] = []
        self._cur = 0

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        self._cur += time.perf_counter_ns() - t0
        return out

    def end_step(self) -> None:
        self.per_step_ns.append(self._cur)
        self._cur = 0


def _mlp(layers: int = 3) -> Any:
    import torch.nn as nn

    mods: list[Any] = [nn.Linear(FEATURES, HIDDEN), nn.ReLU()]
    for _ in range(layers - 2):
        mods += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    mods.append(nn.Linear(HIDDEN, FEATURES))
    return nn.Sequential(*mods)


def _train_step(prof: Any, model: Any, opt: Any, batch: int) -> None:
    import torch

    x = torch.randn(batch, FEATURES)
    with prof.phase("forward"):
        loss = model(x).square().mean()
    with prof.phase("backward"):
        loss.backward()
    with prof.phase("optimizer"):
        opt.step()
        opt.zero_grad()


def fsdp_worker(rank: int, world_size: int, store: str, options: dict[str, Any]) -> dict[str, Any]:
    """FSDP2: fully_shard on each Linear layer and the root; all-gathers in forward and backward,
    reduce-scatters in backward."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import perfscope

    dist = _init(rank, world_size)
    model = _mlp(options.get("layers", 4))
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    for m in linears:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = options.get("batch", 32)
    with perfscope.profile(store, experiment="pattern-fsdp", batch_size=batch, poll_hz=0,
                           gpu_telemetry=False, **options.get("profile", {})) as prof:  # fmt: skip
        prof.watch(model)
        run_id = prof.run_id
        for _ in range(options.get("steps", 8)):
            _train_step(prof, model, opt, batch)
            prof.step()
    # what each all-gather carries: every fully_shard group's padded unsharded bytes
    shard_bytes = [
        sum(p.to_local().numel() * p.element_size() for p in m.parameters())  # type: ignore[attr-defined]
        for m in linears
    ]
    dist.destroy_process_group()
    return {"run_id": run_id, "shard_bytes": shard_bytes}


def pipeline_worker(rank: int, world_size: int, store: str, options: dict[str, Any]) -> dict[str, Any]:
    """Two stages, GPipe: stage 0 sends m micro-batches' activations forward, then receives their
    gradients; stage 1 receives, computes the loss, and sends gradients back. `slow_stage` does
    `slow_factor` times the work of the other."""
    import torch

    import perfscope

    dist = _init(rank, world_size)
    micro, micro_batch = options.get("micro_batches", 4), options.get("micro_batch", 16)
    repeat = options.get("slow_factor", 3) if rank == options.get("slow_stage", 1) else 1
    stage = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(repeat)])
    opt = torch.optim.SGD(stage.parameters(), lr=0.001)
    timer = _Timer()
    role = f"stage:{rank}" if options.get("role", True) else None
    extra: dict[str, Any] = {"role": role} if role else {}
    if options.get("global_batch", True):  # else perfscope counts the samples once per global batch
        extra["global_batch_size"] = micro * micro_batch
    with perfscope.profile(store, experiment="pattern-pipeline", batch_size=micro * micro_batch,
                           poll_hz=0, gpu_telemetry=False, **extra) as prof:  # fmt: skip
        run_id = prof.run_id
        for _ in range(options.get("steps", 8)):
            acts, outs = [], []
            with prof.phase("forward"):
                for _ in range(micro):
                    if rank == 0:
                        x = torch.randn(micro_batch, HIDDEN)
                    else:
                        x = torch.empty(micro_batch, HIDDEN)
                        timer(dist.recv, x, 0)
                        x.requires_grad_(True)
                    y = stage(x)
                    acts.append(x)
                    outs.append(y)
                    if rank == 0:
                        timer(dist.send, y.detach(), 1)
            with prof.phase("backward"):
                for x, y in zip(acts, outs, strict=True):
                    if rank == 0:
                        g = torch.empty_like(y)
                        timer(dist.recv, g, 1)
                        y.backward(g)
                    else:
                        y.square().mean().backward()
                        timer(dist.send, x.grad, 0)
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.step()
            timer.end_step()
    dist.destroy_process_group()
    return {"run_id": run_id, "comm_per_step_ns": timer.per_step_ns}


def ps_worker(rank: int, world_size: int, store: str, options: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 serves: receives each worker's gradients, updates, sends the parameters back; it has
    no steps. Workers push gradients and pull parameters every step."""
    import torch

    import perfscope

    dist = _init(rank, world_size)
    model = _mlp(3)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    steps, batch = options.get("steps", 8), options.get("batch", 32)
    timer = _Timer()
    role = ("server" if rank == 0 else "worker") if options.get("role", True) else None
    extra = {"role": role} if role else {}
    with perfscope.profile(store, experiment="pattern-ps", batch_size=batch, poll_hz=0,
                           gpu_telemetry=False, **extra) as prof:  # fmt: skip
        run_id = prof.run_id
        if rank == 0:
            grad = torch.empty_like(flat)
            for _ in range(steps * (world_size - 1)):
                src = dist.recv(grad)  # any worker
                flat -= 0.01 * grad
                for _ in range(options.get("server_work", 1)):
                    flat.mul_(1.0).add_(0.0)  # the update's cost, scaled to overload the server
                dist.send(flat, src)
        else:
            prof.watch(model)
            for _ in range(steps):
                x = torch.randn(batch, FEATURES)
                with prof.phase("forward"):
                    loss = model(x).square().mean()
                with prof.phase("backward"):
                    loss.backward()
                g = torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters())
                timer(dist.send, g, 0)  # push
                timer(dist.recv, flat, 0)  # pull
                torch.nn.utils.vector_to_parameters(flat, model.parameters())
                model.zero_grad()
                prof.step()
                timer.end_step()
    dist.destroy_process_group()
    return {"run_id": run_id, "comm_per_step_ns": timer.per_step_ns}


def paramavg_worker(rank: int, world_size: int, store: str, options: dict[str, Any]) -> dict[str, Any]:
    """Local SGD: every rank trains alone and all-reduces its parameters every `every` steps."""
    import torch

    import perfscope

    dist = _init(rank, world_size)
    model = _mlp(options.get("layers", 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    every, batch = options.get("every", 4), options.get("batch", 32)
    timer = _Timer()
    with perfscope.profile(store, experiment="pattern-paramavg", batch_size=batch, poll_hz=0,
                           gpu_telemetry=False) as prof:  # fmt: skip
        prof.watch(model)
        run_id = prof.run_id
        for i in range(options.get("steps", 12)):
            _train_step(prof, model, opt, batch)
            if i % every == every - 1:
                with torch.no_grad():
                    for p in model.parameters():
                        timer(dist.all_reduce, p.data)
                        p.data /= world_size
            prof.step()
            timer.end_step()
    dist.destroy_process_group()
    return {"run_id": run_id, "comm_per_step_ns": timer.per_step_ns, "every": every}


def async_worker(rank: int, world_size: int, store: str, options: dict[str, Any]) -> dict[str, Any]:
    """An all_reduce issued with async_op=True, overlapped with compute, then waited for."""
    import torch

    import perfscope

    dist = _init(rank, world_size)
    a = torch.randn(192, 192)
    with perfscope.profile(store, experiment="pattern-async", poll_hz=0, gpu_telemetry=False) as prof:
        run_id = prof.run_id
        for _ in range(options.get("steps", 6)):
            t = torch.ones(1 << 20)
            with prof.phase("backward"):
                work = dist.all_reduce(t, async_op=True)
                for _ in range(options.get("compute", 30)):
                    a = torch.tanh(a @ a)
                work.wait()
            prof.step()
    dist.destroy_process_group()
    return {"run_id": run_id, "is_work": True}


#: pattern -> (worker, world size, options of the full and the quick version)
PLANS: dict[str, tuple[Any, int, dict[str, Any], dict[str, Any]]] = {
    "fsdp": (fsdp_worker, 2, {"steps": 40}, {"steps": 12}),
    "pipeline": (pipeline_worker, 2, {"steps": 40, "micro_batches": 4}, {"steps": 12}),
    "ps": (ps_worker, 3, {"steps": 40}, {"steps": 12}),
    "paramavg": (paramavg_worker, 2, {"steps": 40, "every": 4}, {"steps": 16, "every": 4}),
}
RUN_TIMEOUT_S = 600.0


def _rank_entry(
    rank: int, pattern: str, world_size: int, port: int, store: str, options: dict[str, Any]
) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    PLANS[pattern][0](rank, world_size, store, options)


def run_pattern(store: str, pattern: str, *, quick: bool = False) -> tuple[int, dict[str, Any]]:
    """Record one pattern's job into `store` (gloo on the CPU); returns (world size, options)."""
    import socket

    import torch.multiprocessing as mp

    from .errors import PerfscopeError

    _, world, full, small = PLANS[pattern]
    options = small if quick else full
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "perfscope", "perfscope.demo_patterns"])
    job = mp.start_processes(
        _rank_entry, args=(pattern, world, port, store, options), nprocs=world, join=False,
        start_method="forkserver",
    )  # fmt: skip
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not job.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise PerfscopeError(f"demo --pattern {pattern} took over {RUN_TIMEOUT_S:.0f} s")
    except mp.ProcessRaisedException as exc:
        raise PerfscopeError(
            f"demo --pattern {pattern} failed in a rank; its error follows", exit_code=1, detail=str(exc)
        ) from None
    except mp.ProcessExitedException as exc:
        raise PerfscopeError(f"demo --pattern {pattern} failed: {exc}", exit_code=1) from None
    finally:
        for p in job.processes:
            if p.is_alive():
                p.kill()
    return world, options
