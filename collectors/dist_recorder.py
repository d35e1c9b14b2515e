"""Every torch.distributed collective and point-to-point call made while `profile` is open, by any
caller (FSDP, torch.distributed.pipelining, DeepSpeed's comm layer, user code), as a `comm` row.

The functions of `torch.distributed` (and of `torch.distributed.distributed_c10d`, which FSDP and
the pipelining schedules reach through either name) are replaced by recording wrappers when the
profile starts, if a process group exists, and put back when it closes. A row holds the op, the
payload bytes, the peer of a point-to-point transfer, the process group's size and its members'
global ranks (`group_ranks`: the group passed to the call, all ranks for the default group, both
sides of a point-to-point transfer), the total time
(issue to completion) and the exposed time (what the calling thread waited: the whole call when it
is synchronous; the call plus `Work.wait()` when it is asynchronous).

Not counted: calls made while another recorder owns the communication (`quiet()`: DDP's comm hook,
`prof.collective`, perfscope's own rendezvous), and calls nested inside a recorded one
(`all_gather_object` calling `all_gather`, `batch_isend_irecv` calling `isend`).
Functional collectives called eagerly through `torch.distributed._functional_collectives`
(DTensor's redistributions: tensor and sequence parallelism) are recorded too, on the group they
name: issued asynchronously, their exposed time is the issue call plus the `wait_tensor` that
first reads the result (an AsyncCollectiveTensor's), their total runs from the issue to the end of
that wait (see `watch_functional`).
Not seen: collectives that bypass the Python API (DDP's C++ reducer, a ProcessGroup's methods
called directly) and functional collectives inside a torch.compile graph (the compiled code calls
the `_c10d_functional` ops itself): a compiled DTensor module is noticed when torch traces it, one
warning (`events` kind 'functional_collectives_compiled').
A `P2POp` built inside the profile
holds the recording `isend`; passed to `batch_isend_irecv` after the profile closed, it would read as
a receive (pipelining builds its ops anew every step).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from .clocks import perf_ns
from .faults import Faults
from .phases import Timeline
from .step_rows import CANON, EXPOSED_ALL, NAME, Collective

#: Python function -> (op name in `comm`, argument holding the payload, payload kind).
#: Payload kinds: 'tensor' (its bytes), 'list' (the tensors' bytes summed), 'list_x_group' (that
#: times the group's size), 'none' (0 bytes).
#: Collective sizes follow nccl-tests: the full buffer (an all-gather's output, a reduce-scatter's input).
COLLECTIVES: dict[str, tuple[str, str, str]] = {
    "all_reduce": ("allreduce", "tensor", "tensor"),
    "all_gather": ("all_gather", "tensor_list", "list"),
    "all_gather_into_tensor": ("all_gather_into_tensor", "output_tensor", "tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list", "list"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "input", "tensor"),
    # FSDP2's collectives in torch 2.13 and later
    "all_gather_single": ("all_gather_single", "output_tensor", "tensor"),
    "reduce_scatter_single": ("reduce_scatter_single", "input", "tensor"),
    "_all_gather_base": ("all_gather_into_tensor", "output_tensor", "tensor"),
    "_reduce_scatter_base": ("reduce_scatter_tensor", "input", "tensor"),
    "all_reduce_coalesced": ("allreduce", "tensors", "list"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list", "list_x_group"),
    "broadcast": ("broadcast", "tensor", "tensor"),
    "reduce": ("reduce", "tensor", "tensor"),
    "all_to_all": ("all_to_all", "input_tensor_list", "list"),
    "all_to_all_single": ("all_to_all_single", "input", "tensor"),
    "gather": ("gather", "tensor", "tensor"),
    "scatter": ("scatter", "tensor", "tensor"),
    "barrier": ("barrier", "", "none"),
}
#: point-to-point: function -> (argument naming the peer, argument naming it within the group, async)
P2P: dict[str, tuple[str, str, bool]] = {
    "send": ("dst", "group_dst", False),
    "recv": ("src", "group_src", False),
    "isend": ("dst", "group_dst", True),
    "irecv": ("src", "group_src", True),
}

#: the eager entry points of torch.distributed._functional_collectives (DTensor calls them) ->
#: (op name in `comm`, payload kind of their first argument, `self`): 'tensor', 'list', 'tensor_x_group'
#: (an all-gather's input: the output is the group's size times as large); sizes as for COLLECTIVES
FUNCTIONAL: dict[str, tuple[str, str]] = {
    "all_reduce": ("allreduce", "tensor"),
    "all_reduce_coalesced": ("allreduce", "list"),
    "all_gather_single": ("all_gather_into_tensor", "tensor_x_group"),
    "all_gather_single_autograd": ("all_gather_into_tensor", "tensor_x_group"),
    "all_gather_tensor": ("all_gather_into_tensor", "tensor_x_group"),
    "all_gather_tensor_autograd": ("all_gather_into_tensor", "tensor_x_group"),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor", "list_x_group"),
    "reduce_scatter_single": ("reduce_scatter_tensor", "tensor"),
    "reduce_scatter_single_autograd": ("reduce_scatter_tensor", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "tensor"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter_tensor", "tensor"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", "list"),
    "all_to_all_single": ("all_to_all_single", "tensor"),
    "all_to_all_single_autograd": ("all_to_all_single", "tensor"),
    "permute_tensor": ("permute_tensor", "tensor"),
    "broadcast": ("broadcast", "tensor"),
}
#: the argument naming the group, by position after `self` (all_reduce(self, reduceOp, group, tag))
FUNCTIONAL_GROUP_ARG = "group"
#: collectives issued but not yet waited on, at most (a result never waited on is dropped)
FUNCTIONAL_PENDING_MAX = 256
FUNCTIONAL_MODULE = "torch.distributed._functional_collectives"

_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


class quiet:
    """Calls made inside are not recorded here: another recorder counts them (DDP's comm hook,
    `prof.collective`), or they are perfscope's own, or nested inside a recorded call."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = _depth() + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth = _depth() - 1


class _Args:
    """Reads a call's arguments by name without `inspect.Signature.bind` (several µs a call)."""

    __slots__ = ("_index",)

    def __init__(self, fn: Any) -> None:
        params = list(inspect.signature(fn).parameters)
        self._index = {name: i for i, name in enumerate(params)}

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self._index.get(name)
        return args[i] if i is not None and i < len(args) else None


def _nbytes(value: Any, kind: str, group_size: int) -> int:
    if kind == "list_x_group":  # inputs of an all-gather: the output is group_size times as large
        return group_size * _nbytes(value, "list", group_size)
    if kind == "tensor_x_group":
        return group_size * _nbytes(value, "tensor", group_size)
    if kind == "tensor":
        return int(value.numel() * value.element_size()) if value is not None else 0
    if kind == "list":
        return sum(int(t.numel() * t.element_size()) for t in value or ())
    return 0


def _group_key(group: Any) -> Any:
    """A functional collective's group argument as a dict key: a (DeviceMesh, dim) pair, a group's
    name, a list of ranks, a ProcessGroup or a 1-D DeviceMesh (by identity: the entry holds it)."""
    if isinstance(group, tuple):
        return (id(group[0]), group[1])
    if isinstance(group, list):
        return tuple(group)
    return group if isinstance(group, str) else id(group)


def group_members(dist: Any, group: Any) -> tuple[int, str | None]:
    """A process group's size and its members' global ranks as `comm.group_ranks` ('0,2'); None
    (the default group) is every rank. The members are None where torch cannot say (matched by size)."""
    if group is None:
        size = int(dist.get_world_size())
        return size, ",".join(map(str, range(size)))
    size = int(dist.get_world_size(group))
    try:
        return size, ",".join(map(str, sorted(dist.get_process_group_ranks(group))))
    except Exception:  # not a member, or a torch without it
        return size, None


class DistRecorder:
    """Installs the wrappers on `start`, removes them on `stop`; one per profile."""

    def __init__(self, timeline: Timeline, faults: Faults, dist: Any) -> None:
        self.timeline = timeline
        self.faults = faults
        self.dist = dist
        self.active = False
        self._modules = [dist, dist.distributed_c10d]
        self._saved: list[tuple[Any, str, Any]] = []
        # id(group) -> (group, its size, its members' global ranks as comm.group_ranks); the group is
        # held so that its id is not reused by another while the recorder runs
        self._groups: dict[int, tuple[Any, int, str | None]] = {}
        self._world_size = int(dist.get_world_size())
        self._rank = int(dist.get_rank())
        self._pairs: dict[int, str] = {}  # peer -> comm.group_ranks of a transfer with it
        self._originals: dict[Any, Any] = {}  # wrapper -> original, for batch_isend_irecv
        self._functional_watched = False
        self._pending: dict[int, Collective] = {}  # functional collectives issued, not yet waited on

    @classmethod
    def for_process(cls, timeline: Timeline, faults: Faults) -> DistRecorder | None:
        """A started recorder when torch.distributed has a process group, else None (zero cost)."""
        import sys

        dist = sys.modules.get("torch.distributed")
        try:
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return None
        except Exception:
            return None
        rec = cls(timeline, faults, dist)
        rec.start()
        return rec

    # -- install / remove ------------------------------------------------------------------------
    def start(self) -> None:
        c10d = self.dist.distributed_c10d
        for name, spec in COLLECTIVES.items():
            orig = getattr(c10d, name, None)
            if orig is not None:
                self._patch(name, self._collective_wrapper(orig, *spec), both=True)
        for name, (peer_arg, group_peer_arg, is_async) in P2P.items():
            orig = getattr(c10d, name, None)
            if orig is not None:
                # isend/irecv only under torch.distributed: batch_isend_irecv tells a send from a
                # receive by `op is isend` against distributed_c10d's own name
                wrapper = self._p2p_wrapper(orig, name, peer_arg, group_peer_arg, is_async)
                self._patch(name, wrapper, both=not is_async)
        orig_batch = getattr(c10d, "batch_isend_irecv", None)
        if orig_batch is not None:
            self._patch("batch_isend_irecv", self._batch_wrapper(orig_batch), both=True)
        orig_check = getattr(c10d, "_check_op", None)
        if orig_check is not None:  # P2POp(dist.isend, ...) must accept the wrapper
            originals = self._originals

            def check_op(op: Any) -> Any:
                return orig_check(originals.get(op, op))

            self._saved.append((c10d, "_check_op", orig_check))
            c10d._check_op = check_op
        self.watch_functional()
        self.active = True

    def watch_functional(self) -> None:
        """Record the functional collectives (DTensor's redistributions, tensor and sequence
        parallelism) once the job imported them (DTensor does); called at start and again when the
        training loop starts.

        An eager call issues the collective and returns an AsyncCollectiveTensor (or waits at once);
        the job waits on it (`wait_tensor`) when it first reads the result. The row's total runs
        from the issue to the end of that wait (torch gives no other completion signal), its exposed
        time is the issue call plus the wait. The wait is matched to its collective by the result's
        storage. Calls traced by torch.compile run inside the compiled graph, unseen from Python:
        the first such trace is one warning ('functional_collectives_compiled')."""
        import sys

        funcol = sys.modules.get(FUNCTIONAL_MODULE)
        if funcol is None or self._functional_watched:
            return
        self._functional_watched = True
        try:
            import torch

            dynamo = torch.compiler.is_dynamo_compiling  # a constant in Dynamo's trace: the branch is gone
            compiling = torch.compiler.is_compiling  # True in AOTAutograd's trace too, run for real
            tracing = getattr(funcol, "_are_we_tracing", compiling)
            resolve = funcol._resolve_group
            by_name = self.dist.distributed_c10d._resolve_process_group
            orig_wrap = funcol._maybe_wrap_tensor
            orig_wait = funcol.wait_tensor
        except Exception as exc:
            self.faults.report(
                "functional_collectives_unseen",
                f"perfscope: the functional collectives of {FUNCTIONAL_MODULE} (DTensor, tensor parallelism) "
                f"are not recorded in this torch ({type(exc).__name__}: {exc}).",
            )
            return
        rec = self
        pending: dict[int, Collective] = {}  # storage of an issued result -> its collective
        # the collective being issued, per thread (autograd's device threads issue backward's)
        issuing = threading.local()
        groups: dict[Any, Any] = {}  # the group argument -> (it, its ProcessGroup)
        tl = self.timeline

        def group_of(group: Any, tag: str) -> Any:
            known = groups.get(_group_key(group))
            if known is None:
                pg = resolve(group, tag)
                known = groups[_group_key(group)] = (group, by_name(pg) if isinstance(pg, str) else pg)
            return known[1]

        def compiled() -> None:
            rec.faults.report(
                "functional_collectives_compiled",
                f"perfscope: this job traces functional collectives ({FUNCTIONAL_MODULE}) into a "
                "torch.compile graph; the compiled graph runs them unseen from Python, not in `comm`.",
            )

        def wrap(name: str, orig: Any, op: str, kind: str) -> Callable[..., Any]:
            arg = _Args(orig).get

            @functools.wraps(orig)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if dynamo() or not rec.active or _depth():
                    return orig(*args, **kwargs)
                try:
                    if compiling() or tracing():  # AOTAutograd's trace of a compiled DTensor module
                        compiled()
                        return orig(*args, **kwargs)
                    pg = group_of(arg(args, kwargs, FUNCTIONAL_GROUP_ARG), arg(args, kwargs, "tag") or "")
                    nbytes = _nbytes(arg(args, kwargs, "self"), kind, rec._group_size(pg))
                    c = rec._begin(op, nbytes, pg, None, True)
                except Exception as exc:
                    rec._failed(exc)
                    return orig(*args, **kwargs)
                t0 = perf_ns()
                issuing.c = c
                try:
                    with quiet():
                        result = orig(*args, **kwargs)
                except BaseException:
                    tl.end_collective(c)
                    raise
                finally:
                    issuing.c = None
                called = perf_ns() - t0
                c.exposed = called if c.exposed is None else c.exposed + called
                if c.end is None and not rec._waiting(c):  # waited inside the call (a gather's cat)
                    tl.end_collective(c)
                return result

            return wrapper

        @functools.wraps(orig_wrap)
        def maybe_wrap(tensor: Any) -> Any:
            c = None if dynamo() else getattr(issuing, "c", None)
            if c is not None:
                try:
                    if len(pending) >= FUNCTIONAL_PENDING_MAX:
                        pending.pop(next(iter(pending)))  # never waited on: no row
                    pending[tensor.untyped_storage().data_ptr()] = c
                except Exception:
                    pass
            return orig_wrap(tensor)

        @functools.wraps(orig_wait)
        def wait_tensor(tensor: Any) -> Any:
            if dynamo() or not pending:
                return orig_wait(tensor)
            try:
                c = pending.pop(tensor.untyped_storage().data_ptr(), None)
            except Exception:
                c = None
            if c is None:
                return orig_wait(tensor)
            t0 = perf_ns()
            try:
                return orig_wait(tensor)
            finally:
                t1 = perf_ns()
                if not rec._waiting(c):  # its last result (coalesced calls have several)
                    tl.end_collective(c)
                if (
                    getattr(issuing, "c", None) is not c
                ):  # a wait inside the issuing call is in that call's time
                    c.exposed = (c.exposed or 0) + t1 - t0

        self._pending = pending
        # module globals: the collectives and AsyncCollectiveTensor look them up at each call
        for name, fn in (("_maybe_wrap_tensor", maybe_wrap), ("wait_tensor", wait_tensor)):
            self._saved.append((funcol, name, getattr(funcol, name)))
            setattr(funcol, name, fn)
        for name, (op, kind) in FUNCTIONAL.items():
            orig = getattr(funcol, name, None)
            if callable(orig):
                self._saved.append((funcol, name, orig))
                setattr(funcol, name, wrap(name, orig, op, kind))

    def _waiting(self, c: Collective) -> bool:
        """Whether a result of `c` is still to be waited on (coalesced calls have several)."""
        return any(p is c for p in self._pending.values())

    def _patch(self, name: str, wrapper: Callable[..., Any], *, both: bool) -> None:
        for module in self._modules if both else self._modules[:1]:
            current = getattr(module, name, None)
            if current is None:
                continue
            self._saved.append((module, name, current))
            self._originals[wrapper] = getattr(current, "__wrapped__", current)
            setattr(module, name, wrapper)

    def stop(self) -> None:
        """Put every function back (in reverse, so a name patched twice ends as it began)."""
        self.active = False
        for module, name, orig in reversed(self._saved):
            try:
                setattr(module, name, orig)
            except Exception as exc:
                self.faults.report("dist_recorder_restore", f"perfscope: could not restore {name} ({exc!r}).")
        self._saved.clear()

    # -- per call --------------------------------------------------------------------------------
    def _group(self, group: Any) -> tuple[Any, int, str | None]:
        known = self._groups.get(id(group))
        if known is None:
            known = self._groups[id(group)] = (group, *group_members(self.dist, group))
        return known

    def _group_size(self, group: Any) -> int:
        return self._group(group)[1]

    def _begin(self, op: str, nbytes: int, group: Any, peer: int | None, is_async: bool) -> Collective:
        phase = "other"
        for span in reversed(self.timeline.stack):
            if span[CANON] >= 0:
                phase = span[NAME]
                break
        c = self.timeline.begin_collective(
            op, None, nbytes, overlapped=False, group=None if peer is not None else ("pg", id(group))
        )  # collectives of one group run in issue order; point-to-point transfers need not
        c.peer = peer
        _, c.group_size, c.group_ranks = self._group(group)
        if peer is not None:  # a transfer's two sides
            pair = self._pairs.get(peer)
            if pair is None:
                pair = self._pairs[peer] = ",".join(map(str, sorted({self._rank, peer})))
            c.group_ranks = pair
        c.is_async = is_async
        c.phase = phase
        return c

    def _collective_wrapper(self, orig: Any, op: str, payload_arg: str, kind: str) -> Callable[..., Any]:
        arg = _Args(orig).get
        rec = self

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not rec.active or _depth():
                return orig(*args, **kwargs)
            try:
                is_async = bool(arg(args, kwargs, "async_op"))  # every default is False
                group = arg(args, kwargs, "group")
                nbytes = _nbytes(arg(args, kwargs, payload_arg), kind, rec._group_size(group))
                c = rec._begin(op, nbytes, group, None, is_async)
            except Exception as exc:
                rec._failed(exc)
                return orig(*args, **kwargs)
            return rec._run(c, orig, args, kwargs, is_async)

        return wrapper

    def _p2p_wrapper(
        self, orig: Any, op: str, peer_arg: str, group_peer_arg: str, is_async: bool
    ) -> Callable[..., Any]:
        arg = _Args(orig).get
        rec = self

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not rec.active or _depth():
                return orig(*args, **kwargs)
            try:
                group = arg(args, kwargs, "group")
                peer = arg(args, kwargs, peer_arg)
                group_peer = arg(args, kwargs, group_peer_arg)
                if peer is None and group_peer is not None:
                    peer = rec.dist.get_global_rank(group, group_peer)
                c = rec._begin(op, _nbytes(arg(args, kwargs, "tensor"), "tensor", 0), group, peer, is_async)
            except Exception as exc:
                rec._failed(exc)
                return orig(*args, **kwargs)
            result = rec._run(c, orig, args, kwargs, is_async)
            if op == "recv" and c.peer is None and isinstance(result, int):
                c.peer = result  # recv from any source returns the sender
                c.group_ranks = ",".join(map(str, sorted({rec._rank, result})))  # rare: not cached
            return result

        return wrapper

    def _batch_wrapper(self, orig: Any) -> Callable[..., Any]:
        rec = self

        @functools.wraps(orig)
        def wrapper(p2p_op_list: Any) -> Any:
            if not rec.active or _depth():
                return rec._batch_call(orig, p2p_op_list)
            try:
                ops = list(p2p_op_list)
                t0 = perf_ns()
                cs = []
                for p in ops:
                    real = rec._originals.get(p.op, p.op)
                    name = "isend" if real is rec.dist.distributed_c10d.isend else "irecv"
                    peer = p.peer
                    if peer is None and getattr(p, "group_peer", None) is not None:
                        peer = rec.dist.get_global_rank(p.group, p.group_peer)
                    cs.append(rec._begin(name, _nbytes(p.tensor, "tensor", 0), p.group, peer, True))
            except Exception as exc:
                rec._failed(exc)
                return rec._batch_call(orig, p2p_op_list)
            try:
                with quiet():
                    works = rec._batch_call(orig, ops)
            except BaseException:
                for c in cs:
                    rec.timeline.end_collective(c)
                raise
            called_ns = perf_ns() - t0
            try:
                works = list(works)
                if len(works) == len(cs):
                    return [rec._track(w, [c], called_ns) for w, c in zip(works, cs, strict=True)]
                return [rec._track(w, cs, called_ns) for w in works]
            except Exception as exc:
                rec._failed(exc)
                return works

        return wrapper

    def _batch_call(self, orig: Any, ops: list[Any]) -> Any:
        """batch_isend_irecv with each op's function back to the original (restored after), since
        it compares them with `is` against distributed_c10d's own isend."""
        saved = [p.op for p in ops]
        for p in ops:
            p.op = self._originals.get(p.op, p.op)
        try:
            return orig(ops)
        finally:
            for p, op in zip(ops, saved, strict=True):
                p.op = op

    def _run(
        self, c: Collective, orig: Any, args: tuple[Any, ...], kwargs: dict[str, Any], is_async: bool
    ) -> Any:
        tl = self.timeline
        t0 = perf_ns()
        try:
            with quiet():
                result = orig(*args, **kwargs)
        except BaseException:
            tl.end_collective(c)
            raise
        if not is_async:
            tl.end_collective(c)
            c.exposed = EXPOSED_ALL
            return result
        called_ns = perf_ns() - t0
        if result is None:  # not a member of the group: nothing was sent
            tl.end_collective(c)
            c.exposed = called_ns
            return result
        try:
            return self._track(result, [c], called_ns)
        except Exception as exc:
            tl.end_collective(c)
            self._failed(exc)
            return result

    def _track(self, work: Any, cs: list[Collective], called_ns: int) -> Any:
        """The Work, wrapped so that wait() adds to the exposed time; its future ends the total."""
        for c in cs:
            c.exposed = called_ns
        tl = self.timeline
        try:
            fut = work.get_future()

            def done(_: Any) -> None:
                for c in cs:
                    if c.end is None:
                        tl.end_collective(c)

            fut.add_done_callback(done)
        except Exception:
            pass  # no future for this backend's Work: the total ends at wait()
        return RecordedWork(work, cs, tl, self.dist.Work)

    def _failed(self, exc: Exception) -> None:
        self.active = False
        self.faults.report(
            "dist_recorder_failed",
            f"perfscope: stopped recording torch.distributed calls ({type(exc).__name__}: {exc}); "
            "training goes on unchanged.",
        )


def RecordedWork(work: Any, cs: list[Collective], timeline: Timeline, work_type: type) -> Any:
    """A `dist.Work` (FSDP checks isinstance) that forwards to `work` and times its wait()."""
    cls = _work_class(work_type)
    return cls(work, cs, timeline)


@functools.cache
def _work_class(work_type: type) -> type:
    class _RecordedWork(work_type):
        def __init__(self, work: Any, cs: list[Collective], timeline: Timeline) -> None:
            super().__init__()
            self._work = work
            self._cs = cs
            self._timeline = timeline

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            t0 = perf_ns()
            try:
                return self._work.wait(*args, **kwargs)
            finally:
                t1 = perf_ns()
                for c in self._cs:
                    if c.end is None:
                        self._timeline.end_collective(c)
                    c.exposed = (c.exposed if c.exposed is not None and c.exposed >= 0 else 0) + t1 - t0

        def __getattr__(self, name: str) -> Any:
            return getattr(self.__dict__["_work"], name)

    # every other method of Work answers for the wrapped one (the base class's own would act on
    # an empty C++ Work): is_completed, get_future, result, synchronize ...
    for name in _FORWARDED:
        setattr(_RecordedWork, name, _forward(name))
    return _RecordedWork


_FORWARDED = (
    "is_completed", "is_success", "exception", "source_rank", "_source_rank", "result", "get_future",
    "get_future_result", "synchronize", "block_current_stream", "_get_op_type", "_get_duration", "boxed",
)  # fmt: skip


def _forward(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._work, name)(*args, **kwargs)

    method.__name__ = name
    return method
