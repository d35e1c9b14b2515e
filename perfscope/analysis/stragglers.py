"""Wait at collective per rank: who enters last and how often, from comm.start_ns (or exposed sync)."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from ..store.rollups import by_step_sql
from .cache import temp_table
from .registry import analysis
from .scaling import grouped_stats_table
from .selection import Selection
from .steady import rank_agg_table, thresholds_table
from .sync import instance_rows_table, instances_table

#: Heat-map buckets of steps per run.
WAIT_BUCKETS = 2000


def straggler_threshold_sql(n_ranks: str) -> str:
    """Share of instances a rank must be last in to be called a straggler: most of them, and well
    above the 1/n a fair draw gives (with 2 ranks, 50% is a coin toss)."""
    return f"greatest(0.5, 1.0 / {n_ranks} + 0.25)"


def _comm_runs(store: Store, sel: Selection) -> str:
    return f"SELECT DISTINCT run_id FROM {instances_table(store, sel)} WHERE ranks > 1"


def sync_spread_table(store: Store, sel: Selection) -> str:
    """Per steady step of multi-rank runs without comm rows: the least and most exposed sync and
    the rank with the least (it waited least, so it entered the synchronisation last; a tie goes
    to the lowest rank)."""
    thr = thresholds_table(store, sel)
    gs = grouped_stats_table(store, sel)
    cols = ("sync_n", "sync_min_ns", "sync_max_ns", "sync_last_rank")
    steps = by_step_sql(store, thr, cols, "s.step >= t.first_steady_step")
    return temp_table(
        store,
        ("sync_spread", sel),
        f"""
        SELECT run_id, step, sync_min_ns, sync_max_ns, sync_last_rank AS last_rank
        FROM ({steps})
        WHERE run_id IN (SELECT run_id FROM {gs} WHERE world_size > 1)
          AND run_id NOT IN ({_comm_runs(store, sel)})
          AND sync_n > 0
        """,
    )


@analysis("stragglers", "Wait at collective per rank", "wait-at-collective")
def stragglers(store: Store, sel: Selection) -> pa.Table:
    """Per run and rank: how often it entered a collective last, how long it waited, and how long
    the other ranks waited on average (others_wait_*: what the rank costs them).

    With comm rows: per instance w_i = max_j(start_j) − start_i. Without: per step the rank with
    the least exposed sync entered last, and w_i = sync_i − min_j(sync_j), summed from the per-rank
    and per-step aggregates (no extra pass over the steps).
    """
    inst = instances_table(store, sel)
    rows = instance_rows_table(store, sel)
    gs = grouped_stats_table(store, sel)
    sa = sync_spread_table(store, sel)
    ra = rank_agg_table(store, sel)
    return store.query(
        f"""
        WITH comm_waits AS (
            SELECT c.run_id, c.rank, count(*) AS instances,
                   sum(i.last_entry_ns - c.start_ns)::DOUBLE AS wait_sum,
                   NULL::BIGINT AS steps, 'comm.start_ns' AS wait_source
            FROM {rows} c JOIN {inst} i USING (run_id, step, grp, nth)
            WHERE i.ranks > 1
            GROUP BY c.run_id, c.rank
        ), comm_last AS (
            SELECT run_id, last_rank AS rank, count(*) AS last_count
            FROM {inst} WHERE ranks > 1 AND last_unique GROUP BY run_id, last_rank
        ), step_min AS (
            SELECT run_id, sum(sync_min_ns)::DOUBLE AS sync_min_sum FROM {sa} GROUP BY run_id
        ), sync_waits AS (
            SELECT a.run_id, a.rank, a.sync_exposed_n AS instances,
                   a.sync_exposed_sum - m.sync_min_sum AS wait_sum,
                   a.rows AS steps, 'steps.sync_exposed_ns' AS wait_source
            FROM {ra} a JOIN step_min m USING (run_id)
            WHERE a.sync_exposed_n > 0
              AND a.run_id IN (SELECT run_id FROM {sa})
        ), sync_last AS (
            -- a step has a last rank only when the ranks' exposed sync differs
            SELECT run_id, last_rank AS rank, count(*) AS last_count
            FROM {sa} WHERE sync_max_ns > sync_min_ns GROUP BY run_id, last_rank
        ), w AS (
            SELECT w.*, coalesce(cl.last_count, 0) AS last_count FROM comm_waits w
            LEFT JOIN comm_last cl USING (run_id, rank)
            UNION ALL
            SELECT w.*, coalesce(sl.last_count, 0) FROM sync_waits w
            LEFT JOIN sync_last sl USING (run_id, rank)
        ), n AS (SELECT run_id, rank, any_value(hostname) AS hostname FROM ranks GROUP BY ALL)
        SELECT w.run_id, g.source, g.world_size, w.rank, n.hostname, w.instances, w.last_count,
               w.last_count / nullif(w.instances, 0) AS last_share,
               w.wait_sum / nullif(w.instances, 0) AS wait_mean_ns,
               w.wait_sum / nullif(coalesce(w.steps, g.steady_steps), 0) AS wait_per_step_ns,
               w.wait_sum / nullif(coalesce(w.steps, g.steady_steps), 0) / nullif(g.step_ns, 0)
                   AS wait_share_of_step,
               -- what the rank costs the others: their mean wait per step (the straggler finding's number)
               (sum(w.wait_sum / nullif(coalesce(w.steps, g.steady_steps), 0)) OVER r
                   - w.wait_sum / nullif(coalesce(w.steps, g.steady_steps), 0))
                   / nullif(count(*) OVER r - 1, 0) AS others_wait_per_step_ns,
               (sum(w.wait_sum / nullif(coalesce(w.steps, g.steady_steps), 0)) OVER r
                   - w.wait_sum / nullif(coalesce(w.steps, g.steady_steps), 0))
                   / nullif(count(*) OVER r - 1, 0) / nullif(g.step_ns, 0) AS others_wait_share,
               w.last_count / nullif(w.instances, 0) > {straggler_threshold_sql("g.ranks_seen")}
                   AS is_straggler,
               w.wait_source
        FROM w JOIN {gs} g USING (run_id) LEFT JOIN n USING (run_id, rank)
        WINDOW r AS (PARTITION BY w.run_id)
        ORDER BY w.run_id, w.rank
        """
    )


@analysis("collective_wait", "Wait at collective, rank × step", "wait-at-collective")
def collective_wait(store: Store, sel: Selection) -> pa.Table:
    """Heat map data: per run, rank and step bucket, the wait at collective summed over the step."""
    inst = instances_table(store, sel)
    rows = instance_rows_table(store, sel)
    thr = thresholds_table(store, sel)
    sa = sync_spread_table(store, sel)
    return store.query(
        f"""
        WITH waits AS (
            SELECT c.run_id, c.rank, c.step, sum(i.last_entry_ns - c.start_ns)::DOUBLE AS wait_ns
            FROM {rows} c JOIN {inst} i USING (run_id, step, grp, nth)
            WHERE i.ranks > 1
            GROUP BY c.run_id, c.rank, c.step
            UNION ALL
            SELECT s.run_id, s.rank, s.step, (s.sync_exposed_ns - a.sync_min_ns)::DOUBLE
            FROM steps s JOIN {sa} a USING (run_id, step)
            WHERE s.sync_exposed_ns IS NOT NULL
        ), k AS (
            SELECT run_id, first_steady_step,
                   greatest(1, ceil((last_step - first_steady_step + 1) / {WAIT_BUCKETS}))::BIGINT AS k
            FROM {thr}
        )
        SELECT w.run_id, w.rank, min(w.step) AS step, count(*) AS steps_in_bucket, avg(w.wait_ns) AS wait_ns
        FROM waits w JOIN k USING (run_id)
        GROUP BY w.run_id, w.rank, (w.step - k.first_steady_step) // k.k
        ORDER BY w.run_id, w.rank, step
        """
    )
