"""What-if (issue 23): per-worker slowdown as a dp rank × stage heat map and step by step, the step's
excess over the ideal attributed to stages, op types and workers, and the recorded step beside the
ideal one.

Every builder reads the `what_if` analysis table only (one row per run: means over the run's steps,
as the analysis gives them) and draws one run: the one asked for, else the one with the largest
slowdown."""

from __future__ import annotations

from typing import Any

import altair as alt
import pyarrow as pa

from .rows import Row, data, rows
from .style import (
    IDEAL_COLOUR,
    PANEL_HEIGHT,
    SERIES_SCHEME,
    THRESHOLD_COLOUR,
    WIDTH,
    ChartLike,
    finish,
    no_data,
)

#: the workers the attribution chart lists (largest cost first): more would not be read
TOP_WORKERS = 12


def what_if_run(what_if: pa.Table | None, run_id: str | None = None) -> Row | None:
    """The what-if row to draw: `run_id`'s, else the run with the largest slowdown; None when absent."""
    values = rows(what_if)
    if run_id is not None:
        return next((r for r in values if r["run_id"] == run_id), None)
    ranked = sorted(values, key=lambda r: r["run_id"])
    return max(ranked, key=lambda r: r["slowdown"] or 0.0, default=None)


def cost_ns(row: Row, slowdown: float | None) -> float:
    """ns per step that one part, left as recorded while all else is ideal, adds to the ideal step:
    (S_x − 1) · ideal (negative when the part is faster than typical)."""
    return ((slowdown or 1.0) - 1.0) * float(row["ideal_step_ns"] or 0.0)


def worker_label(w: Row) -> str:
    ranks = ",".join(str(k) for k in w.get("ranks") or [])
    return (
        f"dp {w['dp_rank']} · stage {w['stage']} (rank{'s' if len(w.get('ranks') or []) > 1 else ''} {ranks})"
    )


def _missing(title: str, run_id: str | None) -> ChartLike:
    why = (
        f"run {run_id} has no what-if row (it needs more than one rank and a known layout)"
        if run_id
        else "no run in this selection has a what-if row (more than one rank and a known layout)"
    )
    return no_data(title, why)


def heatmap_rows(row: Row) -> list[Row]:
    """One cell per worker: its slowdown S_x and what it costs per step (ms)."""
    return [
        {
            "dp_rank": int(w["dp_rank"]),
            "stage": int(w["stage"]),
            "ranks": ", ".join(str(k) for k in w.get("ranks") or []),
            "slowdown": float(w["slowdown"]),
            "cost_ms": cost_ns(row, w["slowdown"]) / 1e6,
        }
        for w in row.get("by_worker") or []
    ]


def what_if_heatmap(what_if: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """Slowdown of the step with only one worker (a dp rank at a stage) as recorded, per dp rank and
    stage, for one run."""
    title = "What-if: slowdown per worker (dp rank × stage)"
    row = what_if_run(what_if, run_id)
    values = heatmap_rows(row) if row else []
    if row is None or not values:
        return _missing(title, run_id)
    stages = sorted({v["stage"] for v in values})
    dps = sorted({v["dp_rank"] for v in values})
    top = max(v["slowdown"] for v in values)
    chart = (
        alt.Chart(data(values))
        .mark_rect(stroke="white", strokeWidth=1)
        .encode(
            x=alt.X("stage:O", title="pipeline stage", sort=stages, axis=alt.Axis(labelAngle=0)),
            y=alt.Y("dp_rank:O", title="data-parallel rank", sort=dps),
            color=alt.Color(
                "slowdown:Q",
                title="slowdown S",
                scale=alt.Scale(scheme="orangered", domain=[1.0, max(top, 1.01)], clamp=True),
            ),
            tooltip=[
                alt.Tooltip("dp_rank:O", title="dp rank"),
                alt.Tooltip("stage:O"),
                alt.Tooltip("ranks:N"),
                alt.Tooltip("slowdown:Q", format=".3f", title="S with only this worker as recorded"),
                alt.Tooltip("cost_ms:Q", format=".3f", title="cost (ms/step)"),
            ],
        )
        .properties(
            # the full width whatever the stages: the subtitle is wrapped for it (narrower, it was cut off)
            width=WIDTH,
            height=max(60, min(PANEL_HEIGHT * 2, 22 * len(dps))),
        )
    )
    return finish(
        chart,
        title,
        [
            f"run {row['run_id']}, means over {row['steps']} steps: the step with only this worker as "
            "recorded, every other op at its ideal time, over the ideal step (1 = no cost)"
        ],
    )


#: the workers the heat map over steps draws (most costly first): a row per worker
TOP_STEP_WORKERS = 32


def step_heatmap_rows(row: Row, top_workers: int = TOP_STEP_WORKERS) -> list[Row]:
    """One cell per worker and bin of steps (`steps_per_bin` consecutive steps; one step when the run
    has at most the analysis' MAX_STEP_BINS): the step's slowdown with only that worker as recorded."""
    per_bin = int(row.get("steps_per_bin") or 1)
    workers = sorted(row.get("by_worker") or [], key=lambda w: -(w["slowdown"] or 0.0))[:top_workers]
    return [
        {
            "worker": worker_label(w),
            "order": i,
            "step": k * per_bin,
            "slowdown": float(v),
        }
        for i, w in enumerate(workers)
        for k, v in enumerate(w.get("step_slowdown") or [])
    ]


def what_if_step_heatmap(what_if: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """Each worker's slowdown step by step, for one run: a worker slow in every step is a bad node or
    GPU; one slow in some steps only is its data or a neighbour."""
    title = "What-if: slowdown per worker, step by step"
    row = what_if_run(what_if, run_id)
    values = step_heatmap_rows(row) if row else []
    if row is None or not values:
        return _missing(title, run_id)
    per_bin = int(row.get("steps_per_bin") or 1)
    workers = [v["worker"] for v in sorted(values, key=lambda v: v["order"]) if v["step"] == 0]
    top = max(v["slowdown"] for v in values)
    step_title = "step (of the steady steps)" if per_bin == 1 else f"first step of each bin of {per_bin}"
    chart = (
        alt.Chart(data(values))
        .mark_rect()
        .encode(
            x=alt.X("step:O", title=step_title, axis=alt.Axis(labelAngle=0, labelOverlap=True)),
            y=alt.Y("worker:N", title="worker", sort=workers),
            color=alt.Color(
                "slowdown:Q",
                title="slowdown S",
                scale=alt.Scale(scheme="orangered", domain=[1.0, max(top, 1.01)], clamp=True),
            ),
            tooltip=[
                alt.Tooltip("worker:N"),
                alt.Tooltip("step:O"),
                alt.Tooltip("slowdown:Q", format=".3f", title="S with only this worker as recorded"),
            ],
        )
        .properties(width=WIDTH, height=max(60, min(PANEL_HEIGHT * 2, 18 * len(workers))))
    )
    shown = len(workers)
    total = len(row.get("by_worker") or [])
    return finish(
        chart,
        title,
        [
            f"run {row['run_id']}: each step with only this worker as recorded, every other op at its "
            "ideal time, over the ideal step (1 = no cost)"
            + (f"; the {shown} costliest of {total} workers" if shown < total else "")
        ],
    )


def attribution_rows(row: Row, top_workers: int = TOP_WORKERS) -> list[Row]:
    """The step's excess over the ideal (ms per step) with only one stage, op type or worker left as
    recorded: stages and op types all, the `top_workers` costliest workers."""
    out: list[Row] = []
    for r in row.get("by_stage") or []:
        out.append({"by": "stage", "part": f"stage {r['stage']}", "slowdown": r["slowdown"]})
    for r in row.get("by_op_type") or []:
        out.append({"by": "op type", "part": str(r["op_type"]), "slowdown": r["slowdown"]})
    workers = sorted(row.get("by_worker") or [], key=lambda w: -(w["slowdown"] or 0.0))[:top_workers]
    for w in workers:
        out.append({"by": "worker", "part": worker_label(w), "slowdown": w["slowdown"]})
    for i, r in enumerate(out):
        r["cost_ms"] = cost_ns(row, r["slowdown"]) / 1e6
        r["order"] = i
    return out


def what_if_attribution(what_if: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """What each stage, op type and worker adds to the ideal step when it alone is as recorded."""
    title = "What-if: the step's excess over the ideal by stage, op type and worker"
    row = what_if_run(what_if, run_id)
    values = attribution_rows(row) if row else []
    if row is None or not values:
        return _missing(title, run_id)
    excess_ms = (float(row["actual_step_ns"]) - float(row["ideal_step_ns"])) / 1e6
    parts = [v["part"] for v in sorted(values, key=lambda v: v["order"])]
    bars = (
        alt.Chart(data(values))
        .mark_bar()
        .encode(
            y=alt.Y("part:N", title=None, sort=parts, axis=alt.Axis(labelLimit=260)),
            x=alt.X("cost_ms:Q", title="added to the ideal step (ms/step)"),
            color=alt.Color(
                "by:N",
                title="left as recorded",
                scale=alt.Scale(domain=["stage", "op type", "worker"], scheme=SERIES_SCHEME),
            ),
            tooltip=[
                alt.Tooltip("by:N", title="kind"),
                alt.Tooltip("part:N"),
                alt.Tooltip("slowdown:Q", format=".3f", title="S with only this as recorded"),
                alt.Tooltip("cost_ms:Q", format=".3f", title="ms/step"),
            ],
        )
    )
    whole = (
        alt.Chart(alt.Data(values=[{"excess_ms": excess_ms}]))
        .mark_rule(color=THRESHOLD_COLOUR, strokeDash=[4, 3])
        .encode(
            x="excess_ms:Q",
            tooltip=[alt.Tooltip("excess_ms:Q", format=".3f", title="whole excess (ms/step)")],
        )
    )
    chart = alt.layer(bars, whole).properties(width=WIDTH, height=max(80, 16 * len(values)))
    return finish(
        chart,
        title,
        [
            f"run {row['run_id']}: dashed, the whole excess (recorded − ideal step, "
            f"{excess_ms:.3g} ms/step); parts overlap, they need not add up to it",
        ],
    )


def steps_rows(row: Row) -> list[Row]:
    """The recorded step and the ideal step (ms, means over the run's steps)."""
    return [
        {"step": "recorded", "ms": float(row["actual_step_ns"]) / 1e6},
        {"step": "ideal (replayed)", "ms": float(row["ideal_step_ns"]) / 1e6},
    ]


def what_if_steps(what_if: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """The recorded step time beside the ideal one (every op at its typical time at its dp peers)."""
    title = "What-if: recorded step against the ideal step"
    row = what_if_run(what_if, run_id)
    if row is None or row.get("actual_step_ns") is None or row.get("ideal_step_ns") is None:
        return _missing(title, run_id)
    values = steps_rows(row)
    colours = alt.Scale(domain=["recorded", "ideal (replayed)"], range=["#0072B2", IDEAL_COLOUR])
    base = alt.Chart(data(values)).encode(
        y=alt.Y("step:N", title=None, sort=[v["step"] for v in values]),
        x=alt.X("ms:Q", title="step time (ms, mean over steps)"),
    )
    bars = base.mark_bar().encode(
        color=alt.Color("step:N", scale=colours, legend=None),
        tooltip=[alt.Tooltip("step:N"), alt.Tooltip("ms:Q", format=".3f", title="ms/step")],
    )
    labels = base.mark_text(align="left", dx=4).encode(text=alt.Text("ms:Q", format=".3g"))
    chart = alt.layer(bars, labels).properties(width=WIDTH, height=70)
    words: list[Any] = [
        f"run {row['run_id']}, {row['steps']} steps: slowdown S = {float(row['slowdown']):.3g}, "
        f"cause {row.get('cause') or 'none'}; replay error {float(row['replay_error'] or 0.0) * 100:.2g}%"
    ]
    return finish(chart, title, words)
