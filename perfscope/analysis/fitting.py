"""Model fitting on small aggregated tables (numpy): Extra-P normal form, alpha-beta, SMAPE, adjusted R²."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

#: Extra-P's exponent set for p^i, plus -1 and -1/2 for the compute share of strong scaling.
EXPONENTS_I: tuple[Fraction, ...] = tuple(
    Fraction(x)
    for x in (
        "-1",
        "-1/2",
        "0",
        "1/4",
        "1/3",
        "1/2",
        "2/3",
        "3/4",
        "1",
        "5/4",
        "4/3",
        "3/2",
        "5/3",
        "7/4",
        "2",
        "9/4",
        "7/3",
        "5/2",
        "8/3",
        "11/4",
        "3",
    )
)
EXPONENTS_J: tuple[int, ...] = (0, 1, 2)
#: Fewer distinct world sizes than this: the model is shown but flagged, never called trusted.
MIN_POINTS = 4
#: Extra-P recommends at least five measurement points for a model one can extrapolate from.
TRUSTED_POINTS = 5
TRUSTED_SMAPE_PCT = 10.0
#: A fitted α above this multiple of the time per ring hop that the cheapest measured collective
#: took is refused: no collective can take less than its latency, so such an α is queueing or CPU
#: contention fitted as latency (issue 11: α 2.8 ms where an isolated allreduce took 0.17 ms).
ALPHA_CEILING_FACTOR = 1.5

Term = tuple[Fraction, int]


def term_values(p: np.ndarray, term: Term) -> np.ndarray:
    i, j = term
    logp = np.log2(p)
    return np.power(p, float(i)) * (np.power(logp, j) if j else 1.0)


def term_text(term: Term) -> str:
    i, j = term
    parts = []
    if i != 0:
        parts.append("p" if i == 1 else f"p^({i})")
    if j:
        parts.append("log2(p)" if j == 1 else f"log2(p)^{j}")
    return "·".join(parts) or "1"


def smape_pct(y: np.ndarray, yhat: np.ndarray) -> float:
    """Symmetric mean absolute percentage error, in percent (0 = perfect, 200 = worst)."""
    denom = np.abs(y) + np.abs(yhat)
    safe = np.where(denom == 0, 1.0, denom)
    return float(np.mean(np.where(denom == 0, 0.0, 2 * np.abs(y - yhat) / safe)) * 100)


def adjusted_r2(y: np.ndarray, yhat: np.ndarray, predictors: int) -> float | None:
    """Adjusted R² with `predictors` terms besides the constant; None without degrees of freedom."""
    n = len(y)
    if n - predictors - 1 < 1:
        return None
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    ss_res = float(np.sum((y - yhat) ** 2))
    if ss_tot == 0:
        return 1.0 if ss_res == 0 else None
    r2 = 1 - ss_res / ss_tot
    return 1 - (1 - r2) * (n - 1) / (n - predictors - 1)


@dataclass(frozen=True)
class NormalFormModel:
    """c0 + Σ c_k · p^i_k · log2(p)^j_k"""

    terms: tuple[Term, ...]
    coefficients: tuple[float, ...]  # c0 first
    points: int
    smape_pct: float
    r2_adj: float | None
    loo_smape_pct: float | None

    def predict(self, p: np.ndarray | float) -> np.ndarray:
        p = np.asarray(p, dtype=float)
        out = np.full(p.shape, self.coefficients[0])
        for c, t in zip(self.coefficients[1:], self.terms, strict=True):
            out = out + c * term_values(p, t)
        return out

    @property
    def formula(self) -> str:
        parts = [f"{self.coefficients[0]:.6g}"]
        for c, t in zip(self.coefficients[1:], self.terms, strict=True):
            parts.append(f"{c:.6g}·{term_text(t)}")
        return " + ".join(parts)

    @property
    def too_few_points(self) -> bool:
        return self.points < MIN_POINTS

    @property
    def trusted(self) -> bool:
        return self.points >= TRUSTED_POINTS and self.smape_pct <= TRUSTED_SMAPE_PCT


def _lstsq(p: np.ndarray, y: np.ndarray, terms: tuple[Term, ...]) -> np.ndarray | None:
    cols = [np.ones_like(p)] + [term_values(p, t) for t in terms]
    x = np.column_stack(cols)
    # Scale columns so p^3 next to p^-1 does not wreck the conditioning.
    norms = np.linalg.norm(x, axis=0)
    if np.any(norms == 0):
        return None
    coef, *_ = np.linalg.lstsq(x / norms, y, rcond=None)
    coef = coef / norms
    if np.any(coef[1:] < 0):  # time components add; a negative term extrapolates to nonsense
        return None
    return coef


def _hypotheses(max_terms: int) -> list[tuple[Term, ...]]:
    terms = [(i, j) for i in EXPONENTS_I for j in EXPONENTS_J if (i, j) != (0, 0)]
    hyps: list[tuple[Term, ...]] = [()]
    if max_terms >= 1:
        hyps += [(t,) for t in terms]
    if max_terms >= 2:
        shrinking = [t for t in terms if t[0] < 0]
        growing = [t for t in terms if t[0] >= 0]
        hyps += [(a, b) for a, b in itertools.product(shrinking, growing)]
    return hyps


def _predict(coef: np.ndarray, terms: tuple[Term, ...], p: np.ndarray) -> np.ndarray:
    out = np.full(p.shape, coef[0])
    for c, t in zip(coef[1:], terms, strict=True):
        out = out + c * term_values(p, t)
    return out


def _loo_predictions(p: np.ndarray, y: np.ndarray, terms: tuple[Term, ...]) -> np.ndarray | None:
    """Leave-one-out predictions of a linear least-squares fit in closed form: the held-out
    residual is e_i / (1 - h_ii), h the hat matrix. None when a point determines its own fit."""
    x = np.column_stack([np.ones_like(p)] + [term_values(p, t) for t in terms])
    x = x / np.linalg.norm(x, axis=0)
    hat = x @ np.linalg.pinv(x)
    leverage = np.diag(hat)
    if np.any(leverage > 1 - 1e-9):
        return None
    resid = y - hat @ y
    return y - resid / (1 - leverage)


def _complexity(terms: tuple[Term, ...]) -> tuple[int, float]:
    return len(terms), float(sum(abs(i) + j for i, j in terms))


def fit_normal_form(p_values: Sequence[float], y_values: Sequence[float]) -> NormalFormModel | None:
    """Pick the Extra-P-style hypothesis that best explains y(p).

    With at least MIN_POINTS points the choice is by leave-one-out SMAPE (hypotheses with at most
    n-2 coefficients, so every fold keeps a degree of freedom); with 3 points by adjusted R² among
    one-term hypotheses. Fewer than 3 points: no model.
    """
    p = np.asarray(p_values, dtype=float)
    y = np.asarray(y_values, dtype=float)
    n = len(p)
    if n < 3 or len(set(p_values)) < 3:
        return None
    loo = n >= MIN_POINTS
    max_coef = n - 2 if loo else 2
    best: tuple[tuple[float, int, float], tuple[Term, ...], np.ndarray, float | None] | None = None
    for terms in _hypotheses(max_coef - 1):
        coef = _lstsq(p, y, terms)
        if coef is None:
            continue
        yhat = _predict(coef, terms, p)
        if np.any(yhat <= 0):
            continue
        cv: float | None = None
        if loo:
            held_out = _loo_predictions(p, y, terms)
            if held_out is None:
                continue
            cv = smape_pct(y, held_out)
            score = cv
        else:
            r2 = adjusted_r2(y, yhat, len(terms))
            score = -(r2 if r2 is not None else -math.inf)
        # Scores within 0.001 (percentage points of SMAPE) are a tie, and the simpler hypothesis wins.
        key = (round(score, 3), *_complexity(terms))
        if best is None or key < best[0]:
            best = (key, terms, coef, cv)
    if best is None:
        return None
    _, terms, coef, cv = best
    yhat = _predict(coef, terms, p)
    return NormalFormModel(
        terms=terms,
        coefficients=tuple(float(c) for c in coef),
        points=n,
        smape_pct=smape_pct(y, yhat),
        r2_adj=adjusted_r2(y, yhat, len(terms)),
        loo_smape_pct=cv,
    )


@dataclass(frozen=True)
class AlphaBetaFit:
    """t = k·2(p−1)·α + 2(p−1)/p·n·β for k collectives of n bytes over p ranks."""

    alpha_s: float
    beta_s_per_byte: float
    points: int
    smape_pct: float
    r2_adj: float | None
    #: the least time per ring hop and collective any point took: α cannot be above it
    alpha_ceiling_s: float | None = None

    @property
    def alpha_refused(self) -> bool:
        """α is far above what the smallest messages took: not a latency, do not report it."""
        return self.alpha_ceiling_s is not None and self.alpha_s > ALPHA_CEILING_FACTOR * self.alpha_ceiling_s

    @property
    def bandwidth_gb_per_s(self) -> float | None:
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else None

    def predict_s(self, p: float, n_bytes: float, k: float = 1.0) -> float:
        return k * 2 * (p - 1) * self.alpha_s + 2 * (p - 1) / p * n_bytes * self.beta_s_per_byte

    def latency_share(self, p: float, n_bytes: float, k: float = 1.0) -> float:
        total = self.predict_s(p, n_bytes, k)
        return k * 2 * (p - 1) * self.alpha_s / total if total > 0 else 0.0


def fit_alpha_beta(
    p: list[float], n_bytes: list[float], k: list[float], t_s: list[float]
) -> AlphaBetaFit | None:
    """Non-negative least squares for (α, β) on points (p ranks, n bytes, k collectives, t seconds)."""
    pa_ = np.asarray(p, dtype=float)
    y = np.asarray(t_s, dtype=float)
    kk = np.asarray(k, dtype=float)
    nn = np.asarray(n_bytes, dtype=float)
    # a point with an unknown (NaN) or infinite coordinate says nothing about α or β
    keep = (pa_ >= 2) & np.isfinite(pa_) & np.isfinite(y) & np.isfinite(kk) & np.isfinite(nn)
    if keep.sum() < 2:
        return None
    pa_, y = pa_[keep], y[keep]
    x1 = kk[keep] * 2 * (pa_ - 1)
    x2 = 2 * (pa_ - 1) / pa_ * nn[keep]
    x = np.column_stack([x1, x2])
    candidates = []
    if np.linalg.matrix_rank(x) == 2:
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        if np.all(coef >= 0):
            candidates.append(coef)
    # NNLS with two unknowns: if the free fit has a negative side, the optimum lies on an axis.
    for col in (0, 1):
        xc = x[:, col]
        denom = float(xc @ xc)
        c = max(0.0, float(xc @ y) / denom) if denom > 0 else 0.0
        coef = np.zeros(2)
        coef[col] = c
        candidates.append(coef)
    best = min(candidates, key=lambda c: float(np.sum((x @ c - y) ** 2)))
    ceiling = float(np.min(y / x1)) if np.all(x1 > 0) else None
    if ceiling is not None and ceiling < best[0] <= ALPHA_CEILING_FACTOR * ceiling:
        # a little above what the cheapest collective took per hop (noise in the small messages'
        # times): no collective takes less than its latency, so α is that time (far above: refused)
        best = np.array([ceiling, best[1]])
    yhat = x @ best
    return AlphaBetaFit(
        alpha_s=float(best[0]),
        beta_s_per_byte=float(best[1]),
        points=len(y),
        smape_pct=smape_pct(y, yhat),
        r2_adj=adjusted_r2(y, yhat, 2),
        alpha_ceiling_s=ceiling,
    )
