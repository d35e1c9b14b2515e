"""The Finding data type: what the explainer says, with its evidence, as plain data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("alarm", "warning", "info")
CATEGORIES = ("cause", "comparison", "measurement", "data-quality")

Number = float | int | str | None


@dataclass(frozen=True)
class Evidence:
    run_ids: tuple[str, ...]
    analyses: tuple[str, ...]


@dataclass(frozen=True)
class Finding:
    id: str
    rule: str
    severity: str
    category: str
    title: str
    text: str
    evidence: Evidence
    recommendation: str
    confidence: float
    explained_loss: float | None
    numbers: dict[str, Number] = field(default_factory=dict)
    group_id: str | None = None
    #: other rules' findings on the same group that this root cause explains (their shares overlap it)
    symptoms: tuple[Finding, ...] = ()
    #: the same rule's findings on other groups, collapsed into this one
    also_in: tuple[Finding, ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}")
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, not {self.category!r}")

    @property
    def groups(self) -> tuple[str, ...]:
        """Every group this finding speaks for: its own, then those it was collapsed with."""
        return tuple(g for g in (self.group_id, *(f.group_id for f in self.also_in)) if g)

    def flatten(self) -> list[Finding]:
        """This finding, its symptoms and its repeats on other groups: every rule firing it stands for."""
        out = [self]
        for f in (*self.symptoms, *self.also_in):
            out += f.flatten()
        return out

    @property
    def confidence_label(self) -> str:
        return "high" if self.confidence >= 0.75 else "medium" if self.confidence >= 0.5 else "low"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "rule": self.rule,
            "severity": self.severity,
            "category": self.category,
            "title": self.title,
            "text": self.text,
            "evidence": {
                "run_ids": list(self.evidence.run_ids),
                "analyses": list(self.evidence.analyses),
            },
            "recommendation": self.recommendation,
            "confidence": _json_number(self.confidence),
            "confidence_label": self.confidence_label,
            "explained_loss": _json_number(self.explained_loss),
            "numbers": {k: _json_number(v) for k, v in self.numbers.items()},
            "group_id": self.group_id,
            "groups": list(self.groups),
            "symptoms": [f.to_dict() for f in self.symptoms],
            "also_in": [f.to_dict() for f in self.also_in],
        }


def _json_number(v: Number) -> Number:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


#: Rules whose findings are confounds: they qualify the causes they touch (DESIGN.md, "The cost of a
#: cause, and the order of findings") and follow them, in this order, with the data-quality notes.
CONFOUND_RULES = ("threads", "contention", "oversubscription")

#: a cause that costs less than this share of the step is no warning (info at most): on a shared host a
#: rank's step-to-step noise alone reaches a few percent
MINOR_COST_SHARE = 0.05


def impact(f: Finding) -> float:
    """What a finding costs, as a share of the step: its measured cost per step over the run's step
    (`numbers['cost_share']`: the step time removing it would save) where the rule measured one, else
    the share of the lost efficiency it explains (a sweep's verdict, for which it is measured)."""
    share = f.numbers.get("cost_share")
    if isinstance(share, int | float) and not math.isnan(share):
        return float(share)
    return f.explained_loss or 0.0


def _tier(f: Finding) -> int:
    """Causes first, then comparisons and measurements, then confounds and data-quality notes."""
    if f.rule in CONFOUND_RULES or f.category == "data-quality":
        return 2
    return 0 if f.category == "cause" else 1


def rank_findings(findings: list[Finding]) -> list[Finding]:
    """Causes by what they cost (`impact`), most first, those too small or too noisy to warn of
    (info) after the rest; then comparisons and measurements; then the confounds and data-quality
    notes that qualify them. Ties: alarm before warning before info, then confidence."""
    return sorted(
        findings,
        key=lambda f: (
            _tier(f),
            f.severity == "info",
            -impact(f),
            SEVERITIES.index(f.severity),
            -f.confidence,
            f.id,
        ),
    )
