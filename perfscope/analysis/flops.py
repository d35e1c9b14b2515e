"""Achieved FLOP/s per device and model FLOPs utilisation (MFU), where FLOPs per step are known."""

from __future__ import annotations

import pyarrow as pa

from ..store.reader import Store
from .registry import analysis
from .scaling import grouped_stats_table
from .selection import Selection


@analysis("mfu", "Achieved FLOP/s and MFU", "mfu")
def mfu(store: Store, sel: Selection) -> pa.Table:
    """flops_per_step is one rank's step, so achieved FLOP/s per device = flops_per_step / T."""
    gs = grouped_stats_table(store, sel)
    return store.query(
        f"""
        SELECT run_id, source, world_size, device_model, flops_per_step, step_ns,
               flops_per_step / (step_ns / 1e9) AS achieved_flops_per_s, device_peak_flops,
               flops_per_step / (step_ns / 1e9) / nullif(device_peak_flops, 0) AS mfu
        FROM {gs} WHERE flops_per_step > 0
        ORDER BY experiment, cluster, backend, world_size, run_id
        """
    )
