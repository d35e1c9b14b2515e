"""The report's "Compared with a base run" section (`perfscope report --compare BASE`, issue 34): the
verdict of perfscope.analysis.compare in words, the set-up changes first, the tables by phase, rank,
collective and op type, and two charts (the step-time distributions, the difference by phase as a
waterfall). The same Comparison object the `perfscope compare` command prints."""

from __future__ import annotations

from ..analysis.compare import PHASE_LABELS, Comparison
from ..charts.compare import phase_waterfall_chart, step_distribution_chart
from .model import ChartBlock, Para, Section, table_block, table_columns

#: the analysis name the section's tables and charts are filed under
ANALYSIS = "compare"
TITLE = "perfscope compare: candidate against a base run"


def _ms(ns: float | None, sign: bool = False) -> str:
    if ns is None:
        return "n/a"
    return f"{ns / 1e6:+.2f} ms" if sign else f"{ns / 1e6:.2f} ms"


def compare_section(c: Comparison) -> Section:
    blocks: list = []
    if c.setup_changes:
        blocks.append(
            ["What changed in the set-up between the two runs (listed first: it may explain the rest)."]
        )
        blocks.append(
            table_block(
                ANALYSIS,
                "Set-up changes",
                table_columns(("setting", "setting"), ("base", "base"), ("candidate", "candidate")),
                [
                    {
                        "setting": f"{s['table']}.{s['setting']}",
                        "base": s["base"],
                        "candidate": s["candidate"],
                    }
                    for s in c.setup_changes
                ],
                key="setting",
            )
        )
    ratio = "n/a" if c.step_ratio is None else f"×{c.step_ratio:.3f} ({(c.step_ratio - 1) * 100:+.1f}%)"
    ci = "no interval (too few steady steps)" if c.ci is None else f"95% interval {c.ci[0]:.3f}–{c.ci[1]:.3f}"
    para: Para = [
        f"Verdict: {c.verdict}. This run (candidate {c.candidate.run_id}) against base run {c.base.run_id} "
        f"({c.base.store.root}): steady step time {_ms(c.base_step_ns)} → {_ms(c.candidate_step_ns)}, "
        f"{ratio}, {ci}: a moving-block bootstrap of each run's steady steps (blocks of {c.block_len} "
        "consecutive steps, because steps are autocorrelated; seeded, so the interval is reproducible). "
        f"No change means the interval holds 1 or lies within ±{c.threshold * 100:g}%."
    ]
    if c.throughput_ratio is not None:
        para.append(f" Throughput ×{c.throughput_ratio:.3f}.")
    cul = c.culprit
    if cul and c.verdict != "no-change":
        if cul["every_rank"]:
            para.append(" Every rank's own work changed alike: no single rank is the cause.")
        else:
            phase = PHASE_LABELS.get(cul["phase"], cul["phase"]) if cul.get("phase") else "its step"
            para.append(
                f" The culprit is rank {cul['rank']}: its own work (its step less the communication it "
                f"waited in) changed by {_ms(cul['delta_own_ns'], True)} per step, most in {phase}; the "
                "other ranks only wait for it."
            )
    blocks.append(para)
    blocks.append(
        ChartBlock(
            "compare_steps", "Step-time distributions", step_distribution_chart(c.steps_table()), (ANALYSIS,)
        )
    )
    blocks.append(
        ChartBlock(
            "compare_waterfall", "Difference by phase", phase_waterfall_chart(c.phase_table()), (ANALYSIS,)
        )
    )
    blocks.append(
        table_block(
            ANALYSIS,
            "By phase (steady step, mean over ranks)",
            table_columns(
                ("label", "phase"),
                ("base_ns", "base"),
                ("candidate_ns", "candidate"),
                ("delta_ns", "difference"),
            ),
            c.by_phase,
            key="phase",
        )
    )
    blocks.append(
        table_block(
            ANALYSIS,
            "By rank (own work = step less exposed communication waited)",
            table_columns(
                ("rank", "rank"),
                ("base_own_ns", "own work, base"),
                ("candidate_own_ns", "own work, candidate"),
                ("delta_own_ns", "own work change"),
                ("delta_wait_ns", "wait change"),
                ("phase", "most changed"),
                ("culprit", "culprit"),
            ),
            c.by_rank,
            key="rank",
        )
    )
    if c.by_collective:
        blocks.append(
            table_block(
                ANALYSIS,
                "By collective (per steady step)",
                table_columns(
                    ("op", "op"),
                    ("group_kind", "group"),
                    ("bytes", "bytes"),
                    ("change", "change"),
                    ("base_per_step", "per step, base"),
                    ("candidate_per_step", "per step, candidate"),
                    ("base_busbw_gb_per_s", "busbw GB/s, base"),
                    ("candidate_busbw_gb_per_s", "busbw GB/s, candidate"),
                    ("change_ns", "change per step"),
                ),
                [{**r, "change_ns": r["delta_ns_per_step"]} for r in c.by_collective],
                key="op",
            )
        )
    changed_ops = [r for r in c.by_op_type if r["change"] != "unchanged"]
    if changed_ops:
        blocks.append(
            table_block(
                ANALYSIS,
                "By op type (added, removed, more frequent, slower; per rank and steady step)",
                table_columns(
                    ("op_type", "op type"),
                    ("change", "change"),
                    ("base_calls_per_step", "calls, base"),
                    ("candidate_calls_per_step", "calls, candidate"),
                    ("base_mean_ns", "mean, base"),
                    ("candidate_mean_ns", "mean, candidate"),
                    ("change_ns", "change per step"),
                ),
                [{**r, "change_ns": r["delta_ns_per_step"]} for r in changed_ops],
                key="op_type",
            )
        )
    return Section("compare", "Compared with a base run", blocks)
