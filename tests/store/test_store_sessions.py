"""One open store shared by many dashboard sessions (issue 25): a refresh that finds nothing new
changes nothing, and a refresh that does find something never takes away what another session's
analysis is still using."""

from __future__ import annotations

import threading
from pathlib import Path

from storegen import make_run

from perfscope.analysis import Selection
from perfscope.analysis.cache import store_cache, temp_table
from perfscope.analysis.registry import ANALYSES, run_analysis
from perfscope.store.open import open_store


def test_a_refresh_that_finds_nothing_new_keeps_the_listing_and_the_temp_tables(tmp_path: Path) -> None:
    make_run(tmp_path, "a", world_size=2, steps=30)
    with open_store(tmp_path) as store:
        name = temp_table(store, "probe", "SELECT 1 AS x")
        listing = store.listing
        for _ in range(3):
            store.refresh()
        assert store.listing is listing
        assert store_cache(store).listing is listing
        assert store.query(f"SELECT x FROM {name}").column(0).to_pylist() == [1]


def _analyses_while(store, changing: threading.Thread, stop: threading.Event) -> list[str]:  # type: ignore[no-untyped-def]
    """Every analysis, over and over from two threads (two sessions), while `changing` runs."""
    errors: list[str] = []

    def session(offset: int) -> None:
        names = sorted(ANALYSES)
        i = offset
        while not stop.is_set():
            name = names[i % len(names)]
            i += 1
            try:
                # a new Selection each time: computed, not served from the memo
                run_analysis(name, store, Selection(warmup_steps=i % 7))
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")

    sessions = [threading.Thread(target=session, args=(k,)) for k in (0, 5)]
    for t in (*sessions, changing):
        t.start()
    changing.join()
    stop.set()
    for t in sessions:
        t.join()
    return errors


def test_live_refreshes_of_an_unchanged_store_break_no_other_session(tmp_path: Path) -> None:
    make_run(tmp_path, "a", world_size=2, steps=30)
    make_run(tmp_path, "b", world_size=4, steps=30)
    with open_store(tmp_path) as store:
        stop = threading.Event()

        def live() -> None:
            for _ in range(60):
                store.refresh()
                stop.wait(0.02)

        errors = _analyses_while(store, threading.Thread(target=live), stop)
    assert errors == []


def test_new_runs_arriving_mid_analysis_break_no_other_session(tmp_path: Path) -> None:
    make_run(tmp_path, "a", world_size=2, steps=30)
    with open_store(tmp_path) as store:
        stop = threading.Event()

        def arriving() -> None:
            for k in range(6):
                make_run(tmp_path, f"new{k}", world_size=2, steps=20)
                store.refresh()
                stop.wait(0.1)

        errors = _analyses_while(store, threading.Thread(target=arriving), stop)
        runs = store.query("SELECT count(DISTINCT run_id) FROM steps").column(0).to_pylist()
    assert errors == []
    assert runs == [7]
