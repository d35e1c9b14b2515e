"""The Run page's What-if tab (issue 23): the recorded step against the ideal one, the timeline of one
step replayed with the recorded and the ideal times (the `what_if_timeline` analysis), the per-worker
slowdown heat map and the attribution by stage, op type and worker, from the `what_if` analysis."""

from __future__ import annotations

import pyarrow as pa
import streamlit as st

from perfscope.charts.what_if import (
    heatmap_rows,
    what_if_attribution,
    what_if_heatmap,
    what_if_run,
    what_if_step_heatmap,
    what_if_steps,
    worker_label,
)
from perfscope.charts.what_if_timeline import what_if_timeline_chart
from perfscope.explain.rules_what_if import cost_ns  # the finding's cost: at most the excess
from perfscope.report.text import literal as md
from perfscope.report.what_if import CAUSE_WORDS

from .state import Context
from .widgets import Col, charts, definition_note, ms, num, show_table, wide_chart

WORKER_COLUMNS = {
    "dp_rank": Col("dp rank", fmt="%d"),
    "stage": Col("stage", fmt="%d"),
    "ranks": Col("ranks"),
    "slowdown": Col(
        "slowdown S", fmt="%.3f", help="the step with only this worker as recorded, over the ideal"
    ),
    "cost_ms": Col("cost (ms/step)", fmt="%.3f", help="what this worker alone adds to the ideal step"),
}


def render(ctx: Context, run_id: str) -> None:
    one = ctx.refine(run_ids=(run_id,))
    table = ctx.table("what_if", one)
    row = what_if_run(table, run_id)
    if row is None:
        st.info(
            "No what-if for this run: it needs more than one rank and a layout that is known or can be "
            "read from what was recorded (a pure data-parallel job, a pipeline of stages, or an imported "
            "op table with its dp and pp sizes).",
            icon=":material/info:",
        )
        definition_note("what_if")
        return
    # the verdict is the explainer's (the overview's findings), never a second judgement here
    said = [
        f
        for top in ctx.findings() or []
        for f in top.flatten()
        if f.rule == "what-if" and run_id in f.evidence.run_ids
    ]
    for f in said:
        st.warning(
            f"**{md(f.title)}.** {md(f.text)} {md(f.recommendation)}", icon=":material/model_training:"
        )
    cols = st.columns(3)
    cols[0].metric("Recorded step", ms(row["actual_step_ns"]), help="mean over the run's steps")
    cols[1].metric(
        "Ideal step", ms(row["ideal_step_ns"]), help="every op at its typical time at its dp peers"
    )
    cols[2].metric("Slowdown S", num(row["slowdown"], ".3f"), help="recorded / ideal step")
    cause = str(row.get("cause") or "none")
    # the cause in words, never in a metric: a metric's large type cut it off ("stage-imbal…", issue 34)
    words = [
        f"**Cause: {md(cause)}.** {CAUSE_WORDS.get(cause, md(cause)).capitalize()}. The replay of the "
        "recorded times is off by "
        f"{float(row['replay_error'] or 0.0) * 100:.2g}% over {row['steps']} steps."
    ]
    workers = row.get("by_worker") or []
    if workers:
        w = workers[0]
        words.append(
            f"The costliest worker, {md(worker_label(w))}, costs {ms(cost_ns(row, w['slowdown']))} per "
            "step when it alone is as recorded (at most the whole excess, as in the findings)."
        )
    ops = row.get("by_op_type") or []
    if ops:
        words.append(
            f"The costliest op type, {md(ops[0]['op_type'])}, costs {ms(cost_ns(row, ops[0]['slowdown']))}."
        )
    st.markdown(" ".join(words))
    charts(what_if_steps(table, run_id))
    wide_chart(what_if_timeline_chart(ctx.table("what_if_timeline", one), run_id))
    charts(
        what_if_heatmap(table, run_id),
        what_if_step_heatmap(table, run_id),
        what_if_attribution(table, run_id),
    )
    st.subheader("Per worker")
    show_table(pa.Table.from_pylist(heatmap_rows(row)), WORKER_COLUMNS)
    definition_note("what_if")
