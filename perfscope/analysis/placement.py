"""Placement of ranks on hosts against the hosts' logical CPUs and GPUs (oversubscription), and
each run's threads and cores per rank against its host and the other world sizes of its group."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .groups import groups_table
from .registry import analysis
from .selection import Selection
from .steady import runs_table


@analysis("placement", "Ranks per host against cores and GPUs", "placement")
def placement(store: Store, sel: Selection) -> pa.Table:
    """Per run and host: ranks there, its logical CPUs (ranks.cpu_count, else host_samples), the
    distinct GPUs its ranks use (NULL on CPU) and whether either is oversubscribed."""
    runs = runs_table(store, sel)
    return store.query(
        f"""
        WITH k AS (
            SELECT run_id, coalesce(hostname, 'node' || node_rank) AS hostname,
                   any_value(node_rank) AS node_rank,
                   count(DISTINCT rank) AS ranks_on_host, max(cpu_count) AS cpu_count,
                   CASE WHEN count(device_index) > 0 THEN count(DISTINCT device_index) END AS gpus_on_host
            FROM ranks WHERE run_id IN (SELECT run_id FROM {runs})
            GROUP BY run_id, coalesce(hostname, 'node' || node_rank)
        ), h AS (
            SELECT run_id, hostname, max(cpu_count) AS cpu_count FROM host_samples GROUP BY ALL
        )
        SELECT k.run_id, r.source, r.world_size, k.hostname, k.node_rank, k.ranks_on_host,
               coalesce(k.cpu_count, h.cpu_count) AS cpu_count, k.gpus_on_host,
               coalesce(k.cpu_count, h.cpu_count)::DOUBLE / k.ranks_on_host AS cores_per_rank,
               k.ranks_on_host > coalesce(k.cpu_count, h.cpu_count) AS oversubscribed_cpu,
               k.gpus_on_host IS NOT NULL AND k.ranks_on_host > k.gpus_on_host AS oversubscribed_gpu
        FROM k JOIN {runs} r USING (run_id) LEFT JOIN h USING (run_id, hostname)
        ORDER BY r.experiment, r.world_size, k.run_id, k.node_rank, k.hostname
        """
    )


@analysis("threads", "Threads and cores per rank, across world sizes", "threads")
def threads(store: Store, sel: Selection) -> pa.Table:
    """Per run, on its most crowded host: torch intra-op threads per rank, OMP/MKL_NUM_THREADS as
    set, the cores a rank may use (its affinity, else the host's logical CPUs), ranks × threads
    against the host's cores; and per group whether threads or cores per rank differ between its
    world sizes (runs that record no threads are left out of that comparison)."""
    runs = runs_table(store, sel)
    groups = groups_table(store, sel)
    return store.query(
        f"""
        WITH k AS (
            SELECT run_id, coalesce(hostname, 'node' || node_rank) AS hostname,
                   count(DISTINCT rank) AS ranks_on_host, max(cpu_count) AS cpu_count,
                   max(torch_threads) AS threads_per_rank, sum(torch_threads)::INTEGER AS threads_on_host,
                   min(affinity_cores) AS affinity_cores,
                   any_value(omp_num_threads) AS omp_num_threads,
                   any_value(mkl_num_threads) AS mkl_num_threads
            FROM ranks WHERE run_id IN (SELECT run_id FROM {runs})
            GROUP BY run_id, coalesce(hostname, 'node' || node_rank)
        ), h AS (
            SELECT k.*, least(coalesce(affinity_cores, cpu_count), cpu_count) AS cores_per_rank_allowed
            FROM k
        ), per_run AS (
            SELECT run_id, max(ranks_on_host) AS ranks_on_host, min(cpu_count) AS cpu_count,
                   max(threads_per_rank) AS threads_per_rank, max(threads_on_host) AS threads_on_host,
                   min(cores_per_rank_allowed) AS cores_per_rank_allowed,
                   any_value(omp_num_threads) AS omp_num_threads,
                   any_value(mkl_num_threads) AS mkl_num_threads,
                   bool_or(threads_on_host > cpu_count OR threads_per_rank > cores_per_rank_allowed)
                       AS threads_oversubscribed
            FROM h GROUP BY run_id
        ), g AS (
            SELECT p.*, r.source, r.world_size, gr.group_id,
                   count(DISTINCT r.world_size) FILTER (WHERE p.threads_per_rank IS NOT NULL)
                       OVER (PARTITION BY gr.group_id) AS sizes_with_threads
            FROM per_run p JOIN {runs} r USING (run_id) LEFT JOIN {groups} gr USING (run_id)
        )
        SELECT run_id, source, group_id, world_size, ranks_on_host, cpu_count, threads_per_rank,
               omp_num_threads, mkl_num_threads, cores_per_rank_allowed, threads_on_host,
               threads_oversubscribed,
               sizes_with_threads > 1 AND max(threads_per_rank) OVER w <> min(threads_per_rank) OVER w
                   AS threads_differ,
               sizes_with_threads > 1
                   AND max(cores_per_rank_allowed) FILTER (WHERE threads_per_rank IS NOT NULL) OVER w
                       <> min(cores_per_rank_allowed) FILTER (WHERE threads_per_rank IS NOT NULL) OVER w
                   AS cores_differ
        FROM g
        WINDOW w AS (PARTITION BY group_id)
        ORDER BY group_id, world_size, run_id
        """
    )
