"""Scaling models: Extra-P normal form recovering known terms, fit quality, few points, predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from storegen import DEFAULT_PHASES, MS, make_run

from perfscope.analysis import run_analysis
from perfscope.analysis.fitting import adjusted_r2, fit_alpha_beta, fit_normal_form, smape_pct
from perfscope.store.open import open_store

SIZES = [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize(
    ("i", "j", "c0", "c1"),
    [
        (0.5, 1, 30.0, 2.0),
        (1.0, 0, 5.0, 0.25),
        (0.0, 1, 10.0, 3.0),
        (2.0, 0, 1.0, 0.01),
        (-1.0, 0, 4.0, 100.0),
    ],
)
def test_normal_form_recovers_the_generating_term(i, j, c0, c1):
    y = [c0 + c1 * p**i * (math.log2(p) ** j) for p in SIZES]
    m = fit_normal_form(SIZES, y)
    assert m is not None
    assert [(float(t[0]), t[1]) for t in m.terms] == [(i, j)]
    assert m.coefficients == pytest.approx([c0, c1], rel=1e-6)
    assert m.smape_pct < 1e-6 and m.trusted and not m.too_few_points


def test_normal_form_two_terms_for_strong_scaling():
    # compute that shrinks as 1/p plus a sync that grows as log2(p)
    y = [2.0 + 120.0 / p + 1.5 * math.log2(p) for p in SIZES]
    m = fit_normal_form(SIZES, y)
    assert m is not None
    assert {(float(a), b) for a, b in m.terms} == {(-1.0, 0), (0.0, 1)}
    assert m.predict(128.0) == pytest.approx(2.0 + 120 / 128 + 1.5 * 7, rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(c0=st.floats(1, 100), c1=st.floats(0.1, 10), noise=st.floats(0, 0.01))
def test_normal_form_fit_quality_is_consistent(c0, c1, noise):
    rng = np.random.default_rng(0)
    y = [(c0 + c1 * math.log2(p)) * (1 + noise * rng.standard_normal()) for p in SIZES]
    m = fit_normal_form(SIZES, y)
    assert m is not None
    yhat = m.predict(np.array(SIZES, dtype=float))
    assert m.smape_pct == pytest.approx(smape_pct(np.array(y), yhat))
    assert m.smape_pct < 10
    assert m.loo_smape_pct is not None and m.loo_smape_pct >= 0


def test_fit_quality_measures():
    y = np.array([1.0, 2.0, 3.0, 4.0])
    assert smape_pct(y, y) == 0
    assert smape_pct(np.array([1.0]), np.array([3.0])) == pytest.approx(100.0)
    assert adjusted_r2(y, y, 1) == 1.0
    assert adjusted_r2(y, np.array([1.5, 1.5, 3.5, 3.5]), 1) == pytest.approx(1 - (1 - 0.8) * 3 / 2)
    assert adjusted_r2(y[:2], y[:2], 1) is None


def test_too_few_points():
    assert fit_normal_form([1, 2], [1.0, 2.0]) is None
    m = fit_normal_form([1, 2, 4], [1.0, 2.0, 3.0])
    assert m is not None and m.too_few_points and not m.trusted


def test_alpha_beta_is_non_negative():
    # data that a free fit would explain with a negative latency
    fit = fit_alpha_beta([2, 4, 8], [1e6, 1e6, 1e6], [1, 1, 1], [1e-4, 1.6e-4, 1.7e-4])
    assert fit is not None and fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0


def _sqrt_log_study(tmp_path, sizes):
    for n in sizes:
        sync = 2 * MS * math.sqrt(n) * math.log2(n)
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            steps=30,
            grad_bytes=2**24,
            phases={**DEFAULT_PHASES, "sync_exposed": sync},
        )


def test_scaling_model_and_prediction_from_a_store(tmp_path):
    _sqrt_log_study(tmp_path, [1, 2, 4, 8, 16, 32])
    with open_store(tmp_path) as store:
        model = run_analysis("scaling_model", store).to_pylist()[0]
        pred = run_analysis("scaling_prediction", store).to_pylist()
    # T(p) = 33 ms + 2 ms·p^(1/2)·log2(p)
    assert (model["i1"], model["j1"]) == (0.5, 1)
    assert model["c0"] == pytest.approx(33 * MS, rel=1e-4)
    assert model["c1"] == pytest.approx(2 * MS, rel=1e-4)
    assert model["trusted"] and not model["too_few_points"] and model["points"] == 6
    at = {r["world_size"]: r for r in pred}
    assert [r["kind"] for r in pred] == ["measured"] * 6 + ["prediction"] * 3
    assert sorted(at) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    t64 = 33 * MS + 2 * MS * 8 * 6
    assert at[64]["model_step_ns"] == pytest.approx(t64, rel=1e-4)
    assert at[64]["model_efficiency"] == pytest.approx(33 * MS / t64, rel=1e-4)
    assert at[64]["measured_step_ns"] is None


def test_scaling_model_says_when_points_are_too_few(tmp_path):
    _sqrt_log_study(tmp_path, [1, 2, 4])
    with open_store(tmp_path) as store:
        model = run_analysis("scaling_model", store).to_pylist()[0]
        pred = run_analysis("scaling_prediction", store).to_pylist()
    assert model["too_few_points"] and not model["trusted"]
    assert "do not extrapolate" in model["note"]
    assert pred and not any(r["trusted"] for r in pred)
