"""Batch-size sweeps (step and epoch time, samples/s against batch size) and time-to-metric."""

from __future__ import annotations

import pyarrow as pa

from ..store import Store
from .cache import temp_table
from .registry import analysis
from .scaling import grouped_stats_table
from .selection import Selection
from .steady import runs_table
from .utilisation import _run_t0

CURVE_POINTS = 500
#: Steps in the moving mean that smooths a noisy per-step metric before asking "reached yet?".
SMOOTH_STEPS = 10
LOWER_IS_BETTER = ("loss", "err", "perplex", "mse", "mae", "rmse", "nll", "wer", "cer")
HIGHER_IS_BETTER = ("acc", "f1", "auc", "precision", "recall", "bleu", "score", "iou", "map", "top")


@analysis("batch_sweep", "Batch-size sweep", "batch-sweep", "throughput")
def batch_sweep(store: Store, sel: Selection) -> pa.Table:
    """Runs at one world size that differ in per-rank batch: time and throughput against batch."""
    gs = grouped_stats_table(store, sel)
    return store.query(
        f"""
        WITH r AS (
            SELECT *, count(DISTINCT batch_size_per_rank) OVER k AS batches FROM {gs}
            WINDOW k AS (PARTITION BY experiment, cluster, backend, model, world_size)
        ), s AS (SELECT * FROM r WHERE batches >= 2 AND batch_size_per_rank IS NOT NULL)
        SELECT experiment, cluster, backend, model, world_size, run_id, source,
               batch_size_per_rank, global_batch_size, step_ns,
               step_ns / nullif(samples_per_step, 0) AS per_sample_ns,
               throughput_samples_per_s, epoch_s,
               throughput_samples_per_s / first_value(throughput_samples_per_s) OVER (
                   PARTITION BY experiment, cluster, backend, model, world_size
                   ORDER BY batch_size_per_rank, run_id) AS throughput_vs_smallest
        FROM s
        ORDER BY experiment, cluster, backend, model, world_size, batch_size_per_rank, run_id
        """
    )


def _direction_sql(name: str) -> str:
    lower = " OR ".join(f"contains(lower({name}), '{w}')" for w in LOWER_IS_BETTER)
    higher = " OR ".join(f"contains(lower({name}), '{w}')" for w in HIGHER_IS_BETTER)
    return f"CASE WHEN {lower} THEN 'lower' WHEN {higher} THEN 'higher' END"


def _curves_table(store: Store, sel: Selection) -> str:
    """Every metric value of the lowest rank that logged it, with wall time since the first step."""
    runs = runs_table(store, sel)
    gs = grouped_stats_table(store, sel)
    t0 = _run_t0(store, sel)
    return temp_table(
        store,
        ("curves", sel),
        f"""
        WITH m AS (
            SELECT m.* FROM metrics m
            JOIN (SELECT run_id, name, min(rank) AS r0 FROM metrics GROUP BY run_id, name) f
              ON m.run_id = f.run_id AND m.name = f.name AND m.rank = f.r0
            WHERE m.run_id IN (SELECT run_id FROM {runs})
        )
        SELECT m.run_id, r.source, r.experiment, r.world_size, r.batch_size_per_rank,
               r.global_batch_size, m.name AS metric, m.step, (m.ts_ns - t.t0) / 1e9 AS elapsed_s,
               (m.step + 1) * g.samples_per_step AS samples_seen, m.value,
               avg(m.value) OVER (PARTITION BY m.run_id, m.name ORDER BY m.step
                                  ROWS BETWEEN {SMOOTH_STEPS - 1} PRECEDING AND CURRENT ROW) AS smoothed
        FROM m JOIN {runs} r USING (run_id) JOIN {t0} t USING (run_id)
        LEFT JOIN {gs} g USING (run_id)
        """,
    )


@analysis("metric_curves", "User metrics against wall time", "batch-sweep")
def metric_curves(store: Store, sel: Selection) -> pa.Table:
    """Loss, accuracy ... against wall time and samples seen (at most 500 points per run and metric)."""
    c = _curves_table(store, sel)
    return store.query(
        f"""
        SELECT * EXCLUDE (smoothed, i, n) FROM (
            SELECT *, row_number() OVER w - 1 AS i, count(*) OVER w AS n FROM {c}
            WINDOW w AS (PARTITION BY run_id, metric ORDER BY step)
        ) WHERE i % greatest(1, ceil(n / {CURVE_POINTS})::BIGINT) = 0 OR i = n - 1
        ORDER BY experiment, metric, run_id, step
        """
    )


@analysis("time_to_metric", "Time to a common metric target", "batch-sweep")
def time_to_metric(store: Store, sel: Selection) -> pa.Table:
    """Per experiment and metric the loosest best value every run reached (smoothed over 10 steps)
    is the target; per run, the wall time and steps it took to get there."""
    c = _curves_table(store, sel)
    return store.query(
        f"""
        WITH d AS (
            -- direction from the name, else from the trend (first vs last tenth of the run)
            SELECT experiment, metric, coalesce({_direction_sql("metric")},
                   CASE WHEN avg(value) FILTER (WHERE step <= first_s + (last_s - first_s) / 10)
                           >= avg(value) FILTER (WHERE step >= last_s - (last_s - first_s) / 10)
                        THEN 'lower' ELSE 'higher' END) AS direction
            FROM (SELECT *, min(step) OVER (PARTITION BY run_id, metric) AS first_s,
                            max(step) OVER (PARTITION BY run_id, metric) AS last_s FROM {c})
            GROUP BY experiment, metric
        ), best AS (
            SELECT c.run_id, c.experiment, c.metric, d.direction,
                   CASE WHEN d.direction = 'lower' THEN min(smoothed) ELSE max(smoothed) END AS best_value,
                   arg_max(value, step) AS final_value
            FROM {c} c JOIN d USING (experiment, metric)
            GROUP BY c.run_id, c.experiment, c.metric, d.direction
        ), tgt AS (
            SELECT experiment, metric,
                   CASE WHEN any_value(direction) = 'lower' THEN max(best_value) ELSE min(best_value) END
                       AS target
            FROM best GROUP BY experiment, metric
        ), hit AS (
            SELECT c.run_id, c.metric, min(c.elapsed_s) AS time_to_target_s, min(c.step) AS steps_to_target
            FROM {c} c JOIN d USING (experiment, metric) JOIN tgt USING (experiment, metric)
            WHERE (d.direction = 'lower' AND c.smoothed <= tgt.target)
               OR (d.direction = 'higher' AND c.smoothed >= tgt.target)
            GROUP BY c.run_id, c.metric
        ), r AS (SELECT DISTINCT run_id, source, world_size, batch_size_per_rank, global_batch_size FROM {c})
        SELECT b.experiment, b.metric, b.direction, t.target, b.run_id, r.source, r.world_size,
               r.batch_size_per_rank, r.global_batch_size, h.time_to_target_s IS NOT NULL AS reached,
               h.time_to_target_s, h.steps_to_target, b.best_value, b.final_value
        FROM best b JOIN tgt t USING (experiment, metric) JOIN r USING (run_id)
        LEFT JOIN hit h USING (run_id, metric)
        ORDER BY b.experiment, b.metric, h.time_to_target_s NULLS LAST, b.run_id
        """
    )
