"""Turns a collector failure into one warning and one `events` row, never into an exception in the job."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from perfscope.errors import warn_once


class RowSink(Protocol):
    def append(self, table: str, row: tuple[object, ...]) -> None: ...


#: where the ranks of a job claim its warnings: a folder of the store, one per run
WARNED_DIR = ".perfscope-warned"


class Faults:
    """What the collectors noticed in one run. Each (kind, key) is reported once per run; the
    warning itself is shown once per process (warn_once), so a script that profiles several runs
    is not flooded while every run still carries its own `events` rows (one per rank that saw it).

    Once the ranks agreed on a run (`claim_in`), a warning is shown once per job, not once per rank:
    the first rank to create its file in the run's folder of the store (O_EXCL, so a shared store
    makes it one line for the whole job, a store per host one per host) prints it; the others only
    write their `events` row. A folder that cannot be written lets every rank warn."""

    def __init__(self, rank: int, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.rank = rank
        self.wall_ns = wall_ns
        self._sink: RowSink | None = None
        self._early: list[tuple[object, ...]] = []
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.kinds: list[str] = []
        self.job_dir: Path | None = None

    def claim_in(self, store: str | os.PathLike[str], run_id: str, world_size: int) -> None:
        """Show each warning of this run once for all its ranks (see the class)."""
        self.job_dir = Path(store) / WARNED_DIR / run_id if world_size > 1 else None

    def _first_in_job(self, kind: str, key: str) -> bool:
        folder = self.job_dir
        if folder is None:
            return True
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{kind}-{key}")[:120]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False  # another rank said it
        except OSError:
            return True
        with contextlib.suppress(OSError):
            os.write(fd, f"{self.rank}\n".encode())
        os.close(fd)
        return True

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
        if warn and self._first_in_job(kind, key):
            warn_once(f"perfscope-{kind}-{key}", message)
        return True

    def _emit(self, row: tuple[object, ...]) -> None:
        assert self._sink is not None
        # the writer never raises, but a fault report must not fail either
        with contextlib.suppress(Exception):
            self._sink.append("events", row)
