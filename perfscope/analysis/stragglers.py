"""Wait at collective per rank: who enters last and how often, from comm.start_ns (or exposed sync)."""

from __future__ import annotations

import pyarrow as pa

from ..store import Store
from .cache import temp_table
from .registry import analysis
from .scaling import grouped_stats_table
from .selection import Selection
from .steady import thresholds_table
from .sync import instances_table

#: Heat-map buckets of steps per run.
WAIT_BUCKETS = 2000


def straggler_threshold_sql(n_ranks: str) -> str:
    """Share of instances a rank must be last in to be called a straggler: most of them, and well
    above the 1/n a fair draw gives (with 2 ranks, 50% is a coin toss)."""
    return f"greatest(0.5, 1.0 / {n_ranks} + 0.25)"


def rank_waits_table(store: Store, sel: Selection) -> str:
    """Per run, rank and steady step: wait at collective summed over the step's collectives."""
    thr = thresholds_table(store, sel)
    inst = instances_table(store, sel)
    gs = grouped_stats_table(store, sel)
    return temp_table(
        store,
        ("rank_waits", sel),
        f"""
        SELECT c.run_id, c.rank, c.step, sum(i.last_entry_ns - c.start_ns)::DOUBLE AS wait_ns,
               count(*) AS instances, 'comm.start_ns' AS wait_source
        FROM comm c JOIN {inst} i USING (run_id, step, seq)
        WHERE i.ranks > 1
        GROUP BY c.run_id, c.rank, c.step
        UNION ALL
        -- Without comm rows: the rank that waited least in the sync entered last.
        SELECT s.run_id, s.rank, s.step,
               (s.sync_exposed_ns - min(s.sync_exposed_ns) OVER (PARTITION BY s.run_id, s.step))::DOUBLE,
               1, 'steps.sync_exposed_ns'
        FROM steps s JOIN {thr} t ON s.run_id = t.run_id AND s.step >= t.first_steady_step
        WHERE s.run_id IN (SELECT run_id FROM {gs} WHERE world_size > 1)
              AND s.run_id NOT IN (SELECT DISTINCT run_id FROM {inst})
              AND s.sync_exposed_ns IS NOT NULL
        """,
    )


@analysis("stragglers", "Wait at collective per rank", "wait-at-collective")
def stragglers(store: Store, sel: Selection) -> pa.Table:
    """Per run and rank: how often it entered a collective last, and how long it made others wait."""
    waits = rank_waits_table(store, sel)
    inst = instances_table(store, sel)
    gs = grouped_stats_table(store, sel)
    return store.query(
        f"""
        WITH last_comm AS (
            SELECT run_id, last_rank AS rank, count(*) FILTER (WHERE last_unique) AS last_count,
                   any_value(n) AS n_instances
            FROM (SELECT *, count(*) OVER (PARTITION BY run_id) AS n FROM {inst} WHERE ranks > 1)
            GROUP BY run_id, last_rank
        ), last_steps AS (
            SELECT run_id, rank, count(*) FILTER (WHERE last) AS last_count
            FROM (SELECT *, wait_ns = 0 AND count(*) FILTER (WHERE wait_ns = 0)
                            OVER (PARTITION BY run_id, step) = 1 AS last
                  FROM {waits} WHERE wait_source = 'steps.sync_exposed_ns')
            GROUP BY run_id, rank
        ), w AS (
            SELECT run_id, rank, sum(instances) AS instances, sum(wait_ns) AS wait_sum,
                   count(*) AS steps, any_value(wait_source) AS wait_source
            FROM {waits} GROUP BY run_id, rank
        ), j AS (
            SELECT w.*, g.source, g.world_size, g.step_ns, g.ranks_seen,
                   coalesce(lc.last_count, ls.last_count, 0) AS last_count
            FROM w JOIN {gs} g USING (run_id)
            LEFT JOIN last_comm lc USING (run_id, rank)
            LEFT JOIN last_steps ls USING (run_id, rank)
        ), n AS (SELECT run_id, rank, any_value(hostname) AS hostname FROM ranks GROUP BY ALL)
        SELECT j.run_id, source, world_size, j.rank, n.hostname, instances, last_count,
               last_count / nullif(CASE WHEN wait_source = 'comm.start_ns'
                   THEN instances ELSE steps END, 0) AS last_share,
               wait_sum / nullif(instances, 0) AS wait_mean_ns,
               wait_sum / nullif(steps, 0) AS wait_per_step_ns,
               wait_sum / nullif(steps, 0) / nullif(step_ns, 0) AS wait_share_of_step,
               last_count / nullif(CASE WHEN wait_source = 'comm.start_ns' THEN instances ELSE steps END, 0)
                   > {straggler_threshold_sql("ranks_seen")} AS is_straggler,
               wait_source
        FROM j LEFT JOIN n USING (run_id, rank)
        ORDER BY j.run_id, j.rank
        """
    )


@analysis("collective_wait", "Wait at collective, rank × step", "wait-at-collective")
def collective_wait(store: Store, sel: Selection) -> pa.Table:
    """Heat map data: per run, rank and step bucket, the wait at collective summed over the step."""
    waits = rank_waits_table(store, sel)
    thr = thresholds_table(store, sel)
    return store.query(
        f"""
        WITH k AS (SELECT run_id, first_steady_step,
                          greatest(1, ceil((last_step - first_steady_step + 1) / {WAIT_BUCKETS}))::BIGINT AS k
                   FROM {thr})
        SELECT w.run_id, w.rank, min(w.step) AS step, count(*) AS steps_in_bucket, avg(w.wait_ns) AS wait_ns
        FROM {waits} w JOIN k USING (run_id)
        GROUP BY w.run_id, w.rank, (w.step - k.first_steady_step) // k.k
        ORDER BY w.run_id, w.rank, step
        """
    )
