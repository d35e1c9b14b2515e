"""Lightning: `Trainer(callbacks=[PerfscopeCallback("traces/", experiment="my-model")])` records
every rank's steps and phases from Lightning's hooks, under any strategy (DDP, FSDP ...).

A step is one optimizer update: with `accumulate_grad_batches=k` it spans k batches. Phases:
`data` from the end of a step (or of a batch without an update) to the next batch, `forward` from
the batch's start to the backward (training_step and the loss), `backward` Lightning's backward
call (DDP's wait for its last bucket included), `optimizer` from before the optimizer step to the
batch's end. The DDP model is watched (its buckets recorded); every other torch.distributed call
(FSDP's all-gathers and reduce-scatters) is recorded by the profile's own recorder."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from .common import PhaseCursor, export_run


class PerfscopeCallback(Callback):
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
        super().__init__()
        self.cursor = PhaseCursor(store, profile_options, who="lightning callback")
        self.export_to = export_to
        self.export_destination = export_destination

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
            self.cursor.end_step()
        else:  # accumulating: the next batch is waited for inside the same step
            self.cursor.move("data")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.cursor.move(None)  # validation is not the data wait of the next step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
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
