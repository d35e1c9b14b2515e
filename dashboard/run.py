"""Run page: one run's step times per rank, phases, stragglers, and GPU and host telemetry over time."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import streamlit as st

from perfscope.analysis.rank_timeline import MAX_INTERVALS, MAX_WINDOW_STEPS
from perfscope.charts.comm import comm_ops_chart, comm_roles_chart
from perfscope.charts.phases import phase_breakdown_chart
from perfscope.charts.rank_timeline import rank_timeline_chart
from perfscope.charts.rows import rows
from perfscope.charts.stragglers import last_rank_chart, wait_heatmap
from perfscope.charts.timeline import (
    gpu_timeline_chart,
    host_timeline_chart,
    steady_window,
    step_series_chart,
)
from perfscope.report.model import format_value
from perfscope.report.settings import setting_pairs
from perfscope.report.text import literal as md
from perfscope.words import counted, joined, known

from . import links, what_if
from .state import Context
from .widgets import (
    Col,
    chart,
    charts,
    definition_note,
    ms,
    no_runs,
    num,
    one_row,
    pct,
    show_table,
    tabbed,
    wide_chart,
)

RANK_COLUMNS = {
    "rank": Col("rank", fmt="%d"),
    "hostname": Col("host"),
    "steps": Col("steps", fmt="%d"),
    "step_ns": Col("step (ms)", 1e-6, "%.3f"),
    "data_ns": Col("data (ms)", 1e-6, "%.3f"),
    "forward_ns": Col("forward (ms)", 1e-6, "%.3f"),
    "backward_ns": Col("backward (ms)", 1e-6, "%.3f"),
    "sync_exposed_ns": Col("exposed sync (ms)", 1e-6, "%.3f"),
    "optimizer_ns": Col("optimizer (ms)", 1e-6, "%.3f"),
    "other_ns": Col("other (ms)", 1e-6, "%.3f"),
    "comm_total_ns": Col("comm total (ms)", 1e-6, "%.3f", "all collectives, overlapped or not"),
}
STRAGGLER_COLUMNS = {
    "rank": Col("rank", fmt="%d"),
    "hostname": Col("host"),
    "instances": Col("collectives", fmt="%d"),
    "last_share": Col("last to enter", 100.0, "%.0f%%"),
    "wait_per_step_ns": Col("wait per step (ms)", 1e-6, "%.3f"),
    "wait_share_of_step": Col("wait / step", 100.0, "%.1f%%"),
    "is_straggler": Col("last most often", help="last in most collectives, well above 1/n"),
    "wait_source": Col("measured from"),
}
PLACEMENT_COLUMNS = {
    "hostname": Col("host"),
    "node_rank": Col("node", fmt="%d"),
    "ranks_on_host": Col("ranks", fmt="%d"),
    "cpu_count": Col("logical CPUs", fmt="%d"),
    "gpus_on_host": Col("GPUs", fmt="%d"),
    "cores_per_rank": Col("cores / rank", fmt="%.1f"),
    "oversubscribed_cpu": Col("CPU oversubscribed"),
    "oversubscribed_gpu": Col("GPU oversubscribed"),
}

#: the threads analysis on the run page: what each rank computed with (the report's runs table too)
THREAD_COLUMNS = {
    "threads_per_rank": Col("torch threads / rank", fmt="%d"),
    "omp_num_threads": Col("OMP_NUM_THREADS"),
    "mkl_num_threads": Col("MKL_NUM_THREADS"),
    "cores_per_rank_allowed": Col("cores / rank (affinity)", fmt="%d"),
    "ranks_on_host": Col("ranks on host", fmt="%d"),
    "threads_on_host": Col("threads on host", fmt="%d"),
    "cpu_count": Col("logical CPUs", fmt="%d"),
    "threads_oversubscribed": Col("threads exceed cores"),
}

#: the memory analysis on the Telemetry tab: each rank's level, peak and trend over the steady steps
MEMORY_COLUMNS = {
    "rank": Col("rank", fmt="%d"),
    "kind": Col("memory", help="host: the process's RSS; device: the CUDA allocator's peak per step"),
    "last_bytes": Col("last (MiB)", 2**-20, "%.0f"),
    "peak_bytes": Col("peak (MiB)", 2**-20, "%.0f", "device: peak reserved"),
    "slope_bytes_per_step": Col(
        "trend (MiB/step)", 2**-20, "%.2f", "least-squares slope over the steady steps"
    ),
    "r2": Col("R²", fmt="%.2f"),
    "limit_bytes": Col("limit (MiB)", 2**-20, "%.0f", "the host's or the device's memory"),
    "exhaust_step": Col("runs out at step", fmt="%d", help="at this trend; empty when flat or falling"),
}


def _nodes(run: dict) -> str:
    return counted(run["nodes"], "node") if run.get("nodes") else "an unrecorded number of nodes"


def render(ctx: Context) -> None:
    st.title("Run")
    summary = ctx.table("run_summary")
    if summary.num_rows == 0:
        no_runs()
        return
    runs = rows(summary)
    by_id = {r["run_id"]: r for r in runs}
    held = st.session_state.get(links.RUN)
    if held is not None and held not in by_id:
        # a run outside the selection, gone, or another store's: show the first, and set it, since
        # the widget keeps showing the id it last had when its key is only dropped (issue 34)
        st.session_state[links.RUN] = next(iter(by_id))
    # the options are the run ids themselves: a bound widget's URL value is the option's label
    run_id = st.selectbox(
        "Run", list(by_id), key=links.RUN, bind="query-params", help="runs in the sidebar's selection"
    )
    run = by_id[run_id]
    _headline(run)
    _settings(ctx, run_id)
    tabbed(
        links.RUN_TAB,
        {
            "Steps": lambda: _steps(ctx, run_id),
            "Phases": lambda: _phases(ctx, run_id),
            "Stragglers": lambda: _stragglers(ctx, run_id),
            "Communication": lambda: _communication(ctx, run_id),
            "Telemetry": lambda: _telemetry(ctx, run_id),
            "Timeline": lambda: _timeline(ctx, run_id),
            "What-if": lambda: what_if.render(ctx, run_id),
        },
    )


def _steps(ctx: Context, run_id: str) -> None:
    wide_chart(step_series_chart(ctx.table("step_series", ctx.refine(run_ids=(run_id,)))))
    definition_note("run_summary", "step_series")


def _phases(ctx: Context, run_id: str) -> None:
    one = ctx.refine(run_ids=(run_id,))
    chart(phase_breakdown_chart(ctx.table("phase_breakdown", one)))
    st.subheader("Per rank")
    show_table(ctx.table("rank_breakdown", one), RANK_COLUMNS)
    definition_note("phase_breakdown", "rank_breakdown")


def _headline(run: dict[str, Any]) -> None:
    if run.get("source") == "simulated":
        st.info("This run is **simulated** (perfscope simulate), not measured.", icon=":material/science:")
    cols = st.columns(6)
    cols[0].metric("World size", run["world_size"], help=f"ranks, on {_nodes(run)}")
    cols[1].metric(
        "Step time",
        format_value("step_ns", run["step_ns"]),  # as the report writes it; a long value is cut off
        help=f"steady window's elapsed time per step; median {ms(run.get('step_median_ns'), 3)}, "
        f"p10 {ms(run['step_p10_ns'], 3)}, p90 {ms(run['step_p90_ns'], 3)}",
    )
    cols[2].metric("Step-time CV", num(run["step_cv"], ".3f"), help="stdev / mean of the steady steps")
    cols[3].metric(
        "Samples/s", num(run["throughput_samples_per_s"]), help="global samples / elapsed steady time"
    )
    share = (
        run["sync_exposed_ns"] / run["step_ns"]
        if run["step_ns"] and run["sync_exposed_ns"] is not None
        else None
    )
    cols[4].metric(
        "Exposed sync", pct(share), help="share of the step spent waiting for gradient synchronisation"
    )
    cols[5].metric("Steady steps", f"{run['steady_steps']} / {run['steps_total']}", help="warm-up dropped")
    st.caption(
        md(
            joined(
                (
                    f"{counted(run['world_size'], 'rank')} on {_nodes(run)}",
                    run["cluster"],
                    run["backend"],
                    run.get("device_model") or "unknown device",
                    _batch_words(run),
                    f"experiment {run['experiment']}" if known(run["experiment"]) else None,
                )
            )
        )
    )


def _settings(ctx: Context, run_id: str) -> None:
    """The job's recorded settings (run_settings) as a compact two-column table, folded."""
    found = rows(ctx.table("run_settings", ctx.refine(run_ids=(run_id,))))
    pairs = setting_pairs(found[0]) if found else []
    if not pairs:
        return
    with st.expander("Settings", expanded=False):
        show_table(
            pa.table({"setting": [k for k, _ in pairs], "value": [v for _, v in pairs]}),
            {"setting": Col("setting"), "value": Col("value")},
        )
        definition_note("run_settings", popover=True)


def _batch_words(run: dict[str, Any]) -> str:
    """The run's batch in words: what was recorded of it, or that nothing was."""
    per_rank, total = run["batch_size_per_rank"], run["global_batch_size"]
    parts = [f"{per_rank} per rank" if known(per_rank) else "", f"{total} global" if known(total) else ""]
    return f"batch {joined(parts, ', ')}" if any(parts) else "batch size not recorded"


#: Step buckets sent to the browser for the wait heat map, which bins them into at most 120 columns
#: anyway: 64 ranks × 2000 buckets is 128k cells, tens of MB of chart spec and a minute to build.
HEATMAP_BUCKETS = 120


def coarsen_steps(table: pa.Table, buckets: int) -> pa.Table:
    """Merge a (run_id, rank, step, steps_in_bucket, wait_ns) table into at most `buckets` step
    buckets per rank: the mean wait of equal runs of steps, for drawing only."""
    if table.num_rows == 0 or "step" not in table.column_names:
        return table
    first, last = pc.min(table["step"]).as_py(), pc.max(table["step"]).as_py()
    k = -(-(last - first + 1) // buckets)
    if k <= 1:
        return table
    keyed = table.append_column("bucket", pc.divide(pc.subtract(table["step"], first), k))
    merged = keyed.group_by(["run_id", "rank", "bucket"]).aggregate(
        [("step", "min"), ("steps_in_bucket", "sum"), ("wait_ns", "mean")]
    )
    return pa.table(
        {
            "run_id": merged["run_id"],
            "rank": merged["rank"],
            "step": merged["step_min"],
            "steps_in_bucket": merged["steps_in_bucket_sum"],
            "wait_ns": merged["wait_ns_mean"],
        }
    )


def _stragglers(ctx: Context, run_id: str) -> None:
    one = ctx.refine(run_ids=(run_id,))
    strag = ctx.table("stragglers", one)
    # the verdict is the explainer's (the overview's findings), never a second judgement here
    said = [
        f
        for top in ctx.findings() or []
        for f in top.flatten()
        if f.rule == "straggler" and run_id in f.evidence.run_ids
    ]
    for f in said:
        st.warning(f"**{md(f.title)}.** {md(f.text)}", icon=":material/hourglass_top:")
    if not said:
        st.caption("No straggler finding for this run: no rank holds the others back.")
    # the tables hold this run only; naming it spares the builders their search for one
    wait = coarsen_steps(ctx.table("collective_wait", one), HEATMAP_BUCKETS)
    charts(wait_heatmap(wait, run_id), last_rank_chart(strag, run_id))
    show_table(strag, STRAGGLER_COLUMNS)
    # the whole selection's table: the cached one the Scaling page uses, with the group's baseline
    pop = one_row(ctx.table("pop"), "run_id", run_id)
    if pop is not None:
        cols = st.columns(3)
        cols[0].metric("Load balance", num(pop["load_balance"], ".2f"), help="mean(useful) / max(useful)")
        cols[1].metric("Communication efficiency", num(pop["comm_efficiency"], ".2f"), help="max(useful) / T")
        cols[2].metric("Parallel efficiency", num(pop["parallel_efficiency"], ".2f"), help="LB · CommE")
    definition_note("stragglers", "collective_wait", "pop")


COMM_COLUMNS = {
    "op": Col("op"),
    "phase": Col("phase"),
    "kind": Col("kind"),
    "calls_per_step": Col("calls/step", fmt="%.1f"),
    "total_ns_per_step": Col("total (ms/step)", 1e-6, "%.3f", "issue to completion"),
    "exposed_ns_per_step": Col("exposed (ms/step)", 1e-6, "%.3f", "what the rank waited"),
    "bytes_median": Col("median bytes", fmt="%.0f"),
    "bytes_p10": Col("p10 bytes", fmt="%.0f"),
    "bytes_p90": Col("p90 bytes", fmt="%.0f"),
}


def _communication(ctx: Context, run_id: str) -> None:
    one = ctx.refine(run_ids=(run_id,))
    ops = ctx.table("comm_ops", one)
    roles = ctx.table("comm_by_role", one)
    sync = one_row(ctx.table("sync", one), "run_id", run_id)
    if sync is not None and sync.get("tp_comm_count"):
        # the tensor-parallel collectives (the layout's tp groups) beside the gradient sync, never in it
        cols = st.columns(4)
        cols[0].metric("Gradient sync exposed", ms(sync["sync_exposed_ns"]), help="per step, dp groups")
        cols[1].metric("Gradient sync total", ms(sync["comm_total_ns"]), help="per step, issue to completion")
        cols[2].metric("Tensor-parallel exposed", ms(sync["tp_comm_exposed_ns"]), help="per step, tp groups")
        cols[3].metric(
            "Tensor-parallel total",
            ms(sync["tp_comm_total_ns"]),
            help=f"per step, {num(sync['tp_comm_count'], '.1f')} collectives on the tensor-parallel groups",
        )
    charts(comm_ops_chart(ops, run_id=run_id), comm_roles_chart(roles, run_id=run_id))
    show_table(ops, COMM_COLUMNS)
    definition_note("comm_ops", "comm_by_role", "pipeline_stages", "parameter_server")


def _telemetry(ctx: Context, run_id: str) -> None:
    one = ctx.refine(run_ids=(run_id,))
    window = steady_window(ctx.table("step_series", one))
    gpu = ctx.table("gpu_timeline", one)
    host = host_timeline_chart(ctx.table("host_timeline", one), window)
    if gpu.num_rows == 0:
        st.info(
            "No GPU telemetry for this run: a CPU job, or NVML was not available where it ran. Host CPU and "
            "memory are below.",
            icon=":material/memory:",
        )
        chart(host)
    else:
        charts(gpu_timeline_chart(gpu, window), host)
    st.subheader("Ranks per host")
    show_table(ctx.table("placement", one), PLACEMENT_COLUMNS)
    st.subheader("Threads and cores per rank")
    threads = ctx.table("threads", one)
    if threads.num_rows and threads.column("threads_per_rank").null_count < threads.num_rows:
        show_table(threads, THREAD_COLUMNS)
    else:
        st.caption("not recorded: this run was written by a perfscope that did not record threads yet")
    st.subheader("Memory per rank")
    memory = ctx.table("memory", one)
    if memory.num_rows:
        show_table(memory, MEMORY_COLUMNS)
    else:
        st.caption("not recorded: no memory samples in this run (a perfscope that did not record them yet)")
    definition_note("gpu_timeline", "host_timeline", "placement", "threads", "memory")


def _timeline(ctx: Context, run_id: str) -> None:
    one = ctx.refine(run_ids=(run_id,))
    series = ctx.table("step_series", one)
    default = ctx.table("rank_timeline", one)  # the slowest steady step ± 2
    if series.num_rows == 0 or default.num_rows == 0:
        st.info("No steps recorded for this run.", icon=":material/timeline:")
        return
    first = pc.min(series["step"]).as_py()
    last = pc.max(pc.add(series["step"], pc.subtract(series["steps_in_bucket"], 1))).as_py()
    window = (pc.min(default["step"]).as_py(), pc.max(default["step"]).as_py())
    if first < last:
        window = st.slider(
            "Steps",
            min_value=first,
            max_value=last,
            value=window,
            key=f"timeline_steps_{run_id}",
            help=f"the window drawn (at most {MAX_WINDOW_STEPS} steps); opens on the slowest steady step ± 2",
        )
    table = ctx.table("rank_timeline", ctx.refine(run_ids=(run_id,), steps=window))
    shown = (pc.min(table["step"]).as_py(), pc.max(table["step"]).as_py()) if table.num_rows else window
    if shown != tuple(window):
        st.caption(
            f"Showing steps {shown[0]}–{shown[1]} of the {window[0]}–{window[1]} chosen: a window holds at "
            f"most {MAX_WINDOW_STEPS} steps and {MAX_INTERVALS:,} intervals."
        )
    wide_chart(rank_timeline_chart(table, run_id))
    definition_note("rank_timeline")
