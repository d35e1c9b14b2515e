"""Sizes people type ("4GB", "512MiB", "1.5 gib") in bytes: below every room, so the store and the
commands read PERFSCOPE_MEMORY_LIMIT the same way."""

from __future__ import annotations

import contextlib

from .errors import PerfscopeError, shown

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_UNITS |= {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
#: the smallest size taken: no command runs in less (a '1KB' meant as a limit is a typo)
MIN_SIZE = 10**6
#: what the units are, in the words every refusal uses
UNITS_SAID = (
    "a number and a unit such as 4GB or 512MiB (B, KB, MB, GB, TB in 1000s; KiB, MiB, GiB, TiB in "
    "1024s; case and spaces ignored), at least 1 MB"
)


def read_size(text: str, what: str) -> int:
    """'4GB', '512MiB', '1.5 gb' in bytes; anything else (no number, an unknown unit, NaN, 0, a
    negative size, under 1 MB, over 2^60) refused in one line naming `what`."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num) :]
    value = float("nan")
    if unit in _UNITS and num:
        with contextlib.suppress(ValueError):
            value = float(num) * _UNITS[unit]
    if not MIN_SIZE <= value < 1 << 60:  # NaN fails both
        raise PerfscopeError(f"{what}={shown(text)} is not a size: give {UNITS_SAID}")
    return int(value)


def parse_size(text: str) -> int | None:
    """read_size, or None where it refuses."""
    try:
        return read_size(text, "size")
    except PerfscopeError:
        return None
