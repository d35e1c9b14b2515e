"""Host clocks: perf_counter marks for durations, and their translation to rank 0's wall clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

perf_ns = time.perf_counter_ns


class HostClock:
    """Maps `perf_counter_ns` readings to ns since epoch on rank 0's clock.

    Durations come from the monotonic perf counter (a wall-clock step by NTP cannot distort them);
    timestamps are the perf reading shifted once by (wall - perf) at start plus this rank's clock
    offset, so every timestamp written by one rank moves with one consistent clock.
    """

    def __init__(self, offset_ns: int = 0) -> None:
        before = time.time_ns()
        mid = perf_ns()
        after = time.time_ns()
        self._perf_to_epoch = (before + after) // 2 - mid
        self.offset_ns = offset_ns
        self.shift_ns = self._perf_to_epoch + offset_ns

    def set_offset(self, offset_ns: int) -> None:
        self.offset_ns = offset_ns
        self.shift_ns = self._perf_to_epoch + offset_ns

    def wall(self, perf: int) -> int:
        """ns since epoch on rank 0's clock for a `perf_counter_ns` reading of this process."""
        return perf + self.shift_ns

    def now(self) -> int:
        return perf_ns() + self.shift_ns


class HostMarks:
    """Timing marks on the host: a mark is a perf_counter_ns reading, ready at once."""

    clock = "host"

    def mark(self) -> int:
        return perf_ns()

    def ready(self, mark: object) -> bool:
        return True

    def elapsed_ns(self, start: int, end: int) -> int:
        return end - start

    def release(self, marks: Iterable[object]) -> None:
        pass


def timed_barriers(barrier: Callable[[], None], rounds: int) -> list[int]:
    """`rounds` back-to-back barriers, each bracketed by this process's wall clock: [before, after,
    before, after, ...]. No rank leaves a barrier before every rank entered it, so one instant (the
    last entry) lies inside every rank's [before, after] of the same round: the exchange of an NTP
    or Cristian probe, with every rank at once. The first round absorbs the ranks' arrival skew; the
    later ones start together and are as tight as the barrier's round trip."""
    marks: list[int] = []
    for _ in range(rounds):
        marks.append(time.time_ns())  # looked up at each call: tests shift the wall clock per host
        barrier()
        marks.append(time.time_ns())
    return marks


@dataclass(frozen=True)
class Alignment:
    """A host's wall clock against the reference host's (rank 0's)."""

    #: add to this host's timestamps to get the reference clock
    offset_ns: int
    #: the true offset lies within offset_ns ± error_ns (half the round trip of the best exchange,
    #: narrowed by every other exchange that agrees with it); 0 on the reference host itself
    error_ns: int


def align(marks: Sequence[object], reference: Sequence[int], mine: Sequence[int]) -> Alignment | None:
    """The offset of the host of ranks `mine` to the host of ranks `reference` from every rank's
    `timed_barriers` marks (`marks[rank]`, gathered; a rank whose marks are malformed is left out).

    Per round, the shared instant reads somewhere in [max before, min after] on each host (ranks of
    one host share its clock), so the offset lies in [ref max before − my min after, ref min after −
    my max before]. Rounds are intersected (a clock does not drift measurably in milliseconds); if a
    clock was stepped meanwhile and they disagree, the narrowest round alone is used. None when
    either host has no usable marks."""
    rounds = _rounds(marks)
    if rounds is None or not any(r in rounds for r in mine) or not any(r in rounds for r in reference):
        return None
    n = len(next(iter(rounds.values()))) // 2
    bounds: list[tuple[int, int]] = []
    for k in range(n):
        ref = _instant(rounds, reference, k)
        own = _instant(rounds, mine, k)
        if ref is not None and own is not None:
            bounds.append((ref[0] - own[1], ref[1] - own[0]))
    if not bounds:
        return None
    lo, hi = max(b[0] for b in bounds), min(b[1] for b in bounds)
    if lo > hi:
        lo, hi = min(bounds, key=lambda b: b[1] - b[0])
    return Alignment(offset_ns=(lo + hi) // 2, error_ns=-((lo - hi) // 2))


def _rounds(marks: Sequence[object]) -> dict[int, list[int]] | None:
    """rank -> marks, for ranks whose marks are an even-length list of ints of the common length."""
    good = {
        r: list(m)
        for r, m in enumerate(marks)
        if isinstance(m, (list, tuple)) and m and len(m) % 2 == 0 and all(type(x) is int for x in m)
    }
    if not good:
        return None
    width = len(good[min(good)])
    return {r: m for r, m in good.items() if len(m) == width}


def _instant(rounds: dict[int, list[int]], ranks: Sequence[int], k: int) -> tuple[int, int] | None:
    """[latest entry, earliest exit] of round k on one host's clock: where the shared instant read;
    None when the host's windows do not overlap there (a stepped clock)."""
    windows = [(rounds[r][2 * k], rounds[r][2 * k + 1]) for r in ranks if r in rounds]
    if not windows:
        return None
    start, end = max(w[0] for w in windows), min(w[1] for w in windows)
    return (start, end) if start <= end else None
