"""The store writer's thread gives the GIL back between the pieces of its own Python work (building
the held steps' rows, converting columns), so a pull never holds the training thread up for a whole
switch interval; on any other thread a pause is a no-op."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import perfscope
from perfscope.collectors.step_rows import PAUSE_EVERY_STEPS
from perfscope.store import writer as writer_mod
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

STEPS = 2_000


def test_a_pull_pauses_on_the_writer_thread_every_few_dozen_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    slept: list[str] = []
    original = StoreWriter.pause
    real_sleep = writer_mod.time.sleep

    def counted(self: StoreWriter) -> None:
        calls.append(threading.current_thread().name)
        original(self)

    def sleep(seconds: float) -> None:
        slept.append(threading.current_thread().name)
        real_sleep(seconds)

    monkeypatch.setattr(StoreWriter, "pause", counted)
    monkeypatch.setattr(writer_mod.time, "sleep", sleep)
    with perfscope.profile(tmp_path / "store", experiment="pause", batch_size=8, poll_hz=0) as prof:
        for _ in prof.steps(range(STEPS)):
            with prof.phase("forward"):
                pass
            prof.log(loss=1.0)
    steps = open_store(tmp_path / "store").query("SELECT count(*) AS n FROM steps").column("n")[0].as_py()
    assert steps == STEPS  # nothing lost to the pauses
    on_writer = [name for name in calls if name == "perfscope-writer"]
    # the rows of most steps are built on the writer's thread: at least one pause per PAUSE_EVERY_STEPS
    # of them, and one per column of every table it converts
    assert len(on_writer) >= STEPS // PAUSE_EVERY_STEPS // 2
    # it sleeps only there, never on the job's thread (a flush or close there pulls too)
    assert slept and set(slept) == {"perfscope-writer"}


def test_a_pause_off_the_writer_thread_does_not_sleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(writer_mod.time, "sleep", lambda s: slept.append(s))
    w = StoreWriter(tmp_path / "store", "run-pause")
    try:
        w.pause()
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(w.pause()))
        t.start()
        t.join()
    finally:
        w.close()
    assert slept == []
