"""GPU utilisation (kernel-active time share), memory, power and energy per sample; host CPU; timelines."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from ..store.rollups import by_step_sql
from .registry import analysis
from .scaling import GROUP_SELECT, grouped_stats_table
from .selection import Selection
from .steady import runs_table, thresholds_table, window_table

#: NVML clocks-event reasons that mean the clock was pulled down (power cap, thermal, slowdown, brake).
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
TIMELINE_BUCKETS = 2000


def _run_gpus_filter(alias: str) -> str:
    """Keep a sample when its GPU belongs to one of the run's ranks (or the ranks name no device)."""
    return f"""(
        NOT EXISTS (SELECT 1 FROM ranks d WHERE d.run_id = {alias}.run_id AND d.device_index IS NOT NULL)
        OR EXISTS (SELECT 1 FROM ranks d WHERE d.run_id = {alias}.run_id
                   AND d.device_index = {alias}.gpu_index
                   AND (d.hostname = {alias}.hostname OR d.node_rank = {alias}.node_rank)))"""


@analysis("utilisation", "GPU utilisation, memory, power, energy; host CPU", "utilisation", "energy")
def utilisation(store: Store, sel: Selection) -> pa.Table:
    """Per run over its steady window. util_gpu_pct is the kernel-active time share reported by
    nvmlDeviceGetUtilizationRates, not an efficiency."""
    gs = grouped_stats_table(store, sel)
    return store.query(
        f"""
        WITH w AS (
            SELECT run_id, window_start_ns AS ws, window_end_ns AS we,
                   coalesce(samples_steady, samples_per_step * steady_steps) AS samples
            FROM {gs} JOIN {window_table(store, sel)} USING (run_id)
        ), g AS (
            SELECT s.* FROM gpu_samples s JOIN w ON s.run_id = w.run_id AND s.ts_ns BETWEEN w.ws AND w.we
            WHERE {_run_gpus_filter("s")}
        ), per_gpu AS (
            SELECT run_id, hostname, gpu_index,
                   CASE WHEN count(energy_mj) >= 2 THEN (max(energy_mj) - min(energy_mj)) / 1000 END
                       AS counter_j,
                   avg(power_mw) / 1000 * (max(ts_ns) - min(ts_ns)) / 1e9 AS power_j,
                   (max(ts_ns) - min(ts_ns)) AS span_ns
            FROM g GROUP BY run_id, hostname, gpu_index
        ), energy AS (
            SELECT p.run_id,
                   -- the samples cover a little less than the window: scale to the whole window
                   sum(coalesce(counter_j, power_j) * (w.we - w.ws) / nullif(span_ns, 0)) AS energy_j,
                   CASE WHEN bool_and(counter_j IS NOT NULL) THEN 'energy_mj counter'
                        ELSE 'mean power x time' END AS energy_source
            FROM per_gpu p JOIN w USING (run_id) GROUP BY p.run_id
        ), u AS (
            SELECT run_id, count(DISTINCT (hostname, gpu_index)) AS gpus,
                   median(util_gpu_pct) AS util_gpu_pct,
                   quantile_cont(util_gpu_pct, 0.1) AS util_gpu_p10_pct,
                   quantile_cont(util_gpu_pct, 0.9) AS util_gpu_p90_pct,
                   avg(util_mem_pct) AS util_mem_pct,
                   max(mem_used_bytes) AS mem_used_bytes, max(mem_total_bytes) AS mem_total_bytes,
                   avg(power_mw) / 1000 AS power_w,
                   median(sm_clock_mhz) AS sm_clock_mhz,
                   avg(CASE WHEN clocks_event_reasons & {THROTTLE_MASK} <> 0 THEN 1.0 ELSE 0.0 END)
                       FILTER (WHERE clocks_event_reasons IS NOT NULL) AS throttle_share,
                   max(temp_c) AS temp_c
            FROM g GROUP BY run_id
        ), h AS (
            SELECT s.run_id, avg(proc_cpu_pct) AS host_proc_cpu_pct, avg(sys_cpu_pct) AS host_sys_cpu_pct,
                   avg(load1) AS host_load1, max(cpu_count) AS host_cpu_count
            FROM host_samples s JOIN w ON s.run_id = w.run_id AND s.ts_ns BETWEEN w.ws AND w.we
            GROUP BY s.run_id
        )
        SELECT {GROUP_SELECT}, x.run_id, x.source, x.world_size, x.nodes,
               u.* EXCLUDE (run_id), e.energy_j, e.energy_j / nullif(w.samples, 0) AS energy_per_sample_j,
               e.energy_source, h.* EXCLUDE (run_id)
        FROM {gs} x JOIN w USING (run_id)
        LEFT JOIN u USING (run_id) LEFT JOIN energy e USING (run_id) LEFT JOIN h USING (run_id)
        ORDER BY group_id, world_size, run_id
        """
    )


@analysis("gpu_timeline", "GPU telemetry over time", "raw", "utilisation")
def gpu_timeline(store: Store, sel: Selection) -> pa.Table:
    """Per run and GPU, bucket means over time (t_s since the run's first step)."""
    return _timeline(
        store,
        sel,
        "gpu_samples",
        ("hostname", "gpu_index"),
        """avg(util_gpu_pct) AS util_gpu_pct, avg(util_mem_pct) AS util_mem_pct,
           avg(mem_used_bytes) AS mem_used_bytes, avg(power_mw) / 1000 AS power_w,
           avg(sm_clock_mhz) AS sm_clock_mhz, avg(temp_c) AS temp_c""",
        where=_run_gpus_filter("s"),
    )


@analysis("host_timeline", "Host CPU and memory over time", "raw")
def host_timeline(store: Store, sel: Selection) -> pa.Table:
    """Per run and host, bucket means over time (t_s since the run's first step)."""
    return _timeline(
        store,
        sel,
        "host_samples",
        ("hostname",),
        """avg(proc_cpu_pct) AS proc_cpu_pct, avg(sys_cpu_pct) AS sys_cpu_pct,
           avg(rss_bytes) AS rss_bytes, avg(load1) AS load1""",
    )


def _timeline(
    store: Store, sel: Selection, table: str, keys: tuple[str, ...], aggregates: str, where: str = "true"
) -> pa.Table:
    """A sample table in at most TIMELINE_BUCKETS time buckets per run and key, t_s since the
    run's first step."""
    runs = runs_table(store, sel)
    t0 = _run_t0(store, sel)
    key = ", ".join(keys)
    return store.query(
        f"""
        WITH b AS (
            SELECT s.*, t.t0,
                   greatest(1, (max(s.ts_ns) OVER (PARTITION BY s.run_id) - t.t0) / {TIMELINE_BUCKETS})
                       AS width
            FROM {table} s JOIN {t0} t USING (run_id)
            WHERE s.run_id IN (SELECT run_id FROM {runs}) AND {where}
        )
        SELECT run_id, {key}, min(ts_ns - t0) / 1e9 AS t_s, {aggregates}
        FROM b GROUP BY run_id, {key}, (ts_ns - t0) // width
        ORDER BY run_id, {key}, t_s
        """
    )


def _run_t0(store: Store, sel: Selection) -> str:
    """Per run: the start of its first step (falls back to runs.started_ns)."""
    from .cache import temp_table

    thr = thresholds_table(store, sel)
    runs = runs_table(store, sel)
    return temp_table(
        store,
        ("run_t0", sel),
        f"""
        SELECT r.run_id, coalesce(s.t0, r.started_ns, 0) AS t0
        FROM {runs} r LEFT JOIN (
            SELECT run_id, min(start_min_all_ns) AS t0
            FROM ({by_step_sql(store, thr, ("start_min_all_ns",), "s.step = t.first_step")}) GROUP BY run_id
        ) s USING (run_id)
        """,
    )
