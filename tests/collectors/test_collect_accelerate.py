"""HF Accelerate (issue 32): `accelerate launch` starts the ranks through torchrun, so a job is
recorded like a torchrun job, both ways: a script with no perfscope in it under
`perfscope run -- accelerate launch ...`, and a script that opens perfscope.profile itself under
`accelerate launch`. Real 2-process gloo jobs (Accelerate's MULTI_CPU) on the CPU.

Each rank writes its own view of the job (its steps, their perf_counter times, its batches and the
model's gradient bytes): the steps, samples, DDP buckets and step times perfscope recorded are
checked against it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from perfscope import open_store

WORLD = 2
BATCH = 8
SAMPLES = 256  # 16 batches of 8 per rank
BIN = Path(sys.executable).parent
ROOT = str(Path(__file__).resolve().parents[2])

#: the training script; PROFILED = 1 opens perfscope.profile itself
SCRIPT = """
import json
import time

import torch
from torch import nn
from accelerate import Accelerator

acc = Accelerator(cpu=True)
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 32), torch.randint(0, 4, (SAMPLES,)))
loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
model, opt, loader = acc.prepare(model, opt, loader)
grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())


def train(prof=None):
    times, batches = [], []
    t0 = time.perf_counter()
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        batches.append(len(x))
        t0 = t1
    return times, batches


if PROFILED:
    import perfscope

    with perfscope.profile("S", poll_hz=0, gpu_telemetry=False, batch_size=BATCH) as prof:
        prof.watch(model)
        times, batches = train(prof)
else:
    times, batches = train()
acc.wait_for_everyone()
with open(f"rank{acc.process_index}.json", "w") as f:
    own = {"type": str(acc.distributed_type), "times": times, "batches": batches, "grad_bytes": grad_bytes}
    json.dump(own, f)
print("done", flush=True)
"""


def _launch(tmp_path: Path, profiled: bool) -> list[dict[str, Any]]:
    (tmp_path / "job.py").write_text(
        f"PROFILED = {int(profiled)}\nSAMPLES = {SAMPLES}\nBATCH = {BATCH}\n" + SCRIPT
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    launch = [
        str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(WORLD),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "job.py",
    ]  # fmt: skip
    args = (
        launch if profiled else [sys.executable, "-m", "perfscope.cli", "run", "--store", "S", "--", *launch]
    )
    out = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.count("done") == WORLD, out.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    "how", ["perfscope run -- accelerate launch", "accelerate launch, profile in the script"]
)
def test_accelerate_launch_is_recorded_like_torchrun(tmp_path: Path, how: str) -> None:
    own = _launch(tmp_path, profiled=how.startswith("accelerate"))
    with open_store(tmp_path / "S") as s:
        runs = s.query("SELECT run_id, world_size FROM runs").to_pylist()
        steps = s.query(
            "SELECT rank, step, step_ns, samples, comm_count FROM steps ORDER BY rank, step"
        ).to_pylist()
        buckets = s.query(
            "SELECT rank, step, sum(bytes)::BIGINT AS bytes FROM comm WHERE bucket IS NOT NULL GROUP BY ALL"
        ).to_pylist()
    assert len(runs) == 1 and runs[0]["world_size"] == WORLD, runs  # one run of both ranks
    for rank, mine in enumerate(own):
        assert mine["type"] == "DistributedType.MULTI_CPU", mine["type"]
        rows = [r for r in steps if r["rank"] == rank]
        # one step per batch the rank trained on, each with its samples and one DDP bucket
        assert len(rows) == len(mine["times"]) == SAMPLES // WORLD // BATCH, rows
        assert [r["samples"] for r in rows] == mine["batches"]
        assert {r["comm_count"] for r in rows} == {1}, rows
        assert {b["bytes"] for b in buckets if b["rank"] == rank} == {mine["grad_bytes"]}
        # step times against the script's own perf_counter around each iteration (the first one
        # holds perfscope's start on one side and not the other): medians within 25%
        ours = statistics.median(r["step_ns"] / 1e9 for r in rows[1:])
        theirs = statistics.median(mine["times"][1:])
        assert abs(ours - theirs) <= 0.25 * theirs, (ours, theirs)
