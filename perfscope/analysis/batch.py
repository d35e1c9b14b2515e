"""Batch-size sweeps (step and epoch time, samples/s against batch size) and time-to-metric."""

from __future__ import annotations

import re

import pyarrow as pa

from ..store.reader import Store
from .cache import temp_table
from .registry import analysis
from .scaling import grouped_stats_table
from .selection import Selection, sql_literal
from .steady import runs_table
from .utilisation import _run_t0

CURVE_POINTS = 500
#: Steps in the moving mean that smooths a noisy per-step metric before asking "reached yet?".
SMOOTH_STEPS = 10
#: Which logged metrics are targets (time to target, divergence). A name is read as words (split at
#: '_', '/', '.', '-', spaces and camelCase, lower-cased): a word of LOWER_IS_BETTER makes it a
#: lower-is-better metric, one of HIGHER_IS_BETTER a higher-is-better one; a word of BOOKKEEPING
#: makes it none whatever else it holds (loss_scale, grad_norm, learning_rate, total_flos,
#: train_runtime, train_samples_per_second ...), and a name with neither kind of word (epoch,
#: global_step) is none. A metric the user names (--target, the `target` tag) is a target whatever
#: its name; its direction then comes from its name, else from its trend.
LOWER_IS_BETTER = re.compile(r"\w*loss(es)?|nll|mse|mae|rmse|err|errors?|perplexity|ppl|wer|cer|ter")
HIGHER_IS_BETTER = re.compile(
    r"acc(uracy)?(@?\d+)?|top\d*|f1|auc|auroc|precision|recall|bleu\d*|rouge\w*|score|iou|miou|map\d*"
    r"|ap\d*|dice|ndcg|mrr|r2"
)
BOOKKEEPING = frozenset(
    ("norm", "lr", "learning", "flos", "flops", "runtime", "second", "seconds", "sec", "throughput",
     "time", "scale", "scaler", "momentum", "memory", "mem", "mfu", "samples", "tokens", "num", "count")
)  # fmt: skip
#: The default target is the best value this share of the runs that did not diverge reached.
DEFAULT_TARGET_SHARE = 0.75
#: A run diverged when its smoothed metric ends this share of its progress (first to best) away
#: from its best, the best coming in the first two thirds of the run, and at least DIVERGED_FLOOR
#: of the best value itself; or when a value is NaN or infinite.
DIVERGED_MARGIN = 0.5
DIVERGED_FLOOR = 0.05


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


def metric_words(name: str) -> list[str]:
    """'train/TopAccuracy_step' -> ['train', 'top', 'accuracy', 'step']."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [w for w in re.split(r"[^a-z0-9@]+", spaced.lower()) if w]


def metric_direction(name: str) -> str | None:
    """'lower' or 'higher' for a metric whose name says it is a loss, an error, an accuracy ...;
    None for bookkeeping (grad_norm, learning_rate, epoch, *_runtime, *_per_second ...) and for a
    name that says neither: such a metric is a target only when the user names it."""
    words = metric_words(name)
    if any(w in BOOKKEEPING for w in words):
        return None
    if any(LOWER_IS_BETTER.fullmatch(w) for w in words):
        return "lower"
    if any(HIGHER_IS_BETTER.fullmatch(w) for w in words):
        return "higher"
    return None


def _target_metrics_sql(store: Store, curves: str, variants: str, sel: Selection) -> str:
    """(metric, direction) of the metrics time to target and divergence judge: those whose name
    gives a direction, and those the user names (direction NULL unless the name gives one)."""
    names = store.query(f"SELECT DISTINCT metric FROM {curves}").column("metric").to_pylist()
    named = {m for m, _ in sel.targets}
    named |= set(
        store.query(f"SELECT DISTINCT metric FROM ({_tag_targets_sql(variants)})").column(0).to_pylist()
    )
    rows = [(m, metric_direction(m)) for m in names if m is not None]
    rows = [(m, d) for m, d in rows if d is not None or m in named]
    if not rows:
        return "SELECT NULL::VARCHAR AS metric, NULL::VARCHAR AS direction WHERE false"
    values = ", ".join(f"({sql_literal(m)}, {sql_literal(d) if d else 'NULL'})" for m, d in rows)
    return f"SELECT * FROM (VALUES {values}) t(metric, direction)"


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


def _variants_table(store: Store, sel: Selection) -> str:
    """Per selected run: its variant and the target its `target` tag names ('loss=0.5'), if any.
    The variant is the user tags whose values differ between runs of the same experiment (the
    learning-rate rule, say), as sorted 'k=v' pairs; `target` and `seed` are not variants (runs
    that differ only in seed are repeats). Runs of different variants are compared, never pooled
    as repeats. Malformed tags read as none. Keys are read with json_each, never spliced into a
    JSON path: a `"` in a tag key made every analysis fail (issue 33)."""
    runs = runs_table(store, sel)
    obj = "CASE WHEN json_valid(t) THEN CASE WHEN json_type(t::JSON) = 'OBJECT' THEN t::JSON END END"
    return temp_table(
        store,
        ("variants", sel),
        f"""
        WITH t AS (
            SELECT r.run_id, r.experiment, {obj} AS j
            FROM {runs} r LEFT JOIN (SELECT run_id, any_value(tags) AS t FROM runs GROUP BY run_id) x
                 USING (run_id)
        ), kv AS (
            SELECT t.run_id, t.experiment, e.key AS k, json_extract_string(e.value, '$') AS v
            FROM t, json_each(t.j) e
            WHERE t.j IS NOT NULL AND e.key NOT IN ('target', 'seed')
        ), varying AS (
            -- a key whose value (or absence) is not the same in every run of the experiment
            SELECT kv.experiment, kv.k FROM kv
            JOIN (SELECT experiment, count(*) AS n FROM t GROUP BY experiment) e USING (experiment)
            GROUP BY kv.experiment, kv.k, e.n
            HAVING count(DISTINCT coalesce(kv.v, 'null')) > 1 OR count(*) < e.n
        )
        SELECT t.run_id,
               coalesce(string_agg(kv.k || '=' || coalesce(kv.v, 'null'), ', ' ORDER BY kv.k)
                        FILTER (WHERE varying.k IS NOT NULL), '') AS variant,
               any_value(json_extract_string(t.j, '$.target')) AS target_tag
        FROM t LEFT JOIN kv USING (run_id)
        LEFT JOIN varying ON varying.experiment = t.experiment AND varying.k = kv.k
        GROUP BY t.run_id
        """,
    )


def _tag_targets_sql(variants: str) -> str:
    """(run_id, metric, target) from `target` tags: 'metric=value[,metric=value]' or an object
    {"metric": value}; anything else is ignored."""
    return f"""
        SELECT run_id, metric, target FROM (
            SELECT run_id, trim(split_part(part, '=', 1)) AS metric,
                   TRY_CAST(trim(split_part(part, '=', 2)) AS DOUBLE) AS target
            FROM (SELECT run_id, unnest(string_split(target_tag, ',')) AS part
                  FROM {variants} WHERE target_tag IS NOT NULL AND NOT starts_with(target_tag, '{{'))
            UNION ALL
            SELECT o.run_id, e.key, TRY_CAST(json_extract_string(e.value, '$') AS DOUBLE)
            FROM (SELECT run_id, j
                  FROM (SELECT run_id, CASE WHEN json_valid(target_tag) THEN target_tag::JSON END AS j
                        FROM {variants} WHERE starts_with(target_tag, '{{'))
                  WHERE json_type(j) = 'OBJECT') o, json_each(o.j) e
        ) WHERE target IS NOT NULL AND isfinite(target)
    """


@analysis("time_to_metric", "Time to a metric target", "batch-sweep", "time-to-target")
def time_to_metric(store: Store, sel: Selection) -> pa.Table:
    """Per experiment and metric, the target (the user's: `--target`, else the runs' `target`
    tag; else the best value that DEFAULT_TARGET_SHARE of the runs that did not diverge reached,
    smoothed over 10 steps); per run, the wall time and steps it took to get there, its variant,
    and whether it diverged (a non-finite value, or the smoothed metric moving away from its best
    for the last third of the run by DIVERGED_MARGIN of its progress)."""
    c = _curves_table(store, sel)
    v = _variants_table(store, sel)
    kinds = _target_metrics_sql(store, c, v, sel)
    user = (
        " UNION ALL ".join(
            f"SELECT {sql_literal(m)} AS metric, {float(t)!r}::DOUBLE AS target" for m, t in sel.targets
        )
        or "SELECT NULL::VARCHAR AS metric, NULL::DOUBLE AS target WHERE false"
    )
    worse = (
        "CASE WHEN direction = 'lower' THEN final_smoothed - best_value ELSE best_value - final_smoothed END"
    )
    return store.query(
        f"""
        WITH d AS (
            -- the target metrics only; direction from the name, else from the trend (first vs
            -- last tenth of the run)
            SELECT experiment, metric, coalesce(any_value(k.direction),
                   CASE WHEN avg(value) FILTER (WHERE step <= first_s + (last_s - first_s) / 10)
                           >= avg(value) FILTER (WHERE step >= last_s - (last_s - first_s) / 10)
                        THEN 'lower' ELSE 'higher' END) AS direction
            FROM (SELECT *, min(step) OVER (PARTITION BY run_id, metric) AS first_s,
                            max(step) OVER (PARTITION BY run_id, metric) AS last_s FROM {c})
            JOIN ({kinds}) k USING (metric)
            GROUP BY experiment, metric
        ), per_run AS (
            SELECT c.run_id, c.experiment, c.metric, d.direction,
                   CASE WHEN d.direction = 'lower' THEN min(smoothed) FILTER (WHERE isfinite(smoothed))
                        ELSE max(smoothed) FILTER (WHERE isfinite(smoothed)) END AS best_value,
                   CASE WHEN d.direction = 'lower'
                        THEN arg_min(step, smoothed) FILTER (WHERE isfinite(smoothed))
                        ELSE arg_max(step, smoothed) FILTER (WHERE isfinite(smoothed)) END AS best_step,
                   arg_min(smoothed, step) AS first_smoothed, arg_max(smoothed, step) AS final_smoothed,
                   arg_max(value, step) AS final_value, min(step) AS first_s, max(step) AS last_s,
                   count(*) FILTER (WHERE NOT isfinite(value)) AS non_finite
            FROM {c} c JOIN d USING (experiment, metric)
            GROUP BY c.run_id, c.experiment, c.metric, d.direction
        ), best AS (
            SELECT *,
                   CASE WHEN non_finite > 0 THEN 'non-finite values'
                        WHEN best_step <= first_s + (last_s - first_s) * 2 / 3
                             AND NOT isfinite(final_smoothed) THEN 'non-finite values'
                        WHEN best_step <= first_s + (last_s - first_s) * 2 / 3
                             AND {worse} > greatest({DIVERGED_MARGIN} * abs(first_smoothed - best_value),
                                                    {DIVERGED_FLOOR} * abs(best_value))
                             THEN 'moving away from its best' END AS diverged_reason
            FROM per_run
        ), dflt AS (
            -- the best value most runs reach, among those that did not diverge (all if every one did)
            SELECT experiment, metric,
                   CASE WHEN any_value(direction) = 'lower'
                        THEN quantile_disc(best_value, {DEFAULT_TARGET_SHARE})
                        ELSE quantile_disc(best_value, 1 - {DEFAULT_TARGET_SHARE}) END AS target
            FROM best
            WHERE diverged_reason IS NULL
               OR NOT EXISTS (SELECT 1 FROM best b2 WHERE b2.experiment = best.experiment
                              AND b2.metric = best.metric AND b2.diverged_reason IS NULL)
            GROUP BY experiment, metric
        ), tagged AS (
            SELECT b.experiment, t.metric, mode(t.target) AS target
            FROM ({_tag_targets_sql(v)}) t JOIN best b ON b.run_id = t.run_id AND b.metric = t.metric
            GROUP BY b.experiment, t.metric
        ), tgt AS (
            SELECT dflt.experiment, dflt.metric,
                   coalesce(u.target, tagged.target, dflt.target) AS target,
                   CASE WHEN u.target IS NOT NULL THEN 'user'
                        WHEN tagged.target IS NOT NULL THEN 'tag' ELSE 'default' END AS target_source
            FROM dflt LEFT JOIN ({user}) u USING (metric) LEFT JOIN tagged USING (experiment, metric)
        ), hit AS (
            SELECT c.run_id, c.metric, min(c.elapsed_s) AS time_to_target_s, min(c.step) AS steps_to_target
            FROM {c} c JOIN d USING (experiment, metric) JOIN tgt USING (experiment, metric)
            WHERE isfinite(c.smoothed)
              AND ((d.direction = 'lower' AND c.smoothed <= tgt.target)
                   OR (d.direction = 'higher' AND c.smoothed >= tgt.target))
            GROUP BY c.run_id, c.metric
        ), r AS (SELECT DISTINCT run_id, source, world_size, batch_size_per_rank, global_batch_size FROM {c})
        SELECT b.experiment, coalesce(v.variant, '') AS variant, b.metric, b.direction, t.target,
               t.target_source, b.run_id, r.source, r.world_size,
               r.batch_size_per_rank, r.global_batch_size, h.time_to_target_s IS NOT NULL AS reached,
               h.time_to_target_s, h.steps_to_target, b.best_value, b.final_value,
               b.diverged_reason IS NOT NULL AS diverged, b.diverged_reason
        FROM best b JOIN tgt t USING (experiment, metric) JOIN r USING (run_id)
        LEFT JOIN {v} v USING (run_id)
        LEFT JOIN hit h USING (run_id, metric)
        ORDER BY b.experiment, b.metric, h.time_to_target_s NULLS LAST, b.run_id
        """
    )
