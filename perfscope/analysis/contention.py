"""Contention: how much CPU other processes took on each host during a run's steady window
(system CPU minus the job's ranks), and whether the host had a core to spare at all."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .selection import Selection
from .steady import runs_table, window_table

#: DESIGN: other processes' CPU above ~20% of a core per rank makes timing findings uncertain.
CONTENDED_CORES_PER_RANK = 0.2
#: ... but only where it came out of the job's share: on a host with at least this many cores idle on
#: average, other processes (an OS's own daemons take about a core of a 96-core node) took nothing
#: the ranks could have used.
SPARE_CORES = 1.0
#: System CPU at or above this share: no core was idle, whoever used them (the job's ranks and
#: perfscope's collector threads inside them count as the job).
SATURATED_SYS_CPU_PCT = 90.0


@analysis("contention", "Other processes' CPU on the job's hosts", "contention")
def contention(store: Store, sel: Selection) -> pa.Table:
    """Per run and host over the steady window: the host's busy cores (sys_cpu_pct · cpu_count),
    the job's (proc_cpu_pct: every training process on the host, collector threads included),
    other processes' = the difference (never negative), per rank of the job on that host. Contended:
    more than CONTENDED_CORES_PER_RANK of other processes' cores per rank on a host with less than
    SPARE_CORES idle, so that CPU came out of what the ranks could have used."""
    runs = runs_table(store, sel)
    win = window_table(store, sel)
    return store.query(
        f"""
        WITH k AS (
            SELECT run_id, coalesce(hostname, 'node' || node_rank) AS hostname, count(DISTINCT rank) AS ranks
            FROM ranks WHERE run_id IN (SELECT run_id FROM {runs})
            GROUP BY run_id, coalesce(hostname, 'node' || node_rank)
        ), h AS (
            SELECT s.run_id, s.hostname, count(*) AS samples,
                   avg(s.sys_cpu_pct / 100.0 * s.cpu_count) AS busy_cores,
                   avg(s.proc_cpu_pct / 100.0) AS job_cores,
                   avg(greatest(0.0, s.sys_cpu_pct / 100.0 * s.cpu_count - s.proc_cpu_pct / 100.0))
                       AS other_cores,
                   avg(s.sys_cpu_pct) AS sys_cpu_pct, max(s.cpu_count) AS cpu_count
            FROM host_samples s JOIN {win} w ON s.run_id = w.run_id
                 AND s.ts_ns BETWEEN w.window_start_ns AND w.window_end_ns
            WHERE s.sys_cpu_pct IS NOT NULL AND s.proc_cpu_pct IS NOT NULL AND s.cpu_count > 0
            GROUP BY s.run_id, s.hostname
        )
        SELECT h.run_id, r.source, r.experiment, r.world_size, h.hostname, k.ranks AS ranks_on_host,
               h.samples, h.cpu_count, h.busy_cores, h.job_cores, h.other_cores,
               h.other_cores / nullif(k.ranks, 0) AS other_cores_per_rank,
               h.job_cores / nullif(k.ranks, 0) AS job_cores_per_rank,
               h.cpu_count - h.busy_cores AS spare_cores,
               h.other_cores / nullif(k.ranks, 0) > {CONTENDED_CORES_PER_RANK}
                   AND h.cpu_count - h.busy_cores < {SPARE_CORES} AS contended,
               h.sys_cpu_pct >= {SATURATED_SYS_CPU_PCT} AS saturated
        FROM h JOIN {runs} r USING (run_id) LEFT JOIN k USING (run_id, hostname)
        ORDER BY r.experiment, r.world_size, h.run_id, h.hostname
        """
    )
