"""Hand-written synchronisation: a timed collective block and an averaging all_reduce helper.

A collective recorded here is waited for by the step, so it is exposed sync: when no `sync` phase
is open it opens one around itself. Its row in `comm` carries the payload and this rank's time in it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .dist_recorder import group_members, quiet
from .phases import Timeline
from .step_rows import EXPOSED_ALL, Collective, Span


class CollectiveBlock:
    """`with prof.collective("allreduce", nbytes=t.nbytes): dist.all_reduce(t)`"""

    __slots__ = ("_c", "_phase", "_quiet", "_timeline", "nbytes", "op")

    def __init__(self, timeline: Timeline | None, op: str, nbytes: int) -> None:
        self._timeline = timeline
        self.op = op
        self.nbytes = nbytes
        self._phase: Span | None = None
        self._c: Collective | None = None
        self._quiet = quiet()

    def __enter__(self) -> CollectiveBlock:
        tl = self._timeline
        if tl is not None:
            try:
                if not tl.in_phase("sync"):
                    self._phase = tl.enter("sync")
                self._c = c = tl.begin_collective(self.op, None, int(self.nbytes), overlapped=False)
                c.exposed, c.phase = EXPOSED_ALL, "sync"
            except Exception:
                self._timeline = None  # recording failed: the collective itself must still run
            else:
                self._quiet.__enter__()  # recorded here: the torch.distributed recorder keeps out
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        tl = self._timeline
        if tl is None:
            return
        self._quiet.__exit__()
        try:
            if self._c is not None:
                tl.end_collective(self._c)
            if self._phase is not None:
                tl.exit(self._phase, exc_type)
        except Exception:
            pass


def all_reduce(
    timeline: Timeline | None, tensor: Any, *, op: Any = None, group: Any = None, average: bool = False
) -> Any:
    """`torch.distributed.all_reduce(tensor)` in place, recorded; `average=True` divides by the
    group's size afterwards (parameter or gradient averaging). Returns the tensor."""
    import torch.distributed as dist

    nbytes = tensor.numel() * tensor.element_size()
    members: tuple[int | None, str | None] = (None, None)  # NULL: matched by the run's world size
    if timeline is not None:  # its process group: size and members (comm.group_ranks)
        with contextlib.suppress(Exception):
            members = group_members(dist, group)
    with CollectiveBlock(timeline, "allreduce", nbytes) as block:
        if block._c is not None:
            block._c.group_size, block._c.group_ranks = members
        if op is None:
            dist.all_reduce(tensor, group=group)
        else:
            dist.all_reduce(tensor, op=op, group=group)
    if average:
        tensor.div_(dist.get_world_size(group))
    return tensor
