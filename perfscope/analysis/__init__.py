"""Analyses: small named functions `fn(store, sel) -> pyarrow.Table`, registered in one place.

See docs/analysis.md for every analysis, its columns and the DESIGN.md definition it follows.
"""

from __future__ import annotations

from .registry import (
    ANALYSES,
    DEFINITIONS,
    META_ANALYSIS,
    META_DEFINITION,
    META_TITLE,
    Analysis,
    analysis,
    run_all,
    run_analysis,
)
from .selection import Selection

# Importing the modules registers their analyses.
from . import (  # noqa: F401  isort: skip
    runs,
    scaling,
    sync,
    reference,
    utilisation,
    pop,
    stragglers,
    batch,
    flops,
    models,
    placement,
    quality,
    contention,
    comm_patterns,
    rank_timeline,
    what_if,
    what_if_timeline,
    memory,
)

__all__ = [
    "ANALYSES",
    "DEFINITIONS",
    "META_ANALYSIS",
    "META_DEFINITION",
    "META_TITLE",
    "Analysis",
    "Selection",
    "analysis",
    "run_all",
    "run_analysis",
]
