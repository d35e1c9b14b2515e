"""The one error type of perfscope's tools, and the warning category of its collectors."""

from __future__ import annotations

import threading
import warnings


class PerfscopeError(Exception):
    """A problem the user can fix: the message says what is wrong and what to do."""

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class StoreError(PerfscopeError):
    """The store is missing, empty, foreign or of an unreadable schema version."""


class PerfscopeWarning(UserWarning):
    """Something perfscope could not measure or write; the job it measures goes on."""


_seen: set[str] = set()
_seen_lock = threading.Lock()


def warn_once(key: str, message: str) -> bool:
    """Warn the first time `key` is seen in this process. Returns True when it warned."""
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
    warnings.warn(message, PerfscopeWarning, stacklevel=3)
    return True
