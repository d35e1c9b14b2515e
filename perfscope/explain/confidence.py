"""A finding's confidence, from its evidence, in one function: `confidence()`.

A rule states how strongly its pattern implies its cause when the evidence is good (its
`strength`, 0 to 1). The evidence then caps it, and each cap says what would lift it:

- world sizes: a verdict about scaling that rests on 2 world sizes is at most `FEW_SIZES_CAP`
  (low/medium), on 3 at most `SOME_SIZES_CAP` (medium): "measure N = 4 and 8";
- fit quality: an alpha-beta fit it rests on with fewer than MIN_POINTS points, or that misses its
  points by more than `POOR_FIT_SMAPE_PCT`, caps it at `THIN_FIT_CONFIDENCE` (medium at most);
- noise: runs whose step time varies (coefficient of variation at least `NOISY_CV`) cap it at
  `NOISY_CAP`: "repeat the runs on a quiet host";
- confounds: each confound its runs carry (threads/cores, oversubscription, contention) multiplies
  it by `CONFOUND_FACTOR` (`confounded()`, applied where the confound is found: rules_placement,
  rules_quality), and the caveat says what to fix.

The caps apply to verdicts about timing (categories in VERDICTS), not to the facts that FACT_RULES
read from placement and host samples. Labels (Finding.confidence_label): high from 0.75, medium
from 0.5, low below.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..words import counted

#: The most confidence a scaling verdict on 2 world sizes, or on 3, may state.
FEW_SIZES_CAP = 0.5
SOME_SIZES_CAP = 0.7
#: World sizes a scaling verdict needs before the evidence stops capping it.
ENOUGH_SIZES = 4
#: The most confidence a finding may state when an alpha-beta fit it rests on is thin or poor.
THIN_FIT_CONFIDENCE = 0.6
POOR_FIT_SMAPE_PCT = 25.0
#: Step-time coefficient of variation from which a run counts as noisy, and the cap it puts.
NOISY_CV = 0.25
NOISY_CAP = 0.6
#: Each confound on a finding's runs multiplies its confidence by this.
CONFOUND_FACTOR = 0.5
#: Rules that state facts read from placement, `ranks` and host samples (how many ranks, threads and
#: cores; other processes' CPU), not verdicts about timing: the evidence caps do not apply to them.
FACT_RULES = ("threads", "oversubscription", "contention")
#: Finding categories that are verdicts about timing, the ones the evidence caps apply to.
VERDICTS = ("cause", "comparison")


@dataclass(frozen=True)
class Limit:
    """One thing in the evidence that holds a finding's confidence down."""

    cap: float
    reason: str  # "it rests on 2 world sizes (N = 1, 4)"
    remedy: str  # "measure N = 8 and 16"


@dataclass(frozen=True)
class Inputs:
    """What a finding's confidence depends on (collected by rulebook.make_finding)."""

    #: distinct world sizes of the group a scaling verdict compares (None: not a scaling verdict)
    world_sizes: tuple[int, ...] | None = None
    #: limits from the alpha-beta fits it rests on (thin or poor)
    fit_limits: tuple[Limit, ...] = ()
    #: the noisiest run's step-time coefficient of variation, and its run id
    step_cv: float | None = None
    noisiest_run: str | None = None


def confidence(strength: float, ev: Inputs) -> tuple[float, str]:
    """The confidence a finding states, and a sentence saying what holds it down and what would
    raise it ("" when nothing does)."""
    limits = list(ev.fit_limits)
    sizes = ev.world_sizes
    if sizes is not None and len(sizes) < ENOUGH_SIZES:
        cap = FEW_SIZES_CAP if len(sizes) <= 2 else SOME_SIZES_CAP
        limits.append(
            Limit(
                cap,
                f"it compares {counted(len(sizes), 'world size')} (N = {', '.join(map(str, sizes))})",
                f"measure N = {_and(more_sizes(sizes, ENOUGH_SIZES - len(sizes)))}",
            )
        )
    if ev.step_cv is not None and ev.step_cv >= NOISY_CV:
        limits.append(
            Limit(
                NOISY_CAP,
                f"step time varies (coefficient of variation {ev.step_cv:.2f} in run {ev.noisiest_run})",
                "repeat the runs on a quiet host with more steps",
            )
        )
    binding = [lim for lim in limits if lim.cap < strength]
    if not binding:
        return round(strength, 2), ""
    value = min(lim.cap for lim in binding)
    reasons = "; ".join(dict.fromkeys(lim.reason for lim in binding))
    remedies = "; ".join(dict.fromkeys(lim.remedy for lim in binding))
    return round(value, 2), f"Confidence is held down: {reasons}. To raise it: {remedies}."


def confounded(value: float, factor: float = CONFOUND_FACTOR) -> float:
    """A finding's confidence once a confound is found on its runs."""
    return round(value * factor, 2)


def more_sizes(sizes: tuple[int, ...] | list[int], wanted: int) -> list[int]:
    """`wanted` world sizes to measure next: doubling from the largest measured one."""
    out: list[int] = []
    n = max(sizes, default=1)
    while len(out) < max(1, wanted):
        n *= 2
        out.append(n)
    return out


def _and(items: list[int]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
