"""Scaling across world sizes: speedup, efficiency, per-GPU speedup, lost time by phase, backends."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .cache import temp_table
from .groups import groups_table
from .registry import analysis
from .selection import Selection
from .steady import BREAKDOWN_PHASES, run_stats_table

GROUP_SELECT = "group_id, experiment, cluster, backend, model, scaling_mode, mixed, mode_note"


def grouped_stats_table(store: Store, sel: Selection) -> str:
    """Run statistics joined with the group columns (runs with steady steps only)."""
    return temp_table(
        store,
        ("grouped_stats", sel),
        f"""
        SELECT s.*, g.group_id, g.scaling_mode, g.mixed, g.mode_note
        FROM {run_stats_table(store, sel)} s JOIN {groups_table(store, sel)} g USING (run_id)
        WHERE s.step_ns IS NOT NULL
        """,
    )


def scaling_table(store: Store, sel: Selection) -> str:
    gs = grouped_stats_table(store, sel)
    base_phases = ", ".join(f"median({p}_ns) AS {p}0" for p in BREAKDOWN_PHASES)
    # Lost time has a floor of 0: a phase (or a whole step) cheaper than at the baseline is a gain,
    # and lost_note names it (a superlinear step, from a contaminated baseline or a cache effect).
    raw = {p: f"(world_size * {p}_ns - n0 * {p}0 * work_ratio)" for p in BREAKDOWN_PHASES}
    lost = ",\n".join(f"greatest({raw[p]}, 0) AS lost_{p}_ns" for p in BREAKDOWN_PHASES)
    gained = ", ".join(f"CASE WHEN {raw[p]} < 0 THEN '{p}' END" for p in BREAKDOWN_PHASES)
    phase_cols = ", ".join(f"{p}_ns" for p in BREAKDOWN_PHASES)
    return temp_table(
        store,
        ("scaling", sel),
        f"""
        WITH n0 AS (SELECT group_id, min(world_size) AS n0 FROM {gs} GROUP BY group_id),
        base AS (
            SELECT g.group_id, any_value(n0.n0) AS n0,
                   string_agg(g.run_id, ',' ORDER BY g.run_id) AS baseline_run_id,
                   median(step_ns) AS t0, median(samples_per_step) AS g0,
                   -- one baseline step time for speedup and lost time alike, even with repeated runs
                   median(samples_per_step) / (median(step_ns) / 1e9) AS x0, {base_phases}
            FROM {gs} g JOIN n0 ON g.group_id = n0.group_id AND g.world_size = n0.n0
            GROUP BY g.group_id
        ), j AS (
            SELECT g.*, base.* EXCLUDE (group_id),
                   g.samples_per_step / nullif(base.g0, 0) AS work_ratio
            FROM {gs} g JOIN base USING (group_id)
        )
        SELECT {GROUP_SELECT}, run_id, source, world_size, nodes, gpus_per_node,
               batch_size_per_rank, global_batch_size, samples_per_step,
               baseline_run_id, n0 AS baseline_world_size,
               step_ns, {phase_cols}, throughput_samples_per_s,
               throughput_samples_per_s / x0 AS speedup,
               world_size::DOUBLE / n0 AS ideal_speedup,
               throughput_samples_per_s / x0 * n0 / world_size AS efficiency,
               throughput_samples_per_s / x0 / world_size AS per_gpu_speedup,
               greatest(world_size * step_ns - n0 * t0 * work_ratio, 0) AS lost_ns,
               {lost},
               CASE WHEN world_size * step_ns - n0 * t0 * work_ratio < 0 THEN
                        'superlinear: less time per sample than at the baseline (a contaminated '
                        || 'baseline or a cache effect), so nothing is lost'
                    WHEN concat_ws(', ', {gained}) <> '' THEN
                        'faster than at the baseline, shown as 0 lost: ' || concat_ws(', ', {gained})
               END AS lost_note,
               sync_exposed_ns / nullif(step_ns, 0) AS sync_share,
               data_ns / nullif(step_ns, 0) AS data_share
        FROM j
        """,
    )


@analysis(
    "scaling", "Scaling: speedup, efficiency, lost time", "speedup", "scaling-mode", "lost-time", "throughput"
)
def scaling(store: Store, sel: Selection) -> pa.Table:
    """One row per run in its scaling group, against the group's smallest world size."""
    return store.query(f"SELECT * FROM {scaling_table(store, sel)} ORDER BY group_id, world_size, run_id")


@analysis("lost_time", "Lost time by phase", "lost-time")
def lost_time(store: Store, sel: Selection) -> pa.Table:
    """Long form of the lost time: one row per run and phase, with its share of the run's lost time."""
    sc = scaling_table(store, sel)
    unions = " UNION ALL ".join(
        f"SELECT group_id, run_id, source, world_size, '{p}' AS phase, {i} AS phase_order, "
        f"lost_{p}_ns AS lost_ns, lost_{p}_ns / nullif(lost_ns, 0) AS share_of_lost FROM {sc}"
        for i, p in enumerate(BREAKDOWN_PHASES)
    )
    return store.query(
        f"SELECT * EXCLUDE (phase_order) FROM ({unions}) ORDER BY group_id, world_size, run_id, phase_order"
    )


@analysis("backend_compare", "Backends side by side", "step-time", "throughput")
def backend_compare(store: Store, sel: Selection) -> pa.Table:
    """Runs that differ only in backend at the same world size: which backend is fastest there."""
    rs = run_stats_table(store, sel)
    return store.query(
        f"""
        WITH r AS (SELECT * FROM {rs} WHERE step_ns IS NOT NULL AND backend <> ''),
        k AS (
            SELECT experiment, cluster, model, batch_size_per_rank, world_size
            FROM r GROUP BY ALL HAVING count(DISTINCT backend) >= 2
        ), c AS (
            SELECT r.experiment, r.cluster, r.model, r.batch_size_per_rank, r.world_size, r.nodes,
                   r.backend, r.run_id, r.source, r.step_ns, r.sync_exposed_ns, r.throughput_samples_per_s
            FROM r JOIN k USING (experiment, cluster, model, batch_size_per_rank, world_size)
        )
        SELECT *,
               first_value(backend) OVER w AS best_backend,
               step_ns / first_value(step_ns) OVER w AS ratio_to_best
        FROM c
        WINDOW w AS (PARTITION BY experiment, cluster, model, batch_size_per_rank, world_size
                     ORDER BY step_ns, backend, run_id
                     ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
        ORDER BY experiment, cluster, model, batch_size_per_rank, world_size, step_ns, backend, run_id
        """
    )
