"""Rule 12, oversubscription (more ranks than cores or GPUs on a host), and the caveat it puts on
every other cause found in the same runs: contention can produce those patterns by itself. Also the
threads confound: world sizes of one group run with different threads or cores per rank, or more
threads than the host has cores, stated before any timing verdict."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable

from ..words import counted, plural
from .confidence import CONFOUND_FACTOR
from .confidence import confounded as confounded_confidence
from .context import Context, Row
from .finding import Finding
from .hardware import setup_of
from .rulebook import make_finding, rule
from .words import listing, num, pct

#: Confidence of a cause found in oversubscribed runs is multiplied by this (confidence.py).
CONFOUNDED_CONFIDENCE = CONFOUND_FACTOR
#: Findings that are verdicts about timing (rules_quality.TIMING_CATEGORIES; it imports this module).
_TIMING = ("cause", "comparison")


def crowded_hosts(ctx: Context) -> dict[str, list[Row]]:
    """run_id -> its placement rows of hosts with more ranks than cores or GPUs."""
    by_run: dict[str, list[Row]] = defaultdict(list)
    for p in ctx.rows("placement"):
        if p["oversubscribed_cpu"] or p["oversubscribed_gpu"]:
            by_run[p["run_id"]].append(p)
    return by_run


@rule("oversubscription", 12, "Oversubscription: more ranks than cores or GPUs on a host")
def oversubscription(ctx: Context) -> list[Finding]:
    out = []
    scaling = ctx.by_run("scaling")
    by_run = crowded_hosts(ctx)
    by_group: dict[str, list[str]] = defaultdict(list)
    for rid in by_run:
        by_group[(scaling.get(rid) or {}).get("group_id") or rid].append(rid)
    for scope, rids in by_group.items():
        parts, caps, lower_bounds = [], {}, {}
        for rid in sorted(rids, key=lambda x: (scaling.get(x) or {}).get("world_size") or 0):
            hosts = by_run[rid]
            h = min(hosts, key=lambda x: _cap(x))
            cap = _cap(h)
            caps[rid] = cap
            sc = scaling.get(rid) or {}
            # a run that is its own baseline (one world size) has no measured efficiency to give
            eff = sc.get("efficiency") if sc.get("baseline_run_id") not in (None, rid) else None
            what = (
                f"{h['ranks_on_host']} ranks share {_count(h['gpus_on_host'], 'GPU')}"
                if h["oversubscribed_gpu"]
                else f"{h['ranks_on_host']} ranks share {h['cpu_count']} logical CPUs "
                f"({num(h['cores_per_rank'])} cores per rank)"
            )
            parts.append(
                f"run {rid} (N={h['world_size']}) on host {h['hostname']}: {what}, so at most "
                f"{pct(cap)} of the ideal speedup is reachable"
                + (f" (measured efficiency {num(eff)})" if eff is not None else "")
            )
            if eff is not None and eff < 1:
                lower_bounds[rid] = min(1.0, (1 - cap) / (1 - eff))
        # Time-sharing alone explains at least (1 − cap)/(1 − E) of the loss; the rest (collectives
        # waiting on descheduled ranks, stragglers, jitter) is what contention looks like, so the
        # whole loss at these world sizes is confounded.
        explained = 1.0 if lower_bounds else None
        cpu = any(h["oversubscribed_cpu"] for r in rids for h in by_run[r])
        text = (
            "More ranks than the host can run at once: "
            + "; ".join(parts)
            + ". The ranks time-share "
            + ("the cores" if cpu else "the GPUs")
            + ", so adding ranks there adds no compute; the speedup beyond that point measures "
            "contention, not the job's scaling."
            + (
                " Every PyTorch rank also starts intra-op threads (one per core by default), which adds "
                "to the contention."
                if cpu
                else ""
            )
        )
        text += _saturated_note(ctx, rids, scaling)
        out.append(
            make_finding(
                ctx,
                "oversubscription",
                scope,
                severity="alarm",
                category="cause",
                title="Oversubscribed host: " + _crowding_title([_crowding(by_run[r][0]) for r in rids]),
                text=text,
                run_ids=rids,
                analyses=("placement", "scaling"),
                recommendation=(
                    "Run at most one rank per core on CPU hosts"
                    + (" (one per GPU on GPU hosts)" if setup_of(ctx, rids).gpu else "")
                    + " and spread larger runs over more hosts; limit each rank's threads (OMP_NUM_THREADS "
                    "or torch.set_num_threads(cores // ranks_per_host)). Read the scaling only up to the "
                    "largest world size that fits the hardware."
                ),
                confidence=0.9,
                explained_loss=explained,
                numbers={f"cap_{r}": c for r, c in caps.items()}
                | {f"explains_at_least_{r}": v for r, v in lower_bounds.items()},
                group_id=(scaling.get(rids[0]) or {}).get("group_id"),
            )
        )
    return out


def _cap(h: Row) -> float:
    """The share of ideal a host's ranks can reach when they time-share its cores or GPUs."""
    caps = [1.0]
    if h["oversubscribed_cpu"] and h["cpu_count"]:
        caps.append(h["cpu_count"] / h["ranks_on_host"])
    if h["oversubscribed_gpu"] and h["gpus_on_host"]:
        caps.append(h["gpus_on_host"] / h["ranks_on_host"])
    return min(caps)


def _crowding_title(crowdings: list[str]) -> str:
    """Each distinct crowding once, with its run count: '3 ranks on 2 cores (2 runs)'."""
    return listing(f"{c} ({n} runs)" if n > 1 else c for c, n in Counter(crowdings).items())


def _crowding(h: Row) -> str:
    if h["oversubscribed_cpu"]:
        return f"{h['ranks_on_host']} ranks on {h['cpu_count']} cores"
    return f"{h['ranks_on_host']} ranks on {h['gpus_on_host']} GPUs"


def _saturated_note(ctx: Context, rids: list[str], scaling: dict[str, Row]) -> str:
    """Runs of the same study that fit the cores exactly still leave none for the framework's own
    threads (gloo, data loader, perfscope's writer); say so when their efficiency is poor."""
    group = (scaling.get(rids[0]) or {}).get("group_id")
    tight = [
        p
        for p in ctx.rows("placement")
        if p["run_id"] not in rids
        and p["world_size"] > 1
        and p["gpus_on_host"] is None
        and p["cores_per_rank"] is not None
        and p["cores_per_rank"] <= 1
        and (scaling.get(p["run_id"]) or {}).get("group_id") == group
    ]
    if not tight:
        return ""
    notes = [
        f"N={p['world_size']} ({num(p['cores_per_rank'])} core per rank, efficiency "
        f"{num((scaling.get(p['run_id']) or {}).get('efficiency'))})"
        for p in tight
    ]
    return (
        f" Runs that fit the cores exactly, {listing(notes)}, leave no core for the communication "
        "and data-loading threads either."
    )


def annotate_confounded(findings: list[Finding]) -> list[Finding]:
    """Add a caveat to every other cause that rests on oversubscribed runs, and to every timing finding
    that rests on runs of the threads confound, and halve its confidence (once per confound)."""
    findings = add_caveat(
        findings,
        lambda f: f.rule == "oversubscription",
        lambda f: f.category == "cause" and f.rule != "oversubscription",
        lambda hit: (
            f"{plural('run', len(hit))} {listing(hit)} put more ranks on a host than it can run at once; "
            "contention alone can produce this pattern, so fix the placement before acting on it."
        ),
    )
    return add_caveat(
        findings,
        lambda f: f.rule == "threads",
        lambda f: f.category in _TIMING,
        lambda hit: (
            f"{plural('run', len(hit))} {listing(hit)} ran with different threads or cores per rank "
            "(or more threads than cores); pin the threads and rerun before acting on this."
        ),
    )


def add_caveat(
    findings: list[Finding],
    confound: Callable[[Finding], bool],
    applies: Callable[[Finding], bool],
    caveat: Callable[[list[str]], str],
    factor: float = CONFOUNDED_CONFIDENCE,
) -> list[Finding]:
    """The runs of the `confound` findings: every finding that `applies` and rests on some of them
    gets "Caveat: " + caveat(those runs) and its confidence times `factor`."""
    confounded: set[str] = set()
    for f in findings:
        if confound(f):
            confounded |= set(f.evidence.run_ids)
    out = []
    for f in findings:
        hit = sorted(confounded & set(f.evidence.run_ids))
        if hit and applies(f):
            f = dataclasses.replace(
                f,
                text=f"{f.text} Caveat: {caveat(hit)}",
                confidence=confounded_confidence(f.confidence, factor),
            )
        out.append(f)
    return out


@rule(
    "threads", 12, "Confound: threads or cores per rank differ between world sizes or exceed the host's cores"
)
def threads_confound(ctx: Context) -> list[Finding]:
    """One finding per group whose world sizes ran with different torch threads or allowed cores per
    rank, or whose ranks × threads exceed a host's cores (hosts with more ranks than cores are left
    to the oversubscription rule)."""
    crowded = crowded_hosts(ctx)
    used = _cores_used_per_rank(ctx)
    by_group: dict[str, list[Row]] = defaultdict(list)
    for r in ctx.rows("threads"):
        if r["threads_per_rank"] is not None:
            by_group[r["group_id"] or r["run_id"]].append(r)
    out = []
    for scope, rows in by_group.items():
        differ = [w for w in ("threads", "cores") if any(r[f"{w}_differ"] for r in rows)]
        over = [r for r in rows if r["threads_oversubscribed"] and r["run_id"] not in crowded]
        if not differ and not over:
            continue
        rows = sorted(rows, key=lambda r: (r["world_size"] or 0, r["run_id"]))
        flagged = rows if differ else over
        fit = max(1, min((r["cpu_count"] or 1) // max(1, r["ranks_on_host"] or 1) for r in flagged))
        what = []
        if differ:
            what.append(f"{' and '.join(differ)} per rank differ between world sizes")
        if over:
            what.append("ranks × threads exceed the host's cores")
        text = (
            "Read this before any timing verdict: "
            + "; ".join(_threads_fact(r, used.get(r["run_id"])) for r in flagged)
            + ". "
            + (
                "The world sizes are not compared like with like: a speedup, lost time or compute cost per "
                "sample between them measures the change in threads and cores as well as the scaling "
                "(torchrun sets OMP_NUM_THREADS=1 only when it starts more than one process). "
                if differ
                else ""
            )
            + (
                f"In {listing(sorted(r['run_id'] for r in over))} the ranks' threads outnumber the cores, so "
                "they time-share them and the CPU time per step includes that contention. "
                if over
                else ""
            )
            + "Timing findings on these runs are less certain."
        )
        out.append(
            make_finding(
                ctx,
                "threads",
                scope,
                severity="alarm",
                category="measurement",
                title="Threads confound: " + " and ".join(what),
                text=text,
                run_ids=[r["run_id"] for r in flagged],
                analyses=("threads", "placement"),
                recommendation=(
                    "Pin the threads to the same number for every world size and to at most the cores per "
                    f"rank: e.g. OMP_NUM_THREADS={fit} for every N (or torch.set_num_threads(cores // "
                    "ranks_per_host) at the start of the script), then rerun the group and compare again."
                ),
                confidence=0.9,
                numbers={f"threads_{r['run_id']}": r["threads_per_rank"] for r in flagged}
                | {f"cores_allowed_{r['run_id']}": r["cores_per_rank_allowed"] for r in flagged},
                group_id=rows[0]["group_id"],
            )
        )
    return out


def _cores_used_per_rank(ctx: Context) -> dict[str, float]:
    """run_id -> the CPU time its ranks used, in cores per rank (most loaded host; host samples)."""
    used: dict[str, float] = {}
    for c in ctx.rows("contention"):
        v = c["job_cores_per_rank"]
        if v is not None:
            used[c["run_id"]] = max(used.get(c["run_id"], 0.0), v)
    return used


def _count(n: object, noun: str) -> str:
    """counted() of a value a row may lack ('? cores')."""
    return counted(n, noun) if isinstance(n, int) else f"{'?' if n is None else n} {plural(noun, 2)}"


def _threads_fact(r: Row, used: float | None) -> str:
    omp = r["omp_num_threads"]
    return (
        f"N={r['world_size']} (run {r['run_id']}) ran "
        f"{_count(r['threads_per_rank'], 'torch thread')} per rank "
        f"(OMP_NUM_THREADS{'=' + omp if omp is not None else ' unset'}), each rank allowed "
        f"{_count(r['cores_per_rank_allowed'], 'core')}, {_count(r['ranks_on_host'], 'rank')} × "
        f"{r['threads_per_rank']} = "
        f"{r['threads_on_host']} threads on {r['cpu_count']} cores"
        + (f", using {num(used)} cores of CPU time per rank" if used is not None else "")
    )
