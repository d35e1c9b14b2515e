"""The Chrome trace events the Perfetto exporters write: metadata (a process's or thread's name and
order) and complete slices; the recorded timeline (perfetto.py) and the ideal one
(perfetto_ideal.py) both build on them."""

from __future__ import annotations

from typing import Any


def meta_event(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}


def slice_event(
    name: str, cat: str, pid: int, tid: int, ts_us: float, dur_ns: int, args: dict[str, Any]
) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts_us,
            "dur": round(max(0, dur_ns or 0) / 1000.0, 3), "args": args}  # fmt: skip
