"""Scaling models per group: Extra-P normal-form fit of step time, and predictions at larger N."""

from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any

import pyarrow as pa

from ..store.reader import Store
from ..words import counted
from .cache import memo
from .fitting import MIN_POINTS, NormalFormModel, fit_normal_form
from .groups import GROUP_COLUMNS
from .registry import analysis
from .scaling import grouped_stats_table, scaling_table
from .selection import Selection
from .steady import run_comm_table
from .sync import alpha_beta_fits

#: Predict at these multiples of the largest measured world size.
PREDICT_FACTORS = (2, 4, 8)
#: A model's predicted step time further than this factor from what its components (compute per
#: rank and the alpha-beta allreduce model) give at the same world size disagrees with them.
COMPONENT_DISAGREEMENT = 2.0


def _group_points(store: Store, sel: Selection) -> dict[str, list[dict[str, Any]]]:
    sc = scaling_table(store, sel)
    gs = grouped_stats_table(store, sel)
    rows = store.query(
        f"""
        SELECT s.*, g.grad_bytes, c.comm_count_mean
        FROM {sc} s JOIN {gs} g USING (run_id) LEFT JOIN {run_comm_table(store, sel)} c USING (run_id)
        WHERE s.scaling_mode <> 'single' AND NOT s.mixed
        ORDER BY s.group_id, s.world_size
        """
    ).to_pylist()
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["group_id"]].append(r)
    return by


def group_models(
    store: Store, sel: Selection
) -> dict[str, tuple[NormalFormModel | None, list[dict[str, Any]]]]:
    """group_id -> (model of step_ns against world size or None, the group's rows)."""

    def compute() -> dict[str, tuple[NormalFormModel | None, list[dict[str, Any]]]]:
        out = {}
        for gid, rows in _group_points(store, sel).items():
            per_n: dict[int, list[float]] = defaultdict(list)
            for r in rows:
                per_n[int(r["world_size"])].append(float(r["step_ns"]))
            sizes = sorted(per_n)
            out[gid] = (fit_normal_form(sizes, [median(per_n[n]) for n in sizes]), rows)
        return out

    return memo(store, ("group_models", sel), compute)


def _group_cols(row: dict[str, Any]) -> dict[str, Any]:
    return {c: row[c] for c in GROUP_COLUMNS}


@analysis("scaling_model", "Scaling model of step time (Extra-P normal form)", "scaling-model")
def scaling_model(store: Store, sel: Selection) -> pa.Table:
    """One row per scaling group: the chosen hypothesis, its coefficients and its fit quality."""
    rows = []
    fits = alpha_beta_fits(store, sel)
    for model, grows in group_models(store, sel).values():
        npoints = len({r["world_size"] for r in grows})
        disagrees = disagreement(model, grows, fits) if model else ""
        terms = list(model.terms) if model else []
        coefs = list(model.coefficients) if model else []
        row = _group_cols(grows[0]) | {
            "points": npoints,
            "formula": (model.formula + " (ns; p = world size)") if model else None,
            "c0": coefs[0] if coefs else None,
            "c1": coefs[1] if len(coefs) > 1 else None,
            "c2": coefs[2] if len(coefs) > 2 else None,
            "i1": float(terms[0][0]) if terms else None,
            "j1": terms[0][1] if terms else None,
            "i2": float(terms[1][0]) if len(terms) > 1 else None,
            "j2": terms[1][1] if len(terms) > 1 else None,
            "smape_pct": model.smape_pct if model else None,
            "r2_adj": model.r2_adj if model else None,
            "loo_smape_pct": model.loo_smape_pct if model else None,
            "too_few_points": npoints < MIN_POINTS,
            "trusted": bool(model and model.trusted and not disagrees),
            "note": _note(model, npoints, disagrees),
        }
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=SCALING_MODEL_SCHEMA)


def component_step_ns(
    grows: list[dict[str, Any]], fits: dict[Any, Any], n: int
) -> tuple[float, float, float] | None:
    """(compute per rank, predicted allreduce, their sum) in ns per step at world size `n`, from the
    group's baseline compute (step minus exposed sync, scaled by the samples per rank) and the
    alpha-beta fit of its cluster, backend and scope; None where the allreduce model cannot predict."""
    base = [r for r in grows if r["world_size"] == r["baseline_world_size"]]
    grad_bytes = next((r["grad_bytes"] for r in grows if r["grad_bytes"]), None)
    if not base or not grad_bytes or n <= 1:
        return None
    gpn = max(int(r["gpus_per_node"] or 1) for r in grows)
    scope = "intra-node" if n <= gpn else "inter-node"
    fit = fits.get((grows[0]["cluster"], grows[0]["backend"], scope), (None, []))[0]
    if fit is None:
        return None
    n0 = float(grows[0]["baseline_world_size"])
    compute0 = median(float(r["step_ns"]) - float(r["sync_exposed_ns"] or 0.0) for r in base)
    # weak scaling keeps the samples per rank; strong scaling divides the baseline's among n ranks
    compute = compute0 if grows[0]["scaling_mode"] == "weak" else compute0 * n0 / n
    k = median(float(r["comm_count_mean"] or 1) for r in grows)
    allreduce = float(fit.predict_s(n, grad_bytes, k)) * 1e9
    return compute, allreduce, compute + allreduce


def disagreement(model: NormalFormModel, grows: list[dict[str, Any]], fits: dict[Any, Any]) -> str:
    """'' when the model agrees with its components at every predicted world size; otherwise where
    it disagrees most, in words. The step time lies between max(compute, allreduce) (fully
    overlapped) and their sum (not overlapped); a model beyond either by COMPONENT_DISAGREEMENT
    disagrees."""
    nmax = max(int(r["world_size"]) for r in grows)
    worst: tuple[float, str] | None = None
    for n in [nmax * f for f in PREDICT_FACTORS]:
        parts = component_step_ns(grows, fits, n)
        if parts is None:
            continue
        compute, allreduce, total = parts
        t = float(model.predict(float(n)))
        low, high = max(compute, allreduce), total
        off = t / high if t > high else low / t if 0 < t < low else 1.0
        if off > COMPONENT_DISAGREEMENT and (worst is None or off > worst[0]):
            worst = (
                off,
                f"it predicts {t / 1e6:.1f} ms per step at N={n} where compute ({compute / 1e6:.1f} ms) "
                f"and the alpha-beta allreduce model ({allreduce / 1e6:.2f} ms) give "
                f"{low / 1e6:.1f}-{high / 1e6:.1f} ms",
            )
    return worst[1] if worst else ""


def _note(model: NormalFormModel | None, npoints: int, disagrees: str = "") -> str:
    if model is not None and disagrees:
        return (
            f"not trusted: the model disagrees with its components ({disagrees}); "
            "trust neither until a larger world size is measured"
        )
    if model is None:
        return f"no model: {counted(npoints, 'world size')}; at least 3 are needed to fit and 5 to trust one"
    if npoints < MIN_POINTS:
        return f"only {npoints} world sizes: the model is a guess, do not extrapolate from it"
    if not model.trusted:
        return (
            f"{npoints} world sizes, SMAPE {model.smape_pct:.1f}%: use predictions with care "
            "(5 or more points and SMAPE under 10% are needed to trust them)"
        )
    return ""


@analysis(
    "scaling_prediction", "Measured and predicted step time and efficiency", "scaling-model", "alpha-beta"
)
def scaling_prediction(store: Store, sel: Selection) -> pa.Table:
    """Model step time at the measured world sizes and at 2, 4 and 8 times the largest one."""
    fits = alpha_beta_fits(store, sel)
    out = []
    for _gid, (model, grows) in group_models(store, sel).items():
        if model is None:
            continue
        base = [r for r in grows if r["world_size"] == r["baseline_world_size"]]
        n0 = float(grows[0]["baseline_world_size"])
        # speedup against the model's own baseline step time, so that E(N0) = 1 by construction
        # (against the measured one a fit's residual at N0 showed as "E(N0) = 109%")
        t0 = float(model.predict(n0))
        g0 = median(float(r["samples_per_step"]) for r in base)
        weak = grows[0]["scaling_mode"] == "weak"
        gpn = max(int(r["gpus_per_node"] or 1) for r in grows)
        grad_bytes = next((r["grad_bytes"] for r in grows if r["grad_bytes"]), None)
        k = median(float(r["comm_count_mean"] or 1) for r in grows)
        measured: dict[int, list[float]] = defaultdict(list)
        for r in grows:
            measured[int(r["world_size"])].append(float(r["step_ns"]))
        nmax = max(measured)
        sizes = sorted(measured) + [nmax * f for f in PREDICT_FACTORS]
        trusted = model.trusted and not disagreement(model, grows, fits)
        for n in sizes:
            t_model = float(model.predict(float(n)))
            g = g0 * n / n0 if weak else g0
            speedup = (g * t0) / (g0 * t_model) if t_model > 0 and t0 > 0 else None
            scope = "intra-node" if n <= gpn else "inter-node"
            fit = fits.get((grows[0]["cluster"], grows[0]["backend"], scope), (None, []))[0]
            allreduce = fit.predict_s(n, grad_bytes, k) * 1e9 if fit and grad_bytes and n > 1 else None
            out.append(
                _group_cols(grows[0])
                | {
                    "world_size": n,
                    "kind": "measured" if n in measured else "prediction",
                    "measured_step_ns": median(measured[n]) if n in measured else None,
                    "model_step_ns": t_model,
                    "model_speedup": speedup,
                    "model_efficiency": speedup * n0 / n if speedup is not None else None,
                    "predicted_allreduce_ns": allreduce,
                    "component_step_ns": parts[2] if (parts := component_step_ns(grows, fits, n)) else None,
                    "trusted": trusted,
                }
            )
    return pa.Table.from_pylist(out, schema=SCALING_PREDICTION_SCHEMA)


_GROUP_FIELDS = [
    ("group_id", pa.string()),
    ("experiment", pa.string()),
    ("cluster", pa.string()),
    ("backend", pa.string()),
    ("model", pa.string()),
    ("scaling_mode", pa.string()),
    ("mixed", pa.bool_()),
    ("mode_note", pa.string()),
]
SCALING_MODEL_SCHEMA = pa.schema(
    [
        *_GROUP_FIELDS,
        ("points", pa.int64()),
        ("formula", pa.string()),
        ("c0", pa.float64()),
        ("c1", pa.float64()),
        ("c2", pa.float64()),
        ("i1", pa.float64()),
        ("j1", pa.int64()),
        ("i2", pa.float64()),
        ("j2", pa.int64()),
        ("smape_pct", pa.float64()),
        ("r2_adj", pa.float64()),
        ("loo_smape_pct", pa.float64()),
        ("too_few_points", pa.bool_()),
        ("trusted", pa.bool_()),
        ("note", pa.string()),
    ]
)
SCALING_PREDICTION_SCHEMA = pa.schema(
    [
        *_GROUP_FIELDS,
        ("world_size", pa.int64()),
        ("kind", pa.string()),
        ("measured_step_ns", pa.float64()),
        ("model_step_ns", pa.float64()),
        ("model_speedup", pa.float64()),
        ("model_efficiency", pa.float64()),
        ("predicted_allreduce_ns", pa.float64()),
        ("component_step_ns", pa.float64()),
        ("trusted", pa.bool_()),
    ]
)
