"""The warm-up cut (DESIGN.md, "Steady state"): how many of a run's first steps are warm-up.

One rule, read by both sides: the store's rollups (rollups.py) precompute per-window sums from the
cut, and the analysis (analysis/steady.py) applies it, with or without a user's override. Kept in the
store layer so that the storage code never depends on the analysis.
"""

from __future__ import annotations

#: DESIGN: drop the first 10 steps or the first 5%, whichever is larger.
WARMUP_MIN_STEPS = 10
WARMUP_FRACTION = 0.05
#: Fewer steady steps than this and the warm-up rule falls back to dropping the first half.
MIN_STEADY_STEPS = 5


def warmup_sql(n_steps: str) -> str:
    """SQL for the default number of warm-up steps of a run of `n_steps` (an SQL expression) steps."""
    return f"greatest({WARMUP_MIN_STEPS}, ceil({WARMUP_FRACTION} * {n_steps}))::BIGINT"


def fallback_sql(n_steps: str, warmup: str) -> str:
    """SQL that is true when cutting `warmup` steps leaves too few steady steps (the rule then drops
    the first half instead)."""
    return f"{n_steps} - {warmup} < {MIN_STEADY_STEPS}"


def cut_sql(n_steps: str, warmup: str, fallback: str) -> str:
    """SQL for the steps cut: the first half when `fallback` holds, else `warmup`."""
    return f"CASE WHEN {fallback} THEN {n_steps} // 2 ELSE {warmup} END"


def default_cut_sql(n_steps: str) -> str:
    """SQL for the steps the default rule cuts (no override): the offset of the first steady step."""
    warmup = warmup_sql(n_steps)
    return cut_sql(n_steps, warmup, fallback_sql(n_steps, warmup))
