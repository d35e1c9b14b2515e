"""The Hugging Face callback in a real Trainer on CPU: a tiny GPT-2 built from a config (never a
download), gradient accumulation, evaluation between steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import perfscope
from perfscope.cli import main

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_trainer_on_cpu_with_accumulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from perfscope.integrations.transformers import PerfscopeCallback

    for key in [k for k in os.environ if k.startswith("PERFSCOPE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=16))
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 97, (16,), generator=gen) for _ in range(40)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, disable_tqdm=True,
    )  # fmt: skip
    store = tmp_path / "S"
    trainer = Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data[:8],
        callbacks=[PerfscopeCallback(store, experiment="hf", poll_hz=0, export_to="tensorboard",
                                     export_destination=str(tmp_path / "tb"))],
    )  # fmt: skip
    trainer.train()
    with perfscope.open_store(store) as st:
        runs = st.query("SELECT experiment, world_size, param_count FROM runs").to_pylist()
        assert runs == [
            {"experiment": "hf", "world_size": 1, "param_count": sum(p.numel() for p in model.parameters())}
        ]
        steps = st.query(
            "SELECT step, samples, forward_ns, backward_ns, optimizer_ns FROM steps ORDER BY step"
        ).to_pylist()
        assert [s["step"] for s in steps] == [0, 1, 2]  # max_steps optimizer updates
        assert all(s["samples"] == 8 for s in steps)  # two micro-batches of 4
        assert all(s["forward_ns"] > 0 and s["backward_ns"] > 0 and s["optimizer_ns"] > 0 for s in steps)
        fwd = st.query(
            "SELECT step, count(*) AS n FROM spans WHERE name = 'forward' GROUP BY step"
        ).to_pylist()
        assert {f["step"]: f["n"] for f in fwd} == {0: 2, 1: 2, 2: 2}  # evaluation forwards are not training
        losses = st.query("SELECT count(*) AS n FROM metrics WHERE name = 'loss'").to_pylist()[0]["n"]
        assert losses >= 3  # Trainer's logs become metrics
    assert main(["analyze", str(store)]) == 0
    # sent to TensorBoard when training ended, read back with its own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list((tmp_path / "tb").iterdir())
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("perfscope/forward_ms")] == [0, 1, 2]
    assert acc.Scalars("perfscope/step_ms")[0].value > 0
    assert not model._forward_hooks and not model._forward_pre_hooks  # nothing left behind after train()


TORCHRUN_SCRIPT = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from perfscope.integrations.transformers import PerfscopeCallback

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=16))
gen = torch.Generator().manual_seed(0)
rows = [torch.randint(0, 97, (16,), generator=gen) for _ in range(64)]
args = TrainingArguments(
    output_dir=sys.argv[2], per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
    use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, ddp_backend="gloo",
)
trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
                  callbacks=[PerfscopeCallback(sys.argv[1], experiment="hf-ddp", poll_hz=0)])
trainer.train()
"""


def test_trainer_ddp_under_torchrun_records_buckets(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "hf.py").write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_DISABLED="true")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "hf.py", "S", "out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    with perfscope.open_store(tmp_path / "S") as st:
        assert st.query("SELECT world_size, backend FROM runs").to_pylist() == [
            {"world_size": 2, "backend": "gloo"}
        ]
        steps = st.query(
            "SELECT rank, count(*) AS n, min(samples) AS s, min(backward_ns) AS b "
            "FROM steps GROUP BY rank ORDER BY rank"
        ).to_pylist()
        assert [(r["rank"], r["n"], r["s"]) for r in steps] == [(0, 4, 8), (1, 4, 8)]
        assert all(r["b"] > 0 for r in steps)
        # the DDP wrapper Trainer made was found and watched: one bucket allreduce per update (the
        # first micro-batch of each step runs under no_sync)
        buckets = st.query(
            "SELECT rank, count(*) AS n FROM comm WHERE bucket IS NOT NULL GROUP BY rank ORDER BY rank"
        ).to_pylist()
        assert buckets == [{"rank": 0, "n": 4}, {"rank": 1, "n": 4}]


def _train(store: Path, out: Path, experiment: str, **args: object) -> None:
    """A tiny GPT-2 learning a few repeated token patterns, logged every step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from perfscope.integrations.transformers import PerfscopeCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=16))
    rows = [torch.arange(16) % 5 + 5 * (i % 3) for i in range(64)]
    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=30, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, **args,  # type: ignore[arg-type]
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=targs, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
        callbacks=[PerfscopeCallback(store, experiment=experiment, poll_hz=0)],
    )  # fmt: skip
    trainer.train()


def test_logged_trainer_divergence_is_judged_on_the_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21: a Trainer run logging every step (loss, grad_norm, learning_rate with a warm-up,
    epoch, then train_runtime, total_flos, *_per_second) was reported diverged. A run whose loss and
    grad norm fall has no divergence finding and only its loss is a time-to-target metric; a run
    whose loss really grows (learning rate 1.0) gets the finding, on its loss."""
    from perfscope.analysis import Selection, run_analysis
    from perfscope.explain import explain

    for key in [k for k in os.environ if k.startswith("PERFSCOPE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_DISABLED", "true")
    store = tmp_path / "S"
    _train(store, tmp_path / "a", "healthy", learning_rate=1e-2, warmup_steps=6)
    _train(store, tmp_path / "b", "too-hot", learning_rate=1.0, lr_scheduler_type="constant")
    with perfscope.open_store(store) as st:
        logged = st.query(
            "SELECT r.experiment, m.name, arg_min(m.value, m.step) AS first, count(*) AS n, "
            "avg(m.value) FILTER (WHERE m.step >= 20) AS tail "  # the mean of the last third
            "FROM metrics m JOIN runs r USING (run_id) GROUP BY ALL"
        ).to_pylist()
        curves = {(r["experiment"], r["name"]): r for r in logged}
        # what the Trainer logged is recorded, bookkeeping included
        assert {"grad_norm", "learning_rate", "epoch", "train_runtime", "total_flos"} <= {
            n for _, n in curves
        }
        ok_loss, ok_norm = curves[("healthy", "loss")], curves[("healthy", "grad_norm")]
        assert ok_loss["n"] >= 30 and ok_loss["tail"] < 0.8 * ok_loss["first"]
        assert ok_norm["tail"] < ok_norm["first"]  # the grad norm falls
        hot = curves[("too-hot", "loss")]
        assert hot["tail"] > 2 * hot["first"]  # the loss really grows (clipped gradients: no NaN)
        ttm = run_analysis("time_to_metric", st, Selection()).to_pylist()
        findings = [f for f in explain(st, Selection()) if f.rule == "diverged"]
    assert {r["metric"] for r in ttm} <= {"loss", "train_loss"}
    diverged = {(r["experiment"], r["metric"]) for r in ttm if r["diverged"]}
    assert diverged == {("too-hot", "loss")}
    (f,) = findings
    assert "too-hot" in f.title and "(loss " in f.text and "grad_norm" not in f.text
