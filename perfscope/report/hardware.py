"""The hardware section: GPU utilisation, energy and MFU, or, where every run was on CPU, what
the hosts' CPUs did."""

from __future__ import annotations

from typing import Any

from .context import Context, curve_groups, with_group
from .model import Section, TableBlock, table_block, table_columns


def utilisation(ctx: Context) -> Section:
    if ctx.unit == "rank":
        return host_cpu(ctx)
    s = Section("utilisation", "Utilisation and energy", definitions=("utilisation", "energy", "mfu"))
    s.blocks.append(
        [
            "GPU utilisation here is NVML's kernel-active time share: the share of time some kernel ran. "
            "It is not an efficiency: a GPU can be 100% 'utilised' by one tiny kernel at a time."
        ]
    )
    s.blocks.append(ctx.chart("utilisation", drawn="util_gpu_pct"))
    s.blocks.append(ctx.chart("energy", drawn="energy_per_sample_j"))
    values = with_group(ctx, ctx.rows("utilisation"))
    curve = [r for rs in curve_groups(values).values() for r in rs] or values
    s.blocks.append(
        table_block(
            "utilisation",
            "Utilisation and energy per run",
            table_columns(
                ("group", "group"),
                ("world_size", "N"),
                ("gpus", "GPUs"),
                ("util_gpu_pct", "kernel-active share"),
                ("util_mem_pct", "memory busy"),
                ("power_w", "power/GPU"),
                ("sm_clock_mhz", "SM clock"),
                ("throttle_share", "throttled"),
                ("energy_per_sample_j", "energy/sample"),
                ("host_proc_cpu_pct", "process CPU"),
            ),
            curve,
        )
    )
    on_cpu = [r for r in values if r["util_gpu_pct"] is None and r["host_sys_cpu_pct"] is not None]
    if on_cpu:  # a store of CPU and GPU runs: the CPU runs' hosts, where their GPU figures would be
        s.blocks.append(
            [
                "Runs on CPU have no GPU figures; what their hosts' CPUs did over the steady window "
                "(the job's processes, 100% = one core; the whole host; its 1-minute load):"
            ]
        )
        s.blocks.append(_host_cpu_table(on_cpu))
    mfu = [r for r in ctx.rows("mfu") if r["mfu"] is not None]
    if mfu:
        s.blocks.append(
            table_block(
                "mfu",
                "Model FLOP/s utilisation (MFU)",
                table_columns(
                    ("run_id", "run"),
                    ("world_size", "N"),
                    ("device_model", "device"),
                    ("achieved_flops_per_s", "achieved/GPU"),
                    ("device_peak_flops", "peak"),
                    ("mfu", "MFU"),
                ),
                mfu,
            )
        )
    return s


def host_cpu(ctx: Context) -> Section:
    """Where a GPU job shows GPU utilisation, a CPU job shows what its hosts' CPUs did."""
    s = Section("utilisation", "Host CPU and load", definitions=("utilisation",))
    s.blocks.append(
        [
            "Every run here ran on CPU; instead of device utilisation and energy, what the hosts' "
            "CPUs did over the steady window: the job's processes (100% is one core busy), the whole "
            "host, and its 1-minute load average against its logical CPUs. Ranks whose threads together "
            "want more cores than the host has slow each other down: compare the load with the CPUs."
        ]
    )
    values = with_group(ctx, ctx.rows("utilisation"))
    s.blocks.append(_host_cpu_table([r for rs in curve_groups(values).values() for r in rs] or values))
    return s


def _host_cpu_table(values: list[dict[str, Any]]) -> TableBlock:
    return table_block(
        "utilisation",
        "Host CPU per run",
        table_columns(
            ("group", "group"),
            ("world_size", "N"),
            ("host_cpu_count", "logical CPUs"),
            ("host_proc_cpu_pct", "job's CPU (100% = 1 core)"),
            ("host_sys_cpu_pct", "host CPU busy"),
            ("host_load1", "load (1 min)"),
        ),
        values,
    )
