"""Hugging Face: `Trainer(..., callbacks=[PerfscopeCallback("traces/", experiment="my-model")])`
records every rank's steps and phases.

Trainer's callback events mark the training's start and end; its own events do not separate
forward from backward, so inside the run the phases come from the model's forward hooks, autograd
and torch's optimizer-step hooks, with perfscope run's definitions (collectors/auto.py): a step is
one optimizer update (gradient accumulation included), `data` runs from the end of a step to the
next forward, `backward` until the autograd engine finishes. The DDP wrapper Trainer makes is found
at its first forward and watched (its buckets recorded); every other torch.distributed call is
recorded by the profile's recorder."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from transformers import TrainerCallback

from perfscope.errors import warn_once

from ..collectors import profiler
from ..collectors.auto import AutoRecorder
from .common import export_run


class PerfscopeCallback(TrainerCallback):
    """Record training into the store folder `store`; keywords are those of `perfscope.profile`
    (experiment, batch_size, run metadata, poll_hz ...). `export_to` ('mlflow', 'wandb' or
    'tensorboard', with `export_destination` as for `perfscope report --to ... -o`) sends the run's
    phase times, scaling summary and findings to that tracker when training ends."""

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        export_to: str | None = None,
        export_destination: str | None = None,
        **profile_options: Any,
    ) -> None:
        self.store = os.fspath(store)
        self.options = profile_options
        self.export_to = export_to
        self.export_destination = export_destination
        self.recorder: AutoRecorder | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.recorder is not None or model is None:
            return
        try:
            import torch

            prof = profiler.profile(self.store, **self.options).start()
            if prof.recording:
                self.recorder = AutoRecorder(torch, self.store, self.options, prof=prof, scope=model)
                self.recorder.install()
        except Exception as exc:
            warn_once(
                "perfscope-transformers-failed",
                f"perfscope: the Trainer runs unrecorded ({type(exc).__name__}: {exc}).",
            )

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        prof = self.recorder.prof if self.recorder is not None else None
        if prof is not None and logs:
            with contextlib.suppress(Exception):
                prof.log(**{k: v for k, v in logs.items() if isinstance(v, (int, float))})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return
        prof = recorder.prof
        run_id, rank = (prof.run_id, prof.rank) if prof is not None else (None, -1)
        recorder.close()
        if self.export_to is not None:
            with contextlib.suppress(Exception):  # every rank's rows are in the store
                from accelerate import PartialState

                PartialState().wait_for_everyone()
            if rank == 0:
                export_run(self.store, run_id, self.export_to, self.export_destination)
