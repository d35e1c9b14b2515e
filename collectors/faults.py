"""Turns a collector failure into one warning and one `events` row, never into an exception in the job."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Protocol

from perfscope.errors import warn_once


class RowSink(Protocol):
    def append(self, table: str, row: tuple[object, ...]) -> None: ...


class Faults:
    """What the collectors noticed in one run. Each (kind, key) is reported once per run; the
    warning itself is shown once per process (warn_once), so a script that profiles several runs
    is not flooded while every run still carries its own `events` rows."""

    def __init__(self, rank: int, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.rank = rank
        self.wall_ns = wall_ns
        self._sink: RowSink | None = None
        self._early: list[tuple[object, ...]] = []
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.kinds: list[str] = []

    def attach(self, sink: RowSink) -> None:
        """Start writing rows; what was reported before the store was open is written now."""
        with self._lock:
            self._sink = sink
            early, self._early = self._early, []
        for row in early:
            self._emit(row)

    def report(self, kind: str, message: str, *, key: str = "", warn: bool = True) -> bool:
        """Record `kind` once per run (per `key`); returns False when it was already reported."""
        with self._lock:
            if (kind, key) in self._seen:
                return False
            self._seen.add((kind, key))
            self.kinds.append(kind)
            row = (self.rank, self.wall_ns(), kind, message)
            sink = self._sink
            if sink is None:
                self._early.append(row)
        if sink is not None:
            self._emit(row)
        if warn:
            warn_once(f"perfscope-{kind}-{key}", message)
        return True

    def _emit(self, row: tuple[object, ...]) -> None:
        assert self._sink is not None
        # the writer never raises, but a fault report must not fail either
        with contextlib.suppress(Exception):
            self._sink.append("events", row)
