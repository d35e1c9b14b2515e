"""Writes rows into a store as immutable Parquet segments, encoded off the caller's thread.

Rows are buffered per table (bounded), handed to one background thread every `roll_interval_s`
or when a buffer fills, and written as `<table>/run_id=<run>/<writer>-<seq>.parquet` through a
temporary name and an atomic rename. A process killed mid-run loses at most the rows of the
current interval. A write that fails (full or read-only disk, a bug of ours) drops that batch
with one warning; the caller never sees an exception.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import warn_once
from .schema import PARTITION_KEY, TABLES

Row = Sequence[Any]

_STOP = object()


@dataclass
class WriterStats:
    rows_written: int = 0
    rows_dropped: int = 0
    segments_written: int = 0
    write_errors: int = 0


def segment_dir(root: str | os.PathLike[str], table: str, run_id: str) -> Path:
    return Path(root) / table / f"{PARTITION_KEY}={run_id}"


def write_segment(
    path: Path, table: pa.Table, *, compression: str = "zstd", row_group_size: int | None = None
) -> None:
    """Write `table` to `path` atomically: temporary hidden name, close, rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        pq.write_table(table, tmp, compression=compression, row_group_size=row_group_size)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rows_to_table(table: str, rows: list[Row]) -> pa.Table:
    schema = TABLES[table].arrow_schema
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(schema)
    if len(columns) != len(schema):
        raise ValueError(f"{table}: rows have {len(columns)} values, schema has {len(schema)}")
    arrays = [pa.array(col, type=field.type) for col, field in zip(columns, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)


class StoreWriter:
    """One writer per process and run. `append` is cheap and thread-safe; `close` flushes."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str,
        *,
        writer_id: str | None = None,
        roll_interval_s: float = 1.0,
        max_buffer_rows: int = 65_536,
        max_queued_batches: int = 16,
        compression: str = "zstd",
    ) -> None:
        if roll_interval_s <= 0:
            raise ValueError("roll_interval_s must be positive")
        self.root = Path(root)
        self.run_id = run_id
        self.writer_id = writer_id or f"p{os.getpid()}-{secrets.token_hex(3)}"
        self.roll_interval_s = roll_interval_s
        self.max_buffer_rows = max_buffer_rows
        self.compression = compression
        self.stats = WriterStats()
        self._bufs: dict[str, list[Row]] = {name: [] for name in TABLES}
        self._lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued_batches)
        self._seq = 0
        self._made_dirs: set[Path] = set()
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perfscope-writer", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------
    def append(self, table: str, row: Row) -> None:
        with self._lock:
            buf = self._bufs[table]
            buf.append(row)
            if len(buf) < self.max_buffer_rows:
                return
            self._bufs[table] = []
        self._enqueue((table, buf))

    def extend(self, table: str, rows: Iterable[Row]) -> None:
        with self._lock:
            buf = self._bufs[table]
            buf.extend(rows)
            if len(buf) < self.max_buffer_rows:
                return
            self._bufs[table] = []
        self._enqueue((table, buf))

    def write_arrow(self, table: str, data: pa.Table) -> None:
        """Queue a ready-made Arrow table (bulk producers such as the simulator)."""
        self._enqueue((table, data.select(list(TABLES[table].column_names))))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Hand every buffer to the writer thread and wait until it has written them."""
        self._swap_all()
        done = threading.Event()
        self._enqueue(done)
        done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> WriterStats:
        if self._closed:
            return self.stats
        self._closed = True
        self._swap_all()
        self._enqueue(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            warn_once(
                f"writer-stuck-{self.writer_id}",
                f"perfscope: the store writer for {self.root} did not finish within {timeout_s:.0f} s; "
                "the last rows of this run may be missing.",
            )
        if self.stats.rows_dropped:
            warn_once(
                f"writer-dropped-{self.writer_id}",
                f"perfscope: {self.stats.rows_dropped} rows could not be written to {self.root} "
                f"({self.stats.write_errors} failed segment writes); the training itself was not affected.",
            )
        return self.stats

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _swap_all(self) -> None:
        with self._lock:
            full = [(t, b) for t, b in self._bufs.items() if b]
            for t, _ in full:
                self._bufs[t] = []
        for item in full:
            self._enqueue(item)

    def _enqueue(self, item: Any) -> None:
        if not self._thread.is_alive():
            self._drop(item, "the writer thread has stopped")
            return
        try:
            # Backpressure only when the disk is far slower than the job produces rows.
            self._queue.put(item, timeout=10.0)
        except queue.Full:
            self._drop(item, "the writer fell more than 10 s behind")

    def _drop(self, item: Any, why: str) -> None:
        if isinstance(item, tuple):
            self.stats.rows_dropped += (
                len(item[1]) if isinstance(item[1], list) else item[1].num_rows
            )
            warn_once(
                f"writer-drop-{self.writer_id}-{why}",
                f"perfscope: dropping rows for {self.root}: {why}.",
            )
        elif isinstance(item, threading.Event):
            item.set()

    # -- writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        next_roll = time.monotonic() + self.roll_interval_s
        while True:
            timeout = max(0.0, next_roll - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if item is None:
                next_roll = time.monotonic() + self.roll_interval_s
                self._swap_all_from_thread()
                continue
            if item is _STOP:
                self._drain()
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            self._write(*item)

    def _swap_all_from_thread(self) -> None:
        with self._lock:
            full = [(t, b) for t, b in self._bufs.items() if b]
            for t, _ in full:
                self._bufs[t] = []
        for table, rows in full:
            self._write(table, rows)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                self._write(*item)
            elif isinstance(item, threading.Event):
                item.set()

    def _write(self, table: str, rows: list[Row] | pa.Table) -> None:
        n = len(rows) if isinstance(rows, list) else rows.num_rows
        try:
            data = rows if isinstance(rows, pa.Table) else rows_to_table(table, rows)
            directory = segment_dir(self.root, table, self.run_id)
            if directory not in self._made_dirs:
                directory.mkdir(parents=True, exist_ok=True)
                self._made_dirs.add(directory)
            self._seq += 1
            path = directory / f"{self.writer_id}-{self._seq:06d}.parquet"
            write_segment(path, data, compression=self.compression)
        except (
            Exception
        ) as exc:  # disk full, read-only store, a bug of ours: never the job's problem
            self.stats.rows_dropped += n
            self.stats.write_errors += 1
            warn_once(
                f"writer-error-{self.writer_id}",
                f"perfscope: could not write to the store {self.root} ({type(exc).__name__}: {exc}); "
                "rows of this run are being dropped, training continues. Free space or pick a "
                "writable folder for the store.",
            )
            return
        self.stats.rows_written += n
        self.stats.segments_written += 1
