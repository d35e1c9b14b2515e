"""The `perfscope demo` workload: real DDP training of a small CNN on a generated image dataset,
spawned at several world sizes and per-rank batch sizes and recorded with perfscope.profile."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PerfscopeError

IMAGE_SIDE = 16
CLASSES = 10
#: bucket cap small enough that the demo model's gradients travel in several DDP buckets
BUCKET_CAP_MB = 0.05
RUN_TIMEOUT_S = 600.0
#: what every rank imports; DDP's constructor alone pulls in torch._dynamo (seconds on 2 cores)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "torch.utils.data",
           "torch.utils.flop_counter", "perfscope", "perfscope.collectors", "perfscope.demo"]  # fmt: skip


@dataclass(frozen=True)
class DemoPlan:
    world_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    steps: int
    dataset_samples: int

    @property
    def runs(self) -> list[tuple[int, int]]:
        """(world size, per-rank batch) of every run, in the order they are recorded."""
        return [(w, b) for b in self.batch_sizes for w in self.world_sizes]

    @property
    def total_steps(self) -> int:
        return self.steps * len(self.runs)


def plan(*, quick: bool = False) -> DemoPlan:
    if quick:
        return DemoPlan(world_sizes=(1, 2), batch_sizes=(8, 32), steps=12, dataset_samples=1024)
    # 60 steps: the analysis drops the first 10 as warm-up and keeps 50 steady-state steps
    return DemoPlan(world_sizes=(1, 2, 4), batch_sizes=(16, 64), steps=60, dataset_samples=4096)


def make_dataset(samples: int) -> Any:
    """Noisy copies of one fixed random 16x16 template per class: deterministic (seeded), learnable."""
    import torch

    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(CLASSES, 1, IMAGE_SIDE, IMAGE_SIDE, generator=g)
    labels = torch.arange(samples) % CLASSES
    images = templates[labels] + 0.8 * torch.randn(samples, 1, IMAGE_SIDE, IMAGE_SIDE, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def make_model() -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (IMAGE_SIDE // 4) ** 2, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def _epochs(loader: Any, sampler: Any, steps: int) -> Any:
    """Batches across as many epochs as `steps` needs (the sampler reshuffles each epoch)."""
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if done == steps:
                return
            done += 1
            yield batch
        epoch += 1


def train_rank(
    rank: int,
    world_size: int,
    port: int,
    store: str,
    batch: int,
    the_plan: DemoPlan,
    labels: dict[str, str],
    counter: Any,
) -> None:
    """One rank of one demo run (the target of torch.multiprocessing.start_processes)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import perfscope

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = labels["device"] == "cuda"
    # one thread per rank at every world size: the runs then differ only in their number of ranks
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from datetime import timedelta

    dist.init_process_group(
        labels["backend"], rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = make_model().to(device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[rank] if cuda else None, bucket_cap_mb=BUCKET_CAP_MB
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05 * (batch * world_size / 64) ** 0.5, momentum=0.9)
    data = make_dataset(the_plan.dataset_samples)
    sampler: Any = DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
    try:
        with perfscope.profile(
            store,
            experiment=labels["experiment"],
            batch_size=batch,
            cluster=labels["cluster"],
            scaling_mode="weak",
            dataset_samples=len(data),
            model="demo-cnn",
            tags={"demo": True},
            count_flops=True,
            gpu_telemetry=cuda,
        ) as prof:
            prof.watch(ddp)
            for images, target in prof.steps(_epochs(loader, sampler, the_plan.steps)):
                with prof.phase("forward"):
                    logits = ddp(images.to(device, non_blocking=True))
                    loss = nn.functional.cross_entropy(logits, target.to(device, non_blocking=True))
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                prof.log(loss=loss.detach(), accuracy=(logits.argmax(1) == target.to(device)).float().mean())
                if rank == 0:
                    with counter.get_lock():
                        counter.value += 1
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def labels_for(max_world: int) -> dict[str, str]:
    """Backend, device, experiment and cluster label of this machine's demo runs: NCCL on GPUs when
    there is one per rank of the largest run, else gloo on the CPU."""
    import torch

    host = socket.gethostname()
    if torch.cuda.is_available() and torch.cuda.device_count() >= max_world:
        name = torch.cuda.get_device_name(0)
        return {
            "backend": "nccl",
            "device": "cuda",
            "experiment": "demo-gpu",
            "cluster": f"{host} ({torch.cuda.device_count()}x {name})",
        }
    return {
        "backend": "gloo",
        "device": "cpu",
        "experiment": "demo-cpu",
        "cluster": f"{host} ({os.cpu_count()} cores)",
    }


Progress = Callable[[int, int, int, int, int], None]  # steps done, steps total, run index, world, batch


def run_demo(store: Path, the_plan: DemoPlan, progress: Progress | None = None) -> dict[str, str]:
    """Record every run of `the_plan` into `store`, one spawned job after the other."""
    import torch.multiprocessing as mp

    labels = labels_for(max(the_plan.world_sizes))
    # ranks share the cores: one BLAS thread each unless told otherwise
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a fork server that has imported torch once starts each rank in a fraction of a spawn's time
    # (torch's import dominates a short run); it forks before any training thread exists
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    counter = ctx.Value("i", 0)
    for index, (world, batch) in enumerate(the_plan.runs):
        args = (world, _free_port(), str(store), batch, the_plan, labels, counter)
        job = mp.start_processes(train_rank, args=args, nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while not job.join(timeout=0.2):
                if progress is not None:
                    progress(counter.value, the_plan.total_steps, index, world, batch)
                if time.monotonic() > deadline:
                    raise PerfscopeError(
                        f"demo run (world size {world}, batch {batch}) took over {RUN_TIMEOUT_S:.0f} s"
                    )
        except mp.ProcessRaisedException as exc:
            raise PerfscopeError(
                f"demo run (world size {world}, batch {batch}) failed in a rank; its error follows",
                exit_code=1,
                detail=str(exc),
            ) from None
        except mp.ProcessExitedException as exc:
            raise PerfscopeError(
                f"demo run (world size {world}, batch {batch}) failed: {exc}", exit_code=1
            ) from None
        finally:
            for p in job.processes:
                if p.is_alive():
                    p.kill()
        with counter.get_lock():
            counter.value = the_plan.steps * (index + 1)  # exact after each run
        if progress is not None:
            progress(counter.value, the_plan.total_steps, index, world, batch)
    return labels


def progress_bar(stream: Any = sys.stderr) -> Progress:
    """A one-line progress bar on `stream` (redrawn in place on a terminal, a line per run otherwise)."""
    tty = hasattr(stream, "isatty") and stream.isatty()
    last_run = [-1]

    def show(done: int, total: int, index: int, world: int, batch: int) -> None:
        frac = done / total if total else 1.0
        if tty:
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            end = "\n" if done >= total else ""
            stream.write(
                f"\r[{bar}] {frac:4.0%}  run {index + 1}: world size {world}, batch {batch}/rank {end}"
            )
            stream.flush()
        elif index != last_run[0] and done >= 0:
            last_run[0] = index
            stream.write(f"[{frac:4.0%}] run {index + 1}: world size {world}, batch {batch}/rank\n")
            stream.flush()

    return show
