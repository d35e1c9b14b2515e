"""PERFSCOPE_MEMORY_LIMIT bounds the whole process of a perfscope command, not DuckDB alone.

DuckDB's own memory limit (store.listing.analysis_memory_limit, half of this one) covers its buffer
pool; Arrow results, parsed traces and Python objects are outside it. When PERFSCOPE_MEMORY_LIMIT is
set, the commands that read or write a store (`analyze`, `report`, `import`, `export`, `sql`, `info`,
`compact`, `simulate`) run under a watchdog: the resident memory of the command's process and its
children, above what the process held when the command began (the interpreter and its libraries,
about 100-200 MB, which no setting moves), stays under the limit. Past it the command is stopped
with one line that says so, as Ctrl-C would stop it (its clean-up runs; an import leaves nothing
half-written), and exits 1.

`dashboard` too: its Streamlit server is the command's child, so the server's analyses, every session's,
count, and past the limit the server is stopped with the command (issue 33: one store's analysis took
a server to 6.3 GB). Not `run` (the training job's memory is its own) or `top`. A value that is not a
size (sizes.read_size: `garbage`, `nanGB`, `0`, `1KB`) is refused with exit 2 by every command that
reads it (READS_LIMIT) before it starts: warning and carrying on would run with no whole-process limit
at all. The watchdog samples every 20 ms: a spike shorter than that can pass the limit unseen; a
process that does not stop within 5 s of being asked is ended.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import sys
import threading
from types import TracebackType

import psutil

from .errors import one_line
from .sizes import read_size

ENV = "PERFSCOPE_MEMORY_LIMIT"
GUARDED = frozenset(
    {"analyze", "report", "import", "export", "sql", "info", "compact", "simulate", "dashboard"}
)
#: the commands whose DuckDB takes its memory limit from PERFSCOPE_MEMORY_LIMIT too: a mistyped value
#: is refused by each of them before it starts
READS_LIMIT = GUARDED | {"top"}
#: how often the watchdog looks, and how long a stopped command may take to stop before it is ended
INTERVAL_S = 0.02
GRACE_S = 5.0
#: exit status of a command stopped at the limit
EXIT = 1


def _tree_rss(proc: psutil.Process, with_children: bool) -> int:
    total = proc.memory_info().rss
    if with_children:
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                total += child.memory_info().rss
    return total


class MemoryGuard:
    """Stops the main thread (KeyboardInterrupt) when the process tree's RSS grows past `limit` bytes
    above where it began; `tripped` says it did, `said` says so in words."""

    def __init__(self, limit: int, shown: str, verb: str = "") -> None:
        self.verb = verb
        self.limit = limit
        self.shown = shown
        self.tripped = False
        self.peak = 0
        self._proc = psutil.Process()
        self._base = _tree_rss(self._proc, True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="perfscope-memory-guard", daemon=True)

    def __enter__(self) -> MemoryGuard:
        self._thread.start()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()

    @property
    def said(self) -> str:
        return (
            f"stopped: its memory grew past {ENV}={self.shown} (this command's whole process, above "
            f"the {self._base / 2**20:.0f} MB it started with); raise the limit, or narrow what it reads"
        )

    def _watch(self) -> None:
        n = 0
        while not self._stop.wait(INTERVAL_S):
            try:
                used = _tree_rss(self._proc, n % 5 == 0) - self._base  # children every 100 ms
            except psutil.Error:
                return
            n += 1
            self.peak = max(self.peak, used)
            if used > self.limit:
                self.tripped = True
                _thread.interrupt_main()
                if not self._stop.wait(GRACE_S):  # native code that never returns to Python
                    # the same line the command would have printed (its main thread is in native code)
                    who = f"perfscope {self.verb}" if self.verb else "perfscope"
                    print(f"{who}: {self.said}", file=sys.stderr, flush=True)
                    os._exit(EXIT)
                return


def guard_for(verb: str) -> MemoryGuard | None:
    """The watchdog for `verb` when PERFSCOPE_MEMORY_LIMIT is set. A value that is not a size
    (`garbage`, `nanGB`, `0`, `-1GB`, `1KB`) is refused (PerfscopeError, exit 2) by every command that
    reads it, before it starts: warning and going on would run with no whole-process limit at all."""
    value = os.environ.get(ENV, "").strip()
    if verb not in READS_LIMIT or not value:
        return None
    limit = read_size(value, ENV)
    return MemoryGuard(limit, one_line(value), verb) if verb in GUARDED else None


def stopped_in_time(guard: MemoryGuard | None) -> bool:
    """Whether a KeyboardInterrupt was the guard's doing (and not the user's Ctrl-C)."""
    return guard is not None and guard.tripped
