"""`perfscope compact` merges segments without a moment of missing or doubled data for readers."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from perfscope import StoreError, open_store
from perfscope.store.compact import compact
from perfscope.store.schema import META_REPLACES
from perfscope.store.writer import StoreWriter


def _fill(root: Path, runs: int = 3, segments: int = 6, rows: int = 50) -> int:
    total = 0
    for r in range(runs):
        # sealed at every batch and never merged at close: a store of many segments to compact
        with StoreWriter(root, f"run{r}", live_max_bytes=1, merge_at_close=False) as w:
            for s in range(segments):
                for i in range(rows):
                    step = s * rows + i
                    w.append("steps", (0, step, step, 7, 1, 1, 1, 1, 1, 1, 1, 1, 4, "host"))
                    w.append("metrics", (0, step, step, "loss", 1.0 / (step + 1)))
                w.flush()  # one segment per flush
                total += rows
    return total


def _segments(root: Path) -> list[Path]:
    return sorted(root.glob("*/run_id=*/*.parquet"))


def test_compact_merges_each_partition_into_one_file(tmp_path: Path) -> None:
    total = _fill(tmp_path)
    before = open_store(tmp_path).query("SELECT * FROM steps ORDER BY run_id, step")
    assert len(list(tmp_path.glob("steps/run_id=run0/*.parquet"))) == 6
    res = compact(tmp_path, grace_s=0)
    assert res.partitions == 6 and res.files_merged == 36 and res.files_written == 6
    assert res.rows == 2 * total
    for part in tmp_path.glob("[!_]*/run_id=*"):  # the tables (not _rollups, perfscope.store.rollups)
        files = list(part.glob("*.parquet"))
        assert len(files) == 1 and files[0].name.startswith("c-")
    after = open_store(tmp_path).query("SELECT * FROM steps ORDER BY run_id, step")
    assert after.equals(before)
    # a second compaction has nothing to do
    assert compact(tmp_path, grace_s=0).files_merged == 0


def test_reader_never_sees_missing_or_doubled_rows_during_compaction(tmp_path: Path) -> None:
    total = _fill(tmp_path, runs=2, segments=10, rows=30)
    store = open_store(tmp_path)
    seen: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                store.refresh()  # pick up whatever is in the folder right now
                seen.append(store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for k in range(12):
            # new segments keep arriving while compaction runs (distinct rows: identical copies count once)
            for r in range(2):
                with StoreWriter(tmp_path, f"run{r}") as w:
                    w.append("steps", (1, k, k, 7, 1, 1, 1, 1, 1, 1, 1, 1, 4, "host"))
                total += 1
            compact(tmp_path, grace_s=0.2)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert len(seen) > 3
    # counts only grow (new rows), never dip (missing) or overshoot (doubled)
    assert all(a <= b for a, b in itertools.pairwise(seen))
    assert max(seen) <= total
    assert store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == total


def test_stale_view_recovers_when_compaction_removes_its_files(tmp_path: Path) -> None:
    total = _fill(tmp_path, runs=1, segments=4, rows=10)
    store = open_store(tmp_path)  # views list the four segments
    compact(tmp_path, grace_s=0)  # ... which are now gone
    n = store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py()
    assert n == total


def test_interrupted_compaction_is_finished_by_the_next(tmp_path: Path) -> None:
    total = _fill(tmp_path, runs=1, segments=4, rows=10)
    segs = sorted((tmp_path / "steps" / "run_id=run0").glob("*.parquet"))
    # simulate a crash between writing the merged file and deleting its sources
    from perfscope.store.compact import _merge
    from perfscope.store.listing import list_store

    listing = list_store(tmp_path)
    _merge("steps", listing.segments["steps"], tmp_path / "steps" / "run_id=run0" / "c-crash.parquet")
    assert all(s.exists() for s in segs)
    meta = pq.read_metadata(tmp_path / "steps" / "run_id=run0" / "c-crash.parquet").metadata
    assert META_REPLACES in meta
    # readers already ignore the replaced segments: no doubling
    assert open_store(tmp_path).query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == total
    compact(tmp_path)
    assert not any(s.exists() for s in segs)
    assert open_store(tmp_path).query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == total


def test_compact_refuses_a_foreign_folder(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a perfscope store"):
        compact(tmp_path)
