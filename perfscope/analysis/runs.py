"""Per-run analyses: steady-state summary, phase breakdown, per-rank breakdown, step-time series."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .selection import Selection
from .steady import (
    BREAKDOWN_PHASES,
    PHASES,
    USEFUL_PHASES,
    rank_agg_table,
    rank_comm_table,
    run_comm_table,
    run_stats_table,
    runs_table,
    thresholds_table,
)

#: Step-series buckets per run and rank: enough for a chart, bounded for million-step runs.
SERIES_BUCKETS = 2000

RUN_SUMMARY_COLUMNS = (
    "run_id, experiment, source, cluster, backend, model, device_model, world_size, nodes, "
    "gpus_per_node, batch_size_per_rank, global_batch_size, "
    "coalesce(ranks_seen, 0) AS ranks_seen, coalesce(n_steps, 0) AS steps_total, warmup_steps, "
    "coalesce(steady_steps, 0) AS steady_steps, step_ns, step_median_ns, step_p10_ns, step_p90_ns, step_cv, "
    "slow_step_share, slow_step_ratio, step_period, "
    + ", ".join(f"{p}_ns" for p in BREAKDOWN_PHASES)
    + ", c.comm_total_mean AS comm_total_ns, c.comm_count_mean AS comm_count, samples_per_step, "
    "throughput_samples_per_s, dataset_samples, epoch_s, "
    "steady_elapsed_ns / 1e9 AS elapsed_s, elapsed_source"
)


@analysis(
    "run_summary",
    "Runs: steady-state step time, phases, throughput",
    "steady-state",
    "step-time",
    "throughput",
)
def run_summary(store: Store, sel: Selection) -> pa.Table:
    """One row per selected run. Phase columns are the additive breakdown: they add up to step_ns."""
    stats = run_stats_table(store, sel)
    comm = run_comm_table(store, sel)
    return store.query(
        f"SELECT {RUN_SUMMARY_COLUMNS} FROM {stats} LEFT JOIN {comm} c USING (run_id) "
        "ORDER BY experiment, cluster, backend, batch_size_per_rank, world_size, run_id"
    )


@analysis("phase_breakdown", "Phase breakdown per run", "steady-state", "step-time")
def phase_breakdown(store: Store, sel: Selection) -> pa.Table:
    """Long form of the additive breakdown: one row per run and phase, with its share of the step."""
    stats = run_stats_table(store, sel)
    unions = " UNION ALL ".join(
        f"SELECT run_id, experiment, source, cluster, backend, world_size, '{p}' AS phase, "
        f"{i} AS phase_order, {p}_ns AS time_ns, {p}_ns / nullif(step_ns, 0) AS share FROM {stats} "
        "WHERE step_ns IS NOT NULL"
        for i, p in enumerate(BREAKDOWN_PHASES)
    )
    return store.query(
        f"SELECT * EXCLUDE (phase_order) FROM ({unions}) "
        "ORDER BY experiment, cluster, backend, world_size, run_id, phase_order"
    )


@analysis("rank_breakdown", "Per-rank steady-state breakdown", "steady-state")
def rank_breakdown(store: Store, sel: Selection) -> pa.Table:
    """Per run and rank: means per steady step of each phase; useful = forward + backward + optimizer."""
    ra = rank_agg_table(store, sel)
    runs = runs_table(store, sel)
    named = [p for p in PHASES if p != "other"]
    means = ", ".join(f"{p}_sum / nullif({p}_n, 0) AS {p}_ns" for p in named)
    other = " - ".join(["step_sum"] + [f"coalesce({p}_sum, 0)" for p in named])
    useful = " + ".join(f"coalesce({p}_sum, 0)" for p in USEFUL_PHASES)
    return store.query(
        f"""
        SELECT a.run_id, r.source, r.world_size, a.rank, k.hostname, a.rows AS steps,
               step_sum / rows AS step_ns, {means},
               CASE WHEN ({other}) < 0 THEN 0.0 ELSE ({other}) / rows END AS other_ns,
               ({useful}) / rows AS useful_ns, c.comm_total_mean AS comm_total_ns,
               k.cpu_count, k.loader_workers, k.loader_prefetch_factor, k.loader_pin_memory,
               k.loader_persistent_workers, k.loader_batch_size
        FROM {ra} a JOIN {runs} r USING (run_id)
        LEFT JOIN {rank_comm_table(store, sel)} c USING (run_id, rank)
        LEFT JOIN (SELECT run_id, rank, any_value(hostname) AS hostname, any_value(cpu_count) AS cpu_count,
                          any_value(loader_workers) AS loader_workers,
                          any_value(loader_prefetch_factor) AS loader_prefetch_factor,
                          any_value(loader_pin_memory) AS loader_pin_memory,
                          any_value(loader_persistent_workers) AS loader_persistent_workers,
                          any_value(loader_batch_size) AS loader_batch_size
                   FROM ranks GROUP BY ALL) k
            USING (run_id, rank)
        ORDER BY a.run_id, a.rank
        """
    )


#: the runs columns of the job's settings (collectors/settings.py), in the order they are shown
RUN_SETTINGS = (
    "param_dtypes",
    "autocast",
    "compiled",
    "ddp_bucket_cap_mb",
    "ddp_gradient_as_bucket_view",
    "ddp_find_unused_parameters",
    "ddp_static_graph",
    "env",
)
#: the ranks columns of the job's settings, taken from rank 0's row (the most CPUs for cpu_count)
RANK_SETTINGS = (
    "loader_workers",
    "loader_prefetch_factor",
    "loader_pin_memory",
    "loader_persistent_workers",
    "loader_batch_size",
    "torch_threads",
    "omp_num_threads",
    "mkl_num_threads",
)


@analysis("run_settings", "The job's settings per run", "settings")
def run_settings(store: Store, sel: Selection) -> pa.Table:
    """Per run: the host's logical CPUs (the largest host), rank 0's DataLoader and thread settings,
    and the model, autocast, torch.compile, DDP and environment settings of the runs row."""
    runs = runs_table(store, sel)
    ranked = ", ".join(f"arg_min({c}, rank) AS {c}" for c in RANK_SETTINGS)
    run_cols = ", ".join(f"any_value({c}) AS {c}" for c in RUN_SETTINGS)
    return store.query(
        f"""
        SELECT r.run_id, r.source, r.world_size, k.cpu_count, {", ".join(RANK_SETTINGS)},
               {", ".join(RUN_SETTINGS)}
        FROM {runs} r
        LEFT JOIN (SELECT run_id, max(cpu_count) AS cpu_count, {ranked} FROM ranks GROUP BY run_id) k
            USING (run_id)
        LEFT JOIN (SELECT run_id, {run_cols} FROM runs GROUP BY run_id) m USING (run_id)
        ORDER BY r.run_id
        """
    )


@analysis("step_series", "Step time per rank over the run", "raw")
def step_series(store: Store, sel: Selection) -> pa.Table:
    """Every rank's step and phase times by step; long runs are bucketed into medians of k steps."""
    thr = thresholds_table(store, sel)
    phase_medians = ", ".join(f"median(s.{p}_ns) AS {p}_ns" for p in PHASES)
    return store.query(
        f"""
        WITH b AS (
            SELECT run_id, first_step, first_steady_step,
                   greatest(1, ceil(n_steps / {SERIES_BUCKETS}))::BIGINT AS k FROM {thr}
        )
        SELECT s.run_id, s.rank, min(s.step) AS step, count(*) AS steps_in_bucket,
               bool_and(s.step >= b.first_steady_step) AS steady,
               median(s.step_ns) AS step_ns, {phase_medians}
        FROM steps s JOIN b ON s.run_id = b.run_id
        GROUP BY s.run_id, s.rank, (s.step - b.first_step) // b.k
        ORDER BY s.run_id, s.rank, step
        """
    )
