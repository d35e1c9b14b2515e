"""Gradient synchronisation: exposed and total sync against N, bus bandwidth, alpha-beta fit."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pyarrow as pa

from ..store.reader import Store
from .cache import memo, temp_table
from .fitting import MIN_POINTS, AlphaBetaFit, fit_alpha_beta
from .registry import analysis
from .scaling import GROUP_SELECT, grouped_stats_table
from .selection import Selection
from .steady import run_comm_table, thresholds_table

SCOPE_SQL = "CASE WHEN world_size <= 1 THEN 'single' WHEN nodes <= 1 THEN 'intra-node' ELSE 'inter-node' END"


def instances_table(store: Store, sel: Selection) -> str:
    """Per collective instance (run, step, seq) of the steady steps: bytes and transfer time.

    transfer_ns runs from the last rank's entry to the last rank's exit, so the wait for late
    ranks is not counted as transfer (that wait is the straggler analysis's business). Only
    collectives: point-to-point rows (a peer) are no instance, and ranks whose calls at one
    (step, seq) differ in op or group size made different collectives, not one.
    """
    thr = thresholds_table(store, sel)
    return temp_table(
        store,
        ("instances", sel),
        f"""
        SELECT c.run_id, c.step, c.seq, any_value(c.op) AS op, max(c.bytes) AS bytes,
               count(*) AS ranks,
               max(c.start_ns + c.dur_ns) - max(c.start_ns) AS transfer_ns,
               max(c.start_ns) - min(c.start_ns) AS entry_spread_ns,
               max(c.start_ns) AS last_entry_ns,
               arg_max(c.rank, c.start_ns) AS last_rank,
               -- the last rank counts only when nobody entered at the same instant
               count(*) > 1 AND list_count(list_distinct(max(c.start_ns, 2))) = 2 AS last_unique
        FROM comm c JOIN {thr} t ON c.run_id = t.run_id AND c.step >= t.first_steady_step
        WHERE c.peer IS NULL
        GROUP BY c.run_id, c.step, c.seq
        HAVING count(DISTINCT c.op) = 1 AND count(DISTINCT coalesce(c.group_size, 0)) = 1
        """,
    )


def sync_table(store: Store, sel: Selection) -> str:
    gs = grouped_stats_table(store, sel)
    inst = instances_table(store, sel)
    busbw = "bytes / (transfer_ns / 1e9) * 2 * (i.world_size - 1) / i.world_size / 1e9"
    return temp_table(
        store,
        ("sync", sel),
        f"""
        WITH i AS (
            SELECT inst.*, g.world_size FROM {inst} inst JOIN {gs} g USING (run_id)
            WHERE transfer_ns > 0 AND op = 'allreduce'  -- the ring model and busbw are an allreduce's
        ), bw AS (
            -- bytes are unknown in traces that do not record them (nsys, gloo Kineto): such an
            -- instance has no bandwidth, and a step's bytes are a sum only when every one is known
            SELECT run_id, count(*) AS instances, count(bytes) AS sized,
                   CASE WHEN count(bytes) = count(*) THEN sum(bytes) END AS bytes_sum,
                   sum(transfer_ns) AS transfer_sum,
                   median(bytes / (transfer_ns / 1e9) / 1e9) AS algbw,
                   median({busbw}) AS busbw,
                   quantile_cont({busbw}, 0.1) AS busbw_p10,
                   quantile_cont({busbw}, 0.9) AS busbw_p90
            FROM i GROUP BY run_id
        ), s AS (
            SELECT g.*, {SCOPE_SQL} AS scope, bw.* EXCLUDE (run_id), c.* EXCLUDE (run_id),
                   coalesce(c.comm_total_mean, bw.transfer_sum / g.steady_steps) AS comm_total,
                   coalesce(c.comm_count_mean, bw.instances::DOUBLE / g.steady_steps) AS comm_n,
                   coalesce(bw.bytes_sum::DOUBLE / g.steady_steps, g.grad_bytes::DOUBLE) AS step_bytes
            FROM {gs} g LEFT JOIN bw USING (run_id) LEFT JOIN {run_comm_table(store, sel)} c USING (run_id)
        )
        SELECT {GROUP_SELECT}, run_id, source, world_size, nodes, scope,
               sync_exposed_ns, comm_total AS comm_total_ns, comm_n AS comm_count,
               step_bytes AS bytes_per_step,
               CASE WHEN comm_total > 0 THEN greatest(0, 1 - sync_exposed_ns / comm_total) END
                   AS overlap_share,
               CASE WHEN world_size > 1 THEN CASE
                   WHEN sized > 0 THEN algbw
                   WHEN grad_bytes > 0 AND coalesce(comm_total_mean, sync_exposed_ns) > 0
                       THEN grad_bytes / (coalesce(comm_total_mean, sync_exposed_ns) / 1e9) / 1e9
               END END AS algbw_gb_per_s,
               CASE WHEN world_size > 1 THEN CASE
                   WHEN sized > 0 THEN busbw
                   WHEN grad_bytes > 0 AND coalesce(comm_total_mean, sync_exposed_ns) > 0
                       THEN grad_bytes / (coalesce(comm_total_mean, sync_exposed_ns) / 1e9) / 1e9
                            * 2 * (world_size - 1) / world_size
               END END AS busbw_gb_per_s,
               CASE WHEN world_size > 1 AND sized > 0 THEN busbw_p10 END AS busbw_p10_gb_per_s,
               CASE WHEN world_size > 1 AND sized > 0 THEN busbw_p90 END AS busbw_p90_gb_per_s,
               CASE WHEN world_size <= 1 THEN NULL
                    WHEN sized > 0 THEN 'comm'
                    WHEN grad_bytes > 0 AND comm_total_mean > 0 THEN 'steps.comm_total_ns+runs.grad_bytes'
                    WHEN grad_bytes > 0 AND sync_exposed_ns > 0 THEN 'steps.sync_exposed_ns+runs.grad_bytes'
               END AS bw_source
        FROM s
        """,
    )


@analysis("sync", "Gradient sync and bus bandwidth against world size", "steady-state", "busbw")
def sync(store: Store, sel: Selection) -> pa.Table:
    """Exposed and total sync per step, collectives per step, bytes, overlap and bus bandwidth per run."""
    return store.query(f"SELECT * FROM {sync_table(store, sel)} ORDER BY group_id, world_size, run_id")


@analysis("collectives", "Collectives by message size", "busbw")
def collectives(store: Store, sel: Selection) -> pa.Table:
    """Per run, op and message size: instances, median transfer time and bus bandwidth."""
    gs = grouped_stats_table(store, sel)
    inst = instances_table(store, sel)
    return store.query(
        f"""
        SELECT i.run_id, g.source, g.world_size, g.nodes,
               CASE WHEN g.world_size <= 1 THEN 'single' WHEN g.nodes <= 1 THEN 'intra-node'
                    ELSE 'inter-node' END AS scope,
               i.op, i.bytes, count(*) AS instances, median(i.transfer_ns) AS transfer_ns,
               CASE WHEN g.world_size > 1 AND i.op = 'allreduce' THEN median(i.bytes / (i.transfer_ns / 1e9))
                    / 1e9 * 2 * (g.world_size - 1) / g.world_size END AS busbw_gb_per_s
        FROM {inst} i JOIN {gs} g USING (run_id)
        WHERE i.transfer_ns > 0
        GROUP BY i.run_id, g.source, g.world_size, g.nodes, i.op, i.bytes
        ORDER BY i.run_id, i.op, i.bytes
        """
    )


def _fit_points(store: Store, sel: Selection) -> list[dict[str, Any]]:
    """Points (cluster, backend, scope, p, n bytes, k collectives, t seconds) for the alpha-beta fit."""
    gs = grouped_stats_table(store, sel)
    inst = instances_table(store, sel)
    st = sync_table(store, sel)
    return store.query(
        f"""
        SELECT g.cluster, g.backend, {SCOPE_SQL} AS scope, g.run_id, g.world_size AS p,
               i.bytes::DOUBLE AS n, 1.0 AS k, median(i.transfer_ns) / 1e9 AS t, 'comm' AS data_source
        FROM {inst} i JOIN {gs} g USING (run_id)
        WHERE i.transfer_ns > 0 AND g.world_size > 1 AND i.op = 'allreduce' AND i.bytes IS NOT NULL
        GROUP BY g.cluster, g.backend, scope, g.run_id, g.world_size, i.bytes
        UNION ALL
        SELECT s.cluster, s.backend, s.scope, s.run_id, s.world_size, g.grad_bytes::DOUBLE,
               coalesce(s.comm_count, 1.0), coalesce(c.comm_total_mean, g.sync_exposed_ns) / 1e9,
               CASE WHEN c.comm_total_mean IS NOT NULL THEN 'steps.comm_total_ns'
                    ELSE 'steps.sync_exposed_ns' END
        FROM {st} s JOIN {gs} g USING (run_id) LEFT JOIN {run_comm_table(store, sel)} c USING (run_id)
        WHERE s.world_size > 1 AND s.bw_source IS NOT NULL AND s.bw_source <> 'comm'
              AND g.grad_bytes > 0
        """
    ).to_pylist()


def fit_points(pts: list[dict[str, Any]]) -> AlphaBetaFit | None:
    """Fit α and β to points with keys p, n, k, t (as `_fit_points` returns them). A point with an
    unknown (NULL) or non-finite value is no point: unknown bytes are not zero bytes."""
    known = [x for x in pts if all(_finite(x.get(key)) for key in ("p", "n", "k", "t"))]
    return fit_alpha_beta(
        [float(x["p"]) for x in known],
        [float(x["n"]) for x in known],
        [float(x["k"]) for x in known],
        [float(x["t"]) for x in known],
    )


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def alpha_beta_fits(
    store: Store, sel: Selection
) -> dict[tuple[str, str, str], tuple[AlphaBetaFit | None, list[dict[str, Any]]]]:
    """(cluster, backend, scope) -> (fit or None, its points)."""

    def compute() -> dict[tuple[str, str, str], tuple[AlphaBetaFit | None, list[dict[str, Any]]]]:
        by: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
        for pt in _fit_points(store, sel):
            by[(str(pt["cluster"]), str(pt["backend"]), str(pt["scope"]))].append(pt)
        return {key: (fit_points(pts), pts) for key, pts in sorted(by.items())}

    return memo(store, ("alpha_beta", sel), compute)


@analysis("allreduce_fit", "Alpha-beta fit of the ring allreduce", "alpha-beta")
def allreduce_fit(store: Store, sel: Selection) -> pa.Table:
    """α (latency per ring step) and β (seconds per byte) within a node and across nodes. α is
    NULL (`alpha_refused`) when it is far above the time per hop the cheapest collective took
    (`alpha_ceiling_s`): that is queueing or contention fitted as latency, not latency."""
    rows = []
    for (cluster, backend, scope), (fit, pts) in alpha_beta_fits(store, sel).items():
        sizes = sorted({int(x["p"]) for x in pts})
        rows.append(
            {
                "cluster": cluster,
                "backend": backend,
                "scope": scope,
                "alpha_s": fit.alpha_s if fit and not fit.alpha_refused else None,
                "alpha_ceiling_s": fit.alpha_ceiling_s if fit else None,
                "alpha_refused": bool(fit and fit.alpha_refused),
                "beta_s_per_byte": fit.beta_s_per_byte if fit else None,
                "bandwidth_gb_per_s": fit.bandwidth_gb_per_s if fit else None,
                "points": len(pts),
                "world_sizes": ",".join(str(s) for s in sizes),
                "smape_pct": fit.smape_pct if fit else None,
                "r2_adj": fit.r2_adj if fit else None,
                "too_few_points": fit is None or len(pts) < MIN_POINTS,
                "data_source": ",".join(sorted({str(x["data_source"]) for x in pts})),
            }
        )
    return pa.Table.from_pylist(rows, schema=ALLREDUCE_FIT_SCHEMA)


ALLREDUCE_FIT_SCHEMA = pa.schema(
    [
        ("cluster", pa.string()),
        ("backend", pa.string()),
        ("scope", pa.string()),
        ("alpha_s", pa.float64()),
        ("alpha_ceiling_s", pa.float64()),
        ("alpha_refused", pa.bool_()),
        ("beta_s_per_byte", pa.float64()),
        ("bandwidth_gb_per_s", pa.float64()),
        ("points", pa.int64()),
        ("world_sizes", pa.string()),
        ("smape_pct", pa.float64()),
        ("r2_adj", pa.float64()),
        ("too_few_points", pa.bool_()),
        ("data_source", pa.string()),
    ]
)
