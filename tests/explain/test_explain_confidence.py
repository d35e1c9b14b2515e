"""Confidence from the evidence (explain/confidence.py): the same finding is less certain on fewer
world sizes or noisier runs, and says what would raise it."""

from __future__ import annotations

from pathlib import Path

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, healthy_study, make_run, ring_transfer_ns

from perfscope import open_store
from perfscope.analysis import run_analysis
from perfscope.explain import Finding, explain
from perfscope.explain.confidence import FEW_SIZES_CAP, NOISY_CAP, Inputs, Limit, confidence, more_sizes

pytestmark = pytest.mark.filterwarnings("error::perfscope.errors.PerfscopeWarning")


def _comm_bound(root: Path, sizes: tuple[int, ...], *, noisy: bool = False) -> Finding:
    """A communication-bound group (exposed sync 3 ms per rank); `noisy` makes every other step
    40 ms slower on the data loader (step CV about 0.4)."""
    for n in sizes:
        make_run(
            root,
            f"n{n}",
            world_size=n,
            phases={**DEFAULT_PHASES, "sync_exposed": 0 if n == 1 else 3.0 * MS * n},
            phase_fn=(lambda r, s: {"data": 1 * MS + (40 * MS if s % 2 else 0)}) if noisy else None,
        )
    with open_store(root) as store:
        found = [g for f in explain(store) for g in f.flatten() if g.rule == "communication-bound"]
    assert len(found) == 1
    return found[0]


def test_fewer_world_sizes_mean_less_confidence_and_say_which_to_measure(tmp_path: Path) -> None:
    four = _comm_bound(tmp_path / "four", (1, 2, 4, 8))
    two = _comm_bound(tmp_path / "two", (1, 4))
    assert four.confidence_label == "high" and "held down" not in four.text
    assert two.confidence <= FEW_SIZES_CAP < four.confidence
    assert "it compares 2 world sizes (N = 1, 4)" in two.text
    assert "To raise it: measure N = 8 and 16." in two.text


def test_noisy_runs_mean_less_confidence_and_say_so(tmp_path: Path) -> None:
    quiet = _comm_bound(tmp_path / "quiet", (1, 2, 4, 8))
    noisy = _comm_bound(tmp_path / "noisy", (1, 2, 4, 8), noisy=True)
    assert noisy.confidence <= NOISY_CAP < quiet.confidence
    assert "step time varies (coefficient of variation" in noisy.text
    assert "repeat the runs on a quiet host" in noisy.text


def test_the_confidence_function_takes_the_lowest_cap_and_names_every_limit() -> None:
    value, why = confidence(0.9, Inputs())
    assert value == pytest.approx(0.9) and why == ""
    fit = Limit(0.6, "the fit is thin", "measure N = 24")
    value, why = confidence(0.9, Inputs(world_sizes=(1, 2), fit_limits=(fit,), step_cv=0.5, noisiest_run="r"))
    assert value == pytest.approx(FEW_SIZES_CAP)
    assert "the fit is thin" in why and "2 world sizes" in why and "coefficient of variation 0.50" in why
    assert "measure N = 24" in why and "measure N = 4 and 8" in why
    # a cap above the rule's own strength holds nothing down
    value, why = confidence(0.4, Inputs(world_sizes=(1, 2, 4)))
    assert value == pytest.approx(0.4) and why == ""
    assert more_sizes([1, 2], 2) == [4, 8] and more_sizes([], 1) == [2]


def test_a_scaling_model_that_disagrees_with_its_components_is_not_trusted(tmp_path: Path) -> None:
    """Exposed sync that grows as N² while the collectives, over a fast link, stay short: the
    step-time model extrapolates the N² far past what compute plus the allreduce model give."""
    for n in (1, 2, 4, 8, 16):
        make_run(
            tmp_path / "bad",
            f"n{n}",
            world_size=n,
            gpus_per_node=4,  # nodes of 4: an alpha-beta fit inside a node and one across nodes
            grad_bytes=2**25,
            phases={**DEFAULT_PHASES, "sync_exposed": 0 if n == 1 else 0.2 * MS * n * n},
            comm=None
            if n == 1
            else Comm([2**24, 2**24], lambda nb, n=n: ring_transfer_ns(n, nb, 5e-6, 1e-11)),
        )
    healthy_study(tmp_path / "good")
    with open_store(tmp_path / "bad") as store:
        (model,) = run_analysis("scaling_model", store).to_pylist()
        pred = run_analysis("scaling_prediction", store).to_pylist()
    assert model["points"] == 5 and model["smape_pct"] <= 10.0  # it fits its points well ...
    assert not model["trusted"]  # ... and is still not trusted
    assert "disagrees with its components" in model["note"] and "at N=" in model["note"]
    far = [r for r in pred if r["kind"] == "prediction"]
    assert far and not any(r["trusted"] for r in far)
    assert all(r["model_step_ns"] > 2 * r["component_step_ns"] for r in far)
    with open_store(tmp_path / "good") as store:
        (model,) = run_analysis("scaling_model", store).to_pylist()
    assert model["trusted"] and model["note"] == ""
