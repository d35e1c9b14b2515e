"""Rules for communication beyond DDP (DESIGN.md): a pipeline's bubble and its slowest stage, a
parameter server's load, the cost of periodic synchronisation, and sharded-data-parallel
collectives exposed in forward and backward. A rank waiting for a peer is a victim: these rules
name the stage, server or rank that is slow, and the straggler rule leaves such runs to them."""

from __future__ import annotations

import math
from collections import defaultdict

from ..words import counted, plural
from .context import Context, Row
from .finding import Finding
from .rulebook import make_finding, rule
from .words import dur, listing, pct

#: measured bubble this far above the ideal GPipe bubble is worth a finding
BUBBLE_EXCESS = 0.10
#: waiting on communication for this share of a run's step makes it the run's first finding,
#: whatever the ideal: a pipeline's bubble, a parameter server's push and pull, DDP's exposed sync
COMM_WAIT_SHARE = 0.25
#: the ideal bubble the micro-batch count in the advice brings a pipeline under
TARGET_BUBBLE = 0.10
#: stages computing at least this share of the slowest stage's compute are balanced
BALANCED_STAGES = 0.9
#: a server busy this share of its active time is the bottleneck
SERVER_BUSY = 0.8
#: workers waiting on push and pull this share of their step
PS_WAIT_SHARE = 0.25
WORKER_SKEW = 1.25
#: collectives of sharded data parallelism exposed in forward/backward above this share of the step
SHARDED_EXPOSED_SHARE = 0.15
SHARDED_OPS = ("all_gather", "reduce_scatter")


def pattern_runs(ctx: Context) -> set[str]:
    """Runs with pipeline stages or a parameter server: their waits belong to these rules."""
    return {
        r["run_id"] for r in ctx.rows("comm_roles") if r["role"] == "server" or r["role"].startswith("stage:")
    }


def _by_run(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[r["run_id"]].append(r)
    return out


def alone(ctx: Context, run_id: str) -> bool:
    """A run in no scaling series: no other world size of the same job to compare it with."""
    return not any(r["run_id"] == run_id for rows in ctx.scaling_groups().values() for r in rows)


def waits_on(row: Row, world_size: int | None = None) -> str:
    """The op a rank waited on longest, and with whom: 'recv from rank 1', 'allreduce across all 2
    ranks', 'allreduce on a group of 2 of 4 ranks' (comm_by_role's wait_op, wait_peer and
    wait_group_size; the run's world size from `world_size`, else the row's)."""
    op = row.get("wait_op")
    if not op:
        return "communication"
    if row.get("wait_peer") is not None:
        return f"{op} {'to' if op.lstrip('i') == 'send' else 'from'} rank {row['wait_peer']}"
    world = world_size or row.get("world_size")
    n = row.get("wait_group_size") or world
    if not n:
        return op
    if world and n < world:  # a sub-group (a tensor-parallel pair, one stage's data-parallel ranks)
        return f"{op} on a group of {n} of {world} ranks"
    return f"{op} across all {n} ranks"


def micro_batches_for(stages: int, target: float = TARGET_BUBBLE) -> int:
    """The fewest micro-batches m whose ideal GPipe bubble (p−1)/(m+p−1) is at most `target`."""
    return max(1, math.ceil((stages - 1) * (1 - target) / target - 1e-9))


def measure_next(ctx: Context, run_id: str, sizes: list[int], how: str) -> str:
    """What to record next for a scaling answer when a run stands alone ('' when it is in a series):
    the same job at `sizes` world sizes, `how` saying what changes."""
    if not alone(ctx, run_id):
        return ""
    todo = listing([f"N={n}" for n in sizes])
    return (
        f" This run is the only world size of its job, so it cannot say how the job scales: record "
        f"the same job at {todo} ({how}) into the same store, and perfscope compares them as one "
        "series and splits the lost time by phase."
    )


def role_words(row: Row) -> str:
    """'stage 0 (rank 0)', 'server rank 0', 'worker rank 1' from a row with role and rank."""
    role = str(row.get("role") or "worker")
    if role.startswith("stage:"):
        return f"stage {role.split(':', 1)[1]} (rank {row['rank']})"
    return f"{role} rank {row['rank']}"


def ranks_waiting(rows: list[Row]) -> str:
    """'stage 0 (rank 0) waits 62.8 ms per step in recv from rank 1 and stage 1 (rank 1) 68.2 ms per
    step in recv from rank 0', from comm_by_role rows with a known wait."""
    rows = sorted((r for r in rows if r.get("wait_op_ns")), key=lambda r: r["rank"])
    return listing(
        f"{role_words(r)} {'waits ' if i == 0 else ''}{dur(r['wait_op_ns'])} per step in {waits_on(r)}"
        for i, r in enumerate(rows)
    )


@rule("pipeline-bubble", None, "Pipeline bubble: stages wait for the slowest stage")
def pipeline_bubble(ctx: Context) -> list[Finding]:
    out = []
    waits = _by_run(ctx.rows("comm_by_role"))
    for run_id, stages in _by_run(ctx.rows("pipeline_stages")).items():
        bubble = sum(s["bubble_fraction"] or 0.0 for s in stages) / len(stages)
        ideal = stages[0]["ideal_bubble_fraction"] or 0.0
        # over the ideal (the stages are unbalanced), or a large share of the step even at the
        # ideal (too few micro-batches for the stages)
        if bubble < ideal + BUBBLE_EXCESS and bubble < COMM_WAIT_SHARE:
            continue
        p, m = stages[0]["stages"], stages[0]["micro_batches"]
        slow = next(s for s in stages if s["stage"] == stages[0]["slowest_stage"])
        others = [s for s in stages if s is not slow]
        balance = min((s["compute_vs_slowest"] or 0.0 for s in others), default=1.0)
        unbalanced = balance < BALANCED_STAGES
        m_fix = micro_batches_for(p)
        more_m = m_fix if (m or 1) < m_fix else 2 * (m or 1)
        where = ranks_waiting([w for w in waits.get(run_id, []) if w["role"].startswith("stage:")])
        text = (
            f"The {p} pipeline stages wait in send/recv for {pct(bubble)} of each step on average "
            f"(measured bubble{': ' + where if where else ''}), against an ideal GPipe bubble of "
            f"{pct(ideal)} for {counted(m, 'micro-batch')} ((p−1)/(m+p−1)). "
        )
        if unbalanced:
            text += (
                f"Stage {slow['stage']} (rank {slow['rank']}) computes the most, "
                f"{dur(slow['compute_ns'])} per step; the other {plural('stage', p - 1)} "
                f"do{'es' if p - 1 == 1 else ''} as little as {pct(balance)} of that "
                f"and wait for it. This wait is the pipeline bubble, not gradient synchronisation: stage "
                f"{slow['stage']} is slow, the others are its victims."
            )
            title = f"Pipeline bubble: {pct(bubble)} of the step waiting; stage {slow['stage']} is slowest"
        else:
            text += (
                f"The stages compute about the same ({pct(balance)} of the slowest at least), so the wait "
                f"comes from the schedule: with {counted(m, 'micro-batch')} each stage idles while the "
                f"{'other works' if p == 2 else 'others work'} on it. This wait is the pipeline bubble, "
                "not gradient synchronisation; "
                f"{more_m} micro-batches bring the ideal bubble to {pct((p - 1) / (more_m + p - 1))}."
            )
            title = (
                f"Pipeline bubble: {pct(bubble)} of the step waiting with {counted(m, 'micro-batch')} "
                f"(ideal {pct(ideal)})"
            )
        world = int(stages[0]["world_size"] or p)
        nxt = measure_next(ctx, run_id, [2 * world], "the pipeline replicated over 2 data-parallel groups")
        out.append(
            make_finding(
                ctx,
                "pipeline-bubble",
                run_id,
                severity="alarm" if bubble >= COMM_WAIT_SHARE else "warning",
                category="cause",
                title=title,
                text=text,
                run_ids=[run_id],
                analyses=("pipeline_stages", "comm_by_role", "comm_ops"),
                recommendation=(
                    (
                        f"Balance the stages: move layers off stage {slow['stage']} until their compute "
                        "matches. "
                        if unbalanced
                        else ""
                    )
                    + f"Use more micro-batches (m={more_m} gives an ideal bubble of "
                    f"{pct((p - 1) / (more_m + p - 1))}), a 1F1B schedule (ScheduleOneFOneB) to keep "
                    "activation memory bounded at that m, and an interleaved schedule "
                    "(ScheduleInterleaved1F1B) with several virtual stages per rank to divide the bubble. "
                    "DDP bucket sizes do not matter here." + nxt
                ),
                confidence=0.8 if slow["role_source"] == "recorded" else 0.65,
                explained_loss=bubble,
                numbers={
                    "bubble_fraction": bubble,
                    "comm_share": bubble,
                    "ideal_bubble_fraction": ideal,
                    "stages": p,
                    "micro_batches": m,
                    "micro_batches_advised": more_m,
                    "slowest_stage": slow["stage"],
                    "slowest_rank": slow["rank"],
                    "stage_balance": balance,
                },
            )
        )
    return out


@rule("parameter-server", None, "Parameter server: the server or a worker holds the others back")
def parameter_server(ctx: Context) -> list[Finding]:
    out = []
    for run_id, ranks in _by_run(ctx.rows("parameter_server")).items():
        servers = [r for r in ranks if r["role"] == "server"]
        workers = [r for r in ranks if r["role"] != "server" and r["step_ns"]]
        if not servers or not workers:
            continue
        busy = max((s["server_busy_share"] or 0.0) for s in servers)
        busiest = max(servers, key=lambda s: s["server_busy_share"] or 0.0)
        wait = sum(((w["push_ns"] or 0) + (w["pull_ns"] or 0)) / w["step_ns"] for w in workers) / len(workers)
        push = sum(w["push_ns"] or 0 for w in workers) / len(workers)
        pull = sum(w["pull_ns"] or 0 for w in workers) / len(workers)
        skew = workers[0]["worker_skew"] or 1.0
        slow_worker = workers[0]["slowest_worker"]
        numbers = {
            "server_busy_share": busy,
            "worker_wait_share": wait,
            "push_ns": push,
            "pull_ns": pull,
            "worker_skew": skew,
            "server_rank": busiest["rank"],
            "comm_share": wait,
        }
        server_ranks = listing(str(x["rank"]) for x in servers)
        head = (
            f"{counted(len(workers), 'worker')} spend{'s' if len(workers) == 1 else ''} "
            f"{pct(wait)} of each step pushing gradients ({dur(push)}, send) and "
            f"pulling parameters ({dur(pull)}, recv) to and from {counted(len(servers), 'server')} "
            f"(rank{'s' if len(servers) > 1 else ''} {server_ranks})."
        )
        if busy >= SERVER_BUSY:
            title = f"Parameter server overloaded: rank {busiest['rank']} busy {pct(busy)} of the time"
            text = (
                f"{head} Server rank {busiest['rank']} is busy {pct(busy)} of its active time, so workers "
                "queue behind it: the server is the bottleneck, not the workers' imbalance."
            )
            advice = (
                "Shard the parameters over more servers (each serves a slice), make the update cheaper, "
                "or push less often (larger batches per push, local steps between pushes)."
            )
        elif wait >= min(PS_WAIT_SHARE, COMM_WAIT_SHARE):
            title = f"Workers wait {pct(wait)} of the step on push and pull"
            text = (
                f"{head} The server is busy only {pct(busy)} of its active time: the transfers themselves "
                "cost the time, not the server's work."
            )
            advice = (
                "Send less or less often: compress or quantise the gradients, push every few steps "
                "(local SGD), overlap the pull of the next parameters with compute, or use a faster link."
            )
        elif skew >= WORKER_SKEW:
            title = f"Worker rank {slow_worker} is slow: {skew:.2f}× the median worker step"
            text = f"{head} Worker rank {slow_worker}'s steps take {skew:.2f}× the median worker's."
            advice = "Check that worker's host (other load, slower device) and its share of the data."
        else:
            continue
        advice += measure_next(
            ctx,
            run_id,
            [len(servers) + 2 * len(workers), len(servers) + 4 * len(workers)],
            "twice and four times the workers, the same servers",
        )
        out.append(
            make_finding(
                ctx,
                "parameter-server",
                run_id,
                severity="alarm" if max(busy, wait) >= 0.5 else "warning",
                category="cause",
                title=title,
                text=text,
                run_ids=[run_id],
                analyses=("parameter_server", "comm_by_role"),
                recommendation=advice,
                confidence=0.75,
                explained_loss=wait,
                numbers=numbers,
            )
        )
    return out


@rule("periodic-sync", None, "Periodic synchronisation costs more than 10% amortised")
def periodic_sync(ctx: Context) -> list[Finding]:
    out = []
    for r in ctx.rows("periodic_sync"):
        share = r["amortised_share"]
        if share is None or share < r["target_share"]:
            continue
        k, k_target = r["every_k"], r["k_for_target"]
        keep = (
            f" Synchronising every {k_target} steps keeps it under {pct(r['target_share'])}."
            if k_target
            else ""
        )
        out.append(
            make_finding(
                ctx,
                "periodic-sync",
                r["run_id"],
                severity="warning",
                category="cause",
                title=f"Parameter averaging every {k:.0f} steps costs {pct(share)} of the time",
                text=(
                    f"The collectives come every {k:.0f} steps and the step that makes them waits "
                    f"{dur(r['sync_cost_ns'])} for them; spread over {k:.0f} steps that is {pct(share)} of "
                    f"the mean step ({dur(r['plain_step_ns'])} without a sync).{keep}"
                ),
                run_ids=[r["run_id"]],
                analyses=("periodic_sync", "comm_ops"),
                recommendation=(
                    "Average less often (larger k), average in the background (async all_reduce "
                    "overlapped with the next steps), or average fewer bytes (low precision)."
                    + (f" k = {k_target} meets the 10% target." if k_target else "")
                ),
                confidence=0.75,
                explained_loss=share,
                numbers={
                    "every_k": k,
                    "sync_cost_ns": r["sync_cost_ns"],
                    "amortised_share": share,
                    "k_for_target": k_target,
                },
            )
        )
    return out


@rule("sharded-exposed", None, "Sharded data parallel: gathers and scatters exposed in compute")
def sharded_exposed(ctx: Context) -> list[Finding]:
    out = []
    for run_id, ops in _by_run(ctx.rows("comm_ops")).items():
        rows = [o for o in ops if o["phase"] in ("forward", "backward") and o["op"].startswith(SHARDED_OPS)]
        share = sum(o["exposed_share_of_step"] or 0.0 for o in rows)
        if share < SHARDED_EXPOSED_SHARE:
            continue
        parts = ", ".join(
            f"{o['op']} in {o['phase']} {pct(o['exposed_share_of_step'] or 0)} "
            f"({o['calls_per_step']:.0f} per step, median {o['bytes_median'] / 1024:.0f} KiB)"
            for o in rows
        )
        out.append(
            make_finding(
                ctx,
                "sharded-exposed",
                run_id,
                severity="alarm" if share >= 0.25 else "warning",
                category="cause",
                title=f"Parameter gathers and gradient scatters are exposed: {pct(share)} of the step",
                text=(
                    f"Sharded data parallelism (FSDP, ZeRO) gathers parameters before each layer and "
                    f"scatters gradients after it; here the step waits for them: {parts}. That time is "
                    "communication, not forward or backward compute."
                ),
                run_ids=[run_id],
                analyses=("comm_ops",),
                recommendation=(
                    "Overlap them: prefetch the next layer's all-gather (FSDP2 "
                    "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch), shard coarser "
                    "units (fewer, larger collectives), keep parameters gathered after forward "
                    "(reshard_after_forward=False) when memory allows, or shard within a node only (HSDP)."
                ),
                confidence=0.7,
                explained_loss=share,
                numbers={"exposed_share": share},
            )
        )
    return out
