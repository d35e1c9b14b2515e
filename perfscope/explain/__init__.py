"""The explainer: rules that turn analyses into ranked findings in plain words.

`explain(store, sel)` runs every rule in `RULES`, merges what one cause shows several ways into one
root cause with its symptoms (root_causes.py), and returns `Finding`s ranked by what they cost per
step (finding.rank_findings). See docs/analysis.md.
"""

from __future__ import annotations

import warnings

from ..analysis import Selection
from ..errors import PerfscopeWarning, is_interrupt
from ..store.reader import Store
from . import (  # noqa: F401  (registers rules)
    rules_comm,
    rules_compute,
    rules_memory,
    rules_patterns,
    rules_quality,
    rules_topology,
    rules_what_if,
)
from .biggest_loss import uncovered_losses
from .context import Context
from .finding import CATEGORIES, SEVERITIES, Evidence, Finding, rank_findings
from .root_causes import root_causes
from .rulebook import RULES, Rule
from .rules_placement import annotate_confounded
from .rules_quality import annotate_contended

__all__ = ["CATEGORIES", "RULES", "SEVERITIES", "Evidence", "Finding", "Rule", "explain", "rank_findings"]


def explain(store: Store, sel: Selection | None = None) -> list[Finding]:
    """Every cause found in the selected runs, once, the costliest first.

    `Finding.flatten()` gives back every rule firing a finding stands for (its symptoms and its
    repeats on other groups).

    A rule that fails on data it did not expect is skipped with a warning naming it, so one odd
    store never hides the other findings; an interrupted query (Ctrl-C, PERFSCOPE_MEMORY_LIMIT) stops
    the explanation instead.
    """
    ctx = Context(store, sel or Selection())
    findings: list[Finding] = []
    for r in RULES:
        try:
            findings += r.fn(ctx)
        except Exception as exc:  # a rule's bug must not take the whole explanation down
            if is_interrupt(exc):  # Ctrl-C or the memory limit's stop, met inside a query: stop
                raise KeyboardInterrupt from exc
            warnings.warn(
                f"perfscope: rule {r.id} failed ({type(exc).__name__}: {exc}); its findings are missing.",
                PerfscopeWarning,
                stacklevel=2,
            )
    findings += uncovered_losses(ctx, findings)  # the phase that lost most always has a finding
    return root_causes(annotate_contended(rank_findings(annotate_confounded(findings))))
