"""The sections about how the ranks and the batch shape a step: stragglers (what the straggler
rule found, per rank) and batch-size effects (the sweep, metric curves, time to a target)."""

from __future__ import annotations

from ..explain.rules_compute import LOW_LOAD_BALANCE, STRAGGLER_WAIT_SHARE
from .context import Context
from .model import Ref, Section, format_value, table_block, table_columns


def stragglers(ctx: Context) -> Section:
    """What the straggler rule found (the explainer's own finding, linked), the per-rank waits of the
    runs it names, and the charts of its run: the section never says less or other than the finding."""
    s = Section("stragglers", "Stragglers", definitions=("wait-at-collective", "pop"))
    waits = ctx.rows("stragglers")
    said = [(rank, f) for rank, f in ctx.fired if f.rule == "straggler"]
    s.blocks.append(
        [
            "At every collective the early ranks wait for the last one. A rank that is last far more "
            "often than 1/n of the time holds the others back; so does one that computes more than the "
            "others (a load balance, mean/max useful compute per rank, under "
            f"{LOW_LOAD_BALANCE})."
        ]
    )
    run_id: str | None = None
    if said:
        sizes = {r["run_id"]: r["world_size"] or 0 for r in ctx.rows("run_summary", ("run_id", "world_size"))}
        for rank, f in said:
            s.blocks.append([Ref(f.title, f"finding-{rank}"), f". {f.text}"])
        named = {run for _, f in said for run in f.evidence.run_ids}
        # the run the first finding speaks of: its largest world size, as the rule chooses
        run_id = max(said[0][1].evidence.run_ids, key=lambda r: (sizes.get(r, 0), r), default=None)
        s.blocks.append(
            table_block(
                "stragglers",
                "Wait at collective per rank, in the runs the findings name",
                table_columns(
                    ("run_id", "run"),
                    ("world_size", "N"),
                    ("rank", "rank"),
                    ("hostname", "host"),
                    ("last_share", "last in"),
                    ("is_straggler", "last most often"),
                    ("others_wait_per_step_ns", "others wait/step"),
                    ("others_wait_share", "others wait share"),
                    ("wait_source", "from"),
                ),
                [r for r in waits if r["run_id"] in named],
            )
        )
    else:
        s.blocks.append(
            [
                "No rank holds the others back in this selection: every run's load balance is at least "
                f"{LOW_LOAD_BALANCE}, and no rank is last in most collectives with the others waiting "
                f"{format_value('others_wait_share', STRAGGLER_WAIT_SHARE)} of the step or more for it."
            ]
        )
        for r in (r for r in waits if r["is_straggler"]):
            run_id = run_id or r["run_id"]
            s.blocks.append(
                [
                    f"Rank {r['rank']} of run {r['run_id']} is last in "
                    f"{format_value('last_share', r['last_share'])} of the collectives, but the others wait "
                    f"only {format_value('others_wait_share', r['others_wait_share'] or 0.0)} of the step "
                    "for it: too little to slow the run."
                ]
            )
    s.blocks.append(ctx.chart("last_rank", run_id=run_id))
    s.blocks.append(ctx.chart("wait_heatmap", run_id=run_id))
    return s


def batch(ctx: Context) -> Section | None:
    sweep = ctx.rows("batch_sweep")
    curves = ctx.tables.get("metric_curves")
    if not sweep and (curves is None or curves.num_rows == 0):
        return None
    s = Section("batch", "Batch-size effects", definitions=("batch-sweep", "throughput"))
    s.blocks.append(
        [
            "A larger batch raises samples per second, but it can need more samples to reach the same "
            "quality: time-to-target decides (scale the learning rate linearly or with √k, with warm-up, "
            "or use LARS/LAMB)."
        ]
    )
    if sweep:
        s.blocks.append(ctx.chart("batch_sweep"))
    else:
        s.blocks.append(["No batch-size sweep: one batch size per experiment and world size."])
    if curves is not None and curves.num_rows:
        s.blocks.append(ctx.chart("metric_curves"))
    if sweep:
        s.blocks.append(
            table_block(
                "batch_sweep",
                "Batch-size sweep",
                table_columns(
                    ("experiment", "experiment"),
                    ("cluster", "cluster"),
                    ("world_size", "N"),
                    ("global_batch_size", "global batch"),
                    ("step_ns", "step time T"),
                    ("per_sample_ns", "time/sample"),
                    ("throughput_samples_per_s", "throughput X"),
                    ("epoch_s", "epoch"),
                    ("throughput_vs_smallest", "X / smallest batch"),
                ),
                sorted(
                    sweep,
                    key=lambda r: (
                        str(r["experiment"]),
                        str(r["cluster"]),
                        r["world_size"],
                        r["global_batch_size"] or 0,
                    ),
                ),
            )
        )
    ttm = ctx.rows("time_to_metric")
    if ttm:
        s.blocks.append(
            table_block(
                "time_to_metric",
                "Time to a metric target",
                table_columns(
                    ("experiment", "experiment"),
                    ("variant", "variant"),
                    ("metric", "metric"),
                    ("target", "target"),
                    ("target_source", "target from"),
                    ("world_size", "N"),
                    ("global_batch_size", "global batch"),
                    ("reached", "reached"),
                    ("diverged", "diverged"),
                    ("time_to_target_s", "time to target"),
                    ("steps_to_target", "steps"),
                    ("final_value", "final value"),
                ),
                sorted(
                    ttm,
                    key=lambda r: (
                        str(r["experiment"]),
                        str(r["variant"]),
                        r["metric"],
                        r["global_batch_size"] or 0,
                    ),
                ),
            )
        )
    return s
