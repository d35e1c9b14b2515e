"""Host clocks: perf_counter marks for durations, and their translation to rank 0's wall clock."""

from __future__ import annotations

import time
from collections.abc import Iterable

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
