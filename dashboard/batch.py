"""Batch size page: step time and throughput against batch size, and the user metric against wall time."""

from __future__ import annotations

import streamlit as st

from perfscope.charts.batch import batch_sweep_chart, metric_curve_chart

from .state import Context
from .widgets import Col, chart, charts, definition_note, show_table, simulated_notice

SWEEP_COLUMNS = {
    "experiment": Col("experiment"),
    "cluster": Col("cluster"),
    "backend": Col("backend"),
    "world_size": Col("N", fmt="%d"),
    "batch_size_per_rank": Col("batch/rank", fmt="%d"),
    "global_batch_size": Col("global batch", fmt="%d"),
    "source": Col("source"),
    "step_ns": Col("step (ms)", 1e-6, "%.3f"),
    "per_sample_ns": Col("per sample (µs)", 1e-3, "%.2f"),
    "throughput_samples_per_s": Col("samples/s", fmt="%,.0f"),
    "throughput_vs_smallest": Col(
        "× smallest batch", fmt="%.2f", help="throughput / throughput at the smallest batch"
    ),
    "epoch_s": Col("epoch (s)", fmt="%.1f", help="dataset samples / throughput"),
}
TARGET_COLUMNS = {
    "metric": Col("metric"),
    "direction": Col("goal"),
    "target": Col("target", fmt="%.4g"),
    "batch_size_per_rank": Col("batch/rank", fmt="%d"),
    "world_size": Col("N", fmt="%d"),
    "source": Col("source"),
    "reached": Col("reached"),
    "time_to_target_s": Col("time to target (s)", fmt="%.1f"),
    "steps_to_target": Col("steps", fmt="%d"),
    "best_value": Col("best", fmt="%.4g"),
    "final_value": Col("final", fmt="%.4g"),
}


def render(ctx: Context) -> None:
    st.title("Batch size")
    sweep = ctx.table("batch_sweep")
    curves = ctx.table("metric_curves")
    if sweep.num_rows == 0 and curves.num_rows == 0:
        st.info(
            "No batch-size sweep in this selection: it needs runs of one experiment, cluster, backend and "
            "world size at two or more batch sizes (and user metrics for the "
            "time-to-accuracy curves, `prof.log(loss=...)` in the training loop).",
            icon=":material/info:",
        )
        return
    simulated_notice(sweep if sweep.num_rows else curves)
    # a store with user metrics but one batch size has curves and no sweep: draw only what there is
    if sweep.num_rows and curves.num_rows:
        charts(batch_sweep_chart(sweep), metric_curve_chart(curves))
    elif sweep.num_rows:
        chart(batch_sweep_chart(sweep))
    else:
        st.caption("No batch-size sweep in this selection (one batch size per experiment and world size).")
        chart(metric_curve_chart(curves))
    if sweep.num_rows:
        show_table(sweep, SWEEP_COLUMNS)
        definition_note("batch_sweep")
    if curves.num_rows == 0:
        return
    st.subheader("Time to a common target")
    st.caption(
        "A larger batch buys throughput but may need more steps to the same accuracy: compare the wall time "
        "to the target, not samples per second. Scaling the learning rate with the batch (linearly or by "
        "√k, with warm-up; LARS/LAMB for very large batches) is usually needed."
    )
    show_table(ctx.table("time_to_metric"), TARGET_COLUMNS)
    definition_note("metric_curves", "time_to_metric")
