"""Helpers of the collector tests: real multi-process gloo jobs with free ports and bounded waits."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import random
import socket
import sys
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

JOIN_TIMEOUT_S = 120.0
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "perfscope", "collect_helpers"]


#: ports handed out in this process: never twice (a job's store may still hold its port)
_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (where a connecting socket's port comes from)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the ephemeral range. A port the kernel hands out (bind to 0) is free when
    asked, but between that and the job's bind, the many sockets of gloo jobs running beside it (each
    connection takes an ephemeral port) can take it: EADDRINUSE in init_process_group. Ports below the
    range are only ever taken by a bind that names them."""
    rnd = random.SystemRandom()
    high = _ephemeral_low() - 1
    for _ in range(200):
        port = rnd.randint(max(1024, high - 12000), high)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # the range below is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    q: Any,
    dump_after_s: float | None,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if dump_after_s:
        # a rank still alive just before run_ranks kills it prints where each of its threads is
        # (the test's captured stderr shows it): a hang is then a stack, not only an exit code
        faulthandler.dump_traceback_later(dump_after_s, exit=False)
    try:
        q.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise


def start_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, dump_after_s: float | None = None
) -> tuple[list[Any], Any]:
    """Start fn(rank, world_size, *args) in `world_size` processes of the fork server; the processes
    and the queue each puts its (rank, status, value) on. The caller joins (or kills) them. A rank
    still running after `dump_after_s` prints its Python stacks to stderr."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, q, dump_after_s))
        for r in range(world_size)
    ]
    # Streamlit's AppTest (another test in this process) can leave __main__ pointing at a script
    # that no longer exists; a child would re-run __main__'s file before the target. Start them
    # from a plain __main__.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        for p in procs:
            p.start()
    finally:
        sys.modules["__main__"] = main
    return procs, q


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = JOIN_TIMEOUT_S
) -> dict[int, Any]:
    """Run fn(rank, world_size, *args) in `world_size` fresh processes (like mp.spawn, which sets no
    launcher environment). Returns {rank: ("ok", result) | ("error", traceback) | ("exit", code)}.
    Every process is joined with a deadline and killed after it, so a test never hangs.

    The processes come from a fork server that imported torch once (the import costs seconds per
    process on 2 cores); it forks before any thread of torch exists."""
    procs, q = start_ranks(fn, world_size, *args, dump_after_s=max(1.0, timeout_s - 5.0))
    results: dict[int, Any] = {}
    import queue
    import time

    deadline = time.monotonic() + timeout_s
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=0.5)
            results[rank] = (status, value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    for r, p in enumerate(procs):
        results.setdefault(r, ("exit", p.exitcode))
    return results


def results_ok(results: dict[int, Any]) -> dict[int, Any]:
    """run_ranks' results when every rank returned; fails the test with the first rank that did not."""
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {status}: {value}"
    return {r: v for r, (_, v) in results.items()}


# -- the workload of the DDP tests ------------------------------------------------------------------
def make_model() -> Any:
    import torch.nn as nn

    # ~40k parameters in 6 tensors: several DDP buckets with bucket_cap_mb=0.05
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 96), nn.ReLU(), nn.Linear(96, 10))


def make_loader(rank: int, world_size: int, batch_size: int, samples: int = 512) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    ds = TensorDataset(x, y)
    sampler: DistributedSampler[Any] = DistributedSampler(
        ds, num_replicas=world_size, rank=rank, shuffle=False
    )
    return DataLoader(ds, batch_size=batch_size, sampler=sampler)


def ddp_worker(rank: int, world_size: int, store: str, options: dict[str, Any]) -> dict[str, Any]:
    """Train a small model with DDP on gloo under perfscope.profile; options: steps, die_rank,
    die_at, comm_hook ('fp16'), register_before_watch (register that hook on DDP, not through
    watch), manual_sync (average gradients by hand instead of DDP), threads (torch intra-op threads,
    default 1), env (environment variables to set; None unsets one), ddp (keywords of DDP, default
    bucket_cap_mb=0.05), autocast (run the forward under torch.autocast('cpu', bfloat16)), watch
    (False: no prof.watch, the profiler's DDP finder finds the model)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import perfscope

    for name, value in options.get("env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.manual_seed(0)
    torch.set_num_threads(options.get("threads", 1))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    model = make_model()
    manual = options.get("manual_sync", False)
    ddp_kwargs = {"bucket_cap_mb": 0.05, **options.get("ddp", {})}
    net = model if manual else nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    hook = None
    if options.get("comm_hook") == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        hook = fp16_compress_hook
        if options.get("register_before_watch"):  # the user registered it directly on DDP
            net.register_comm_hook(None, fp16_compress_hook)
            hook = None
    steps = options.get("steps", 6)
    out: dict[str, Any] = {"grads": None, "error": None}
    try:
        with perfscope.profile(
            store, experiment="ddp-test", batch_size=8, poll_hz=20, gpu_telemetry=False, scaling_mode="weak"
        ) as prof:
            if options.get("watch", True):
                prof.watch(net, comm_hook=hook)
            out["run_id"] = prof.run_id
            cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.get("autocast", False))
            for i, (x, y) in enumerate(prof.steps(make_loader(rank, world_size, 8))):
                if i >= steps:
                    break
                with prof.phase("forward"):
                    if rank == options.get("die_rank") and i == options.get("die_at"):
                        os._exit(3)  # a rank killed mid-run: no cleanup of any kind
                    with cast:
                        loss = nn.functional.cross_entropy(net(x).float(), y)
                with prof.phase("backward"):
                    loss.backward()
                if manual:
                    with prof.phase("sync"):
                        for p in model.parameters():
                            prof.all_reduce(p.grad, average=True)
                # numpy, not tensors: torch would pass tensors through shared memory that dies with us
                out["grads"] = (
                    torch.cat([p.grad.detach().flatten() for p in model.parameters()]).numpy().copy()
                )
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                prof.log(loss=loss.item())
    except RuntimeError as exc:  # a peer died: the collective fails, our side must finish cleanly
        out["error"] = type(exc).__name__
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    # a peer's death included: a process group left to the interpreter's exit can abort it
    # ("terminate called without an active exception") with gloo's threads still running
    dist.destroy_process_group()
    return out
