"""What the framework callbacks share: a profile opened on every rank and the one phase open at a
time, moved along by the framework's hooks. A failure here is one warning; training goes on."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from perfscope.errors import warn_once

from ..collectors import profiler
from ..collectors.phases import infer_samples


class PhaseCursor:
    """One rank's profile and its flat phase sequence: data, forward, backward (repeated under
    gradient accumulation), optimizer, then the step ends and data starts again."""

    def __init__(self, store: str | os.PathLike[str], options: dict[str, Any], *, who: str) -> None:
        self.store = store
        self.options = options
        self.who = who
        self.prof: profiler.Profiler | None = None
        self.open: str | None = None
        self.samples = 0
        self.updated = False  # the optimizer stepped in the step in progress

    @property
    def live(self) -> bool:
        return self.prof is not None and self.prof.recording

    def start(self) -> profiler.Profiler | None:
        """Open the profile (once the framework has set up its process group)."""
        if self.prof is None:
            with self.guard():
                self.prof = profiler.profile(self.store, **self.options).start()
        return self.prof

    def watch(self, model: Any) -> None:
        if self.live:
            with self.guard():
                assert self.prof is not None
                self.prof.watch(model)

    def move(self, phase: str | None) -> None:
        """Close the open phase, open `phase` (None: leave none open)."""
        if not self.live or phase == self.open:
            return
        with self.guard():
            assert self.prof is not None
            if self.open is not None:
                self.prof.phase(self.open).__exit__(None, None, None)
                self.open = None
            if phase is not None:
                self.prof.phase(phase).__enter__()
                self.open = phase

    def batch(self, batch: Any) -> None:
        """A (micro-)batch arrived: the data wait is over, its samples count in this step."""
        self.move(None)
        with self.guard():
            self.samples += infer_samples(batch) or 0

    def end_step(self) -> None:
        """The optimizer update is done: the step ends, waiting for the next batch is data."""
        self.move(None)
        if not self.live:
            return
        with self.guard():
            assert self.prof is not None
            samples, self.samples, self.updated = self.samples, 0, False
            self.prof.step(samples or None)
        self.move("data")

    def log(self, **values: Any) -> None:
        if self.live:
            assert self.prof is not None
            self.prof.log(**values)

    def close(self) -> None:
        prof, self.prof, self.open = self.prof, None, None
        if prof is not None:
            prof.close()

    @contextlib.contextmanager
    def guard(self) -> Any:
        """Our own bookkeeping: an exception stops recording with one warning, never the training."""
        try:
            yield
        except Exception as exc:
            warn_once(
                f"perfscope-{self.who}-failed",
                f"perfscope {self.who}: recording stopped after an internal error "
                f"({type(exc).__name__}: {exc}); training continues unrecorded.",
            )
            prof, self.prof, self.open = self.prof, None, None
            if prof is not None:
                with contextlib.suppress(Exception):
                    prof.close()


def export_run(
    store: str | os.PathLike[str], run_id: str | None, tracker: str, destination: str | None
) -> None:
    """Send the finished run to a tracker (`perfscope report --to` for one run), from rank 0 once
    every rank has closed its profile. A failure is one warning: training has already finished."""
    if run_id is None:
        return
    try:
        from ..analysis import Selection
        from ..exporters.trackers import export, mlflow_note
        from ..store.open import open_store

        with open_store(store, warn=False) as st:
            export(st, tracker, destination, Selection(run_ids=(run_id,)))
        note = mlflow_note(destination) if tracker == "mlflow" else None
        if note:
            warn_once(
                f"perfscope-export-{tracker}-note", f"perfscope: the run was sent to {tracker}; {note}."
            )
    except Exception as exc:
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        warn_once(f"perfscope-export-{tracker}", f"perfscope: the run was not sent to {tracker} ({message}).")
