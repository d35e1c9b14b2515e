"""Time intervals as (n, 2) float arrays of [start, end): union, difference, clipping, total length.

Importers use them to tell compute from communication: the union of kernels, the part of a
collective no compute overlapped.
"""

from __future__ import annotations

import numpy as np


def merge(iv: np.ndarray) -> np.ndarray:
    """The union of `iv` as sorted, disjoint intervals (empty ones dropped)."""
    iv = np.asarray(iv, dtype=np.float64).reshape(-1, 2)
    iv = iv[iv[:, 1] > iv[:, 0]]
    if len(iv) < 2:
        return iv
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends = np.maximum.accumulate(iv[:, 1])
    # a new group starts where an interval begins after every earlier one has ended
    new = np.empty(len(iv), dtype=bool)
    new[0] = True
    new[1:] = iv[1:, 0] > ends[:-1]
    starts = iv[new, 0]
    group_end = np.maximum.reduceat(iv[:, 1], np.flatnonzero(new))
    return np.stack([starts, group_end], axis=1)


def length(iv: np.ndarray) -> float:
    """Total length of disjoint intervals."""
    iv = np.asarray(iv).reshape(-1, 2)
    return float((iv[:, 1] - iv[:, 0]).sum()) if len(iv) else 0.0


def clip(iv: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Disjoint sorted intervals cut to [lo, hi)."""
    iv = np.asarray(iv).reshape(-1, 2)
    if not len(iv):
        return iv
    a = np.searchsorted(iv[:, 1], lo, side="right")
    b = np.searchsorted(iv[:, 0], hi, side="left")
    out = iv[a:b].copy()
    if len(out):
        out[0, 0] = max(out[0, 0], lo)
        out[-1, 1] = min(out[-1, 1], hi)
    return out[out[:, 1] > out[:, 0]]


def subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The parts of disjoint sorted intervals `a` not covered by disjoint sorted intervals `b`."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 2)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 2)
    if not len(a) or not len(b):
        return a
    out: list[tuple[float, float]] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j, 1] <= s:
            j += 1
        cur = s
        k = j
        while k < len(b) and b[k, 0] < e:
            if b[k, 0] > cur:
                out.append((cur, b[k, 0]))
            cur = max(cur, b[k, 1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return np.array(out, dtype=np.float64).reshape(-1, 2)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the intersection of two disjoint sorted interval sets."""
    return length(a) - length(subtract(a, b))
