"""The what-if finding (issue 23): the straggler cause of a 3D-parallel run with what it costs per step
and the change that removes it, from the `what_if` analysis (DESIGN.md, "Parallel layout and
what-if")."""

from __future__ import annotations

from typing import Any

from .context import Context
from .finding import Finding
from .rulebook import cause_severity, cost_numbers, make_finding, rule
from .rules_placement import crowded_hosts
from .words import dur, listing, num, pct


def _hosts(ctx: Context, run_id: str, ranks: list[int]) -> tuple[list[str], bool]:
    """The hosts of these ranks, and whether they hold no other rank of the run (the worker is alone
    on its hosts, so the host is what differs from its peers)."""
    names = {r["rank"]: r.get("hostname") for r in ctx.rows("rank_breakdown") if r["run_id"] == run_id}
    mine = {h for k in ranks if (h := names.get(k))}
    others = {h for k, h in names.items() if k not in ranks and h}
    return sorted(mine), bool(mine) and not (mine & others)


def cost_ns(row: dict[str, Any], slowdown: float) -> float:
    """ns per step that x costs: its slowdown over the ideal step, at most the whole excess (ops
    elsewhere faster than typical take the rest back)."""
    excess = max(0.0, row["actual_step_ns"] - row["ideal_step_ns"])
    return min(excess, max(0.0, (slowdown - 1.0) * row["ideal_step_ns"]))


@rule("what-if", None, "What-if: what a slow worker, stage or data imbalance costs each step")
def what_if_cause(ctx: Context) -> list[Finding]:
    out = []
    # on a host where other processes took CPU, or with more ranks than cores, work that varies across
    # ranks from step to step is what the contention or oversubscription finding already explains: no
    # sequence-packing advice for it
    contended = {c["run_id"] for c in ctx.rows("contention") if c["contended"]} | set(crowded_hosts(ctx))
    for r in ctx.rows("what_if"):
        cause = r["cause"]
        if cause in (None, "none") or (cause == "data-imbalance" and r["run_id"] in contended):
            continue
        actual, ideal, s = r["actual_step_ns"], r["ideal_step_ns"], r["slowdown"]
        lost = 1.0 - 1.0 / s if s > 0 else 0.0
        run = r["run_id"]
        # a data-parallel job without a pipeline (one stage) has no stages to balance
        staged = ", balanced over the pipeline stages," if len(r["by_stage"]) > 1 else ""
        base = (
            f"Replaying run {run}'s {r['steps']} steps through their dependencies (replay error "
            f"{pct(r['replay_error'])}), a step takes {dur(actual)}; with every op at the typical time of "
            f"its data-parallel peers{staged} it would take {dur(ideal)}: "
            f"a slowdown of {num(s)} ({pct(lost)} of each step, {dur(actual - ideal)} per step)."
        )
        numbers: dict[str, float | int | str | None] = {
            "slowdown": s,
            "actual_step_ns": actual,
            "ideal_step_ns": ideal,
            **cost_numbers(actual - ideal, actual),
        }
        if cause == "stage-imbalance":
            top, fastest = r["by_stage"][0], r["by_stage"][-1]
            cost = cost_ns(r, top["slowdown"])
            title = f"Pipeline stage {top['stage']} is too long in run {run}: it costs {dur(cost)} per step"
            text = (
                f"{base} Stage {top['stage']} alone, as recorded, makes it {num(top['slowdown'])}: its "
                "compute is longer than the other stages' at every data-parallel rank, so every stage waits "
                "for it."
            )
            advice = (
                f"Give stage {top['stage']} fewer layers (move them to stage {fastest['stage']}, the "
                "shortest; "
                "Megatron-LM: an uneven split such as --decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers, or account for the embedding and loss on the first and "
                f"last stage). Balanced, a step would take about {dur(ideal)} instead of {dur(actual)}."
            )
            numbers.update(
                {"stage": top["stage"], "stage_slowdown": top["slowdown"], **cost_numbers(cost, actual)}
            )
        elif cause == "slow-worker":
            w = r["by_worker"][0]
            # the step time the job saves without it (its ops at the ideal, the others as recorded),
            # never more than its slowdown gives
            cost = min(cost_ns(r, w["slowdown"]), w.get("saving_ns") or 0.0)
            hosts, alone = _hosts(ctx, run, w["ranks"])
            where = f" on {listing(hosts)}" if hosts else ""
            phase = w.get("phase")
            in_phase = f" in {phase}" if phase else ""
            piped = len(r["by_stage"]) > 1
            who = f"dp rank {w['dp_rank']}" + (f" at stage {w['stage']}" if piped else "")
            title = (
                f"A slow worker in run {run}: {who} "
                f"(rank {listing(str(k) for k in w['ranks'])}{where}) "
                f"is slower{in_phase} and costs {dur(cost)} per step, "
                f"{pct(cost / actual if actual else None)}"
            )
            text = (
                f"{base} That worker alone, as recorded, makes it {num(w['slowdown'])}; its data-parallel "
                f"peers{' at the same stage' if piped else ''} do the same work faster in most steps, by "
                f"more than their own step-to-step spread, so it is the worker, not the work"
                + (
                    f": its {phase} takes {dur(w.get('excess_ns'))} longer per step than theirs."
                    if phase
                    else "."
                )
                + " The peers that wait for it in the next collective are its victims."
            )
            rerun = f"without it a step would take about {dur(actual - cost)}"
            own_work = (
                "its own work (extra work on that rank: logging, evaluation or checkpointing only there; a "
                "larger shard or longer sequences; a process or thread pinned beside it)"
            )
            if alone:
                advice = (
                    f"Replace or cordon the node{where} (check its clocks and throttling, its temperature "
                    f"and its links) and rerun: {rerun}."
                )
            elif hosts:
                advice = (
                    f"Find what that rank does differently{in_phase}: it shares its host with its peers, so "
                    f"look at {own_work} first, then at the cores it was given; {rerun}."
                )
            else:  # where the ranks ran was not recorded (an imported op table)
                advice = (
                    f"Look at {own_work}; if it runs alone on its node and does the same work, replace or "
                    f"cordon that node (check its clocks and throttling, its temperature and its links); "
                    f"{rerun}."
                )
            numbers.update(
                {"dp_rank": w["dp_rank"], "stage": w["stage"], "rank": w["ranks"][0], "phase": phase,
                 "excess_ns": w.get("excess_ns"), "alone_on_host": int(alone), **cost_numbers(cost, actual)}
            )  # fmt: skip
        else:
            title = (
                f"Work differs between data-parallel ranks from step to step in run {run}: "
                f"{pct(lost)} of each step"
            )
            text = (
                f"{base} The same op takes different times on different data-parallel ranks, and the slowest "
                "rank changes from step to step: the data (sequence lengths) differs, not the workers."
            )
            advice = (
                "Pack sequences to the same length (sequence packing), or sample batches by length "
                f"(length-bucketed sampling): the simulation puts the balanced step at {dur(ideal)} "
                f"instead of {dur(actual)}."
            )
        if r.get("second_cause"):
            text += f" A second cause is present too: {r['second_cause']}."
        out.append(
            make_finding(
                ctx,
                "what-if",
                f"{run}:{cause}",
                severity=cause_severity(lost),
                category="cause",
                title=title,
                text=text,
                run_ids=[run],
                analyses=("what_if",),
                recommendation=advice,
                confidence=0.8,
                explained_loss=lost,
                numbers=numbers,
            )
        )
    # a run the what-if reads but cannot replay says so, never disappears (issue 33)
    for u in ctx.rows("what_if_unreplayed"):
        out.append(
            make_finding(
                ctx,
                "what-if",
                f"{u['run_id']}:unreplayed",
                severity="info",
                category="measurement",
                title=f"No what-if for run {u['run_id']}: it cannot be replayed",
                text=f"The what-if cannot replay run {u['run_id']}: {u['note']}.",
                run_ids=[u["run_id"]],
                analyses=("what_if_unreplayed",),
                recommendation="Fix the table as the line says and import it again to get the what-if.",
                confidence=0.9,
            )
        )
    return out
