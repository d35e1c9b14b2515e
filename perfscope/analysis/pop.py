"""POP efficiencies per run: load balance, communication and parallel efficiency, computation scaling."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .scaling import GROUP_SELECT, grouped_stats_table, scaling_table
from .selection import Selection
from .steady import USEFUL_PHASES, rank_agg_table


@analysis("pop", "POP efficiencies", "pop")
def pop(store: Store, sel: Selection) -> pa.Table:
    """useful = forward + backward + optimizer per rank, mean per steady step; T = the run's step time
    (the steady window's wall clock / its steps, steady.run_stats_table)."""
    ra = rank_agg_table(store, sel)
    gs = grouped_stats_table(store, sel)
    sc = scaling_table(store, sel)
    useful = " + ".join(f"coalesce({p}_sum, 0)" for p in USEFUL_PHASES)
    return store.query(
        f"""
        WITH u AS (
            SELECT run_id, avg(({useful}) / rows) AS useful_mean_ns, max(({useful}) / rows) AS useful_max_ns,
                   sum(({useful}) / rows) AS useful_total_ns
            FROM {ra} GROUP BY run_id
        ), r AS (
            SELECT g.*, u.useful_mean_ns, u.useful_max_ns, u.useful_total_ns,
                   u.useful_total_ns / nullif(g.samples_per_step, 0) AS useful_per_sample_ns,
                   sc.baseline_world_size
            FROM {gs} g JOIN u USING (run_id) JOIN {sc} sc USING (run_id)
        ), base AS (
            SELECT group_id, median(useful_per_sample_ns) AS useful_per_sample0
            FROM r WHERE world_size = baseline_world_size GROUP BY group_id
        )
        SELECT {GROUP_SELECT}, run_id, source, world_size, useful_mean_ns, useful_max_ns,
               step_ns AS step_mean_ns,
               useful_mean_ns / nullif(useful_max_ns, 0) AS load_balance,
               useful_max_ns / nullif(step_ns, 0) AS comm_efficiency,
               useful_mean_ns / nullif(useful_max_ns, 0) * useful_max_ns / nullif(step_ns, 0)
                   AS parallel_efficiency,
               useful_per_sample0 / nullif(useful_per_sample_ns, 0) AS computation_scaling,
               useful_mean_ns / nullif(step_ns, 0) * useful_per_sample0
                   / nullif(useful_per_sample_ns, 0) AS global_efficiency
        FROM r JOIN base USING (group_id)
        ORDER BY group_id, world_size, run_id
        """
    )
