"""DDP gradient synchronisation: a comm hook that records every bucket's collective and wraps the
user's own hook (fp16 compression, PowerSGD ...), since DDP accepts only one hook per model."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from .dist_recorder import group_members, quiet
from .faults import Faults
from .phases import Timeline
from .settings import is_ddp, model_settings

#: Hooks from torch.distributed.algorithms.ddp_comm_hooks that put 2-byte elements on the wire:
#: the collective's payload is half the bucket's fp32 buffer.
_HALF_PRECISION_HOOKS = frozenset(
    {"fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper_hook", "bf16_compress_wrapper_hook"}
)


@dataclass
class ModelFacts:
    name: str
    param_count: int
    grad_bytes: int
    device_type: str
    device_index: int | None
    is_ddp: bool
    #: the runs columns of collectors/settings.py (param_dtypes, compiled, ddp_*); empty when unread
    settings: dict[str, Any] = field(default_factory=dict)


def model_facts(model: Any) -> ModelFacts:
    """Trainable parameters and the bytes of their gradients (what DDP synchronises every step)."""
    inner = getattr(model, "module", model) if is_ddp(model) else model
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile's wrapper: name the model inside
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else None
    try:
        settings = model_settings(model)
    except Exception:  # an odd model: its settings stay NULL, its facts are still counted
        settings = {}
    return ModelFacts(
        name=type(inner).__name__,
        param_count=sum(p.numel() for p in params),
        grad_bytes=sum(p.numel() * p.element_size() for p in params),
        device_type=device.type if device is not None else "cpu",
        device_index=device.index if device is not None and device.type == "cuda" else None,
        is_ddp=is_ddp(model),
        settings=settings,
    )


class HookState:
    """Passed by DDP to `recording_hook` on every bucket; carries the user's hook and state."""

    __slots__ = ("active", "element_bytes", "faults", "group", "hook", "state", "timeline")

    def __init__(
        self, timeline: Timeline, faults: Faults, hook: Any, state: Any, group: tuple[int | None, str | None]
    ) -> None:
        self.timeline = timeline
        self.group = group  # the model's process group: size and members (comm.group_ranks)
        self.faults = faults
        self.hook = hook
        self.state = state
        self.element_bytes = 2 if getattr(hook, "__name__", "") in _HALF_PRECISION_HOOKS else 0
        self.active = True


# No annotations on purpose: DDP's _check_comm_hook rejects a `bucket` annotation other than the
# GradBucket class itself, and string annotations (from __future__) would not compare equal.
def recording_hook(state, bucket):
    """DDP comm hook: note the bucket's entry (its gradients are ready), run the user's hook, note
    the completion of the future it returns. The future is returned untouched."""
    if not state.active:
        with quiet():
            return state.hook(state.state, bucket)
    collective = None
    try:
        buf = bucket.buffer()
        nbytes = buf.numel() * (state.element_bytes or buf.element_size())
        collective = state.timeline.begin_collective(
            "allreduce", bucket.index(), nbytes, overlapped=True, group=state
        )  # one model's buckets share its process group: each waits for the one before
        collective.group_size, collective.group_ranks = state.group
    except Exception as exc:
        state.faults.report("ddp_hook_failed", f"perfscope: could not record a DDP bucket ({exc!r}).")
    with quiet():  # the bucket is recorded here: the hook's dist.all_reduce must not count again
        fut = state.hook(state.state, bucket)
    if collective is not None:
        timeline = state.timeline

        def done(_: Any) -> None:
            with contextlib.suppress(Exception):
                timeline.end_collective(collective)

        try:
            fut.add_done_callback(done)
        except Exception as exc:
            state.faults.report("ddp_hook_failed", f"perfscope: could not time a DDP bucket ({exc!r}).")
    return fut


def registered_hook_name(model: Any) -> str | None:
    """The comm hook already registered on a DDP model, if any (Python or built-in)."""
    hooks = getattr(model, "_comm_hooks", None) or []
    if hooks:
        return str(getattr(hooks[0][0], "__qualname__", hooks[0][0]))
    try:
        name = model._get_ddp_logging_data().get("comm_hook")
    except Exception:
        return None
    return str(name) if name else None


def instrument_ddp(
    model: Any, timeline: Timeline, faults: Faults, *, comm_hook: Any = None, comm_state: Any = None
) -> HookState | None:
    """Register the recording hook on a DDP model, composing it with `comm_hook` (called with
    `comm_state`, as DDP would). Without `comm_hook`, DDP's own averaging allreduce is used.

    DDP keeps Python hooks in `model._comm_hooks` and its reducer refuses a second registration, so
    a hook registered before watch() cannot be wrapped: it is left alone, with a warning saying how
    to pass it through watch() instead."""
    existing = registered_hook_name(model)
    if existing is not None:
        faults.report(
            "ddp_hook_present",
            f"perfscope: this DDP model already has the comm hook {existing!r} and DDP accepts only one, "
            "so gradient synchronisation is not recorded per bucket. Register it through perfscope "
            "instead: prof.watch(model, comm_hook=<hook>, comm_state=<state>).",
        )
        return None
    if comm_hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        comm_hook, comm_state = allreduce_hook, model.process_group
    import torch.distributed as dist

    group: tuple[int | None, str | None]
    try:
        group = group_members(dist, model.process_group)
    except Exception:
        group = (None, None)  # NULL: matched by the run's world size
    state = HookState(timeline, faults, comm_hook, comm_state, group)
    model.register_comm_hook(state, recording_hook)
    return state
