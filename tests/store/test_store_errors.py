"""Bad input to the reader: corrupt, truncated and foreign files, empty and missing stores, versions."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from perfscope import PerfscopeWarning, StoreError, open_store
from perfscope.store.schema import META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES
from perfscope.store.writer import StoreWriter


def _step(rank: int, step: int) -> tuple[object, ...]:
    return (rank, step, step * 10, 10, 1, 2, 3, 1, 1, 2, 1, 1, 8, "host")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    with StoreWriter(tmp_path, "good") as w:
        for i in range(20):
            w.append("steps", _step(0, i))
    return tmp_path


def _one_segment(root: Path) -> Path:
    return next((root / "steps" / "run_id=good").glob("*.parquet"))


def _count(root: Path) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        with open_store(root) as s:
            return int(s.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py())


def test_truncated_file_is_skipped_and_named(store: Path) -> None:
    seg = _one_segment(store)
    bad = seg.with_name("truncated.parquet")
    bad.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])
    with pytest.warns(PerfscopeWarning, match="truncated.parquet"), open_store(store) as s:
        assert s.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == 20
        assert [Path(x.path).name for x in s.skipped] == ["truncated.parquet"]
        assert "truncated or corrupt" in s.skipped[0].reason


def test_garbage_file_is_skipped(store: Path) -> None:
    (store / "steps" / "run_id=good" / "garbage.parquet").write_bytes(b"PAR1 this is not parquet")
    assert _count(store) == 20


def test_corrupt_pages_with_valid_footer_do_not_break_a_query(store: Path) -> None:
    seg = _one_segment(store)
    data = bytearray(seg.read_bytes())
    bad = seg.with_name("flipped.parquet")
    # keep magic and footer, destroy the column data in the middle
    for i in range(8, len(data) // 2):
        data[i] = 0xFF
    bad.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PerfscopeWarning)
        with open_store(store) as s:
            n = s.query("SELECT count(*) AS n, sum(step_ns) AS t FROM steps").to_pylist()[0]
            names = [Path(x.path).name for x in s.skipped]
    # the good rows survive; the broken file is named, either at listing or at query time
    assert n["n"] >= 20 and "flipped.parquet" in names
    assert any("flipped.parquet" in str(w.message) for w in caught)


def test_foreign_parquet_file_is_skipped(store: Path) -> None:
    pq.write_table(pa.table({"x": [1, 2, 3]}), store / "steps" / "run_id=good" / "foreign.parquet")
    with pytest.warns(PerfscopeWarning, match="foreign Parquet file"):
        assert open_store(store).query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == 20


def test_file_of_another_table_and_stray_files_are_skipped(store: Path) -> None:
    shutil.copy(_one_segment(store), store / "steps" / "loose.parquet")
    (store / "metrics" / "run_id=good").mkdir(parents=True)
    shutil.copy(_one_segment(store), store / "metrics" / "run_id=good" / "wrong.parquet")
    with pytest.warns(PerfscopeWarning) as rec, open_store(store) as s:
        assert s.query("SELECT count(*) AS n FROM metrics").column("n")[0].as_py() == 0
    text = " ".join(str(r.message) for r in rec)
    assert "loose.parquet" in text and "wrong.parquet" in text


def test_missing_store_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"does not exist.*perfscope demo"):
        open_store(tmp_path / "nope")


def test_file_instead_of_folder(tmp_path: Path) -> None:
    f = tmp_path / "file.parquet"
    f.write_bytes(b"x")
    with pytest.raises(StoreError, match="is a file"):
        open_store(f)


def test_foreign_folder_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    with pytest.raises(StoreError, match="not a perfscope store"):
        open_store(tmp_path)


def test_empty_store_gets_a_clear_message_or_empty_views(tmp_path: Path) -> None:
    for name in TABLES:
        (tmp_path / name).mkdir()
    with pytest.raises(StoreError, match="holds no perfscope data"):
        open_store(tmp_path)
    with open_store(tmp_path, allow_empty=True) as s:
        for name in TABLES:
            t = s.query(f"SELECT * FROM {name}")
            assert t.num_rows == 0
            assert t.column_names == ["run_id", *TABLES[name].column_names]


def _with_version(src: Path, dst: Path, version: int, drop: str | None = None) -> None:
    t = pq.read_table(src, partitioning=None)
    if drop:
        t = t.drop_columns([drop])
    meta = {META_TABLE: b"steps", META_VERSION: str(version).encode()}
    pq.write_table(t.replace_schema_metadata(meta), dst)


def test_newer_schema_version_is_a_clear_error(store: Path) -> None:
    _with_version(_one_segment(store), store / "steps" / "run_id=good" / "v9.parquet", SCHEMA_VERSION + 1)
    with pytest.raises(StoreError) as err:
        open_store(store)
    msg = str(err.value)
    assert f"version {SCHEMA_VERSION + 1}" in msg and f"to {SCHEMA_VERSION}" in msg and "Upgrade" in msg


def test_older_unmigratable_version_is_a_clear_error(store: Path) -> None:
    _with_version(_one_segment(store), store / "steps" / "run_id=good" / "v0.parquet", 0)
    with pytest.raises(StoreError, match=r"version 0.*cannot migrate"):
        open_store(store)


def test_segment_missing_a_column_reads_it_as_null(tmp_path: Path) -> None:
    # the migration path: a column added since the segment was written reads as NULL
    with StoreWriter(tmp_path, "good") as w:
        w.append("steps", _step(0, 0))
    seg = _one_segment(tmp_path)
    _with_version(seg, seg.with_name("old.parquet"), SCHEMA_VERSION, drop="comm_count")
    seg.unlink()
    with open_store(tmp_path) as s:
        assert s.query("SELECT comm_count, step_ns FROM steps").to_pylist() == [
            {"comm_count": None, "step_ns": 10}
        ]


def test_read_only_queries_only(store: Path) -> None:
    from perfscope import PerfscopeError

    with open_store(store) as s:
        for bad in [
            "COPY steps TO 'x.csv'",
            "CREATE TABLE t AS SELECT 1",
            "DROP VIEW steps",
            "ATTACH 'x.db'",
            "SELECT 1; DELETE FROM steps",
        ]:
            with pytest.raises(PerfscopeError, match="only reading queries"):
                s.read_only_query(bad)
        # reading outside the store is refused by DuckDB itself
        with pytest.raises(PerfscopeError, match="only the store's tables may be read"):
            s.read_only_query("SELECT * FROM read_csv('/etc/hostname')")
        assert s.read_only_query("WITH x AS (SELECT 1 AS a) SELECT a FROM x").to_pylist() == [{"a": 1}]


def test_unwritable_store_never_raises_into_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import perfscope.store.writer as writer_mod

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod.LiveSegment, "append", full)  # every batch meets a full disk
    with pytest.warns(PerfscopeWarning) as rec:
        w = StoreWriter(tmp_path, "r", roll_interval_s=0.05)
        for i in range(100):
            w.append("steps", _step(0, i))
        w.flush()
        stats = w.close()
    assert stats.rows_dropped == 100 and stats.rows_written == 0
    # one warning when writing fails, one summary at close: never an exception
    messages = [str(r.message) for r in rec]
    assert any("No space left" in m for m in messages)
    assert any("100 rows could not be written" in m for m in messages)
