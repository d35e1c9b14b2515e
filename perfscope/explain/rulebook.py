"""The rule registry and the helper that builds a Finding: it marks simulated evidence and sets the
confidence from the evidence (confidence.py: world sizes, fit quality, noise), saying what would
raise it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..analysis.fitting import MIN_POINTS
from ..analysis.groups import group_name
from ..words import counted
from .confidence import (
    FACT_RULES,
    POOR_FIT_SMAPE_PCT,
    THIN_FIT_CONFIDENCE,
    VERDICTS,
    Inputs,
    Limit,
    confidence,
    more_sizes,
)
from .context import Context, Row
from .finding import MINOR_COST_SHARE, Evidence, Finding, Number
from .hardware import setup_of

RuleFn = Callable[[Context], list[Finding]]

#: Share of the lost time a cause must explain to be an alarm rather than a warning.
ALARM_SHARE = 0.25


@dataclass(frozen=True)
class Rule:
    id: str
    design_number: int | None  # DESIGN.md's diagnosis rule number; None for rules beyond the twelve
    title: str
    fn: RuleFn


RULES: list[Rule] = []


def rule(rule_id: str, design_number: int | None, title: str) -> Callable[[RuleFn], RuleFn]:
    def wrap(fn: RuleFn) -> RuleFn:
        RULES.append(Rule(rule_id, design_number, title, fn))
        return fn

    return wrap


def cost_numbers(cost_ns: float | None, step_ns: float | None) -> dict[str, Number]:
    """A cause's cost as every finding gives it (DESIGN.md, "The cost of a cause"): the step time it
    would save (ns per step), the run's step time, and the share of the step."""
    share = cost_ns / step_ns if cost_ns is not None and step_ns else None
    return {"cost_ns": cost_ns, "step_ns": step_ns, "cost_share": share}


def cause_severity(explained: float | None) -> str:
    return "alarm" if explained is not None and explained >= ALARM_SHARE else "warning"


def make_finding(
    ctx: Context,
    rule_id: str,
    scope: str,
    *,
    severity: str,
    category: str,
    title: str,
    text: str,
    run_ids: list[str] | tuple[str, ...],
    analyses: tuple[str, ...],
    recommendation: str,
    confidence: float,
    explained_loss: float | None = None,
    numbers: dict[str, Number] | None = None,
    group_id: str | None = None,
) -> Finding:
    if group_id:  # a group by its name in words, never its raw id ('default/-/gloo/Sequential/weak:b-')
        title, text = (t.replace(group_id, group_name(group_id)) for t in (title, text))
    source = ctx.source_of(run_ids)
    if source != "measured":
        # Simulated runs are always marked, wherever they appear.
        title = f"{title} [{source} runs]"
        text = f"({'Simulated' if source == 'simulated' else 'Partly simulated'} runs.) {text}"
    if explained_loss is not None:
        explained_loss = max(0.0, min(1.0, explained_loss))
    share = (numbers or {}).get("cost_share")
    if category == "cause" and isinstance(share, int | float) and share < MINOR_COST_SHARE:
        severity = "info"  # a cause that costs a few percent of the step is no warning
    if category in VERDICTS and rule_id not in FACT_RULES:
        confidence, why = evidence_confidence(ctx, confidence, run_ids, analyses, group_id)
    else:
        why = ""
    if why:
        text = f"{text} {why}"
    return Finding(
        id=f"{rule_id}:{scope}",
        rule=rule_id,
        severity=severity,
        category=category,
        title=title,
        text=text,
        evidence=Evidence(tuple(sorted(set(run_ids))), analyses),
        recommendation=recommendation,
        confidence=confidence,
        explained_loss=explained_loss,
        numbers=dict(numbers or {}),
        group_id=group_id,
    )


#: Findings built on these analyses are verdicts about scaling: they compare world sizes.
SCALING_ANALYSES = ("scaling", "lost_time")


def evidence_confidence(
    ctx: Context,
    strength: float,
    run_ids: list[str] | tuple[str, ...],
    analyses: tuple[str, ...],
    group_id: str | None,
) -> tuple[float, str]:
    """confidence.confidence() on this finding's evidence, collected from the context."""
    runs = ctx.by_run("run_summary")
    series = ctx.scaling_groups().get(group_id or "")
    sizes = None
    if series and any(a in analyses for a in SCALING_ANALYSES):
        sizes = tuple(sorted({int(r["world_size"]) for r in series}))

    noisy = max(
        (runs[r] for r in run_ids if r in runs and runs[r]["step_cv"] is not None),
        key=lambda r: r["step_cv"],
        default=None,
    )
    fits = fit_limits(ctx, run_ids) if "allreduce_fit" in analyses else ()
    return confidence(
        strength,
        Inputs(
            world_sizes=sizes,
            fit_limits=fits,
            step_cv=noisy["step_cv"] if noisy else None,
            noisiest_run=noisy["run_id"] if noisy else None,
        ),
    )


def used_fits(ctx: Context, run_ids: list[str] | tuple[str, ...]) -> list[Row]:
    """The allreduce_fit rows for these runs' (cluster, backend, scope) that have a fitted beta."""
    runs, sync = ctx.by_run("run_summary"), ctx.by_run("sync")
    used = {
        (runs[r]["cluster"], runs[r]["backend"], sync[r].get("scope"))
        for r in run_ids
        if r in runs and r in sync
    }
    return [
        f
        for f in ctx.rows("allreduce_fit")
        if (f["cluster"], f["backend"], f["scope"]) in used and f["beta_s_per_byte"] is not None
    ]


def thin_fits(ctx: Context, run_ids: list[str] | tuple[str, ...]) -> list[Row]:
    """The allreduce_fit rows, for these runs' (cluster, backend, scope), that have too few points."""
    return [f for f in used_fits(ctx, run_ids) if f["too_few_points"]]


def fit_limits(ctx: Context, run_ids: list[str] | tuple[str, ...]) -> tuple[Limit, ...]:
    """What the alpha-beta fits these runs rest on say about the confidence: thin or poor fits."""
    out = []
    thin = thin_fits(ctx, run_ids)
    if thin:
        out.append(_thin_limit(ctx, min(thin, key=lambda f: f["points"]), run_ids))
    poor = [
        f
        for f in used_fits(ctx, run_ids)
        if not f["too_few_points"] and (f["smape_pct"] or 0.0) > POOR_FIT_SMAPE_PCT
    ]
    for f in poor:
        out.append(
            Limit(
                THIN_FIT_CONFIDENCE,
                f"the alpha-beta fit for {f['cluster']}/{f['backend']} ({f['scope']}) misses its points "
                f"by {f['smape_pct']:.0f}% (SMAPE)",
                "measure the collectives on a quiet host, or import a message-size sweep",
            )
        )
    return tuple(out)


def _thin_limit(ctx: Context, fit: Row, run_ids: list[str] | tuple[str, ...]) -> Limit:
    """Why a thin fit holds the confidence down, and the world sizes (or sweep) that would fill it."""
    sizes = sorted({int(s) for s in str(fit["world_sizes"] or "").split(",") if s.strip()})
    wanted = max(1, MIN_POINTS - int(fit["points"]))
    more: list[int] = []
    reason = (
        f"the alpha-beta fit for {fit['cluster']}/{fit['backend']} ({fit['scope']}) rests on "
        f"{counted(int(fit['points']), 'point')} at N = {', '.join(map(str, sizes)) or 'none'}, "
        "too few to trust"
    )
    if fit["scope"] == "intra-node":  # more sizes inside one node, where this fit applies
        per_node = [
            r["gpus_per_node"]
            for r in ctx.rows("run_summary")
            if r["cluster"] == fit["cluster"] and r["gpus_per_node"]
        ]
        more = [k for k in range(2, max(per_node, default=0) + 1) if k not in sizes][:wanted]
        if not more:
            bench = (
                "an nccl-tests sweep of message sizes inside one node (`perfscope import nccl-tests`)"
                if setup_of(ctx, run_ids).uses("nccl")
                else "a sweep of message sizes inside one node"
            )
            return Limit(THIN_FIT_CONFIDENCE, reason + ", and no other world size fits in one node", bench)
    more += more_sizes([*sizes, *more], wanted - len(more)) if len(more) < wanted else []
    todo = ", ".join(map(str, more[:-1])) + " and " + str(more[-1]) if len(more) > 1 else str(more[0])
    return Limit(THIN_FIT_CONFIDENCE, reason, f"measure N = {todo}")
