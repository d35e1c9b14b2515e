"""The CUDA caching allocator's peaks per step (the device_memory table): at the end of every step,
torch.cuda.max_memory_allocated and max_memory_reserved, then reset_peak_memory_stats, so each row
holds the most the step needed. Only a rank that uses CUDA makes one; on CPU nothing runs per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .faults import Faults


class DeviceMemory:
    """One rank's allocator peaks. `step(index)` is called by the profiler after each step ends; a
    failure is one warning and switches it off (`active` False), the job goes on."""

    __slots__ = ("_append", "_cuda", "_device", "_faults", "_now", "_rank", "active", "total")

    def __init__(
        self,
        cuda: Any,
        device: int,
        rank: int,
        append: Callable[[str, tuple[Any, ...]], None],
        now: Callable[[], int],
        faults: Faults,
    ) -> None:
        self._cuda, self._device, self._rank = cuda, device, rank
        self._append, self._now, self._faults = append, now, faults
        try:
            self.total: int | None = int(cuda.mem_get_info(device)[1])  # (free, total) in bytes
        except Exception:
            self.total = None  # NULL: the headroom finding then stays silent
        cuda.reset_peak_memory_stats(device)  # the first step's peak starts here
        self.active = True

    def step(self, index: int) -> None:
        if not self.active:
            return
        cuda, device = self._cuda, self._device
        try:
            allocated = int(cuda.max_memory_allocated(device))
            reserved = int(cuda.max_memory_reserved(device))
            cuda.reset_peak_memory_stats(device)
            self._append("device_memory", (self._rank, index, self._now(), allocated, reserved, self.total))
        except Exception as exc:
            self.active = False
            self._faults.report(
                "device_memory_off",
                f"perfscope: the CUDA allocator's peaks could not be read ({exc!r}); device memory per "
                "step is not recorded from here on.",
            )


def for_torch(
    device: int | None, rank: int, append: Any, now: Callable[[], int], faults: Faults
) -> DeviceMemory | None:
    """A DeviceMemory for this rank when it uses CUDA (torch imported, CUDA initialised), else None."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        index = int(torch.cuda.current_device()) if device is None else device
        return DeviceMemory(torch.cuda, index, rank, append, now, faults)
    except Exception as exc:
        faults.report(
            "device_memory_off", f"perfscope: the CUDA allocator's peaks are not recorded ({exc!r})."
        )
        return None
