"""Horovod: records the synchronisation of `hvd.DistributedOptimizer`. Horovod is imported only when
used; it is not a dependency of perfscope.

Horovod's torch optimizer starts an asynchronous allreduce per gradient from a hook while backward
runs (`_allreduce_grad_async` / `_grouped_allreduce_grad_async`) and waits for all of them in
`synchronize()`, which `step()` calls. perfscope wraps those methods on the optimizer instance:

- each allreduce becomes a `comm` row: its payload, the moment it was enqueued, and its end, which
  is the first moment perfscope saw it complete (`hvd.poll` at the entry of synchronize(), else
  synchronize()'s return; Horovod offers no completion callback, so durations are upper bounds);
- synchronize() is a `sync` phase: the exposed sync the step waits for.

`seq` is the parameter's (or group's) position in the optimizer's parameter list, the same on
every rank even though Horovod may issue the allreduces in a different order on each.
"""

from __future__ import annotations

import importlib
from typing import Any

from .faults import Faults
from .phases import Timeline
from .step_rows import Collective


class HorovodRecorder:
    """The wrappers installed on one Horovod DistributedOptimizer instance."""

    def __init__(self, optimizer: Any, hvd: Any, timeline: Timeline, faults: Faults) -> None:
        self.opt = optimizer
        self.hvd = hvd
        self.timeline = timeline
        self.faults = faults
        self.active = True
        self._position = {
            id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        }
        self._inflight: list[tuple[Any, Collective]] = []
        self._orig_async = optimizer._allreduce_grad_async
        self._orig_grouped = getattr(optimizer, "_grouped_allreduce_grad_async", None)
        self._orig_sync = optimizer.synchronize
        optimizer._allreduce_grad_async = self._allreduce_grad_async
        if self._orig_grouped is not None:
            optimizer._grouped_allreduce_grad_async = self._grouped_allreduce_grad_async
        optimizer.synchronize = self.synchronize

    def _begin(self, params: list[Any]) -> Collective | None:
        try:
            nbytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            c = self.timeline.begin_collective("allreduce", None, nbytes, overlapped=False)
            c.seq = min(self._position.get(id(p), 0) for p in params)
            return c
        except Exception as exc:
            self.faults.report(
                "horovod_record_failed", f"perfscope: could not record a Horovod allreduce ({exc!r})."
            )
            return None

    def _allreduce_grad_async(self, p: Any) -> Any:
        if not self.active:
            return self._orig_async(p)
        c = self._begin([p])
        result = self._orig_async(p)
        if c is not None:
            self._inflight.append((result[0], c))
        return result

    def _grouped_allreduce_grad_async(self, ps: Any) -> Any:
        assert self._orig_grouped is not None
        if not self.active:
            return self._orig_grouped(ps)
        c = self._begin(list(ps))
        result = self._orig_grouped(ps)
        if c is not None:
            self._inflight.append((result[0], c))
        return result

    def synchronize(self) -> Any:
        if not self.active:
            return self._orig_sync()
        tl = self.timeline
        span = None
        try:
            still_running = []
            for handle, c in self._inflight:
                if callable(handle) or not self._poll(handle):
                    still_running.append((handle, c))
                else:
                    tl.end_collective(c)
            self._inflight = still_running
            if not tl.in_phase("sync"):
                span = tl.enter("sync")
        except Exception as exc:
            self.faults.report(
                "horovod_record_failed", f"perfscope: could not time Horovod's synchronize ({exc!r})."
            )
        error: type[BaseException] | None = None
        try:
            return self._orig_sync()
        except BaseException as exc:
            error = type(exc)
            raise
        finally:
            try:
                for _, c in self._inflight:
                    tl.end_collective(c)
                self._inflight = []
                if span is not None:
                    tl.exit(span, error)
            except Exception:
                pass

    def _poll(self, handle: Any) -> bool:
        try:
            return bool(self.hvd.poll(handle))
        except Exception:
            return False


def distributed_optimizer(
    optimizer: Any, timeline: Timeline, faults: Faults, *, hvd: Any = None, **kwargs: Any
) -> Any:
    """`hvd.DistributedOptimizer(optimizer, **kwargs)` with its synchronisation recorded."""
    if hvd is None:
        try:
            hvd = importlib.import_module("horovod.torch")
        except ImportError as exc:
            raise ImportError(
                "prof.horovod_optimizer needs Horovod (pip install horovod); perfscope does not install it"
            ) from exc
    opt = hvd.DistributedOptimizer(optimizer, **kwargs)
    try:
        opt._perfscope = HorovodRecorder(opt, hvd, timeline, faults)
    except Exception as exc:  # an unexpected Horovod version: train unrecorded rather than fail
        faults.report(
            "horovod_unsupported",
            f"perfscope: cannot record this Horovod version's DistributedOptimizer ({exc!r}); "
            "its synchronisation is not recorded.",
        )
    return opt
