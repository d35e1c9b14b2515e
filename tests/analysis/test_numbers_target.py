"""Time to accuracy (issue 11, item 4) and what `perfscope analyze` shows (item 3), on hand-built
stores: a diverged run (linear learning-rate scaling at a large batch) must not set the target,
variants (the learning-rate rule) are told apart, and a user target wins."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from storegen import make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.cli import main
from perfscope.explain import explain
from perfscope.store.open import open_store

STEPS = 60


def _decay(floor: float, rate: float):
    return lambda step: floor + (2.3 - floor) * math.exp(-rate * step)


def _diverging(step: int) -> float:
    # learns for a while, then the loss climbs back up for the rest of the run
    return 2.3 - 0.03 * step if step < 20 else 1.7 + 0.02 * (step - 20)


def _nan_after(step: int) -> float:
    return 2.3 - 0.02 * step if step < 30 else float("nan")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tta")
    runs = {
        # (batch per rank, world size, lr rule, loss curve)
        "b16-n1": (16, 1, "linear", _decay(0.30, 0.10)),
        "b32-n2-sqrt": (32, 2, "sqrt", _decay(0.35, 0.12)),
        "b32-n2-linear": (32, 2, "linear", _decay(0.40, 0.15)),
        "b64-n4-sqrt": (64, 4, "sqrt", _decay(0.45, 0.15)),
        "b256-n2-linear": (256, 2, "linear", _diverging),  # the issue's diverged run
        "b128-n4-linear": (128, 4, "linear", _nan_after),
    }
    for rid, (batch, n, rule, curve) in runs.items():
        make_run(
            root,
            rid,
            experiment="tta",
            world_size=n,
            steps=STEPS,
            batch_size_per_rank=batch,
            metrics={"loss": curve},
            tags={"lr_rule": rule, "seed": 1},
        )
    return root


def _ttm(store_path: Path, sel: Selection | None = None) -> dict[str, dict]:
    with open_store(store_path) as store:
        return {r["run_id"]: r for r in run_analysis("time_to_metric", store, sel or Selection()).to_pylist()}


def test_diverged_runs_are_detected_and_do_not_set_the_default_target(store_path: Path) -> None:
    ttm = _ttm(store_path)
    diverged = {rid: r["diverged_reason"] for rid, r in ttm.items() if r["diverged"]}
    assert diverged == {"b256-n2-linear": "moving away from its best", "b128-n4-linear": "non-finite values"}
    (target,) = {r["target"] for r in ttm.values()}
    healthy = sorted(r["best_value"] for rid, r in ttm.items() if rid not in diverged)
    # the best value that 3 of the 4 healthy runs reach (not the loosest best: the diverged run's ~1.7)
    assert target == pytest.approx(healthy[2])
    assert target < 1.0 and {r["target_source"] for r in ttm.values()} == {"default"}
    reached = {rid for rid, r in ttm.items() if r["reached"]}
    assert reached == {"b16-n1", "b32-n2-sqrt", "b32-n2-linear"}


def test_variants_are_the_tags_that_differ(store_path: Path) -> None:
    ttm = _ttm(store_path)
    assert ttm["b32-n2-sqrt"]["variant"] == "lr_rule=sqrt"
    assert ttm["b32-n2-linear"]["variant"] == "lr_rule=linear"  # seed is equal everywhere: not a variant


def test_a_user_target_wins(store_path: Path) -> None:
    ttm = _ttm(store_path, Selection(targets=(("loss", 0.5),)))
    assert {(r["target"], r["target_source"]) for r in ttm.values()} == {(0.5, "user")}
    assert {rid for rid, r in ttm.items() if r["reached"]} == {
        "b16-n1",
        "b32-n2-sqrt",
        "b32-n2-linear",
        "b64-n4-sqrt",
    }


@pytest.mark.parametrize("tag", ["loss=0.7", {"loss": 0.7}])
def test_a_target_tag_from_profile_is_used(tmp_path: Path, tag: object) -> None:
    # profile(..., target="loss=0.7") or target={"loss": 0.7} stores it as the run's `target` tag
    for rid, floor in (("a", 0.3), ("b", 0.6)):
        make_run(tmp_path, rid, steps=STEPS, metrics={"loss": _decay(floor, 0.1)}, tags={"target": tag})
    ttm = _ttm(tmp_path)
    assert {(r["target"], r["target_source"]) for r in ttm.values()} == {(0.7, "tag")}
    assert all(r["variant"] == "" for r in ttm.values())  # the target is not a variant


def test_malformed_tags_read_as_none(tmp_path: Path) -> None:
    make_run(tmp_path, "bad", steps=STEPS, metrics={"loss": _decay(0.3, 0.1)}, tags={"target": "loss=oops"})
    make_run(tmp_path, "worse", steps=STEPS, metrics={"loss": _decay(0.3, 0.1)}, tags={"x": "1"})
    ttm = _ttm(tmp_path)
    assert {r["target_source"] for r in ttm.values()} == {"default"}


def test_divergence_is_a_finding(store_path: Path) -> None:
    with open_store(store_path) as store:
        findings = [f for f in explain(store, Selection()) if f.rule == "diverged"]
    (f,) = findings
    assert set(f.evidence.run_ids) == {"b256-n2-linear", "b128-n4-linear"}
    assert "lr_rule=linear" in f.text and "diverged" in f.title


def test_analyze_shows_every_analysis(store_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(store_path), "--json", "--target", "loss=0.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format_version"] == 2
    assert {"runs", "scaling", "mfu", "batch_sweep", "time_to_metric", "findings", "evidence"} <= set(doc)
    assert {r["target"] for r in doc["time_to_metric"]} == {0.5}
    cited = {a for f in doc["findings"] for a in f["evidence"]["analyses"]}
    assert cited <= set(doc) | set(doc["evidence"])  # every analysis a finding cites is in the JSON
    assert main(["analyze", str(store_path)]) == 0
    text = capsys.readouterr().out
    for section in ("MFU", "Batch-size sweep", "Time to metric target", "lr_rule=sqrt", "diverged"):
        assert section in text


@pytest.mark.parametrize("bad", ["loss", "loss=", "=0.5", "loss=abc", "loss=nan"])
def test_a_malformed_target_is_one_line(
    store_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    assert main(["analyze", str(store_path), "--target", bad]) != 0
    err = capsys.readouterr().err
    assert "METRIC=NUMBER" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# What a Hugging Face Trainer logs every step (logging_steps=1), and once at the end of training.
def _warmup_lr(step: int) -> float:
    return 5e-3 * min(1.0, step / 10) * (1 - step / STEPS)  # linear warm-up from 0, then decay


def _grad_norm(step: int) -> float:
    return 2.5 - 0.06 * step if step < 20 else 1.3 + 0.03 * (step - 20)  # a dip, then a rise


HF_LOGS = {
    "loss": _decay(0.7, 0.08),
    "grad_norm": _grad_norm,
    "learning_rate": _warmup_lr,
    "epoch": lambda step: (step + 1) / 16,
    "total_flos": lambda step: 2.9e8,
    "train_runtime": lambda step: 40.0 - 0.1 * step,
    "train_samples_per_second": lambda step: 6.0 + 0.01 * step,
    "eval_runtime": lambda step: 1.0 + 0.02 * step,
    "eval_steps_per_second": lambda step: 30.0 - 0.3 * step,
    "loss_scale": lambda step: 65536.0 / 2 ** (step // 10),  # AMP's scaler backing off: not a loss
}


def test_bookkeeping_is_neither_a_target_nor_a_divergence(tmp_path: Path) -> None:
    """A healthy run whose loss falls: grad_norm, the learning-rate warm-up, epoch, *_runtime,
    *_per_second and total_flos move as they always do; none is a time-to-target metric, and no
    run diverged (the old rule read the learning rate leaving its warm-up 0 and the grad norm
    rising after its dip as divergence)."""
    make_run(tmp_path, "hf", experiment="hf", steps=STEPS, metrics=HF_LOGS)
    with open_store(tmp_path) as store:
        ttm = run_analysis("time_to_metric", store, Selection()).to_pylist()
        assert {r["metric"] for r in ttm} == {"loss"}
        assert not any(r["diverged"] for r in ttm)
        assert not [f for f in explain(store, Selection()) if f.rule == "diverged"]


def test_a_growing_loss_still_diverges_beside_bookkeeping(tmp_path: Path) -> None:
    make_run(tmp_path, "hf", experiment="hf", steps=STEPS, metrics={**HF_LOGS, "loss": _diverging})
    with open_store(tmp_path) as store:
        (f,) = [f for f in explain(store, Selection()) if f.rule == "diverged"]
    assert list(f.evidence.run_ids) == ["hf"] and "loss moving away from its best" in f.text
    assert "grad_norm" not in f.text and "learning_rate" not in f.text


@pytest.mark.parametrize("how", ["--target", "tag"])
def test_a_metric_the_user_names_is_judged(tmp_path: Path, how: str) -> None:
    """grad_norm is bookkeeping unless the user names it: then it is a target (its direction from
    its trend) and its moving away from its best is reported."""
    tags = {"target": "grad_norm=1.5"} if how == "tag" else {}
    make_run(tmp_path, "hf", experiment="hf", steps=STEPS, metrics=HF_LOGS, tags=tags)
    sel = Selection(targets=(("grad_norm", 1.5),)) if how == "--target" else Selection()
    with open_store(tmp_path) as store:
        ttm = {r["metric"]: r for r in run_analysis("time_to_metric", store, sel).to_pylist()}
        assert set(ttm) == {"loss", "grad_norm"}
        assert ttm["grad_norm"]["target"] == 1.5 and ttm["grad_norm"]["target_source"] == (
            "user" if how == "--target" else "tag"
        )
        assert ttm["grad_norm"]["diverged"] and not ttm["loss"]["diverged"]


@pytest.mark.parametrize(
    ("name", "direction"),
    [
        ("loss", "lower"), ("train_loss_step", "lower"), ("train_loss_epoch", "lower"), ("val/loss", "lower"),
        ("valLoss", "lower"), ("eval_perplexity", "lower"), ("wer", "lower"), ("val_acc", "higher"),
        ("trainAccuracy", "higher"), ("acc@1", "higher"), ("top5", "higher"), ("mAP50", "higher"),
        ("eval_f1", "higher"), ("rougeL", "higher"), ("grad_norm", None), ("learning_rate", None),
        ("lr", None), ("epoch", None), ("total_flos", None), ("train_runtime", None),
        ("train_samples_per_second", None), ("eval_steps_per_second", None), ("loss_scale", None),
        ("gradient_accumulation_steps", None), ("power_w", None), ("heatmap", None), ("global_step", None),
    ],
)  # fmt: skip
def test_which_names_are_targets(name: str, direction: str | None) -> None:
    from perfscope.analysis.batch import metric_direction

    assert metric_direction(name) == direction


@pytest.mark.parametrize("key", ['x"y', "$.a", "a'b", "x\\\\y", "é ü"])
def test_any_tag_key_keeps_the_other_runs_findings(store_path: Path, tmp_path: Path, key: str) -> None:
    """A `"` in a tag key was spliced into a JSON path ('$."' || k || '"'): every analysis reading
    variants failed ("JSON path error") and the other runs' diverged finding was lost (issue 33)."""
    import shutil

    root = tmp_path / "store"
    shutil.copytree(store_path, root)
    make_run(root, "odd", experiment="tta", steps=STEPS, metrics={"loss": _decay(0.3, 0.1)}, tags={key: "1"})
    ttm = _ttm(root)
    assert ttm["odd"]["variant"] == f"{key}=1"
    with open_store(root) as store:
        (f,) = [f for f in explain(store, Selection()) if f.rule == "diverged"]
    assert set(f.evidence.run_ids) == {"b256-n2-linear", "b128-n4-linear"}


def test_analyze_and_report_read_a_quote_in_a_tag_key(store_path: Path, tmp_path: Path) -> None:
    """`perfscope analyze` and `report` on a store where one run has the tag key 'x"y' (exit 70
    "JSON path error" before issue 33): both succeed and the diverged finding is still shown."""
    import shutil

    root = tmp_path / "store"
    shutil.copytree(store_path, root)
    tags = {'x"y': "1"}
    make_run(root, "odd", experiment="tta", steps=STEPS, metrics={"loss": _decay(0.3, 0.1)}, tags=tags)
    assert main(["analyze", str(root), "--json"]) == 0
    out = tmp_path / "r.md"
    assert main(["report", str(root), "--format", "md", "-o", str(out)]) == 0
    assert "diverged" in out.read_text()
