"""Placement of ranks on hosts against the hosts' logical CPUs and GPUs (oversubscription)."""

from __future__ import annotations

import pyarrow as pa

from ..store import Store
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
