"""The rule registry and the helper that builds a Finding (marking simulated evidence)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .context import Context
from .finding import Evidence, Finding, Number

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
