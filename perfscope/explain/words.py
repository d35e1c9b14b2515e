"""Numbers in words for findings: durations, shares, ratios and lists, consistently formatted."""

from __future__ import annotations

from collections.abc import Iterable


def dur(ns: float | None) -> str:
    if ns is None:
        return "n/a"
    v = abs(ns)
    if v >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if v >= 1e6:
        return f"{ns / 1e6:.1f} ms"
    if v >= 1e3:
        return f"{ns / 1e3:.0f} µs"
    if v >= 1:
        return f"{ns:.0f} ns"
    return "0" if v == 0 else f"{ns:.2g} ns"  # a zero needs no unit ("grows from 0 per step")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.0f}%"


def num(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}×"


def batch_per(b: object, unit: str = "rank") -> str:
    """'batch 32 per rank', or that it was not recorded (zero-code recording, some imports): never 'None'."""
    return f"batch {b} per {unit}" if b is not None else f"batch size per {unit} not recorded"


def gbps(x: float | None) -> str:
    """A bandwidth in GB/s, in MB/s below 1 GB/s (a TCP link, a loaded host: "0.0 GB/s" says nothing)."""
    if x is None:
        return "n/a"
    return f"{x * 1000:.3g} MB/s" if abs(x) < 1 else f"{x:.1f} GB/s"


def listing(items: Iterable[str], limit: int = 6) -> str:
    items = list(items)
    if len(items) > limit:
        items = [*items[:limit], f"{len(items) - limit} more"]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]
