"""Rule 11: confounds and data quality (mixed modes, variance, few points, superlinear speedup,
throttling, missing ranks, phases or baselines), one finding per kind of problem; and the
contention confound (other processes' CPU on the job's hosts), stated before any timing verdict."""

from __future__ import annotations

from collections import defaultdict

from ..words import counted, plural
from .confidence import CONFOUND_FACTOR
from .context import Context, Row
from .finding import Finding, rank_findings
from .rulebook import make_finding, rule
from .rules_placement import add_caveat, crowded_hosts
from .words import listing, num

#: Timing findings resting on contended runs keep this share of their confidence (confidence.py).
CONTENDED_CONFIDENCE = CONFOUND_FACTOR
#: Findings that are verdicts about timing (and so can be produced by contention alone).
TIMING_CATEGORIES = ("cause", "comparison")

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
    "shared_run_id": "Two runs recorded under one run id",
    "impossible_durations": "Steps with impossible durations",
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
    "slow step's cost, make it rarer or overlap it: a periodic sync costs its time divided by its "
    "period, so keep that under about 10% of the mean step.",
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
    "shared_run_id": "Give every run its own id (or let perfscope make one); move one run's files "
    "to a partition of its own.",
    "impossible_durations": "Check the clock the collector used (clock column) and the code that "
    "records steps; those rows are left out of every statistic.",
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


@rule("contention", 11, "Confound: other processes took CPU from the job")
def contention(ctx: Context) -> list[Finding]:
    """Runs during which other processes on a host took more than 0.2 of a core per rank, and hosts
    the job itself (with perfscope's collector threads) kept fully busy."""
    rows = ctx.rows("contention")
    contended = [r for r in rows if r["contended"]]
    crowded = crowded_hosts(ctx)  # more ranks than cores: the oversubscription rule says it
    saturated = [r for r in rows if r["saturated"] and not r["contended"] and r["run_id"] not in crowded]
    out = []
    if contended:
        parts = [
            f"{r['run_id']} on {r['hostname']}: {num(r['other_cores'])} of {r['cpu_count']} cores "
            f"({num(r['other_cores_per_rank'])} per rank) went to other processes, the job's "
            f"{counted(r['ranks_on_host'], 'rank')} used {num(r['job_cores'])}"
            for r in contended
        ]
        out.append(
            make_finding(
                ctx,
                "contention",
                "other-processes",
                severity="warning",
                category="measurement",
                title="Other processes took CPU from the job in "
                f"{counted(len(set(map(_run, contended))), 'run')}",
                text=(
                    "Read this before any timing verdict: system CPU minus the job's ranks' CPU shows other "
                    f"processes busy on the job's hosts ({listing(parts, limit=4)}). Slow steps, stragglers, "
                    "latency and small per-rank work can all come from that contention rather than from the "
                    "job, so the findings that rest on these runs are less certain."
                ),
                run_ids=sorted({r["run_id"] for r in contended}),
                analyses=("contention",),
                recommendation=(
                    "Rerun on an otherwise idle host (or with the ranks pinned to reserved cores) before "
                    "acting on the timing findings of these runs."
                ),
                confidence=0.9,
                numbers={"max_other_cores_per_rank": max(r["other_cores_per_rank"] for r in contended)},
            )
        )
    if saturated:
        rids = sorted({r["run_id"] for r in saturated})
        out.append(
            make_finding(
                ctx,
                "contention",
                "saturated",
                severity="info",
                category="measurement",
                title=f"No idle core during {counted(len(rids), 'run')}: "
                "the job and perfscope filled the host",
                text=(
                    f"During {listing(rids, limit=4)} the hosts' CPUs were at least 90% busy, nearly all of "
                    "it the job's own processes, which include perfscope's collector threads (poller, "
                    "writer, host sampler). With no core to spare those threads compete with the "
                    "ranks: part of the slowdown is the host's oversubscription by the job plus "
                    "perfscope, not the job's scaling."
                ),
                run_ids=rids,
                analyses=("contention",),
                recommendation=(
                    "Leave a core per host free for the collector (or lower poll_hz) when every core "
                    "runs a rank; see BENCHMARKS.md for the collector's CPU per rank."
                ),
                confidence=0.7,
            )
        )
    return out


def _run(r: Row) -> str:
    return str(r["run_id"])


def annotate_contended(findings: list[Finding]) -> list[Finding]:
    """Add the contention confound's caveat to every timing finding resting on
    contended runs, halving its confidence."""
    out = add_caveat(
        findings,
        lambda f: f.id == "contention:other-processes",
        lambda f: f.category in TIMING_CATEGORIES,
        lambda hit: (
            f"other processes took CPU from {plural('run', len(hit))} {listing(hit)}; "
            "contention alone can produce this pattern."
        ),
        CONTENDED_CONFIDENCE,
    )
    return rank_findings(out)
