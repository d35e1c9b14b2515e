"""FLOPs of one training step on one rank, counted once with torch's FlopCounterMode."""

from __future__ import annotations

from typing import Any


class StepFlopCounter:
    """Counts the FLOPs of the matmuls, convolutions ... dispatched between `start` and `stop`
    (forward and backward), the way torch.utils.flop_counter does; used on one step only because
    the counting mode slows the step it watches."""

    def __init__(self) -> None:
        self._mode: Any = None
        self.flops: float | None = None

    @property
    def running(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        mode = FlopCounterMode(display=False)
        mode.__enter__()
        self._mode = mode

    def stop(self) -> float | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return self.flops
        mode.__exit__(None, None, None)
        total = float(mode.get_total_flops())
        self.flops = total if total > 0 else None
        return self.flops
