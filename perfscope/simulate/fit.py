"""Fits the simulator's cost model to the runs of a store, so it can predict other world sizes and batches.

Per (cluster, backend, device) group: the forward+backward time per rank against batch size and ranks
sharing a node gives the host overhead, its growth with ranks per node, the per-sample kernel time and
the batch that fills the GPU; the collective's own time (from the last rank's entry to its exit)
against world size and message size gives the coordination cost and the alpha-beta ring within and
across nodes; the spread of the phases gives the noise. Only steady-state steps count (DESIGN.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..analysis.sync import COLLECTIVE_SQL, INSTANCE_KEY_SQL
from ..errors import PerfscopeError
from ..store.reader import Store
from .model import (
    ACTIVE_IDLE_FACTOR,
    KERNEL_POWER_SHARE,
    Backend,
    Partition,
    Workload,
    simulate_timeline,
)

#: the fill batch is chosen from this grid by least squares (0: no fill effect)
FILL_GRID = (0.0, 10.0, 20.0, 35.0, 50.0, 75.0, 100.0, 120.0, 150.0, 200.0, 300.0, 500.0, 1000.0)
#: DESIGN.md: extrapolating from fewer world sizes than this deserves a warning
MIN_TRUSTED_WORLD_SIZES = 4
_QUALITY_STEPS = 200
#: noise estimates above this mean the runs do not follow the model (or have too few steps)
MAX_NOISE_CV = 0.5
#: the bandwidth written for a ring term fitted to zero (too fast to matter at these message sizes)
UNRESOLVED_GB_PER_S = 1e6
_SOFTWARE_KEYS = ("python_version", "torch_version", "cuda_version", "nccl_version", "driver_version")
#: a fit that misses its own measurements by more than this (SMAPE) predicts nothing
MAX_USEFUL_SMAPE = 0.2
#: fewer steady steps than this per run make every median rough
MIN_STEADY_STEPS = 20

_STEADY = """
steady AS (
    SELECT s.* FROM steps s
    JOIN (SELECT run_id, count(DISTINCT step) AS n FROM steps GROUP BY run_id) c USING (run_id)
    WHERE s.step >= greatest(10, ceil(0.05 * c.n)) AND s.run_id IN (SELECT unnest($runs))
)"""

# log-space spread: (q84 - q16) / 2 is the sigma of a lognormal, robust to the odd outlier
_PER_RANK_SQL = f"""
WITH {_STEADY},
sharing AS (
    SELECT run_id, rank, count(*) OVER (PARTITION BY run_id, node_rank) AS ranks_on_node FROM ranks
)
SELECT s.run_id, s.rank, any_value(h.ranks_on_node) AS ranks_on_node,
       median(s.forward_ns + s.backward_ns) AS fb_ns, median(s.data_ns) AS data_ns,
       median(s.optimizer_ns) AS optimizer_ns, median(s.other_ns) AS other_ns,
       (quantile_cont(ln(greatest(s.forward_ns + s.backward_ns, 1)), 0.8413)
        - quantile_cont(ln(greatest(s.forward_ns + s.backward_ns, 1)), 0.1587)) / 2 AS fb_log_sigma
FROM steady s LEFT JOIN sharing h USING (run_id, rank)
GROUP BY s.run_id, s.rank
"""

# A collective's own time: from the last member's entry to this rank's exit (waiting is not its cost).
# Instances are keyed as the sync analysis keys them (run, step, grp, nth: a call is matched with its
# own process group's members; point-to-point rows are no instance), the points by (grp, nth) over steps.
_COMM_SQL = f"""
WITH {_STEADY},
k AS (
    SELECT c.run_id, c.step, c.bytes, c.group_size, c.start_ns, c.dur_ns, {INSTANCE_KEY_SQL}
    FROM comm c JOIN (SELECT DISTINCT run_id, step FROM steady) s USING (run_id, step)
    WHERE {COLLECTIVE_SQL}
),
c AS (SELECT *, max(start_ns) OVER (PARTITION BY run_id, step, grp, nth) AS last_enter_ns FROM k)
SELECT run_id, grp, nth, median(group_size) AS group_size, median(bytes) AS bytes,
       median(start_ns + dur_ns - last_enter_ns) AS own_ns,
       (quantile_cont(ln(greatest(start_ns + dur_ns - last_enter_ns, 1)), 0.8413)
        - quantile_cont(ln(greatest(start_ns + dur_ns - last_enter_ns, 1)), 0.1587)) / 2 AS log_sigma
FROM c GROUP BY run_id, grp, nth
"""

# Without comm rows: the rank that arrived last waited least, so min over ranks of exposed sync.
_SYNC_FALLBACK_SQL = f"""
WITH {_STEADY}
SELECT run_id, median(m) AS own_ns FROM (
    SELECT run_id, step, min(sync_exposed_ns) AS m FROM steady GROUP BY run_id, step
) GROUP BY run_id
"""

_RUN_STEP_SQL = f"""
WITH {_STEADY}
SELECT run_id, median(t) AS step_ns, count(*) AS steady_steps FROM (
    SELECT run_id, step, max(step_ns) AS t FROM steady GROUP BY run_id, step
) GROUP BY run_id
"""

_UTIL_SQL = f"""
WITH {_STEADY},
win AS (SELECT run_id, min(start_ns) AS lo, max(start_ns + step_ns) AS hi FROM steady GROUP BY run_id)
SELECT g.run_id, median(g.util_gpu_pct) AS util_pct, median(g.sm_clock_mhz) AS sm_clock_mhz,
       median(g.mem_clock_mhz) AS mem_clock_mhz, max(g.mem_total_bytes) AS mem_total_bytes,
       bool_or(g.nvlink_tx_kbps IS NOT NULL) AS nvlink,
       regr_intercept(g.power_mw, g.util_gpu_pct) AS power0_mw,
       regr_slope(g.power_mw, g.util_gpu_pct) AS power_slope
FROM gpu_samples g JOIN win USING (run_id) WHERE g.ts_ns BETWEEN win.lo AND win.hi GROUP BY g.run_id
"""


@dataclass(frozen=True)
class FitPoint:
    run_id: str
    world_size: int
    batch_per_rank: int
    measured_step_ns: float
    model_step_ns: float


@dataclass(frozen=True)
class FittedModel:
    """The cost model of one (cluster, backend, device) group, fitted to its measured runs."""

    cluster: str
    #: the group's experiment with the most runs (a scaling sweep rather than a batch sweep)
    experiment: str
    scaling_mode: str
    partition: Partition
    backend: Backend
    workload: Workload
    run_ids: tuple[str, ...]
    world_sizes: tuple[int, ...]
    #: per-rank batch sizes of `experiment`, the ones a prediction uses by default
    batch_sizes: tuple[int, ...]
    #: every per-rank batch size the fit saw; with one, other batches cannot be predicted
    measured_batch_sizes: tuple[int, ...]
    points: tuple[FitPoint, ...]
    smape: float
    notes: tuple[str, ...]

    @property
    def trusted(self) -> bool:
        return len(self.world_sizes) >= MIN_TRUSTED_WORLD_SIZES

    def summary(self) -> dict[str, Any]:
        p, b = self.partition, self.backend
        return {
            "cluster": self.cluster,
            "backend": b.name,
            "device_model": p.device_model,
            "runs": len(self.run_ids),
            "world_sizes": list(self.world_sizes),
            "batch_sizes": list(self.batch_sizes),
            "step_overhead_us": p.step_overhead_us,
            "cpu_share_penalty": p.cpu_share_penalty,
            "kernel_us_per_sample": p.kernel_us_per_sample,
            "fill_samples": p.fill_samples,
            "data_us_per_sample": p.data_us_per_sample,
            "coord_us": b.coord_us,
            "intra_alpha_us": b.intra_alpha_us,
            "intra_gb_per_s": b.intra_gb_per_s,
            "inter_alpha_us": b.inter_alpha_us,
            "inter_gb_per_s": b.inter_gb_per_s,
            "smape": self.smape,
            "trusted": self.trusted,
            "notes": list(self.notes),
        }


def _fill_g(batch: np.ndarray, fill: float) -> np.ndarray:
    return batch + fill * np.exp(-batch / fill) if fill > 0 else batch.astype(np.float64)


def _lstsq_nonneg(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and solve again."""
    active = [j for j in range(a.shape[1]) if np.any(a[:, j] != 0)]
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def _select_runs(
    store: Store,
    experiments: Sequence[str],
    clusters: Sequence[str],
    backends: Sequence[str],
    run_ids: Sequence[str],
) -> list[dict[str, Any]]:
    where, params = ["TRUE"], []
    for column, values in (
        ("experiment", experiments),
        ("cluster", clusters),
        ("backend", backends),
        ("run_id", run_ids),
    ):
        if values:
            where.append(f"{column} IN (SELECT unnest(?))")
            params.append(list(values))
    # runs predicted by an earlier fit are not measurements: never fit a model to them
    sql = (
        f"SELECT * FROM runs WHERE {' AND '.join(where)} AND run_id IN (SELECT run_id FROM steps) "
        "AND coalesce(tags, '') NOT LIKE '%\"fitted_from\"%'"
    )
    return store.query(sql, params).to_pylist()


def _solve_compute(
    per_rank: list[dict[str, Any]], batch_of: dict[str, int], notes: list[str]
) -> dict[str, float]:
    """forward+backward = host·(1 + κ·(s-1)) + c·g(b): host overhead, penalty κ, kernel c, fill."""
    y = np.array([r["fb_ns"] for r in per_rank], dtype=np.float64)
    shared = np.array([(r["ranks_on_node"] or 1) - 1 for r in per_rank], dtype=np.float64)
    batch = np.array([batch_of[r["run_id"]] for r in per_rank], dtype=np.float64)
    best: tuple[float, float, np.ndarray] | None = None
    distinct = len(set(batch.tolist()))
    many_batches = distinct >= 2
    # the fill batch bends the curve: two batch sizes fit any bend, so it needs three
    for fill in FILL_GRID if distinct >= 3 else (0.0,):
        cols = [np.ones_like(y), shared] + ([_fill_g(batch, fill)] if many_batches else [])
        coef = _lstsq_nonneg(np.column_stack(cols), y)
        sse = float(np.sum((np.column_stack(cols) @ coef - y) ** 2))
        if best is None or sse < best[0]:
            best = (sse, fill, coef)
    assert best is not None
    _, fill, coef = best
    host, growth = float(coef[0]), float(coef[1])
    cols = [np.ones_like(y), shared] + ([_fill_g(batch, fill)] if many_batches else [])
    fitted = np.column_stack(cols) @ coef
    # persistent rank-to-rank speed differences: what the model does not explain per rank
    rank_sigma = float(np.std(np.log(y / fitted))) if np.all(fitted > 0) and len(y) > 2 else 0.0
    kernel_per_sample = float(coef[2]) if many_batches else 0.0
    if not many_batches:
        notes.append(
            "one batch size: host overhead and per-sample kernel time cannot be told apart; "
            "predictions for other batch sizes need runs at two or more batch sizes"
        )
    if len(set(shared.tolist())) < 2:
        notes.append("every run had the same ranks per node: no estimate of CPU sharing (penalty 0)")
    return {
        "host_ns": host,
        "growth_ns": growth,
        "penalty": growth / host if host > 0 else 0.0,
        "kernel_ns_per_sample": kernel_per_sample,
        "fill": fill,
        "rank_cv": math.expm1(rank_sigma),
    }


def _split_kernel_from_util(
    compute: dict[str, float],
    runs: list[dict[str, Any]],
    util: dict[str, dict[str, Any]],
    steps: dict[str, float],
) -> bool:
    """With one batch size, NVML's kernel-active share of one-rank runs splits host from kernel time."""
    singles = [r for r in runs if r["world_size"] == 1 and r["run_id"] in util and r["run_id"] in steps]
    if not singles:
        return False
    r = singles[0]
    kernel_ns = util[r["run_id"]]["util_pct"] / 100.0 * steps[r["run_id"]]
    kernel_ns = min(kernel_ns, compute["host_ns"])
    compute["kernel_ns_per_sample"] = kernel_ns / r["batch_size_per_rank"]
    compute["host_ns"] -= kernel_ns
    # only the host part grows when ranks share a node's CPUs
    compute["penalty"] = compute["growth_ns"] / compute["host_ns"] if compute["host_ns"] > 0 else 0.0
    return True


def _solve_ring(
    points: list[tuple[int, int, float, float]], notes: list[str]
) -> tuple[float, float, float, float, float]:
    """Coordination + alpha-beta ring within and across nodes from (p, nodes, bytes, own_ns) points."""
    rows, y = [], []
    for p, nodes, nbytes, own in points:
        hops, volume = 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes
        intra = nodes <= 1
        rows.append(
            [
                1.0,
                hops if intra else 0.0,
                volume if intra else 0.0,
                0.0 if intra else hops,
                0.0 if intra else volume,
            ]
        )
        y.append(own)
    if not rows:
        notes.append("no multi-rank runs: no collective cost could be fitted")
        return 0.0, 0.0, 0.0, 0.0, 0.0
    a, t = np.array(rows), np.array(y)
    # the noise is multiplicative: weigh every point by 1/t so large world sizes do not dominate
    weight = 1.0 / np.maximum(t, 1.0)
    coef = _lstsq_nonneg(a * weight[:, None], t * weight)
    if not any(nodes > 1 for _, nodes, _, _ in points):
        notes.append("no multi-node runs: the inter-node link is unknown and taken to be the intra-node one")
        coef[3], coef[4] = coef[1], coef[2]
    if not any(nodes <= 1 for _, nodes, _, _ in points):
        notes.append("no single-node multi-rank runs: the intra-node link is taken to be the inter-node one")
        coef[1], coef[2] = coef[3], coef[4]
    for scope, beta in (("intra", coef[2]), ("inter", coef[4])):
        if beta == 0:
            notes.append(
                f"the {scope}-node bandwidth term fitted to zero: with these world sizes and message "
                "sizes it cannot be told from the per-collective coordination cost"
            )
    if np.linalg.matrix_rank(a) < np.count_nonzero(np.any(a != 0, axis=0)):
        notes.append("too few distinct world sizes and message sizes to separate every ring term")
    return tuple(float(c) for c in coef)  # type: ignore[return-value]


def _noise(what: str, cv: float, notes: list[str]) -> float:
    """A noise level the model can use; a larger estimate says the model misses something."""
    if cv > MAX_NOISE_CV:
        notes.append(
            f"{what} variation of {cv:.0%} is beyond what the model describes; capped at {MAX_NOISE_CV:.0%}"
        )
        return MAX_NOISE_CV
    return cv


def _name(value: Any, fallback: str) -> str:
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value or "")).strip("-.")
    return text[:48] or fallback


def _fit_compute(
    store: Store, runs: list[dict[str, Any]], ids: list[str], notes: list[str]
) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, Any]], list[float]]:
    """Host, kernel, CPU sharing, optimizer, other and data costs; the runs' step times, GPU
    telemetry, and the log-spread of forward+backward per rank."""
    per_rank = store.query(_PER_RANK_SQL, {"runs": ids}).to_pylist()
    if not per_rank:
        raise PerfscopeError(f"runs {', '.join(ids[:3])} have no steady-state steps to fit a model to")
    by_run = {r["run_id"]: r for r in runs}
    for r in per_rank:
        if r["ranks_on_node"] is None:  # no ranks table: sequential placement
            meta = by_run[r["run_id"]]
            r["ranks_on_node"] = min(meta["world_size"], meta["gpus_per_node"] or meta["world_size"])
    batch_of = {r["run_id"]: int(r["batch_size_per_rank"] or 1) for r in runs}
    compute = _solve_compute(per_rank, batch_of, notes)
    run_steps = store.query(_RUN_STEP_SQL, {"runs": ids}).to_pylist()
    steps = {r["run_id"]: r["step_ns"] for r in run_steps}
    fewest = min(r["steady_steps"] for r in run_steps)
    if fewest < MIN_STEADY_STEPS:
        notes.append(
            f"a run has only {fewest} steady-state steps (after warm-up): the fit is rough; "
            f"record {MIN_STEADY_STEPS} or more"
        )
    util = {
        r["run_id"]: r for r in store.query(_UTIL_SQL, {"runs": ids}).to_pylist() if r["util_pct"] is not None
    }
    if compute["kernel_ns_per_sample"] == 0.0:
        if _split_kernel_from_util(compute, runs, util, steps):
            notes.append("kernel time per sample taken from the GPU utilisation of the one-rank run")
        else:
            # All of it per sample: exact for the measured batch size, a guess for others.
            compute["kernel_ns_per_sample"] = compute["host_ns"] / max(batch_of.values())
            compute["host_ns"] = compute["penalty"] = 0.0
            notes.append("no per-sample term and no GPU utilisation: all compute taken as per-sample time")

    def cpu_factor(r: dict[str, Any]) -> float:
        return 1.0 + compute["penalty"] * ((r["ranks_on_node"] or 1) - 1)

    compute["optimizer_ns"] = float(np.median([r["optimizer_ns"] / cpu_factor(r) for r in per_rank]))
    compute["other_ns"] = float(np.median([r["other_ns"] / cpu_factor(r) for r in per_rank]))
    run_data: dict[str, list[float]] = {}
    for r in per_rank:
        run_data.setdefault(r["run_id"], []).append(r["data_ns"])
    data_b = np.array([batch_of[k] for k in run_data], dtype=np.float64)
    data_y = np.array([float(np.median(v)) for v in run_data.values()])
    if len(set(data_b.tolist())) >= 2:
        d0, d1 = _lstsq_nonneg(np.column_stack([np.ones_like(data_b), data_b]), data_y)
    else:
        d0, d1 = 0.0, float(np.median(data_y / data_b))
    compute["data_fixed_ns"], compute["data_ns_per_sample"] = float(d0), float(d1)
    sigmas = [r["fb_log_sigma"] for r in per_rank if r["fb_log_sigma"] is not None]
    return compute, steps, util, sigmas


def _fit_backend(
    store: Store, runs: list[dict[str, Any]], ids: list[str], notes: list[str]
) -> tuple[Backend, list[float]]:
    """The collective: coordination and ring from comm rows (or exposed sync without them)."""
    by_run = {r["run_id"]: r for r in runs}
    comm = store.query(_COMM_SQL, {"runs": ids}).to_pylist()
    with_comm = {c["run_id"] for c in comm}
    # the ring of the instance's own group (the run's world where the group size is not recorded)
    points = [
        (
            by_run[c["run_id"]],
            int(c["group_size"] or by_run[c["run_id"]]["world_size"]),
            c["bytes"],
            c["own_ns"],
        )
        for c in comm
        if by_run[c["run_id"]]["world_size"] > 1
    ]
    fallback = [
        (
            by_run[f["run_id"]],
            by_run[f["run_id"]]["world_size"],
            by_run[f["run_id"]]["grad_bytes"] or 0,
            f["own_ns"],
        )
        for f in store.query(_SYNC_FALLBACK_SQL, {"runs": ids}).to_pylist()
        if f["run_id"] not in with_comm and by_run[f["run_id"]]["world_size"] > 1
    ]
    if fallback:
        notes.append("some runs have no comm rows: their collective time is the least exposed sync per step")
    coord, a_i, b_i, a_e, b_e = _solve_ring(
        [(p, run["nodes"] or 1, nbytes, own) for run, p, nbytes, own in points + fallback], notes
    )
    name = runs[0]["backend"] or "unknown"
    backend = Backend(
        name=_name(name, "unknown"),
        coord_us=coord / 1e3,
        intra_alpha_us=a_i / 1e3,
        # a bandwidth term fitted to zero reads as a link too fast to matter
        intra_gb_per_s=1.0 / b_i if b_i > 0 else UNRESOLVED_GB_PER_S,
        inter_alpha_us=a_e / 1e3,
        inter_gb_per_s=1.0 / b_e if b_e > 0 else UNRESOLVED_GB_PER_S,
        ring_in_gpu_kernel="nccl" in str(name).lower(),
    )
    return backend, [c["log_sigma"] for c in comm if c["log_sigma"] is not None]


def _hardware(
    store: Store, runs: list[dict[str, Any]], ids: list[str], gpu: dict[str, Any]
) -> dict[str, Any]:
    """Partition fields that describe the machine rather than the cost model."""
    first = runs[0]
    cpus = store.query(
        "SELECT max(cpu_count) AS c FROM ranks WHERE run_id IN (SELECT unnest(?))", [ids]
    ).to_pylist()[0]["c"]
    # invert the generator's power model (simulate.model.board_power_w), linear in utilisation
    idle_w = max((gpu.get("power0_mw") or 0.0) / 1e3 / ACTIVE_IDLE_FACTOR, 0.0)
    slope_w = (gpu.get("power_slope") or 0.0) * 100 / 1e3
    return {
        "device_model": first["device_model"] or "unknown",
        "gpus_per_node": max(int(r["gpus_per_node"] or r["world_size"]) for r in runs),
        "cpus_per_node": int(cpus or 1),
        "first_node": 0,
        "device_mem_bytes": int(gpu.get("mem_total_bytes") or 0),
        "device_peak_flops": float(first["device_peak_flops"] or 0.0),
        "idle_power_w": idle_w,
        "max_power_w": max(idle_w * ACTIVE_IDLE_FACTOR + slope_w / KERNEL_POWER_SHARE, idle_w),
        "sm_clock_mhz": float(gpu.get("sm_clock_mhz") or 0.0),
        "mem_clock_mhz": float(gpu.get("mem_clock_mhz") or 0.0),
        "has_nvlink": bool(gpu.get("nvlink")),
        "software": {k: first[k] or "" for k in _SOFTWARE_KEYS},
        "gpu_telemetry": bool(gpu),
    }


def _main_experiment(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of the experiment with the most world sizes: a scaling sweep, not a batch sweep."""
    sizes: dict[str, set[int]] = {}
    for r in runs:
        sizes.setdefault(r["experiment"] or "", set()).add(int(r["world_size"]))
    main = min(sizes, key=lambda e: (-len(sizes[e]), e))
    return [r for r in runs if (r["experiment"] or "") == main]


def _fit_group(store: Store, runs: list[dict[str, Any]]) -> FittedModel:
    ids = [r["run_id"] for r in runs]
    notes: list[str] = []
    compute, steps, util, sigmas = _fit_compute(store, runs, ids, notes)
    backend, comm_sigmas = _fit_backend(store, runs, ids, notes)
    cluster = _name(runs[0]["cluster"], "cluster")
    partition = Partition(
        name=cluster,
        hostname_pattern=cluster + "-sim{node:03d}",
        kernel_us_per_sample=compute["kernel_ns_per_sample"] / 1e3,
        fill_samples=compute["fill"],
        step_overhead_us=compute["host_ns"] / 1e3,
        cpu_share_penalty=compute["penalty"],
        optimizer_us=compute["optimizer_ns"] / 1e3,
        other_us=compute["other_ns"] / 1e3,
        data_fixed_us=compute["data_fixed_ns"] / 1e3,
        data_us_per_sample=compute["data_ns_per_sample"] / 1e3,
        step_cv=_noise("step-to-step", math.expm1(float(np.median(sigmas))) if sigmas else 0.0, notes),
        rank_cv=_noise("rank-to-rank", compute["rank_cv"], notes),
        comm_cv=_noise(
            "collective", math.expm1(float(np.median(comm_sigmas))) if comm_sigmas else 0.0, notes
        ),
        backends={backend.name: backend},
        notes=f"fitted to {len(ids)} runs",
        **_hardware(store, runs, ids, next(iter(util.values()), {})),
    )
    first = runs[0]
    param_count = int(first["param_count"] or 0)
    workload = Workload(
        name=first["model"] or "model",
        param_count=param_count,
        bytes_per_param=int((first["grad_bytes"] or 0) // param_count) if param_count else 4,
        dataset_samples=int(first["dataset_samples"] or 0),
        input_bytes_per_sample=0,
    )
    world_sizes = tuple(sorted({int(r["world_size"]) for r in runs}))
    if len(world_sizes) < MIN_TRUSTED_WORLD_SIZES:
        notes.append(
            f"only {len(world_sizes)} world size(s) measured: predictions are extrapolations "
            f"not to be trusted (DESIGN.md wants {MIN_TRUSTED_WORLD_SIZES} or more)"
        )
    points = _quality_points(partition, backend, workload, runs, steps)
    errors = [
        2 * abs(q.model_step_ns - q.measured_step_ns) / (q.model_step_ns + q.measured_step_ns) for q in points
    ]
    smape = float(np.mean(errors)) if errors else math.nan
    if smape > MAX_USEFUL_SMAPE:
        notes.append(
            f"the model misses the measured step times by {smape:.0%} (SMAPE): it does not describe "
            "these runs, so do not trust its predictions"
        )
    main = _main_experiment(runs)
    return FittedModel(
        cluster=cluster,
        experiment=_name(main[0]["experiment"], "fit"),
        scaling_mode=main[0]["scaling_mode"] or "",
        partition=partition,
        backend=backend,
        workload=workload,
        run_ids=tuple(ids),
        world_sizes=world_sizes,
        batch_sizes=tuple(sorted({int(r["batch_size_per_rank"] or 1) for r in main})),
        measured_batch_sizes=tuple(sorted({int(r["batch_size_per_rank"] or 1) for r in runs})),
        points=points,
        smape=smape,
        notes=tuple(dict.fromkeys(notes)),
    )


def _quality_points(
    partition: Partition,
    backend: Backend,
    workload: Workload,
    runs: list[dict[str, Any]],
    steps: dict[str, float],
) -> tuple[FitPoint, ...]:
    """Simulate the fitted model at every measured point: the fit's own check (SMAPE of step time)."""
    out = []
    part = replace(partition, rank_cv=0.0)
    for r in runs:
        if r["run_id"] not in steps:
            continue
        rng = np.random.default_rng(0)
        tl = simulate_timeline(
            part,
            backend,
            int(r["world_size"]),
            int(r["batch_size_per_rank"] or 1),
            _QUALITY_STEPS,
            workload.grad_bytes,
            0,
            rng,
        )
        model_ns = float(np.median(tl.step_ns[10:].max(axis=1)))
        out.append(
            FitPoint(
                r["run_id"],
                int(r["world_size"]),
                int(r["batch_size_per_rank"] or 1),
                float(steps[r["run_id"]]),
                model_ns,
            )
        )
    return tuple(out)


def fit_model(
    store: Store,
    *,
    experiments: Sequence[str] = (),
    clusters: Sequence[str] = (),
    backends: Sequence[str] = (),
    run_ids: Sequence[str] = (),
) -> list[FittedModel]:
    """One fitted model per (cluster, backend, device model, model) group of the selected runs."""
    runs = _select_runs(store, experiments, clusters, backends, run_ids)
    if not runs:
        raise PerfscopeError(
            "no runs with steps match the selection; check --experiment/--cluster/--backend against "
            "`perfscope info` of the store"
        )
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in sorted(runs, key=lambda r: (r["world_size"], r["batch_size_per_rank"] or 0, r["run_id"])):
        groups.setdefault((r["cluster"], r["backend"], r["device_model"], r["model"]), []).append(r)
    return [_fit_group(store, members) for _, members in sorted(groups.items(), key=lambda kv: str(kv[0]))]
