"""CUDA-event timing marks: recorded on the current stream, resolved later, never synchronized per step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class CudaMarks:
    """A mark is a `torch.cuda.Event(enable_timing=True)` recorded on the current stream.

    Recording costs a few microseconds and does not wait for the GPU. A finished step is kept until
    its last event reports `query() == True` (checked on later steps and at close); only then are
    durations read with `elapsed_time`, so the host never blocks on the device. Events are reused
    from a pool once their step has been resolved.
    """

    clock = "cuda"

    def __init__(self, new_event: Callable[[], Any]) -> None:
        self._new_event = new_event
        self._pool: list[Any] = []

    @classmethod
    def for_torch(cls) -> CudaMarks:
        import torch

        return cls(lambda: torch.cuda.Event(enable_timing=True))

    def mark(self) -> Any:
        try:
            event = self._pool.pop()  # atomic under the GIL: comm callbacks mark from other threads
        except IndexError:
            event = self._new_event()
        event.record()
        return event

    def ready(self, mark: Any) -> bool:
        return bool(mark.query())

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return round(start.elapsed_time(end) * 1_000_000)  # elapsed_time is in ms

    def release(self, marks: Iterable[Any]) -> None:
        self._pool.extend(m for m in marks if m is not None)
