"""Rule 11: confounds and data quality (mixed modes, variance, few points, superlinear speedup,
throttling, missing ranks, phases or baselines), one finding per kind of problem."""

from __future__ import annotations

from collections import defaultdict

from .context import Context, Row
from .finding import Finding
from .rulebook import make_finding, rule

TITLES = {
    "runs_without_metadata": "Runs without metadata are left out",
    "run_without_steps": "Runs without recorded steps",
    "missing_ranks": "Ranks are missing from some runs",
    "missing_phases": "Phases were not recorded",
    "few_steady_steps": "Too few steps after the warm-up",
    "high_variance": "Step time varies a lot",
    "periodic_steps": "Periodic slow steps",
    "bimodal_steps": "Two kinds of step (bimodal step time)",
    "no_baseline": "Runs without a baseline",
    "mixed_scaling_mode": "Mixed scaling modes",
    "mixed_sources": "Measured and simulated runs mixed in one group",
    "superlinear": "Superlinear speedup: check the baseline",
    "throttling": "GPU clocks throttle at larger world sizes",
    "too_few_points": "Too few world sizes for a trusted scaling model",
}
ADVICE = {
    "runs_without_metadata": "Make sure rank 0 runs perfscope.profile(...) to the end "
    "(it writes the runs row).",
    "run_without_steps": "Check that the training loop iterates prof.steps(...) or calls prof.step().",
    "missing_ranks": "Profile every rank (perfscope.profile on all of them) and check for ranks "
    "that died early.",
    "missing_phases": "Wrap the loop's parts in prof.phase('forward'/'backward'/'optimizer') so "
    "the breakdown can name them.",
    "few_steady_steps": "Record at least a few hundred steps per run so the warm-up can be dropped.",
    "high_variance": "Run on dedicated nodes, repeat the run, and look at the step series for "
    "periodic stalls.",
    "periodic_steps": "Judge throughput by samples over elapsed time (perfscope does); to cut the "
    "slow step's cost, make it rarer or overlap it (DESIGN: keep a periodic sync under 10% amortised).",
    "bimodal_steps": "Look at the step series for what the slow steps do (I/O, evaluation, a periodic "
    "sync) before trusting a median.",
    "no_baseline": "Add a run at the smallest world size with the same per-rank (or global) batch.",
    "mixed_scaling_mode": "Keep either the per-rank batch (weak) or the global batch (strong) fixed "
    "in a series, or set scaling_mode.",
    "mixed_sources": "Compare measured with measured runs; put simulated ones in their own experiment.",
    "superlinear": "Check that the baseline was not slowed by warm-up, I/O or a bad node, and that "
    "each run does the same work per sample.",
    "throttling": "Check power and cooling (nvidia-smi -q -d PERFORMANCE); compare runs at fixed clocks.",
    "too_few_points": "Measure at least 5 world sizes before trusting a prediction.",
}


@rule("data-quality", 11, "Confounds and data quality")
def data_quality(ctx: Context) -> list[Finding]:
    by_kind: dict[str, list[Row]] = defaultdict(list)
    for q in ctx.rows("quality"):
        by_kind[q["kind"]].append(q)
    out = []
    for kind, rows in by_kind.items():
        messages = [r["message"] for r in rows]
        shown = " ".join(messages[:5]) + (
            f" ({len(messages) - 5} more like these.)" if len(messages) > 5 else ""
        )
        severity = "warning" if any(r["severity"] == "warning" for r in rows) else "info"
        out.append(
            make_finding(
                ctx,
                f"quality:{kind}",
                kind,
                severity=severity,
                category="data-quality",
                title=TITLES.get(kind, kind.replace("_", " ")),
                text=shown,
                run_ids=[r["run_id"] for r in rows if r["run_id"]],
                analyses=("quality",),
                recommendation=ADVICE.get(kind, ""),
                confidence=0.9,
                numbers={"count": len(rows)},
            )
        )
    return out
