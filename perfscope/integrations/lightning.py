"""Lightning: `Trainer(callbacks=[PerfscopeCallback("traces/", experiment="my-model")])` records
every rank's steps and phases from Lightning's hooks, under any strategy (DDP, FSDP ...).

A step is one optimizer update: with `accumulate_grad_batches=k` it spans k batches. Phases:
`data` from the end of a step (or of a batch without an update) to the next batch, `forward` from
the batch's start to the backward (training_step and the loss), `backward` Lightning's backward
call (DDP's wait for its last bucket included), `optimizer` from before the optimizer step to the
batch's end. The DDP model is watched (its buckets recorded); every other torch.distributed call
(FSDP's all-gathers and reduce-scatters) is recorded by the profile's own recorder.

What the module logs with `self.log` / `self.log_dict` is recorded on global rank 0 as the run's
metrics, under the names Lightning gives them (`train_loss`, `train_acc_step`, `train_acc_epoch`,
`val_loss` ...): step-level values at the end of every optimizer step (every step, whatever
`log_every_n_steps`; under accumulation the last batch's value, as Lightning's loggers get it),
epoch-level ones once Lightning has reduced them on every rank (a training epoch's at the next
epoch's start or the end of training, a validation run's at its end; the sanity check's are not
recorded). On a GPU, reading a step's logged tensors at its end waits
for its kernels, as `prof.log` with tensors does: `record_logged=False` leaves them out."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from perfscope.errors import warn_once

from .common import PhaseCursor, export_run


class PerfscopeCallback(Callback):
    """Record training into the store folder `store`; keywords are those of `perfscope.profile`
    (experiment, batch_size, run metadata, poll_hz ...). `export_to` ('mlflow', 'wandb' or
    'tensorboard', with `export_destination` as for `perfscope report --to ... -o`) sends the run's
    phase times, scaling summary and findings to that tracker when training ends. What the module
    logs (`self.log`) is recorded as the run's metrics unless `record_logged=False`."""

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        export_to: str | None = None,
        export_destination: str | None = None,
        record_logged: bool = True,
        **profile_options: Any,
    ) -> None:
        super().__init__()
        self.cursor = PhaseCursor(store, profile_options, who="lightning callback")
        self.export_to = export_to
        self.export_destination = export_destination
        self.step_names: set[str] = set()  # metrics recorded at step ends
        self.seen: dict[str, Any] = {}  # trainer.logged_metrics at the last look
        self.logged_on = record_logged  # off after a failure too

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":  # the strategy has set up its process group: the ranks agree on one run
            self.cursor.start()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.cursor.watch(trainer.strategy.model)  # the wrapped model (DDP, FSDP) when there is one
        self.cursor.move("data")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.cursor.batch(batch)
        self.cursor.move("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.cursor.move("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.cursor.move(None)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.cursor.updated = True
        self.cursor.move("optimizer")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.cursor.updated:
            self.record_logged(trainer, "step")  # before the step ends: they are its metrics
            self.cursor.end_step()
        else:  # accumulating: the next batch is waited for inside the same step
            self.cursor.move("data")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.record_logged(trainer, "epoch")  # the last epoch's reduced values

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.cursor.move(None)  # validation is not the data wait of the next step

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.record_logged(trainer, "epoch")

    def record_logged(self, trainer: Any, level: str) -> None:
        """Record on global rank 0 the scalars the module logged that are new since the last look.

        `trainer.logged_metrics` holds every value logged so far. After a batch it makes the
        batch's step values anew (a new tensor on each read), so what two reads give as different
        objects is this step's (`step`). Epoch values (a training epoch's reduced ones, those logged
        in the module's epoch-end hooks, a validation run's means) are put in by Lightning at the
        epoch's end: what is not the object seen at the last look is new (`epoch`). They are read
        at the next epoch's start, at the end of a validation run and of training, once Lightning
        has reduced them on every rank: reading them first on rank 0 alone would run its sync_dist
        collective out of order with the other ranks'. So every rank reads (what Lightning computes
        on a read, it computes on all of them alike) and rank 0 records."""
        if not self.logged_on or self.cursor.prof is None:  # alike on every rank
            return
        try:
            before = dict(trainer.logged_metrics)
            now = trainer.logged_metrics
            if level == "step":
                values = {k: v for k, v in now.items() if v is not before.get(k) and _numel(v) == 1}
                self.step_names.update(values)
            else:
                values = {
                    k: v
                    for k, v in now.items()
                    if k not in self.step_names and v is not self.seen.get(k) and _numel(v) == 1
                }  # fmt: skip
            self.seen = dict(now)
            if values and trainer.is_global_zero and self.cursor.live:
                self.cursor.log(**values)
        except Exception as exc:
            self.logged_on = False
            warn_once(
                "perfscope-lightning-metrics",
                "perfscope lightning callback: the module's logged values are no longer recorded "
                f"({type(exc).__name__}: {exc}); steps and phases still are.",
            )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.record_logged(trainer, "epoch")
        prof = self.cursor.prof
        run_id, rank = (prof.run_id, prof.rank) if prof is not None else (None, -1)
        self.cursor.close()
        if self.export_to is not None:
            trainer.strategy.barrier("perfscope-export")  # every rank's rows are in the store
            if rank == 0:
                export_run(self.cursor.store, run_id, self.export_to, self.export_destination)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.cursor.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.cursor.close()


def _numel(value: Any) -> int:
    """1 for a number or a one-element tensor (what can be a metric)."""
    if isinstance(value, (int, float)):
        return 1
    numel = getattr(value, "numel", None)
    return int(numel()) if callable(numel) else 0
