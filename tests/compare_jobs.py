"""The jobs of the `perfscope compare` tests (issue 34): 2-rank DDP on gloo recorded by perfscope.profile,
each rank's forward holding WORK_S of sleep as its work (a length that holds on a loaded machine), with
rank 1 optionally sleeping EXTRA_S more in every forward, and the loader's num_workers as given."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from collect_helpers import make_model, results_ok, run_ranks

#: 10 warm-up steps (left out) and 60 steady ones: enough that one stall of the loaded host does not
#: swamp the interval
STEPS = 70
BATCH = 8
#: every rank's forward holds this much work ...
WORK_S = 0.030
#: ... and the slow rank's this much more: a third of the step, far above the steps' noise
EXTRA_S = 0.010


def job(rank: int, world_size: int, store: str, options: dict[str, Any]) -> str:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import perfscope

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    net = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    n = BATCH * world_size * STEPS
    ds = TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    workers = options.get("num_workers", 0)
    loader = DataLoader(
        ds, batch_size=BATCH, sampler=DistributedSampler(ds, shuffle=False), num_workers=workers,
        persistent_workers=workers > 0,
    )  # fmt: skip
    extra = EXTRA_S if rank == options.get("slow_rank") else 0.0
    with perfscope.profile(
        store, experiment="compare", batch_size=BATCH, poll_hz=5, gpu_telemetry=False
    ) as prof:
        prof.watch(net)
        run_id = prof.run_id
        for x, y in prof.steps(loader):
            with prof.phase("forward"):
                time.sleep(WORK_S + extra)
                loss = criterion(net(x), y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    dist.destroy_process_group()
    return str(run_id)


def record(root: Path, batches: list[dict[str, dict[str, Any]]]) -> dict[str, Path]:
    """Each batch's jobs recorded at the same time (a pair compared is recorded under the same load);
    each job into its own store under `root`, named as in its batch."""
    out: dict[str, Path] = {}
    for batch in batches:
        with ThreadPoolExecutor(len(batch)) as pool:
            jobs = {
                name: pool.submit(run_ranks, job, 2, str(root / name), opts) for name, opts in batch.items()
            }
            for name, j in jobs.items():
                results_ok(j.result())
                out[name] = root / name
    return out
