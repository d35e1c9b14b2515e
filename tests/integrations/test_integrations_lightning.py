"""The Lightning callback in a real `Trainer(accelerator="cpu", devices=2, strategy="ddp")` (its
launcher starts the second rank by re-running the script), with gradient accumulation."""

from __future__ import annotations

import json
import os
import re
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
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.log("mean_loss", loss, on_step=False, on_epoch=True, sync_dist=True)  # reduced over ranks
        return loss

    def on_train_epoch_end(self):
        self.all_gather(torch.ones(1))  # a collective of the module's own, on every rank

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
    # the ranks share one stdout: their lines may interleave
    assert sorted(re.findall(r"fitted (\d)", out.stdout)) == ["0", "1"], out.stdout
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
        logged = store.query("SELECT rank, step FROM metrics WHERE name = 'train_loss'").to_pylist()
        assert sorted((r["rank"], r["step"]) for r in logged) == [(0, 0), (0, 1), (0, 2), (0, 3)]  # rank 0's
        # the epoch value reduced over both ranks (sync_dist) is read once every rank has reduced it:
        # reading it first on rank 0 alone would pair its collective with the module's all_gather
        (mean,) = store.query("SELECT rank, value FROM metrics WHERE name = 'mean_loss'").to_pylist()
        assert mean["rank"] == 0 and 0 < mean["value"] < 5
    assert main(["analyze", str(tmp_path / "S")]) == 0
    # rank 0 sent the run to TensorBoard once every rank had finished: both ranks' steps are in it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list((tmp_path / "tb").iterdir())
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("perfscope/forward_ms")] == [0, 1, 2, 3]
    assert acc.Scalars("perfscope/summary/world_size")[0].value == 2


LOGGING_SCRIPT = """
import json
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
        self.sent = []  # (what, optimizer steps so far, name, value): what the module logged

    def _send(self, what, name, value):
        self.sent.append((what, self.trainer.global_step, name, float(value)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = nn.functional.cross_entropy(out, y)
        acc = (out.argmax(1) == y).float().mean()
        self.log("train_loss", loss)  # on_step only (training_step's default)
        self.log_dict({"train_acc": acc}, on_step=True, on_epoch=True)  # train_acc_step, train_acc_epoch
        self._send("step", "train_loss", loss)
        self._send("step", "train_acc", acc)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss)  # on_epoch (validation's default): the mean over the batches
        if not self.trainer.sanity_checking:
            self._send("val", "val_loss", loss)

    def on_train_epoch_end(self):
        self.log("epoch_mark", float(self.current_epoch) + 0.5)  # after the callbacks' hook
        self._send("late", "epoch_mark", float(self.current_epoch) + 0.5)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 16), torch.randint(0, 2, (48,)))
    model = Model()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=50,
        callbacks=[PerfscopeCallback(sys.argv[1], experiment="lit-log", poll_hz=0)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
    print(json.dumps(model.sent))
"""


def test_lightning_logged_values_are_the_runs_metrics(tmp_path: Path) -> None:
    """Issue 21: `self.log(...)` values were not recorded. Every optimizer step's logged values
    (under accumulation the last batch's, as Lightning's loggers get them, whatever
    log_every_n_steps), the epoch-level means and the validation means are the run's metrics,
    each once, equal to what the module logged."""
    script = tmp_path / "lit_log.py"
    script.write_text(textwrap.dedent(LOGGING_SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "S")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    sent = json.loads(out.stdout.strip().splitlines()[-1])
    with perfscope.open_store(tmp_path / "S") as store:
        rows = store.query("SELECT rank, step, name, value FROM metrics ORDER BY ts_ns").to_pylist()
        n_steps = store.query("SELECT count(*) AS n FROM steps").to_pylist()[0]["n"]
    assert n_steps == 12  # 2 epochs of 12 batches, 2 batches per optimizer step
    assert {r["rank"] for r in rows} == {0}
    got: dict[str, list[float]] = {}
    for r in rows:
        got.setdefault(r["name"], []).append(r["value"])
    assert set(got) == {"train_loss", "train_acc_step", "train_acc_epoch", "val_loss", "epoch_mark"}
    # step level: the value of the last batch of each optimizer step, once per step
    by_step: dict[tuple[str, int], float] = {}
    for what, step, name, value in sent:
        if what == "step":
            by_step[(name, step)] = value  # a later batch of the same step overwrites
    losses = [v for (n, _), v in sorted(by_step.items()) if n == "train_loss"]
    accs = [v for (n, _), v in sorted(by_step.items()) if n == "train_acc"]
    assert got["train_loss"] == pytest.approx(losses, rel=1e-6) and len(losses) == n_steps
    assert got["train_acc_step"] == pytest.approx(accs, rel=1e-6)
    assert [r["step"] for r in rows if r["name"] == "train_loss"] == list(range(n_steps))
    # epoch level: Lightning's mean over the epoch's batches (all of batch size 4)
    epoch_accs = [v for what, _, n, v in sent if what == "step" and n == "train_acc"]
    assert got["train_acc_epoch"] == pytest.approx([sum(epoch_accs[:12]) / 12, sum(epoch_accs[12:]) / 12])
    vals = [v for what, _, _, v in sent if what == "val"]
    assert got["val_loss"] == pytest.approx([sum(vals[:6]) / 6, sum(vals[6:]) / 6], rel=1e-6)
    assert got["epoch_mark"] == [0.5, 1.5]  # logged in the module's own epoch-end hook
