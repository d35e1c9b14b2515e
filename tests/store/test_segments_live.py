"""Live segments (`.arrows`): read up to the last complete batch, hidden by their sealed twin, hostile
ones skipped and named, sealed by `perfscope compact` only when their writer is gone, and a reader
never sees rows doubled or missing while segments are sealed and merged under it."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from perfscope import PerfscopeWarning, open_store
from perfscope.store import live as live_module
from perfscope.store.compact import compact
from perfscope.store.listing import list_store
from perfscope.store.live import LIVE_READ_MAX_BYTES, LiveSegment, read_live, twin, writer_alive
from perfscope.store.schema import TABLES
from perfscope.store.segments import write_segment
from perfscope.store.writer import StoreWriter, rows_to_table, segment_dir


def _step(rank: int, step: int) -> tuple[object, ...]:
    return (rank, step, 10**18 + step * 1_000_000, 1_000_000, 1, 2, 3, 4, 5, 6, 7, 1, 8, "host")


def _row(table: str, step: int) -> tuple[object, ...]:
    return _step(0, step) if table == "steps" else (0, step, step, "loss", 1.0)


def _live(root: Path, name: str, batches: list[range], table: str = "steps") -> Path:
    """A live segment written batch by batch, as a writer does, left open (no end marker)."""
    path = segment_dir(root, table, "r") / f"{name}.arrows"
    path.parent.mkdir(parents=True, exist_ok=True)
    seg = LiveSegment(path, TABLES[table].arrow_schema)
    for steps in batches:
        seg.append(rows_to_table(table, [_row(table, s) for s in steps]))
    # as a SIGKILL leaves it: no end-of-stream marker, its lock let go
    assert seg._file is not None and seg._hold is not None
    seg._file.close()
    os.close(seg._hold)
    return path


def _steps(root: Path) -> list[int]:
    with open_store(root) as store:
        return store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist()


def test_a_torn_tail_is_read_up_to_the_last_complete_batch(tmp_path: Path) -> None:
    path = _live(tmp_path, "w-000001", [range(0, 10), range(10, 20), range(20, 30)])
    whole = path.read_bytes()
    assert _steps(tmp_path) == list(range(30))
    last = len(whole)
    for cut in (last - 1, last - 100):  # the writer killed inside its third batch
        path.write_bytes(whole[:cut])
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerfscopeWarning)  # a torn tail is no error
            assert _steps(tmp_path) == list(range(20))
    path.write_bytes(b"")  # killed before its first batch: no rows, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerfscopeWarning)
        with open_store(tmp_path, allow_empty=True) as store:
            assert store.row_count("steps") == 0 and not store.skipped


def test_live_rows_are_read_while_the_writer_runs_and_sealed_at_close(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path, "r", roll_interval_s=0.05)
    for i in range(100):
        w.append("steps", _step(0, i))
    w.flush()
    part = segment_dir(tmp_path, "steps", "r")
    (live,) = part.glob("*.arrows")
    assert live.name.startswith(w.host_tag + "-")
    with open_store(tmp_path) as store:
        assert store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == 100
        # the user's SQL connection sees them too
        assert store.read_only_query("SELECT max(step) AS m FROM steps").column("m")[0].as_py() == 99
    w.close()
    assert not list(part.glob("*.arrows")) and [p.name for p in part.glob("*.parquet")] == [
        live.with_suffix(".parquet").name
    ]
    assert _steps(tmp_path) == list(range(100))


def test_a_sealed_twin_hides_its_live_segment_and_compact_removes_it(tmp_path: Path) -> None:
    path = _live(tmp_path, "w-000001", [range(0, 10), range(10, 20)])
    data = read_live(path)
    assert data is not None
    write_segment(twin(path), data)  # a writer killed between the rename and the unlink
    assert _steps(tmp_path) == list(range(20))  # counted once
    assert list_store(tmp_path).sealed_live == [path]
    result = compact(tmp_path, grace_s=0)
    assert result.live_sealed == [path] and not path.exists()
    assert _steps(tmp_path) == list(range(20))


def _hostile(root: Path) -> dict[str, str]:
    """Hostile files beside a good live segment: name -> what the skip reason must say."""
    part = segment_dir(root, "steps", "r")
    (part / "garbage.arrows").write_bytes(b"\x00" * 7 + os.urandom(500))
    metrics = _live(root, "other-table", [range(3)], table="metrics")  # a metrics stream ...
    os.replace(metrics, part / "other-table.arrows")  # ... in the steps folder
    foreign = pa.table({"step": pa.array([1, 2], pa.int64())})
    with pa.OSFile(str(part / "foreign.arrows"), "wb") as f, pa.ipc.new_stream(f, foreign.schema) as s:
        s.write_table(foreign)
    typed = TABLES["steps"].arrow_schema
    wrong = pa.schema(
        [f.with_type(pa.string()) if f.name == "step" else f for f in typed], metadata=typed.metadata
    )
    cols = [pa.array(["x"], pa.string()) if f.name == "step" else pa.nulls(1, f.type) for f in typed]
    with pa.OSFile(str(part / "wrong-type.arrows"), "wb") as f, pa.ipc.new_stream(f, wrong) as s:
        s.write_table(pa.Table.from_arrays(cols, schema=wrong))
    outside = root.parent / "outside.arrows"
    outside.write_bytes(_live(root, "source", [range(5)]).read_bytes())
    (part / "source.arrows").unlink()
    (part / "link.arrows").symlink_to(outside)
    with open(part / "huge.arrows", "wb") as f:
        f.truncate(LIVE_READ_MAX_BYTES + 1)  # sparse: no disk used
    (part / "folder.arrows").mkdir()
    # a garbage Parquet twin does not hide the live segment's rows
    (part / "w-000001.parquet").write_bytes(b"PAR1 not really")
    return {
        "garbage.arrows": "not a readable Arrow IPC stream",
        "other-table.arrows": "holds table 'metrics'",
        "foreign.arrows": "no perfscope metadata",
        "wrong-type.arrows": "column 'step' has type string",
        "link.arrows": "outside the store",
        "huge.arrows": "which no live segment is",
        "folder.arrows": "not a regular file",
        "w-000001.parquet": "not a readable Parquet file",
    }


def test_hostile_live_segments_are_skipped_and_named(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _live(root, "w-000001", [range(0, 10), range(10, 20)])
    expected = _hostile(root)
    with pytest.warns(PerfscopeWarning) as caught:
        store = open_store(root)
    with store:
        skipped = {Path(s.path).name: s.reason for s in store.skipped}
        assert store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist() == list(
            range(20)
        )
    for name, why in expected.items():
        assert why in skipped.get(name, ""), (name, skipped.get(name))
    text = "\n".join(str(w.message) for w in caught)
    assert all(name in text for name in expected)
    # compact leaves them all alone, and a live segment whose twin is garbage is not sealed over it
    result = compact(root, grace_s=0)
    assert all((segment_dir(root, "steps", "r") / n).exists() or n == "link.arrows" for n in expected)
    assert (segment_dir(root, "steps", "r") / "w-000001.arrows").exists()
    assert not (tmp_path / "outside.arrows.parquet").exists() and (tmp_path / "outside.arrows").exists()
    assert {Path(s.path).name for s in result.skipped} >= set(expected) - {"folder.arrows"}


CHILD = textwrap.dedent(
    """
    import sys
    from perfscope.store.writer import StoreWriter
    w = StoreWriter(sys.argv[1], "r", roll_interval_s=0.02, writer_id="killed")
    for i in range(500):
        w.append("steps", (1, i, 10**18 + i, 1, 1, 2, 3, 4, 5, 6, 7, 1, 8, "host"))
    w.flush()
    print("written", flush=True)
    sys.stdin.read()
    """
)


def test_compact_seals_a_killed_writers_live_segment_but_not_a_running_ones(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    running = StoreWriter(tmp_path, "r", roll_interval_s=0.02, writer_id="running")
    try:
        for i in range(50):
            running.append("steps", _step(0, i))
        running.flush()
        part = segment_dir(tmp_path, "steps", "r")
        (killed,) = part.glob("*-killed-*.arrows")
        (alive,) = part.glob("*-running-*.arrows")
        result = compact(tmp_path, grace_s=0)
        assert result.live_sealed == [killed] and not killed.exists() and twin(killed).exists()
        assert alive.exists() and not twin(alive).exists()
        with open_store(tmp_path) as store:
            got = store.query("SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank").to_pylist()
        assert got == [{"rank": 0, "n": 50}, {"rank": 1, "n": 500}]
    finally:
        running.close()


def test_a_reader_never_sees_doubled_or_missing_rows_while_segments_are_sealed_and_merged(
    tmp_path: Path,
) -> None:
    # a tiny seal size: a live segment is sealed every few batches, and compact merges the sealed ones
    w = StoreWriter(tmp_path, "r", roll_interval_s=0.01, live_max_bytes=4096)
    written = 0
    w.append("steps", _step(0, 0))
    w.flush()
    written = 1
    store = open_store(tmp_path)
    seen: list[tuple[int, int, int]] = []  # (rows flushed before, rows seen, distinct steps seen)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                before = written
                store.refresh()
                row = store.query("SELECT count(*) AS n, count(DISTINCT step) AS d FROM steps").to_pylist()[0]
                seen.append((before, row["n"], row["d"]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def compactor() -> None:
        while not stop.is_set():
            compact(tmp_path, grace_s=0.05)
            time.sleep(0.05)

    threads = [threading.Thread(target=reader), threading.Thread(target=compactor)]
    for t in threads:
        t.start()
    try:
        for i in range(1, 1500):
            w.append("steps", _step(0, i))
            if i % 100 == 0:
                w.flush()
                written = i + 1
                time.sleep(0.02)
    finally:
        w.close()
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert len(seen) > 5
    for before, n, d in seen:
        assert n == d, "a row was counted twice"
        assert n >= before, "rows flushed before the listing were missing"
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(seen))
    assert _steps(tmp_path) == list(range(1500))
    store.close()


def test_leftovers_know_the_merge_temporaries_and_never_take_a_live_segment(tmp_path: Path) -> None:
    from perfscope.store.leftovers import clean_leftovers

    part = segment_dir(tmp_path, "steps", "r")
    part.mkdir(parents=True)
    merging = part / ".c-h1a2b3c-0123456789ab.parquet.tmp"  # a closing writer's merge, killed
    sealing = part / ".h1a2b3c-w-000001.parquet.0badcafe.tmp"  # a seal, killed
    live = part / "h1a2b3c-w-000002.arrows"  # a killed writer's live segment: compact seals it
    for p in (merging, sealing, live):
        p.write_bytes(b"x")
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    assert set(clean_leftovers(tmp_path, temp_root=tmp_path / "none")) == {merging, sealing}
    assert live.exists()


def _compressed(path: Path, batches: list[pa.Table]) -> Path:
    """A steps stream whose record batches are zstd-compressed (perfscope's writer never does that)."""
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    schema = TABLES["steps"].arrow_schema
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, schema, options=options) as s:
        for batch in batches:
            s.write_table(batch)
    return path


def test_a_decompression_bomb_is_refused_unread_and_named_and_the_rest_still_reads(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _live(root, "w-000001", [range(0, 10), range(10, 20)])
    part = segment_dir(root, "steps", "r")
    same = rows_to_table("steps", [(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "")] * 65_536)
    bomb = _compressed(part / "bomb.arrows", [same] * 16)  # 84 MiB declared, a few KiB on disk
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(ValueError, match="decompression bomb"):
        read_live(bomb)
    # a single buffer that declares a terabyte: refused before Arrow allocates it
    liar = _compressed(part / "liar.arrows", [rows_to_table("steps", [_step(0, s) for s in range(20)])])
    data = bytearray(liar.read_bytes())
    prefix = (20 * 8).to_bytes(8, "little")  # the declared length of the `step` column's values
    at = data.index(prefix, data.index(b"\xff\xff\xff\xff", 8))  # in the batch's body
    data[at : at + 8] = (1 << 40).to_bytes(8, "little")
    liar.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="decompression bomb"):
        read_live(liar)
    # an honest compressed stream is read (bounded, not refused)
    honest = _compressed(
        tmp_path / "honest.arrows", [rows_to_table("steps", [_step(1, s) for s in range(30)])]
    )
    got = read_live(honest)
    assert got is not None and got.column("step").to_pylist() == list(range(30))
    with pytest.warns(PerfscopeWarning) as caught:
        store = open_store(root)
    with store:
        assert store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == 20
        reasons = {Path(s.path).name: s.reason for s in store.skipped}
    assert "decompression bomb" in reasons["bomb.arrows"] and "decompression bomb" in reasons["liar.arrows"]
    text = "\n".join(str(w.message) for w in caught)
    assert "bomb.arrows" in text and "liar.arrows" in text


def _open_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row_group_rows: int, batches: int
) -> LiveSegment:
    """A live segment of `batches` batches of 10 steps, its twin encoded alongside in row groups of
    at least `row_group_rows` rows, left open."""
    monkeypatch.setattr(live_module, "ROW_GROUP_ROWS", row_group_rows)
    path = segment_dir(tmp_path, "steps", "r") / "w-000001.arrows"
    path.parent.mkdir(parents=True)
    seg = LiveSegment(path, TABLES["steps"].arrow_schema)
    for start in range(0, 10 * batches, 10):
        seg.append(rows_to_table("steps", [_step(0, s) for s in range(start, start + 10)]))
    return seg


def test_a_sealed_segment_is_the_twin_encoded_alongside_in_row_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = _open_segment(tmp_path, monkeypatch, 25, 10)
    path = seg.path
    # the twin in progress is a hidden temporary: readers see the stream's rows, once
    (tmp,) = path.parent.glob(".*.tmp")
    assert _steps(tmp_path) == list(range(100))
    assert seg.seal() and not tmp.exists()
    meta = pq.read_metadata(twin(path))
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [30, 30, 30, 10]
    # a dictionary for the columns that repeat (text, small integers), not for times and sizes
    group = meta.row_group(0)
    dictionary = {
        group.column(i).path_in_schema
        for i in range(group.num_columns)
        if group.column(i).has_dictionary_page
    }
    assert dictionary == {"rank", "comm_count", "samples", "clock"}
    assert pq.read_table(twin(path)).equals(read_live(path))  # the same rows, schema and metadata
    path.unlink()
    assert _steps(tmp_path) == list(range(100))

    # a twin that cannot be encoded alongside: the writer seals from the stream, nothing is lost
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(live_module.pq, "ParquetWriter", broken)
    w = StoreWriter(tmp_path, "r2", roll_interval_s=0.02, merge_at_close=False)
    for i in range(60):
        w.append("steps", _step(2, i))
        if i % 10 == 9:
            w.flush()
    stats = w.close()
    assert stats.segments_written == 1 and stats.write_errors == 0
    assert not list(segment_dir(tmp_path, "steps", "r2").glob(".*"))
    with open_store(tmp_path) as store:
        got = store.query("SELECT step FROM steps WHERE rank = 2 ORDER BY step").column("step").to_pylist()
    assert got == list(range(60))


FORKING_WRITER = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from perfscope.store.writer import StoreWriter
    w = StoreWriter(sys.argv[1], "r", roll_interval_s=0.02, writer_id="forking")
    for i in range(500):
        w.append("steps", (1, i, 10**18 + i, 1, 1, 2, 3, 4, 5, 6, 7, 1, 8, "host"))
    w.flush()
    # a DataLoader worker: forked while the segment is live, it outlives its killed parent
    ctx = multiprocessing.get_context("fork")
    running = ctx.Event()

    def work():
        running.set()  # the fork handlers have run: the child's copy of the lock is let go
        time.sleep(120)

    worker = ctx.Process(target=work)
    worker.start()
    running.wait(60)
    print(worker.pid, flush=True)
    sys.stdin.read()
    """
)


def test_a_forked_worker_outliving_a_killed_writer_does_not_keep_its_segment_live(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_WRITER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    worker = int(proc.stdout.readline())
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(worker, 0)  # the worker is still running
        (path,) = segment_dir(tmp_path, "steps", "r").glob("*-forking-*.arrows")
        assert writer_alive(path) is False
        result = compact(tmp_path, grace_s=0)
        assert result.live_sealed == [path] and twin(path).exists()
        os.kill(worker, 0)
        assert _steps(tmp_path) == list(range(500))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_a_forked_child_never_writes_to_or_removes_its_parents_segment_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seg = _open_segment(tmp_path, monkeypatch, 10, 3)
    path = seg.path
    (tmp,) = path.parent.glob(".*.tmp")
    sizes = (path.stat().st_size, tmp.stat().st_size)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            # all a child could do to the copies it inherited: seal, close, let pyarrow finalize them
            seg.seal()
            seg.close()
            for obj in (seg._stream, seg._twin_writer, seg._file, seg._twin_file):
                if obj is not None:
                    obj.close()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (path.stat().st_size, tmp.stat().st_size) == sizes and writer_alive(path) is True
    assert seg.seal() and pq.read_metadata(twin(path)).num_rows == 30


def test_rows_appended_from_many_threads_land_whole_and_once(tmp_path: Path) -> None:
    # the buffers take no lock: many producers, tiny buffers, rolls and flushes all the time, and a
    # thread switch forced as often as the interpreter allows
    w = StoreWriter(tmp_path, "r", roll_interval_s=0.002, max_buffer_rows=50, merge_at_close=False)
    per_thread = 2_000

    def row(rank: int, step: int) -> tuple[object, ...]:
        return (rank, step, rank * 10**9 + step, step, 1, 2, 3, 4, 5, 6, 7, 1, rank, f"c{rank}")

    def produce(rank: int) -> None:
        for step in range(per_thread):
            if rank == 0:
                w.append("steps", row(rank, step))
            elif rank == 1:
                w.append("steps", list(row(rank, step)))  # not a tuple: made one
            elif step % 5 == 0:
                w.extend("steps", [row(rank, s) for s in range(step, step + 5)])
            if rank == 3 and step % 400 == 0:
                w.flush()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=produce, args=(rank,)) for rank in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    stats = w.close()
    assert stats.rows_dropped == 0 and stats.rows_written == 4 * per_thread
    with open_store(tmp_path) as store:
        got = store.query(
            "SELECT count(*) AS n, count(DISTINCT (rank, step)) AS d, "
            "count(*) FILTER (WHERE start_ns = rank::BIGINT * 1000000000 + step AND step_ns = step "
            "AND samples = rank AND clock = 'c' || rank) AS whole FROM steps"
        ).to_pylist()
    assert got == [{"n": 4 * per_thread, "d": 4 * per_thread, "whole": 4 * per_thread}]


KILLED_AT_UNLINK = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from perfscope.store.writer import StoreWriter
    unlink = Path.unlink
    def killed_before_the_live_segment_goes(self, missing_ok=False):
        if self.suffix == ".arrows":  # the twin is in place: killed before the segment is removed
            os.kill(os.getpid(), signal.SIGKILL)
        unlink(self, missing_ok=missing_ok)
    Path.unlink = killed_before_the_live_segment_goes
    w = StoreWriter(sys.argv[1], "r", writer_id="killed", merge_at_close=False)
    for i in range(500):
        w.append("steps", (1, i, 10**18 + i, 1, 1, 2, 3, 4, 5, 6, 7, 1, 8, "host"))
    w.close()
    """
)


def test_a_writer_killed_between_the_twins_rename_and_the_unlink_is_counted_once_after_merges(
    tmp_path: Path,
) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_UNLINK, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    part = segment_dir(tmp_path, "steps", "r")
    (killed,) = part.glob("*-killed-*.arrows")
    assert twin(killed).exists()
    # a writer of the same host closes and merges the host's sealed segments (a sealed twin of a
    # live segment still there among them, the live segment's rows were read again)
    with StoreWriter(tmp_path, "r", writer_id="later", live_max_bytes=1) as w:
        for i in range(50):
            w.append("steps", _step(0, i))
            w.flush()
    assert w.stats.files_merged >= 2

    def per_rank() -> list[dict[str, int]]:
        with open_store(tmp_path) as store:
            sql = "SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank"
            return store.query(sql).to_pylist()

    assert per_rank() == [{"rank": 0, "n": 50}, {"rank": 1, "n": 500}]
    compact(tmp_path, grace_s=0)
    assert not killed.exists()
    assert per_rank() == [{"rank": 0, "n": 50}, {"rank": 1, "n": 500}]


def test_two_takes_of_a_buffer_racing_neither_double_nor_lose_rows(tmp_path: Path) -> None:
    # the job's thread hands a full buffer over while the writer thread takes it at a roll: the
    # second take is let run between the first one's copy and its delete (a thread switch there,
    # forced; it finishes at once unless the takes are one at a time), and a producer appends a row
    w = StoreWriter(tmp_path, "r", roll_interval_s=3600, merge_at_close=False, prompt_tables=())

    class Preempted(list[Any]):
        armed = True

        def __getitem__(self, index: Any) -> Any:
            copy = super().__getitem__(index)
            if isinstance(index, slice) and Preempted.armed:
                Preempted.armed = False
                others.append(threading.Thread(target=w._hand_over, args=("steps",)))
                others[0].start()
                others[0].join(2.0)
                w.append("steps", _step(0, 99))
            return copy

    others: list[threading.Thread] = []
    w._bufs["steps"] = buf = Preempted()
    for i in range(3):
        buf.extend(_step(0, i))
    w._hand_over("steps")
    others[0].join()
    stats = w.close()
    assert stats.rows_written == 4
    assert _steps(tmp_path) == [0, 1, 2, 99]


def test_a_seal_read_back_from_the_stream_holds_the_lock_until_its_twin_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the twin encoded alongside is lost (a cleaner took its temporary file), so the seal reads the
    # stream back; a `perfscope compact` running right then must not seal and merge the segment too
    from perfscope.store import writer as writer_module

    monkeypatch.setattr(live_module, "ROW_GROUP_ROWS", 10)
    with StoreWriter(tmp_path, "r", writer_id="before", merge_at_close=False) as before:
        for i in range(20):
            before.append("steps", _step(1, i))
    w = StoreWriter(tmp_path, "r", writer_id="sealing", merge_at_close=False)
    for i in range(50):
        w.append("steps", _step(0, i))
    w.flush()
    (lost,) = segment_dir(tmp_path, "steps", "r").glob(".*.tmp")
    lost.unlink()
    real = writer_module.write_segment

    def compact_first(*args: Any, **kwargs: Any) -> None:
        compact(tmp_path, grace_s=0)
        real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_segment", compact_first)
    assert w.close().segments_written == 1
    with open_store(tmp_path) as store:
        got = store.query("SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank").to_pylist()
    assert got == [{"rank": 0, "n": 50}, {"rank": 1, "n": 20}]
