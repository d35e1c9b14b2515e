"""The alpha-beta fit refuses a latency far above what the smallest messages took (issue 11,
items 1 and 8): queueing or CPU contention fitted as latency is not latency."""

from __future__ import annotations

import pytest

from perfscope.analysis.fitting import ALPHA_CEILING_FACTOR, fit_alpha_beta


def test_alpha_far_above_the_cheapest_collective_is_refused() -> None:
    # the numbers: one isolated 4-byte allreduce took 0.17 ms per hop at N=2, while steps
    # of 10 contended collectives took 2.8 ms per hop
    p, n, k = [2.0, 2.0, 4.0, 4.0], [4.0, 1e5, 4.0, 1e5], [1.0, 10.0, 1.0, 10.0]
    fit = fit_alpha_beta(p, n, k, [0.34e-3, 56e-3, 3.6e-3, 168e-3])
    assert fit is not None and fit.alpha_ceiling_s is not None
    assert fit.alpha_ceiling_s == pytest.approx(0.17e-3)
    assert fit.alpha_s > ALPHA_CEILING_FACTOR * fit.alpha_ceiling_s and fit.alpha_refused


def test_a_consistent_alpha_is_kept() -> None:
    alpha, beta = 0.17e-3, 1 / 1e9

    def ring(p: float, nbytes: float, k: float) -> float:
        return k * 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta

    pts = [(2.0, 4.0, 1.0), (2.0, 1e6, 10.0), (4.0, 4.0, 1.0), (4.0, 1e6, 10.0), (8.0, 1e7, 2.0)]
    p, n, k = ([x[i] for x in pts] for i in range(3))
    fit = fit_alpha_beta(p, n, k, [ring(*x) for x in pts])
    assert fit is not None and not fit.alpha_refused
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-3)
    assert fit.alpha_ceiling_s is not None and fit.alpha_s <= fit.alpha_ceiling_s * (1 + 1e-9)


def test_an_alpha_a_little_above_the_cheapest_collective_is_that_collectives_time() -> None:
    # the smallest message's time per hop came out under the line's intercept (noise on a loaded host):
    # the latency is what that collective took, never more
    p, n, k = [2.0, 2.0, 2.0], [4.0, 1e6, 4e6], [1.0, 1.0, 1.0]
    fit = fit_alpha_beta(p, n, k, [0.10e-3, 1.24e-3, 4.30e-3])  # the free fit: α 71 µs
    assert fit is not None and fit.alpha_ceiling_s == pytest.approx(0.05e-3)
    assert not fit.alpha_refused and fit.alpha_s == fit.alpha_ceiling_s
    assert fit.bandwidth_gb_per_s == pytest.approx(0.96, rel=0.05)
    exact = fit_alpha_beta(p, n, k, [0.10e-3, 1.10e-3, 4.10e-3])
    assert exact is not None and exact.alpha_s == pytest.approx(0.05e-3, rel=1e-3)
