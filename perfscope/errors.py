"""The one error type of perfscope's tools, and the warning category of its collectors."""

from __future__ import annotations

import threading
import warnings


class PerfscopeError(Exception):
    """A problem the user can fix: the message says what is wrong and what to do, in one line; `detail`
    is longer text shown below it as it is (a failed child process's own traceback)."""

    def __init__(self, message: str, *, exit_code: int = 2, detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.detail = detail


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a newline or NUL in a file name, a lone
    surrogate from an undecodable one) written as its escape, so a message stays one line."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text
    )


def shown(value: object, limit: int = 40) -> str:
    """A value from a file or the command line as it may appear in a one-line message: escaped, at
    most `limit` characters (a 5000-digit number is not echoed whole)."""
    text = one_line(str(value))
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text):,} chars)"


def is_interrupt(exc: BaseException) -> bool:
    """Whether `exc` is a Ctrl-C (or PERFSCOPE_MEMORY_LIMIT's stop, which arrives as one) that native
    code turned into its own error: DuckDB ends an interrupted query with "Query interrupted"."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return type(exc).__name__ == "InterruptException" or "Query interrupted" in str(exc)


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
    # one line: at perfscope's own line (line 0 of "perfscope"), so no source line is printed under it
    warnings.warn_explicit(message, PerfscopeWarning, "perfscope", 0, module="perfscope")
    return True


_formatwarning = warnings.formatwarning


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """perfscope's warnings as they are meant to be read, one plain line ("perfscope: ..."), not
    "perfscope:0: PerfscopeWarning: perfscope: ..." (Python's format names the file and line that warned,
    which says nothing to whoever reads a job's log); every other warning as before."""
    if isinstance(category, type) and issubclass(category, PerfscopeWarning):
        text = str(message)
        return (text if text.startswith("perfscope") else f"perfscope: {text}") + "\n"
    return _formatwarning(message, category, filename, lineno, line)


warnings.formatwarning = _format_warning
