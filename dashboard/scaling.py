"""Scaling page: speedup, efficiency, sync, bandwidth, phases, utilisation and groups against world size."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import streamlit as st

from perfscope.charts.backends import backend_compare_chart
from perfscope.charts.phases import lost_time_chart, phase_breakdown_chart
from perfscope.charts.rows import group_label_map, multi_point_groups, rows
from perfscope.charts.scaling import efficiency_chart, per_gpu_speedup_chart, speedup_chart
from perfscope.charts.sync import busbw_chart, sync_time_chart
from perfscope.charts.utilisation import energy_chart, utilisation_chart
from perfscope.report.text import literal as md

from . import links
from .state import Context
from .widgets import (
    Col,
    chart,
    charts,
    definition_note,
    device_unit_of,
    filter_rows,
    for_unit,
    no_runs,
    relabel,
    show_table,
    simulated_notice,
    tabbed,
)

LARGEST_COLUMNS = {
    "group_id": Col("group"),
    "world_size": Col("N", fmt="%d"),
    "per_gpu_speedup": Col("S(N)/N", fmt="%.2f", help="per-GPU speedup"),
    "speedup": Col("S(N)", fmt="%.2f"),
    "efficiency": Col("E(N)", 100.0, "%.0f%%"),
    "source": Col("source"),
}
SCALING_COLUMNS = {
    "group_id": Col("group"),
    "world_size": Col("N", fmt="%d"),
    "nodes": Col("nodes", fmt="%d"),
    "source": Col("source"),
    "step_ns": Col("step (ms)", 1e-6, "%.3f"),
    "throughput_samples_per_s": Col("samples/s", fmt="%,.0f"),
    "speedup": Col("S(N)", fmt="%.2f", help="speedup X(N)/X(N0)"),
    "efficiency": Col("E(N)", 100.0, "%.0f%%", help="efficiency S(N)·N0/N"),
    "per_gpu_speedup": Col("S(N)/N", fmt="%.2f", help="per-GPU speedup"),
    "sync_share": Col("sync share", 100.0, "%.0f%%", help="exposed sync / step time"),
    "lost_ns": Col("lost (GPU·ms/step)", 1e-6, "%.2f", help="N·T(N)·(1 − E(N))"),
}
FIT_COLUMNS = {
    "cluster": Col("cluster"),
    "backend": Col("backend"),
    "scope": Col("scope"),
    "alpha_s": Col("α (µs)", 1e6, "%.2f", "latency per ring step"),
    "bandwidth_gb_per_s": Col("1/β (GB/s)", fmt="%.2f", help="bandwidth of the fit"),
    "points": Col("points", fmt="%d"),
    "world_sizes": Col("world sizes"),
    "smape_pct": Col("SMAPE (%)", fmt="%.1f"),
    "r2_adj": Col("adj. R²", fmt="%.3f"),
    "too_few_points": Col("too few points"),
}
HOST_CPU_COLUMNS = {
    "group_id": Col("group"),
    "world_size": Col("N", fmt="%d"),
    "source": Col("source"),
    "host_cpu_count": Col("logical CPUs", fmt="%d"),
    "host_proc_cpu_pct": Col("job's CPU (%)", fmt="%.0f", help="the job's processes; 100% is one core busy"),
    "host_sys_cpu_pct": Col("host CPU busy (%)", fmt="%.0f", help="the whole host, all CPUs"),
    "host_load1": Col("load (1 min)", fmt="%.2f", help="runnable threads, against the logical CPUs"),
}
POP_COLUMNS = {
    "group_id": Col("group"),
    "world_size": Col("N", fmt="%d"),
    "load_balance": Col("load balance", fmt="%.2f"),
    "comm_efficiency": Col("comm. efficiency", fmt="%.2f"),
    "parallel_efficiency": Col("parallel eff.", fmt="%.2f"),
    "computation_scaling": Col("computation scaling", fmt="%.2f"),
    "global_efficiency": Col("global eff.", fmt="%.2f"),
}
MODEL_COLUMNS = {
    "group_id": Col("group"),
    "points": Col("points", fmt="%d"),
    "formula": Col("model of step time T(p)"),
    "smape_pct": Col("SMAPE (%)", fmt="%.1f"),
    "r2_adj": Col("adj. R²", fmt="%.3f"),
    "loo_smape_pct": Col("leave-one-out SMAPE (%)", fmt="%.1f"),
    "trusted": Col("trusted", help="fitted to 5 or more world sizes"),
    "note": Col("note"),
}

PREDICTION_COLUMNS = {
    "group_id": Col("group"),
    "world_size": Col("N", fmt="%d"),
    "kind": Col("kind", help="measured, or a prediction of the model"),
    "measured_step_ns": Col("measured step (ms)", 1e-6, "%.3f"),
    "model_step_ns": Col("model step (ms)", 1e-6, "%.3f"),
    "model_speedup": Col("model S(N)", fmt="%.2f"),
    "model_efficiency": Col("model E(N)", 100.0, "%.0f%%"),
    "predicted_allreduce_ns": Col("allreduce, alpha-beta (ms)", 1e-6, "%.3f"),
    "trusted": Col("trusted"),
}


def _groups(scaling: pa.Table) -> tuple[list[str], dict[str, str]]:
    vals = [r for r in rows(scaling, ("group_id", "world_size", "mixed")) if not r["mixed"]]
    curves = sorted(multi_point_groups(vals))
    return curves, group_label_map(curves)


def render(ctx: Context) -> None:
    st.title("Scaling")
    scaling = ctx.table("scaling")
    if scaling.num_rows == 0:
        no_runs()
        return
    simulated_notice(scaling)
    _mixed(scaling)
    curves, labels = _groups(scaling)
    if not curves:
        st.info(
            "No scaling group in this selection has runs at two or more world sizes, so there is no curve "
            "to draw. A group is one experiment, cluster, backend and model at one per-rank (weak) or global "
            "(strong) batch size.",
            icon=":material/info:",
        )
        return
    wanted = st.query_params.get(links.GROUP)
    picked = st.multiselect(
        "Scaling groups",
        curves,
        default=[wanted] if wanted in curves else curves,
        format_func=lambda g: labels.get(g, g),
        key="scaling_groups",
        help="experiment / cluster / backend / model / mode:batch; the labels show the parts that differ",
    )
    if not picked:
        st.caption("Pick at least one group.")
        return
    run_ids = rows(filter_rows(scaling, "group_id", picked), ("run_id",))
    runs = [r["run_id"] for r in run_ids]
    shown = filter_rows(scaling, "group_id", picked)
    unit = device_unit_of(filter_rows(ctx.table("run_summary"), "run_id", runs))
    tabbed(
        links.SCALING_TAB,
        {
            "Speedup": lambda: _speedup(ctx, shown, picked, labels, unit),
            "Sync": lambda: _sync(ctx, picked),
            "Phases": lambda: _phases(ctx, picked, runs, labels, unit),
            "Utilisation": lambda: _utilisation(ctx, picked, labels, unit),
            "Groups": lambda: _side_by_side(ctx, runs),
            "Model": lambda: _model(ctx, picked, labels),
        },
    )


def _mixed(scaling: pa.Table) -> None:
    notes = {
        (r["group_id"], r["mode_note"])
        for r in rows(scaling, ("group_id", "mixed", "mode_note"))
        if r["mixed"]
    }
    labels = group_label_map(g for g, _ in notes)
    for group_id, note in sorted(notes):
        st.warning(
            f"**{md(labels.get(group_id, group_id))}** mixes strong and weak scaling "
            f"({md(note or 'batch sizes disagree')}); its runs are not compared with each other.",
            icon=":material/rule:",
        )


def _largest(scaling: pa.Table) -> pa.Table:
    """Each group's row at its largest world size."""
    last: dict[str, dict[str, Any]] = {}
    for r in rows(scaling):
        g = r["group_id"]
        if g not in last or r["world_size"] > last[g]["world_size"]:
            last[g] = r
    return pa.Table.from_pylist([last[g] for g in sorted(last)]) if last else scaling


def _speedup(ctx: Context, scaling: pa.Table, picked: list[str], labels: dict[str, str], unit: str) -> None:
    prediction = filter_rows(ctx.table("scaling_prediction"), "group_id", picked)
    charts(speedup_chart(scaling, prediction), efficiency_chart(scaling, prediction))
    with st.container(horizontal=True, wrap=True, gap="large"):
        chart(per_gpu_speedup_chart(scaling, unit))
        with st.container(width=560):
            st.subheader("At the largest world size")
            st.caption(f"Per group at its largest N: the per-{unit} speedup S(N)/N the seed study quotes.")
            show_table(relabel(_largest(scaling), "group_id", labels), for_unit(LARGEST_COLUMNS, unit))
    show_table(relabel(scaling, "group_id", labels), for_unit(SCALING_COLUMNS, unit))
    definition_note("scaling", "scaling_prediction")


def _sync(ctx: Context, picked: list[str]) -> None:
    sync = filter_rows(ctx.table("sync"), "group_id", picked)
    fit = ctx.table("allreduce_fit")
    reference = filter_rows(ctx.table("reference_busbw"), "group_id", picked)
    charts(sync_time_chart(sync), busbw_chart(sync, fit, reference))
    st.subheader("Ring allreduce fit (alpha-beta)")
    show_table(fit, FIT_COLUMNS)
    definition_note("sync", "allreduce_fit")


def _phases(ctx: Context, picked: list[str], runs: list[str], labels: dict[str, str], unit: str) -> None:
    charts(
        phase_breakdown_chart(filter_rows(ctx.table("phase_breakdown"), "run_id", runs)),
        lost_time_chart(filter_rows(ctx.table("lost_time"), "group_id", picked), unit),
    )
    st.subheader("POP efficiencies")
    show_table(relabel(filter_rows(ctx.table("pop"), "group_id", picked), "group_id", labels), POP_COLUMNS)
    definition_note("phase_breakdown", "lost_time", "pop")


def _utilisation(ctx: Context, picked: list[str], labels: dict[str, str], unit: str) -> None:
    util = filter_rows(ctx.table("utilisation"), "group_id", picked)
    if unit == "rank":  # a CPU job: what its hosts' CPUs did, where a GPU job shows GPU utilisation
        st.caption(
            "Every run here ran on CPU: no GPU utilisation or energy. The job's CPU is 100% per busy core; "
            "a load above the logical CPUs means ranks and their threads wait for a core."
        )
        show_table(relabel(util, "group_id", labels), HOST_CPU_COLUMNS)
    else:
        charts(utilisation_chart(util), energy_chart(util))
        on_cpu = pc.and_(pc.is_null(util["util_gpu_pct"]), pc.is_valid(util["host_sys_cpu_pct"]))
        if util.num_rows and pc.any(on_cpu).as_py():  # CPU runs beside GPU ones: their hosts' CPU
            st.subheader("Runs on CPU: host CPU")
            show_table(relabel(util.filter(on_cpu), "group_id", labels), HOST_CPU_COLUMNS)
    definition_note("utilisation")


def _side_by_side(ctx: Context, runs: list[str]) -> None:
    st.caption(
        "Backends measured at the same world size, per-rank batch, cluster and model. The speedup and "
        "efficiency charts compare clusters and batch sizes: pick their groups above."
    )
    chart(backend_compare_chart(filter_rows(ctx.table("backend_compare"), "run_id", runs)))
    definition_note("backend_compare")


def _model(ctx: Context, picked: list[str], labels: dict[str, str]) -> None:
    st.caption(
        "A model of step time fitted to the measured world sizes (Extra-P normal form) and extrapolated "
        "beyond them; the Speedup tab draws its predictions as hollow diamonds on dashed lines. Fewer than "
        "5 measured world sizes make a model that is not trusted."
    )
    show_table(
        relabel(filter_rows(ctx.table("scaling_model"), "group_id", picked), "group_id", labels),
        MODEL_COLUMNS,
    )
    st.subheader("Measured and predicted")
    show_table(
        relabel(filter_rows(ctx.table("scaling_prediction"), "group_id", picked), "group_id", labels),
        PREDICTION_COLUMNS,
    )
    definition_note("scaling_model", "scaling_prediction")
