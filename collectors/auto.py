"""Zero-code recording for `perfscope run`: in a process started under it, torch's global hooks open
a `perfscope.profile` lazily and mark its steps and phases, with no change to the training script.

- The profile opens at the first outermost module forward in training (by then a process group,
  when the job has one, exists, so the ranks agree on one run id) and closes at exit.
- A step is one optimizer update: it ends in the optimizer's step post-hook (global optimizer hooks),
  so gradient accumulation gives one step per update. `optimizer` is the time inside step().
- `forward` is the time inside the outermost module's forward (one not called from another module's
  forward) while gradients are enabled. A forward the autograd engine runs (activation checkpointing
  recomputing a block) is part of backward.
- Samples are counted from the model being trained, never from a parameter-less module (a loss, a
  metric): see SampleCounter. `--batch-size` (the profile's batch_size), when given, is stored instead.
- `backward` starts when autograd reaches the outermost module's output and ends when the autograd
  engine finishes (after DDP's reducer has waited for its last bucket, so exposed sync is measured).
- `data` runs from the end of a step to the next outermost forward.
- A DDP model is watched (`prof.watch`) at its first forward; every other torch.distributed call is
  recorded by the profile's own recorder.

A script that opens its own `perfscope.profile` is recorded by it alone: this steps aside. Any
failure here is one warning and the job goes on unrecorded.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import threading
import weakref
from pathlib import Path
from typing import Any

from perfscope.errors import warn_once

from . import ddp, profiler
from .phases import infer_samples

#: JSON settings `perfscope run` passes to every process: {"store": PATH, "options": {...}}
AUTO_ENV = "PERFSCOPE_AUTO"
#: the folder `perfscope run` puts first on PYTHONPATH: it holds the start-up hook
BOOTSTRAP_DIR = Path(__file__).with_name("bootstrap")
#: output tensors given a backward hook per outermost forward (the loss's path goes through one)
_MAX_HOOKED_OUTPUTS = 8
#: how deep in nested containers an output's tensors are looked for
_MAX_OUTPUT_DEPTH = 3
#: bounds of what a step's sample count holds (a script that never steps an optimizer ends no step)
_MAX_FORWARDS = 64
_MAX_MICRO_BATCHES = 4096
_MAX_OPTIMIZERS = 16
#: a module's relation to the stepping optimizer
_NO_PARAMETERS, _TRAINABLE, _STEPPED = 0, 1, 2

_recorder: AutoRecorder | None = None


def settings(env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The settings of `perfscope run` in this process's environment, None outside it."""
    raw = (os.environ if env is None else env).get(AUTO_ENV, "")
    if not raw:
        return None
    value = json.loads(raw)
    if not isinstance(value, dict) or not isinstance(value.get("store"), str):
        raise ValueError(f"{AUTO_ENV} must be a JSON object with a 'store'")
    return value


def instrument(torch: Any) -> AutoRecorder | None:
    """Install the global hooks in this process (once), if it runs under `perfscope run`."""
    global _recorder
    if _recorder is not None:
        return _recorder
    if os.environ.get(profiler.DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    conf = settings()
    if conf is None:
        return None
    _recorder = AutoRecorder(torch, conf["store"], dict(conf.get("options") or {}))
    _recorder.install()
    return _recorder


def _samples(inputs: Any) -> int | None:
    """The batch size of a forward's inputs: `model(x)`, `model(**batch)`, or a wrapper called with
    the whole batch first (Lightning's `training_step(batch, batch_idx)` under DDP)."""
    found = infer_samples(inputs)
    if found is None and isinstance(inputs, (tuple, list)) and inputs:
        found = infer_samples(inputs[0])
    return found


def _outputs_needing_grad(output: Any) -> list[Any]:
    """The tensors of a forward's output that autograd will reach: a tensor, or those in tuples,
    lists, dicts (Hugging Face's ModelOutput is one) and dataclasses, nested up to three levels.
    A backward reaching one ends the micro-batch (see SampleCounter) and starts the backward phase."""
    found: list[Any] = []
    _collect_grad_tensors(output, found, 0)
    return found


def _collect_grad_tensors(value: Any, found: list[Any], depth: int) -> None:
    if hasattr(value, "grad_fn"):
        if getattr(value, "requires_grad", False):
            found.append(value)
        return
    if depth >= _MAX_OUTPUT_DEPTH:
        return
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (tuple, list)):
        items = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    else:
        return
    for item in items[:_MAX_HOOKED_OUTPUTS]:
        if len(found) >= _MAX_HOOKED_OUTPUTS:
            return
        _collect_grad_tensors(item, found, depth + 1)


class SampleCounter:
    """Samples of one step, counted from the forwards of the model being trained.

    A micro-batch is the outermost training forwards up to the backward that follows them (a step
    with gradient accumulation has several). Its samples are the batch of its first forward of a
    module whose parameters the stepping optimizer updates (the model, or its DDP/FSDP wrapper),
    so a loss, a metric or an activation used as a module adds nothing, nor does a second call of
    the model on the same batch (two views, a twin network). Where no forward's module is stepped
    by the optimizer (it steps master copies of the weights), the first module with trainable
    parameters counts; a parameter-less one never does. A step's samples are the sum over its
    micro-batches. An optimizer that evaluates its closure several times (L-BFGS) sees one batch."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, int]] = []  # (module, samples) since the last backward
        self.micro: list[list[tuple[Any, int]]] = []  # the step's finished micro-batches
        self.closed_in_step = False  # a micro-batch ended inside the optimizer's step (its closure)
        self._kinds: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], int]] = weakref.WeakKeyDictionary()
        self._stepped: dict[tuple[int, int], frozenset[int]] = {}

    def forward(self, module: Any, samples: int | None) -> None:
        """An outermost training forward of `module` over `samples` ended."""
        if samples is None or len(self.pending) >= _MAX_FORWARDS:
            return
        if all(m is not module for m, _ in self.pending):
            self.pending.append((module, samples))

    def backward(self, in_optimizer: bool) -> None:
        """A backward reached the forwards' outputs: the micro-batch ends."""
        group, self.pending = self.pending, []
        if not group:
            return
        if in_optimizer:
            if self.closed_in_step:  # the closure evaluated again: the same batch
                return
            self.closed_in_step = True
        if len(self.micro) < _MAX_MICRO_BATCHES:
            self.micro.append(group)

    def step_started(self) -> None:
        self.closed_in_step = False

    def take(self, optimizer: Any) -> tuple[int | None, int]:
        """The step's samples (None: no forward counted) and its micro-batches (the backwards of the
        model's forwards: several with gradient accumulation); starts the next step's count."""
        self.backward(False)  # forwards after the last backward (or with none reached) are one batch
        groups, self.micro = self.micro, []
        self.closed_in_step = False
        counts = [n for n in (self._batch(group, optimizer) for group in groups) if n is not None]
        return (sum(counts) if counts else None), len(groups)

    def _batch(self, group: list[tuple[Any, int]], optimizer: Any) -> int | None:
        fallback = None
        for module, samples in group:
            kind = self._kind(module, optimizer)
            if kind == _STEPPED:
                return samples
            if kind == _TRAINABLE and fallback is None:
                fallback = samples
        return fallback

    def _kind(self, module: Any, optimizer: Any) -> int:
        """_STEPPED: the optimizer updates some of the module's parameters; _TRAINABLE: it has
        parameters needing gradients, none stepped by it; _NO_PARAMETERS. Cached per module."""
        groups = getattr(optimizer, "param_groups", None) or []
        key = (id(optimizer), sum(len(g.get("params", ())) for g in groups))
        try:
            known = self._kinds.get(module)
        except TypeError:  # a module that cannot be weakly referenced or hashed: not cached
            known = None
        if known is not None and key in known:
            return known[key]
        stepped = self._stepped.get(key)
        if stepped is None:
            if len(self._stepped) >= _MAX_OPTIMIZERS:
                self._stepped.clear()
            stepped = self._stepped[key] = frozenset(id(p) for g in groups for p in g.get("params", ()))
        kind = _NO_PARAMETERS
        for p in module.parameters():
            if id(p) in stepped:
                kind = _STEPPED
                break
            if p.requires_grad:
                kind = _TRAINABLE
        with contextlib.suppress(TypeError):
            kinds = self._kinds.setdefault(module, {})
            if len(kinds) >= _MAX_OPTIMIZERS:  # optimizers made anew: keep the newest
                kinds.clear()
            kinds[key] = kind
        return kind


class AutoRecorder:
    """The hooks of one process and the profile they feed. `perfscope run` hooks every module and
    opens its profile lazily; a framework callback passes its open profile and its model (`scope`),
    whose forward alone is then watched."""

    def __init__(
        self,
        torch: Any,
        store: str,
        options: dict[str, Any],
        *,
        prof: profiler.Profiler | None = None,
        scope: Any = None,
    ) -> None:
        self.torch = torch
        self.store = store
        self.options = options
        self.prof = prof
        self.scope = scope
        self.off = False  # stepped aside (the script's own profile) or failed: hooks do nothing
        self.pid = os.getpid()
        self.thread = threading.get_ident()
        self.depth = 0  # nesting of module forwards on the training thread
        self.in_forward = False  # the outermost forward in progress is a training one
        self.in_data = False
        self.in_backward = False
        self.in_optimizer = 0
        self.samples = SampleCounter()
        self.stepping: Any = None  # the outermost optimizer in its step()
        self.unopened = 0  # optimizer steps in progress that began before the profile opened
        self.watched: set[int] = set()
        self.handles: list[Any] = []
        self.ddp_finder: Any = None

    # -- set-up -----------------------------------------------------------------------------------
    def install(self) -> None:
        import torch.nn.modules.module as module_hooks
        import torch.optim.optimizer as optimizer_hooks

        if self.scope is None:
            self.handles = [
                module_hooks.register_module_forward_pre_hook(self._forward_pre),
                module_hooks.register_module_forward_hook(
                    self._forward_post, with_kwargs=True, always_call=True
                ),
            ]
            profiler.START_LISTENERS.append(self._profile_started)
            atexit.register(self.close)
        else:
            self.handles = [
                self.scope.register_forward_pre_hook(self._forward_pre),
                self.scope.register_forward_hook(self._forward_post, with_kwargs=True, always_call=True),
            ]
            # the framework wraps the model in DDP out of the callback's sight: find the wrapper at
            # its first forward, then stop looking (at the first step's end)
            self.ddp_finder = module_hooks.register_module_forward_pre_hook(self._find_ddp)
        self.handles += [
            optimizer_hooks.register_optimizer_step_pre_hook(self._optimizer_pre),
            optimizer_hooks.register_optimizer_step_post_hook(self._optimizer_post),
        ]

    def _start(self) -> profiler.Profiler | None:
        """Open the profile, on the training thread of the process that installed the hooks."""
        if os.getpid() != self.pid:  # a forked child (a DataLoader worker) records nothing
            self.off = True
            return None
        prof = profiler.profile(self.store, **self.options)
        self.prof = prof
        prof.start()
        if not prof.recording:
            self.off = True
            return None
        return prof

    def _profile_started(self, prof: profiler.Profiler) -> None:
        """Another profile starts in this process: the script records itself; stand aside."""
        if prof is self.prof or self.off:
            return
        self.off = True
        mine, self.prof = self.prof, None
        if mine is not None:
            mine.close()

    def _fail(self, exc: BaseException) -> None:
        self.off = True
        warn_once(
            "perfscope-auto-failed",
            f"perfscope run: recording stopped after an internal error ({type(exc).__name__}: {exc}); "
            "training continues unrecorded. Please report this.",
        )
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Remove the hooks and close the profile (at exit, or after a failure)."""
        self.off = True
        self._stop_finding_ddp()
        handles, self.handles = self.handles, []
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.remove()
        with contextlib.suppress(ValueError):
            profiler.START_LISTENERS.remove(self._profile_started)
        prof, self.prof = self.prof, None
        if prof is not None and os.getpid() == self.pid:
            prof.close()

    def _in_autograd(self) -> bool:
        """The autograd engine runs this code (a checkpointed block recomputed in backward)."""
        current = getattr(self.torch._C, "_current_graph_task_id", None)
        return current is not None and current() != -1

    # -- phases -----------------------------------------------------------------------------------
    def _enter(self, name: str) -> None:
        assert self.prof is not None
        self.prof.phase(name).__enter__()

    def _exit(self, name: str) -> None:
        assert self.prof is not None
        self.prof.phase(name).__exit__(None, None, None)

    def _forward_pre(self, module: Any, args: Any) -> None:
        if self.depth:
            self.depth += 1
            return
        if self.off or threading.get_ident() != self.thread:
            return
        self.depth = 1
        try:
            training = bool(module.training) and self.torch.is_grad_enabled() and not self._in_autograd()
            prof = self.prof
            if prof is None:
                if not training:
                    return
                prof = self._start()
                if prof is None:
                    return
            if id(module) not in self.watched and training:
                self.watched.add(id(module))
                # the model's facts (parameters, device: CUDA timing) come from a module that has
                # parameters, never from a parameter-less one called first (a preprocessing module)
                if ddp.is_ddp(module) or prof._facts is None or not prof._facts.param_count:
                    prof.watch(module)
            if self.in_data:
                self.in_data = False
                self._exit("data")
            if training:
                self.in_forward = True
                self._enter("forward")
        except Exception as exc:
            self._fail(exc)

    def _forward_post(self, module: Any, args: Any, *rest: Any) -> None:
        """(module, args, kwargs, output); torch calls a global hook as (module, args, result) when the
        forward raised (a checkpoint's recomputation stopping early, an out-of-memory the script
        catches): the nesting still unwinds, and a failed forward counts no samples."""
        if self.depth > 1:
            self.depth -= 1
            return
        if self.depth == 0:
            return
        self.depth = 0
        if not self.in_forward:
            return
        self.in_forward = False
        try:
            self._exit("forward")
            if len(rest) != 2:
                return
            kwargs, output = rest
            self.samples.forward(module, _samples(args) or _samples(kwargs))
            for tensor in _outputs_needing_grad(output):
                tensor.register_hook(self._backward_reached)
        except Exception as exc:
            self._fail(exc)

    def _backward_reached(self, grad: Any) -> None:
        """Autograd reached an outermost output: backward is under way."""
        if self.in_backward or self.off or self.prof is None:
            return
        try:
            self.in_backward = True
            self.samples.backward(self.in_optimizer > 0 or self.unopened > 0)
            self._enter("backward")
            self.torch.autograd.Variable._execution_engine.queue_callback(self._engine_finishing)
        except Exception as exc:
            self._fail(exc)

    def _engine_finishing(self) -> None:
        # Callbacks queued at the end of backward run in order; DDP queues its finalisation (the
        # wait for the last bucket) after this one, so queue the end of the phase behind it.
        try:
            self.torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except Exception:
            self._backward_done()

    def _backward_done(self) -> None:
        if not self.in_backward:
            return
        self.in_backward = False
        try:
            if not self.off and self.prof is not None:
                self._exit("backward")
        except Exception as exc:
            self._fail(exc)

    def _find_ddp(self, module: Any, args: Any) -> None:
        if getattr(module, "module", None) is not self.scope or self.off or self.prof is None:
            return
        try:
            if ddp.is_ddp(module) and id(module) not in self.watched:
                self.watched.add(id(module))
                self.prof.watch(module)
            self._stop_finding_ddp()
        except Exception as exc:
            self._fail(exc)

    def _stop_finding_ddp(self) -> None:
        finder, self.ddp_finder = self.ddp_finder, None
        if finder is not None:
            finder.remove()

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.off or threading.get_ident() != self.thread:
            return
        if self.prof is None:  # an update begun before the profile opens (it may open in a closure)
            self.unopened += 1
            return
        try:
            if self.in_backward:  # the engine's callback never came (a failed backward)
                self.in_backward = False
                self._exit("backward")
            if self.in_data:
                self.in_data = False
                self._exit("data")
            if not self.in_optimizer:
                self.stepping = optimizer
                self.samples.step_started()
            self.in_optimizer += 1
            self._enter("optimizer")
        except Exception as exc:
            self._fail(exc)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.off or threading.get_ident() != self.thread:
            return
        if self.unopened:
            self.unopened -= 1
            # the profile opened inside this update (its closure's first forward): the update is
            # the first step, without an optimizer phase
            if not self.unopened and self.prof is not None and not self.in_optimizer:
                self.stepping = optimizer
                self._end_update()
            return
        if self.prof is None or not self.in_optimizer:
            return
        try:
            self.in_optimizer -= 1
            self._exit("optimizer")
            if self.in_optimizer:  # an optimizer stepping another inside its step: one update
                return
            self._end_update()
        except Exception as exc:
            self._fail(exc)

    def _end_update(self) -> None:
        """The outermost optimizer step ended: the step ends, the wait for the next batch begins."""
        assert self.prof is not None
        try:
            samples, micro = self.samples.take(self.stepping)
            self.stepping = None
            # `--batch-size` given: the loader's batch (one micro-batch) the user gave, times the
            # step's micro-batches (gradient accumulation runs several between two updates)
            given = self.prof.batch_size
            self.prof.step(samples if given is None else given * max(micro, 1))
            self._stop_finding_ddp()
            self.in_data = True
            self._enter("data")
        except Exception as exc:
            self._fail(exc)
