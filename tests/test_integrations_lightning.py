"""The Lightning callback in a real `Trainer(accelerator="cpu", devices=2, strategy="ddp")` (its
launcher starts the second rank by re-running the script), with gradient accumulation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import perfscope
from perfscope.cli import main

pytest.importorskip("lightning")

SCRIPT = """
import sys
import torch
import lightning.pytorch as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from perfscope.integrations.lightning import PerfscopeCallback


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 2, (64,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, accumulate_grad_batches=2,
        callbacks=[PerfscopeCallback(sys.argv[1], experiment="lit", poll_hz=0, export_to="tensorboard",
                                     export_destination=sys.argv[2])],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(data, batch_size=4))
    print("fitted", trainer.global_rank, flush=True)
"""


def test_lightning_ddp_two_ranks_with_accumulation(tmp_path: Path) -> None:
    script = tmp_path / "lit.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "S"), str(tmp_path / "tb")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(out.stdout.split()) == ["0", "1", "fitted", "fitted"]
    with perfscope.open_store(tmp_path / "S") as store:
        runs = store.query("SELECT experiment, world_size, backend, param_count FROM runs").to_pylist()
        assert runs == [
            {
                "experiment": "lit",
                "world_size": 2,
                "backend": "gloo",
                "param_count": 16 * 32 + 32 + 32 * 2 + 2,
            }
        ]
        steps = store.query(
            "SELECT rank, count(*) AS n, min(samples) AS smin, max(samples) AS smax, min(forward_ns) AS f, "
            "min(backward_ns) AS b, min(optimizer_ns) AS o, sum(comm_count) AS comm "
            "FROM steps GROUP BY rank ORDER BY rank"
        ).to_pylist()
        # 32 samples per rank in batches of 4, two batches per optimizer update: 4 steps of 8 samples
        assert [(s["rank"], s["n"], s["smin"], s["smax"]) for s in steps] == [(0, 4, 8, 8), (1, 4, 8, 8)]
        assert all(s["f"] > 0 and s["b"] > 0 and s["o"] > 0 for s in steps)
        assert all(s["comm"] >= 4 for s in steps)  # DDP's buckets, watched through the strategy's model
        fwd = store.query(
            "SELECT rank, step, count(*) AS n FROM spans WHERE name = 'forward' GROUP BY ALL"
        ).to_pylist()
        assert {f["n"] for f in fwd if f["step"] < 4} == {2}  # two micro-batches in every step
    assert main(["analyze", str(tmp_path / "S")]) == 0
    # rank 0 sent the run to TensorBoard once every rank had finished: both ranks' steps are in it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list((tmp_path / "tb").iterdir())
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("perfscope/forward_ms")] == [0, 1, 2, 3]
    assert acc.Scalars("perfscope/summary/world_size")[0].value == 2
