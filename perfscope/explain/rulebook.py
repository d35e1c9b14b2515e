"""The rule registry and the helper that builds a Finding (marking simulated evidence, and holding
its confidence at medium when an alpha-beta fit it rests on has too few points)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..analysis.fitting import MIN_POINTS
from .context import Context, Row
from .finding import Evidence, Finding, Number

RuleFn = Callable[[Context], list[Finding]]

#: Share of the lost time a cause must explain to be an alarm rather than a warning.
ALARM_SHARE = 0.25
#: The most confidence a finding may state when an alpha-beta fit it rests on is marked
#: `too_few_points` (allreduce_fit): below Finding.confidence_label's "high".
THIN_FIT_CONFIDENCE = 0.6


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
    source = ctx.source_of(run_ids)
    if source != "measured":
        # Simulated runs are always marked, wherever they appear.
        title = f"{title} [{source} runs]"
        text = f"({'Simulated' if source == 'simulated' else 'Partly simulated'} runs.) {text}"
    if explained_loss is not None:
        explained_loss = max(0.0, min(1.0, explained_loss))
    thin = thin_fits(ctx, run_ids) if "allreduce_fit" in analyses else []
    if thin and confidence > THIN_FIT_CONFIDENCE:
        confidence = THIN_FIT_CONFIDENCE
        text = f"{text} {_what_would_raise(ctx, thin)}"
    return Finding(
        id=f"{rule_id}:{scope}",
        rule=rule_id,
        severity=severity,
        category=category,
        title=title,
        text=text,
        evidence=Evidence(tuple(sorted(set(run_ids))), analyses),
        recommendation=recommendation,
        confidence=round(confidence, 2),
        explained_loss=explained_loss,
        numbers=dict(numbers or {}),
        group_id=group_id,
    )


def thin_fits(ctx: Context, run_ids: list[str] | tuple[str, ...]) -> list[Row]:
    """The allreduce_fit rows, for these runs' (cluster, backend, scope), that have too few points."""
    runs, sync = ctx.by_run("run_summary"), ctx.by_run("sync")
    used = {
        (runs[r]["cluster"], runs[r]["backend"], sync[r].get("scope"))
        for r in run_ids
        if r in runs and r in sync
    }
    return [
        f
        for f in ctx.rows("allreduce_fit")
        if (f["cluster"], f["backend"], f["scope"]) in used
        and f["too_few_points"]
        and f["beta_s_per_byte"] is not None
    ]


def _what_would_raise(ctx: Context, thin: list[Row]) -> str:
    """'Confidence is medium at most: ... measure N = 4 and 8 to raise it.'"""
    fit = min(thin, key=lambda f: f["points"])
    sizes = sorted({int(s) for s in str(fit["world_sizes"] or "").split(",") if s.strip()})
    wanted = max(1, MIN_POINTS - int(fit["points"]))
    more: list[int] = []
    if fit["scope"] == "intra-node":  # more sizes inside one node, where this fit applies
        per_node = [
            r["gpus_per_node"]
            for r in ctx.rows("run_summary")
            if r["cluster"] == fit["cluster"] and r["gpus_per_node"]
        ]
        more = [k for k in range(2, max(per_node, default=0) + 1) if k not in sizes][:wanted]
    if fit["scope"] == "intra-node" and not more:
        return (
            f"Confidence is medium at most: the alpha-beta fit for {fit['cluster']}/{fit['backend']} "
            f"(intra-node) rests on {fit['points']} point(s), and no other world size fits in one node; "
            "an nccl-tests sweep of message sizes inside one node (`perfscope import nccl-tests`) "
            "would raise it."
        )
    n = max([*sizes, *more], default=1)
    while len(more) < wanted:
        n *= 2
        more.append(n)
    todo = " and ".join(
        [", ".join(str(m) for m in more[:-1]), str(more[-1])] if len(more) > 1 else [str(more[0])]
    )
    return (
        f"Confidence is medium at most: the alpha-beta fit for {fit['cluster']}/{fit['backend']} "
        f"({fit['scope']}) rests on {fit['points']} point(s) at N = {', '.join(map(str, sizes)) or 'none'}, "
        f"too few to trust; measure N = {todo} to raise it."
    )
