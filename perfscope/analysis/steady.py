"""Steady state: the selected runs, their warm-up cut, and the per-step and per-rank aggregates
every other analysis reads (two scans of `steps`, cached per store and selection)."""

from __future__ import annotations

from ..store.reader import Store
from ..store.rollups import by_step_sql, rank_sums_sql, step_bounds_sql
from ..store.warmup import cut_sql, fallback_sql, warmup_sql
from .cache import temp_table
from .selection import Selection

#: A steady step slower than this multiple of the median is a slow step; when they recur at one
#: step distance (at least MIN_PERIODS times, PERIOD_SHARE of their gaps) the run is periodic.
SLOW_STEP_RATIO = 1.5
#: a steady window whose clock covers less than this share of its step numbers' span (at the median
#: step) holds steps numbered with gaps, not lost steps: its steps are counted, not spanned
GAPPED_SPAN = 0.5
MIN_PERIODS = 3
PERIOD_SHARE = 0.8

#: A step row the statistics may use: a NULL or negative step time is impossible (a clock or
#: collector fault); quality's `impossible_durations` names those rows, the statistics leave them out.
VALID_STEP = "s.step_ns >= 0"

#: Where a run's steady elapsed time comes from. `wall_clock` (DESIGN): latest end minus earliest
#: start on any rank. Without step start times, or when the window is longer than the sum of the
#: per-step maxima plus one step (impossible for ranks on one clock: rank clocks disagree, e.g.
#: imported traces of several hosts without a common time base), the sum of the slowest rank's step
#: time per step stands in for it.
ELAPSED_SOURCES = {
    "wall_clock": "wall clock: latest end minus earliest start on any rank",
    "sum_no_timestamps": "sum of the slowest rank per step (the rows carry no start times)",
    "sum_clocks_disagree": "sum of the slowest rank per step (the ranks' clocks disagree)",
}

#: Canonical phases as stored in `steps`, in display order.
PHASES = ("data", "forward", "backward", "sync_exposed", "optimizer", "other")
#: The additive breakdown adds the time the slowest rank makes everyone wait.
BREAKDOWN_PHASES = (*PHASES, "imbalance")
#: each breakdown phase as people read it (charts, the report, `compare`)
PHASE_LABELS: dict[str, str] = {
    "data": "data (loader wait)",
    "forward": "forward",
    "backward": "backward",
    "sync_exposed": "exposed sync",
    "optimizer": "optimizer",
    "other": "other",
    "imbalance": "imbalance (wait for slowest rank)",
}
#: POP "useful" work: compute phases only.
USEFUL_PHASES = ("forward", "backward", "optimizer")


def runs_table(store: Store, sel: Selection) -> str:
    """The selected runs with their metadata; NULL labels become '' so they group together."""
    return temp_table(
        store,
        ("runs", sel),
        f"""
        SELECT r.run_id,
               coalesce(r.experiment, '') AS experiment,
               coalesce(nullif(r.source, ''), 'measured') AS source,
               coalesce(r.cluster, '') AS cluster,
               coalesce(r.backend, '') AS backend,
               coalesce(r.model, '') AS model,
               coalesce(r.device_model, '') AS device_model,
               coalesce(r.world_size, k.ranks) AS world_size,
               coalesce(r.nodes, k.hosts, 1) AS nodes,
               r.gpus_per_node,
               r.batch_size_per_rank,
               r.global_batch_size,
               r.dp_size, r.tp_size, r.pp_size,
               coalesce(r.scaling_mode, '') AS scaling_mode_declared,
               r.grad_bytes, r.param_count, r.flops_per_step, r.device_peak_flops,
               r.dataset_samples, r.started_ns
        FROM runs r
        LEFT JOIN (SELECT run_id, count(DISTINCT rank) AS ranks,
                          count(DISTINCT coalesce(hostname, CAST(node_rank AS VARCHAR))) AS hosts
                   FROM ranks GROUP BY run_id) k USING (run_id)
        WHERE {sel.runs_where("r")}
        """,
    )


def thresholds_table(store: Store, sel: Selection) -> str:
    """Per run: first and last step index and the first steady step (the warm-up cut)."""
    runs = runs_table(store, sel)
    if sel.warmup_steps is not None:
        warmup = f"{int(sel.warmup_steps)}"
        fallback = "false"
    else:
        warmup = warmup_sql("n_steps")
        fallback = fallback_sql("n_steps", warmup)
    # Steps are numbered contiguously by the collector, so last - first + 1 counts them without
    # a DISTINCT over every row.
    return temp_table(
        store,
        ("thresholds", sel),
        f"""
        WITH b AS (
            SELECT run_id, first_step, last_step, last_step - first_step + 1 AS n_steps
            FROM ({step_bounds_sql(store, runs)})
        ), w AS (
            SELECT *, {cut_sql("n_steps", warmup, fallback)} AS warmup_steps,
                   {fallback} AS warmup_fallback
            FROM b
        )
        SELECT *, first_step + warmup_steps AS first_steady_step FROM w
        """,
    )


def step_agg_table(store: Store, sel: Selection) -> str:
    """Per run and steady step: the slowest rank's step time (the spread statistics), ranks present,
    and the step's earliest start and latest end on any rank (aligned clock: the elapsed time).
    From the per-step rollups where they cover the run (store/rollups.py), else from the raw rows."""
    thr = thresholds_table(store, sel)
    steps = by_step_sql(
        store,
        thr,
        ("n_valid", "step_max_ns", "start_min_ns", "end_max_ns"),
        "s.step >= t.first_steady_step",
    )
    return temp_table(
        store,
        ("step_agg", sel),
        "SELECT run_id, step, step_max_ns, n_valid::INTEGER AS n_ranks, start_min_ns, end_max_ns "
        f"FROM ({steps}) WHERE n_valid > 0",
    )


def rank_agg_table(store: Store, sel: Selection) -> str:
    """Per run and rank, over its steady steps: sums and non-NULL counts of every phase (of the rows
    with a valid step time). From the per-window rollups where they cover the run, else raw rows."""
    thr = thresholds_table(store, sel)
    named = [p for p in PHASES if p != "other"]  # other: derived as step - named phases
    sums = rank_sums_sql(
        store,
        thr,
        ["rows", "step_sum", *(f"{p}_{x}" for p in named for x in ("sum", "n")), "samples_sum", "samples_n"],
    )
    phase_cols = ",\n".join(f"{p}_sum::DOUBLE AS {p}_sum, {p}_n::BIGINT AS {p}_n" for p in named)
    return temp_table(
        store,
        ("rank_agg", sel),
        f"""
        SELECT run_id, rank, rows::BIGINT AS rows, step_sum::DOUBLE AS step_sum,
               {phase_cols},
               samples_sum::DOUBLE AS samples_sum, samples_n::BIGINT AS samples_n
        FROM ({sums}) WHERE rows > 0
        """,
    )


def roles_table(store: Store, sel: Selection) -> str:
    """Per run and rank: its role, recorded with profile(role=...) or inferred from what it did:
    a rank with point-to-point traffic and no collective is a server when it has no steps, or when
    it computes no forward or backward while another rank of its run does (a server that ends each
    turn of a loop shared with its workers with prof.step() has steps, but trains nothing);
    point-to-point with fixed peers and no collective is a pipeline stage (numbered by rank),
    unless its peers are servers (a worker)."""
    runs = runs_table(store, sel)
    steps = rank_sums_sql(
        store,
        thresholds_table(store, sel),
        ("rows_all", "forward_sum", "backward_sum"),
        steady=False,
    )
    return temp_table(
        store,
        ("roles", sel),
        f"""
        WITH st AS (
            SELECT run_id, rank, rows_all::BIGINT AS steps,
                   coalesce(forward_sum, 0) + coalesce(backward_sum, 0) > 0 AS trains
            FROM ({steps})
        ), rk AS (
            SELECT run_id, rank FROM ranks WHERE run_id IN (SELECT run_id FROM {runs})
            UNION SELECT run_id, rank FROM st
            UNION SELECT run_id, rank FROM comm WHERE run_id IN (SELECT run_id FROM {runs})
        ), recorded AS (
            -- a role given with profile(role=...), else a pipeline stage from the recorded layout
            -- (profile(parallel=...), an imported op table's coordinates) of a run with several stages
            SELECT run_id, rank, coalesce(role, CASE WHEN stages > 0 THEN 'stage:' || stage END) AS role
            FROM (SELECT run_id, rank, max(role) AS role, max(pp_stage) AS stage FROM ranks GROUP BY ALL)
            JOIN (SELECT run_id, max(pp_stage) AS stages FROM ranks GROUP BY ALL) USING (run_id)
        ), c AS (
            SELECT run_id, rank, count(*) FILTER (WHERE peer IS NOT NULL) AS p2p,
                   count(*) FILTER (WHERE peer IS NULL) AS collectives
            FROM comm GROUP BY ALL
        ), f AS (
            SELECT rk.run_id, rk.rank, rec.role AS recorded_role, coalesce(st.steps, 0) AS steps,
                   coalesce(st.trains, false) AS trains,
                   coalesce(c.p2p, 0) AS p2p, coalesce(c.collectives, 0) AS collectives
            FROM rk LEFT JOIN recorded rec USING (run_id, rank) LEFT JOIN st USING (run_id, rank)
            LEFT JOIN c USING (run_id, rank)
        ), srv AS (
            SELECT *, coalesce(
                       recorded_role = 'server',
                       p2p > 0 AND (steps = 0 OR (collectives = 0 AND NOT trains
                                                  AND bool_or(trains) OVER (PARTITION BY run_id)))
                   ) AS is_server
            FROM f
        ), run_has_server AS (
            SELECT run_id, bool_or(is_server) AS has_server FROM srv GROUP BY run_id
        ), cand AS (
            SELECT srv.*, h.has_server,
                   NOT is_server AND recorded_role IS NULL AND p2p > 0 AND collectives = 0
                   AND NOT h.has_server AS is_stage
            FROM srv JOIN run_has_server h USING (run_id)
        )
        SELECT run_id, rank, steps, p2p, collectives,
               CASE WHEN recorded_role IS NOT NULL THEN recorded_role
                    WHEN is_server THEN 'server'
                    WHEN is_stage THEN 'stage:' || (row_number() OVER (
                        PARTITION BY run_id, is_stage ORDER BY rank) - 1)::VARCHAR
                    ELSE 'worker' END AS role,
               CASE WHEN recorded_role IS NOT NULL THEN 'recorded' ELSE 'inferred' END AS role_source
        FROM cand
        """,
    )


def run_stats_table(store: Store, sel: Selection) -> str:
    """Per selected run: steady-state step time, its spread and shape, the additive phase
    breakdown, and throughput.

    The steady window's elapsed time `steady_elapsed_ns` is wall-clock time: the latest end of its
    last step on any rank minus the earliest start of its first step on any rank (timestamps are on
    rank 0's clock). Never a sum of per-step maxima: ranks' step boundaries are not aligned, so the
    slowest rank of one step is not the slowest of the next and the sum overstates the window by
    the jitter. The step time `step_ns` = elapsed / steps of the window (`elapsed_steps`);
    throughput = global samples over the window / its elapsed time, so periodic slow steps count in
    full (never samples / median step). `elapsed_source` says where the elapsed time came from
    (ELAPSED_SOURCES). The median, p10/p90 and coefficient of variation of the per-step slowest rank
    describe spread only; `step_period` and `slow_step_share` name a bimodal or periodic step-time
    distribution (see `SLOW_STEP_RATIO`). The breakdown's phases are means over steady (rank, step)
    rows and add up to `step_ns` with `imbalance_ns` (the window's time per step that the mean
    rank's own step does not cover: a rank idle between its steps, waiting for the slowest)."""
    runs = runs_table(store, sel)
    thr = thresholds_table(store, sel)
    sa = step_agg_table(store, sel)
    ra = rank_agg_table(store, sel)
    roles = roles_table(store, sel)
    named = [p for p in PHASES if p != "other"]
    # Mean over steady (rank, step) rows of each phase; NULL when the phase was never recorded.
    phase_means = ",\n".join(
        f"CASE WHEN sum({p}_n) > 0 THEN sum({p}_sum) / sum({p}_n) END AS {p}_mean" for p in named
    )
    named_sum = " + ".join(f"coalesce({p}_mean, 0)" for p in named)
    breakdown = ",\n".join(f"coalesce({p}_mean, 0) AS {p}_ns" for p in named)
    return temp_table(
        store,
        ("run_stats", sel),
        f"""
        WITH st AS (
            SELECT run_id, count(*) AS steady_steps,
                   median(step_max_ns) AS step_median_ns,
                   quantile_cont(step_max_ns, 0.1) AS step_p10_ns,
                   quantile_cont(step_max_ns, 0.9) AS step_p90_ns,
                   avg(step_max_ns) AS step_max_mean_ns,
                   sum(step_max_ns) AS step_max_sum_ns,
                   max(step_max_ns) AS step_max_top_ns,
                   min(start_min_ns) AS steady_start_ns,
                   max(end_max_ns) AS steady_end_ns,
                   max(step) FILTER (WHERE end_max_ns IS NOT NULL)
                       - min(step) FILTER (WHERE start_min_ns IS NOT NULL) + 1 AS steady_span_steps,
                   stddev_samp(step_max_ns) / nullif(avg(step_max_ns), 0) AS step_cv,
                   max(n_ranks) AS max_ranks_per_step,
                   count(*) FILTER (WHERE n_ranks < most_ranks) AS incomplete_steps
            FROM (SELECT *, max(n_ranks) OVER (PARTITION BY run_id) AS most_ranks FROM {sa})
            GROUP BY run_id
        ), el AS (
            -- the wall clock of the steady window, unless the rows carry no start times or the
            -- ranks' clocks visibly disagree (see ELAPSED_SOURCES)
            SELECT run_id,
                   CASE WHEN steady_end_ns IS NULL OR steady_start_ns IS NULL THEN 'sum_no_timestamps'
                        WHEN steady_span_steps < 1 OR steady_end_ns <= steady_start_ns
                             OR steady_end_ns - steady_start_ns
                                > step_max_mean_ns * steady_span_steps + step_max_top_ns
                        THEN 'sum_clocks_disagree'
                        ELSE 'wall_clock' END AS elapsed_source
            FROM st
        ), els AS (
            -- the window's steps: from its first to its last step number, unless the numbers have
            -- gaps that the clock does not (a trace of every k-th step laid end to end, such as the
            -- straggler study's): then the steps it holds
            SELECT st.*, el.elapsed_source,
                   CASE WHEN elapsed_source = 'wall_clock' THEN steady_end_ns - steady_start_ns
                        ELSE step_max_sum_ns END::DOUBLE AS steady_elapsed_ns,
                   CASE WHEN elapsed_source <> 'wall_clock' THEN steady_steps
                        WHEN steady_span_steps > steady_steps
                             AND steady_end_ns - steady_start_ns
                                 < {GAPPED_SPAN} * step_median_ns * steady_span_steps
                        THEN steady_steps
                        ELSE steady_span_steps END AS elapsed_steps
            FROM st JOIN el USING (run_id)
        ), slow AS (
            -- steps well above the median, and the gap to the previous such step
            SELECT a.run_id, a.step, a.step_max_ns,
                   a.step - lag(a.step) OVER (PARTITION BY a.run_id ORDER BY a.step) AS gap
            FROM {sa} a JOIN st USING (run_id)
            WHERE a.step_max_ns > {SLOW_STEP_RATIO} * st.step_median_ns
        ), gaps AS (
            SELECT run_id, gap, count(*) AS n FROM slow WHERE gap IS NOT NULL GROUP BY run_id, gap
        ), shape AS (
            SELECT s.run_id, s.slow_steps, s.slow_mean_ns, g.period, g.period_share
            FROM (SELECT run_id, count(*) AS slow_steps, avg(step_max_ns) AS slow_mean_ns
                  FROM slow GROUP BY run_id) s
            LEFT JOIN (SELECT run_id, arg_max(gap, n ORDER BY gap) AS period,
                              max(n) / sum(n) AS period_share
                       FROM gaps GROUP BY run_id) g USING (run_id)
        ), k AS (
            SELECT run_id, count(*) AS ranks_seen, sum(rows) AS rows,
                   sum(step_sum) / sum(rows) AS step_mean_ns,
                   {phase_means},
                   sum(samples_sum / nullif(samples_n, 0)) AS samples_per_step_recorded,
                   sum(samples_sum) AS samples_steady
            FROM {ra} GROUP BY run_id
        ), rl AS (
            SELECT run_id, count(*) FILTER (WHERE role = 'server') AS servers,
                   count(*) FILTER (WHERE role LIKE 'stage:%') AS stages
            FROM {roles} GROUP BY run_id
        ), j AS (
            SELECT r.*, t.first_step, t.last_step, t.n_steps, t.warmup_steps, t.warmup_fallback,
                   els.* EXCLUDE (run_id), k.* EXCLUDE (run_id),
                   coalesce(rl.servers, 0) AS servers, coalesce(rl.stages, 0) AS stages,
                   els.steady_elapsed_ns / els.elapsed_steps AS step_ns,
                   coalesce(shape.slow_steps, 0) / els.steady_steps AS slow_step_share,
                   shape.slow_mean_ns / nullif(els.step_median_ns, 0) AS slow_step_ratio,
                   -- slow steps one step apart are a run of slow steps, not a period
                   CASE WHEN shape.slow_steps >= {MIN_PERIODS} AND shape.period_share >= {PERIOD_SHARE}
                             AND shape.period >= 2
                        THEN shape.period END AS step_period
            FROM {runs} r
            LEFT JOIN {thr} t USING (run_id)
            LEFT JOIN els USING (run_id)
            LEFT JOIN shape USING (run_id)
            LEFT JOIN k USING (run_id)
            LEFT JOIN rl USING (run_id)
        ), g AS (
            SELECT j.*,
                   -- an explicit global batch wins (per-rank batch x world size is the collector's
                   -- SPMD guess, not the user's: the samples recorded say more, the micro-batches of
                   -- gradient accumulation counted); a recorded layout counts the samples of one
                   -- replica (its tensor, pipeline ranks share them) times the data-parallel degree;
                   -- pipeline stages pass one global batch along (counted once), servers process
                   -- none; ranks whose rows are missing did the same work as the ones recorded
                   coalesce(CASE WHEN global_batch_size IS DISTINCT FROM batch_size_per_rank * world_size
                                 THEN global_batch_size::DOUBLE END,
                            CASE WHEN dp_size IS NOT NULL AND coalesce(tp_size, 1) * coalesce(pp_size, 1) > 1
                                 THEN samples_per_step_recorded / ranks_seen * dp_size END,
                            CASE WHEN stages > 1 THEN samples_per_step_recorded / ranks_seen
                                 ELSE samples_per_step_recorded
                                      * greatest(1.0, (world_size - servers) / ranks_seen) END,
                            batch_size_per_rank::DOUBLE * (world_size - servers))
                       AS samples_per_step
            FROM j
        )
        SELECT g.*,
               {breakdown},
               -- the rest of the step, never below zero (phases recorded overlapping, or means
               -- over different rows, can add up past the step: no duration is negative)
               CASE WHEN step_mean_ns < ({named_sum}) THEN 0.0
                    ELSE step_mean_ns - ({named_sum}) END AS other_ns,
               step_ns - step_mean_ns AS imbalance_ns,
               samples_per_step * elapsed_steps / (steady_elapsed_ns / 1e9) AS throughput_samples_per_s,
               dataset_samples / samples_per_step * (step_ns / 1e9) AS epoch_s
        FROM g
        """,
    )


def rank_comm_table(store: Store, sel: Selection) -> str:
    """Per run and rank over its steady steps: total collective time and count per step
    (`steps.comm_total_ns`, `steps.comm_count`). Kept out of the main per-rank scan so the
    scaling summary reads two columns less."""
    thr = thresholds_table(store, sel)
    sums = rank_sums_sql(
        store, thr, ("rows", "comm_total_sum", "comm_total_n", "comm_count_sum", "comm_count_n")
    )
    return temp_table(
        store,
        ("rank_comm", sel),
        f"""
        SELECT run_id, rank, comm_total_sum::DOUBLE / nullif(comm_total_n, 0) AS comm_total_mean,
               comm_count_sum::DOUBLE / nullif(comm_count_n, 0) AS comm_count_mean
        FROM ({sums}) WHERE rows > 0
        """,
    )


def run_comm_table(store: Store, sel: Selection) -> str:
    """Per run: mean over ranks of the per-step collective time and count (NULL when not recorded)."""
    return temp_table(
        store,
        ("run_comm", sel),
        f"""
        SELECT run_id, avg(comm_total_mean) AS comm_total_mean, avg(comm_count_mean) AS comm_count_mean
        FROM {rank_comm_table(store, sel)} GROUP BY run_id
        """,
    )


def window_table(store: Store, sel: Selection) -> str:
    """Per run: from the start of the first steady step to the end of the last step (rank 0's
    clock). Reads only those two steps (of the rollups, or the row groups holding them)."""
    thr = thresholds_table(store, sel)
    steps = by_step_sql(
        store,
        thr,
        ("n_valid", "start_min_ns", "end_max_ns"),
        "(s.step = t.first_steady_step OR s.step = t.last_step)",
    )
    return temp_table(
        store,
        ("window", sel),
        f"""
        SELECT b.run_id,
               min(b.start_min_ns) FILTER (WHERE b.step = t.first_steady_step) AS window_start_ns,
               max(b.end_max_ns) FILTER (WHERE b.step = t.last_step) AS window_end_ns
        FROM ({steps}) b JOIN {thr} t ON b.run_id = t.run_id
        WHERE b.n_valid > 0
        GROUP BY b.run_id
        """,
    )
