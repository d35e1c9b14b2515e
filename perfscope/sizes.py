"""Sizes people type ("4GB", "512MiB", "1.5 gib") in bytes: below every room, so the store and the
commands read PERFSCOPE_MEMORY_LIMIT the same way."""

from __future__ import annotations

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_UNITS |= {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int | None:
    """'4GB', '512MiB', '1.5 gb' in bytes; None for anything else (or a size under 1 MB)."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        return None
    try:
        value = float(num)
    except ValueError:
        return None
    n = value * _UNITS[unit]
    return int(n) if 1e6 <= n < 1 << 60 else None
