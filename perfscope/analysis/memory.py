"""Memory over the run: each rank's resident memory (proc_memory, the poller's samples) and its CUDA
allocator peaks per step (device_memory), fitted against the step over the steady window."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .selection import Selection
from .steady import runs_table, thresholds_table


@analysis("memory", "Memory per rank over the run: level, peak, trend, limit", "memory")
def memory(store: Store, sel: Selection) -> pa.Table:
    """Per run, rank and kind ('host': the process's RSS; 'device': the CUDA allocator's peak
    allocated bytes per step): the steady samples, the first and last value, the peak (for 'device'
    the peak reserved), the least-squares slope against the step (bytes per step) and its R², the
    limit (host or device memory), what was left at the end (host: available memory; device: total
    minus the last peak reserved), and the step at which the slope would use it up (for 'host', all
    the host's rising ranks together)."""
    runs = runs_table(store, sel)
    thr = thresholds_table(store, sel)
    return store.query(
        f"""
        WITH st AS (
            SELECT s.run_id, s.rank, s.step, s.start_ns, s.start_ns + s.step_ns AS end_ns
            FROM steps s JOIN {thr} t USING (run_id)
            WHERE s.step >= t.first_steady_step AND s.step_ns IS NOT NULL
        ), rk AS (
            SELECT run_id, rank, any_value(hostname) AS hostname, any_value(pid) AS pid FROM ranks
            WHERE run_id IN (SELECT run_id FROM {runs}) GROUP BY run_id, rank
        ), pm AS (
            SELECT p.run_id, k.rank, k.hostname, p.ts_ns, p.rss_bytes, p.host_available_bytes,
                   p.host_total_bytes
            FROM proc_memory p JOIN rk k ON p.run_id = k.run_id AND p.hostname = k.hostname AND p.pid = k.pid
        ), host_placed AS (
            SELECT pm.*, st.step FROM pm ASOF JOIN st
                ON pm.run_id = st.run_id AND pm.rank = st.rank AND pm.ts_ns >= st.start_ns
            WHERE pm.ts_ns < st.end_ns
        ), host_fit AS (
            SELECT run_id, rank, any_value(hostname) AS hostname, 'host' AS kind, count(*) AS samples,
                   min(step) AS first_step, max(step) AS last_step,
                   arg_min(rss_bytes, ts_ns) AS first_bytes, arg_max(rss_bytes, ts_ns) AS last_bytes,
                   max(rss_bytes) AS peak_bytes,
                   regr_slope(rss_bytes, step) AS slope_bytes_per_step, regr_r2(rss_bytes, step) AS r2,
                   max(host_total_bytes) AS limit_bytes,
                   arg_max(host_available_bytes, ts_ns) AS left_bytes
            FROM host_placed GROUP BY run_id, rank
        ), host_out AS (
            SELECT *, left_bytes / nullif(sum(greatest(slope_bytes_per_step, 0))
                                              OVER (PARTITION BY run_id, hostname), 0) AS steps_left
            FROM host_fit
        ), dev AS (
            SELECT d.* FROM device_memory d JOIN {thr} t USING (run_id)
            WHERE d.step >= t.first_steady_step AND d.run_id IN (SELECT run_id FROM {runs})
        ), dev_out AS (
            SELECT d.run_id, d.rank, k.hostname, 'device' AS kind, count(*) AS samples,
                   min(step) AS first_step, max(step) AS last_step,
                   arg_min(peak_allocated_bytes, step) AS first_bytes,
                   arg_max(peak_allocated_bytes, step) AS last_bytes,
                   max(peak_reserved_bytes) AS peak_bytes,
                   regr_slope(peak_allocated_bytes, step) AS slope_bytes_per_step,
                   regr_r2(peak_allocated_bytes, step) AS r2,
                   max(device_total_bytes) AS limit_bytes,
                   max(device_total_bytes) - arg_max(peak_reserved_bytes, step) AS left_bytes,
                   (max(device_total_bytes) - arg_max(peak_reserved_bytes, step))
                       / nullif(greatest(regr_slope(peak_allocated_bytes, step), 0), 0) AS steps_left
            FROM dev d LEFT JOIN rk k USING (run_id, rank) GROUP BY d.run_id, d.rank, k.hostname
        ), both_ AS (
            SELECT * FROM host_out UNION ALL BY NAME SELECT * FROM dev_out
        )
        SELECT b.run_id, r.source, r.world_size, b.rank, b.hostname, b.kind, b.samples, b.first_step,
               b.last_step, b.first_bytes, b.last_bytes, b.peak_bytes, b.slope_bytes_per_step, b.r2,
               b.limit_bytes, b.left_bytes,
               CASE WHEN b.steps_left IS NOT NULL AND isfinite(b.steps_left)
                    THEN b.last_step + ceil(b.steps_left)::BIGINT END AS exhaust_step
        FROM both_ b JOIN {runs} r USING (run_id)
        ORDER BY b.run_id, b.kind, b.rank
        """
    )
