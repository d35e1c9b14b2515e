"""The report's "What-if" section (issue 23): for the runs that have a `what_if` row, what each step
would take without each slow worker, stage or op type, in words, a table and five charts (the recorded
and the ideal step, the timeline of one step replayed both ways, the heat maps per worker and over
steps, the attribution). Left out when no run has such a row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..charts.what_if import what_if_run, worker_label
from ..explain.rules_what_if import cost_ns  # the finding's cost: at most the whole excess
from .model import Num, Para, Ref, Section, format_value, table_block, table_columns

if TYPE_CHECKING:
    from .context import Context

#: what each cause means, in words
CAUSE_WORDS = {
    "slow-worker": "one worker (a data-parallel rank at one stage) explains most of the excess",
    "stage-imbalance": "one pipeline stage's compute is longer at every data-parallel rank",
    "data-imbalance": (
        "compute differs across data-parallel ranks from step to step, with no fixed slow worker"
    ),
    "none": "no single worker, stage or data imbalance explains the excess",
}


def _pct(v: float) -> str:
    return f"{v * 100:.2g}%"


def run_words(row: dict[str, Any]) -> Para:
    """One run's what-if numbers in words: the recorded and ideal step, the slowdown, the cause and
    what the costliest worker, stage and op type add to the ideal step."""
    run = row["run_id"]
    cause = row.get("cause") or "none"
    para: Para = [
        f"Run {run} ({row['steps']} steps): the recorded step takes ",
        Num(row["actual_step_ns"], "what_if", "actual_step_ns", run),
        "; replayed with every op at its typical time among its data-parallel peers it would take ",
        Num(row["ideal_step_ns"], "what_if", "ideal_step_ns", run),
        ", a slowdown S = ",
        Num(row["slowdown"], "what_if", "slowdown", run),
        f" (the replay of the recorded times is off by {_pct(float(row['replay_error'] or 0.0))}). ",
        f"Cause: {cause}, {CAUSE_WORDS.get(cause, cause)}",
    ]
    if row.get("second_cause"):
        para.append(f"; also {row['second_cause']}")
    para.append(".")
    parts = []
    workers = row.get("by_worker") or []
    if workers:
        w = workers[0]
        parts.append(f"worker {worker_label(w)} costs {_ms(cost_ns(row, w['slowdown']))}")
    stages = row.get("by_stage") or []
    if len(stages) > 1:
        parts.append(f"stage {stages[0]['stage']} costs {_ms(cost_ns(row, stages[0]['slowdown']))}")
    ops = row.get("by_op_type") or []
    if ops:
        parts.append(f"op type {ops[0]['op_type']} costs {_ms(cost_ns(row, ops[0]['slowdown']))}")
    if parts:
        para.append(
            " Left alone as recorded, every other op at its ideal time (what each costs is at most the "
            "whole excess, as in the findings), the costliest " + "; ".join(parts) + " per step."
        )
    return para


def _ms(ns: float) -> str:
    return format_value("cost_ns", ns)


def what_if(ctx: Context) -> Section | None:
    """The what-if section, or None when no run in the report has a what_if row."""

    values = ctx.rows("what_if")
    if not values:
        return None
    s = Section("what-if", "What-if", definitions=("what-if",))
    s.blocks.append(
        [
            "Each step's dependencies are replayed from what was recorded (each rank's ops in order, a "
            "receive after its send, a collective after its last member). The ideal step replays every "
            "op at its typical time among its data-parallel peers; the slowdown is the recorded step "
            "over the ideal one. Leaving one worker, stage or op type as recorded, all else ideal, "
            "says what it costs each step."
        ]
    )
    said = [(rank, f) for rank, f in ctx.fired if f.rule == "what-if"]
    for rank, f in said:
        s.blocks.append([Ref(f.title, f"finding-{rank}"), f". {f.text}"])
    named = [r for _, f in said for r in f.evidence.run_ids if any(v["run_id"] == r for v in values)]
    chosen = what_if_run(ctx.tables.get("what_if"), named[0] if named else None)
    assert chosen is not None  # values is not empty
    run_id = chosen["run_id"]
    s.blocks.append(run_words(chosen))
    for r in values:  # what a row leaves out, or why it reads as it does (issue 33)
        if r.get("note"):
            s.blocks.append([f"Run {r['run_id']}: {r['note']}."])
    why = "the run the what-if finding names" if named else "the run with the largest slowdown"
    s.blocks.append(ctx.chart("what_if_steps", f"run {run_id}, {why}", run_id=run_id))
    s.blocks.append(
        ctx.chart(
            "what_if_timeline",
            f"run {run_id}, its step of median slowdown, replayed with the recorded and the ideal times",
            run_id=run_id,
        )
    )
    s.blocks.append(ctx.chart("what_if_heatmap", f"run {run_id}", run_id=run_id))
    s.blocks.append(ctx.chart("what_if_step_heatmap", f"run {run_id}", run_id=run_id))
    s.blocks.append(ctx.chart("what_if_attribution", f"run {run_id}", run_id=run_id))
    s.blocks.append(
        table_block(
            "what_if",
            "What-if per run",
            table_columns(
                ("run_id", "run"),
                ("steps", "steps"),
                ("actual_step_ns", "recorded step"),
                ("ideal_step_ns", "ideal step"),
                ("slowdown", "slowdown S"),
                ("cause", "cause"),
                ("replay_error", "replay error"),
            ),
            [{k: v for k, v in r.items() if not k.startswith("by_")} for r in values],
        )
    )
    return s
