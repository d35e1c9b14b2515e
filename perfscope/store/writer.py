"""Writes rows into a store: a live Arrow IPC segment per table, sealed into Parquet, off the job's thread.

Rows are buffered per table (bounded) and handed to one background thread every `roll_interval_s`
or when a buffer fills. The thread appends them as one record batch to the table's live segment
`<table>/run_id=<run>/<writer>-<seq>.arrows`, an Arrow IPC stream flushed to the OS at every batch,
which readers read up to its last complete batch: a process killed mid-run loses at most the rows
of the current interval. Its Parquet twin `<same stem>.parquet` is encoded as the batches come,
under a temporary name (perfscope.store.live); the segment is sealed at `live_max_bytes`, after
`live_max_age_s` and at close: the twin's footer written and renamed into place, then the segment
removed; readers ignore a `.arrows` whose `.parquet` twin exists. At close the sealed segments
this host wrote for the run are merged into one file per table (perfscope.store.compact, under the
store's lock, capped). The first rows of a prompt table (`steps`) are written at once rather than
at the next roll. A folder deleted under a running writer is made again (one warning). A write
that fails (full or read-only disk, a bug of ours) drops that batch with one warning; the caller
never sees an exception.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import warn_once
from . import leftovers
from .live import LIVE_SUFFIX, LiveSegment, read_live, twin
from .process_groups import GroupIds
from .schema import PARTITION_KEY, TABLES, run_id_size_problem
from .segments import LIVE_MAX_AGE_S, write_segment

Row = Sequence[Any]

_STOP = object()
_PULL = object()  # pull_soon(): take the sources' rows now

#: how often the writer thread looks for the first rows of a prompt table
FIRST_ROWS_POLL_S = 0.05
#: a live segment is sealed into Parquet once it is this large or this old
LIVE_MAX_BYTES = 64 << 20
#: close() merges this host's sealed files of a table of the run only up to this size (`perfscope
#: compact` does the rest: a merge re-encodes, about 4 s per 1M step rows on a loaded 2-core machine),
#: waiting at most MERGE_WAIT_S for another merge or compaction to finish: close() stays well within
#: its 30 s
MERGE_MAX_BYTES = 32 << 20
MERGE_WAIT_S = 10.0


def host_tag(hostname: str | None = None) -> str:
    """`h` and 6 hex digits of the host name's hash: leads every writer id, so the files one host
    wrote can be found (and merged) by name."""
    name = socket.gethostname() if hostname is None else hostname
    return "h" + hashlib.blake2b(name.encode(errors="replace"), digest_size=3).hexdigest()


@dataclass
class WriterStats:
    rows_written: int = 0
    rows_dropped: int = 0
    #: batches appended to live segments
    batches_written: int = 0
    #: live segments sealed into Parquet
    segments_written: int = 0
    write_errors: int = 0
    #: files the merge at close replaced (0 when it was skipped)
    files_merged: int = 0


def segment_dir(root: str | os.PathLike[str], table: str, run_id: str) -> Path:
    return Path(root) / table / f"{PARTITION_KEY}={run_id}"


#: numpy's dtype of each numeric Arrow type. Columns are built from buffers: pa.array and
#: DataType.to_pandas_dtype import pandas, seconds on a loaded machine before a job's first rows.
_NUMPY_DTYPES = {
    t: np.dtype(name)
    for t, name in (
        (pa.int8(), "int8"),
        (pa.int16(), "int16"),
        (pa.int32(), "int32"),
        (pa.int64(), "int64"),
        (pa.uint8(), "uint8"),
        (pa.uint16(), "uint16"),
        (pa.uint32(), "uint32"),
        (pa.uint64(), "uint64"),
        (pa.float32(), "float32"),
        (pa.float64(), "float64"),
    )
}


_BOOL = pa.bool_()


def _validity(values: list[Any]) -> Any:
    """The validity bitmap of `values` (a None is a NULL)."""
    mask = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    return pa.py_buffer(np.packbits(mask, bitorder="little"))


def _column(values: list[Any], typ: pa.DataType) -> pa.Array:
    # numpy converts a list of Python numbers several times faster than pa.array does; a None
    # is a NULL (a validity bitmap); an out-of-range value falls back to Arrow's own converter.
    # The common case (no NULL) is tried first: looking for a None costs as much as converting.
    n = len(values)
    dtype = _NUMPY_DTYPES.get(typ)
    if dtype is not None:
        # an int column refuses a None by itself; numpy reads a None into a float as NaN
        if dtype.kind != "f" or None not in values:
            try:
                # fromiter reads 64-bit timestamps about twice as fast as np.array does
                arr = np.fromiter(values, dtype=dtype, count=n)
                return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(arr)])
            except (TypeError, ValueError, OverflowError):
                pass
        if None not in values:
            return pa.array(values, type=typ)
        try:
            arr = np.fromiter((0 if v is None else v for v in values), dtype=dtype, count=n)
        except (TypeError, ValueError, OverflowError):
            return pa.array(values, type=typ)
        return pa.Array.from_buffers(typ, n, [_validity(values), pa.py_buffer(arr)])
    if typ == _BOOL and all(v.__class__ is bool or v is None for v in values):
        # comm.is_async: through pa.array, a run's first comm rows imported pandas on the writer's
        # thread (0.4 s of CPU holding the GIL; 3 s and more on a loaded machine: rows that late
        # were lost to a SIGKILL)
        bits = np.packbits(np.fromiter((v is True for v in values), dtype=bool, count=n), bitorder="little")
        valid = _validity(values) if None in values else None
        return pa.Array.from_buffers(typ, n, [valid, pa.py_buffer(bits)])
    if typ == pa.string():
        first = values[0] if n else None
        if type(first) is str and values.count(first) == n:  # one value throughout: a clock kind, a host
            try:
                one = first.encode()
            except UnicodeEncodeError:  # a lone surrogate: Arrow's converter says so
                return pa.array(values, type=typ)
            offsets = np.arange(n + 1, dtype=np.int64) * len(one)
            if offsets[-1] < 2**31:
                return pa.Array.from_buffers(
                    typ, n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(one * n)]
                )
        valid = _validity(values) if None in values else None
        texts = values if valid is None else [v or "" for v in values]
        try:
            lengths = np.fromiter(map(len, texts), dtype=np.int64, count=n)
            data = "".join(texts).encode()
        except (TypeError, UnicodeEncodeError):  # not text, or a lone surrogate
            return pa.array(values, type=typ)
        if len(data) != int(lengths.sum()):  # not all ASCII: lengths in bytes, one value at a time
            lengths = np.fromiter((len(t.encode()) for t in texts), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] < 2**31:
            buffers = [valid, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
            return pa.Array.from_buffers(typ, n, buffers)
    return pa.array(values, type=typ)


def flat_to_table(table: str, flat: list[Any]) -> pa.Table:
    """Rows laid end to end (`[r0c0, r0c1, ..., r1c0, ...]`) to an Arrow table of `table`'s schema."""
    schema = TABLES[table].arrow_schema
    width = len(schema)
    if len(flat) % width:
        raise ValueError(f"{table}: {len(flat)} values do not make whole rows of {width}")
    arrays = [_column(flat[i::width], field.type) for i, field in enumerate(schema)]
    return pa.Table.from_arrays(arrays, schema=schema)


def rows_to_table(table: str, rows: Iterable[Row]) -> pa.Table:
    width = len(TABLES[table].columns)
    flat: list[Any] = []
    for row in rows:
        if len(row) != width:
            raise ValueError(f"{table}: a row has {len(row)} values, the schema has {width}")
        flat.extend(row)
    return flat_to_table(table, flat)


class StoreWriter:
    """One writer per process and run. `append` is cheap and thread-safe; `close` flushes.

    Rows are tuples of a table's columns in schema order, without `run_id` (the partition key).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str,
        *,
        writer_id: str | None = None,
        roll_interval_s: float = 1.0,
        max_buffer_rows: int = 65_536,
        max_queued_batches: int = 4,
        compression: str = "snappy",
        prompt_tables: Iterable[str] = ("steps",),
        clean_leftovers: bool = False,
        live_max_bytes: int = LIVE_MAX_BYTES,
        live_max_age_s: float = LIVE_MAX_AGE_S,
        merge_at_close: bool = True,
    ) -> None:
        """`prompt_tables`: tables whose first rows are written within FIRST_ROWS_POLL_S instead of
        at the next roll. `clean_leftovers`: once running, remove temporary files that killed
        writers and compactions left in the store (see perfscope.store.leftovers). `live_max_bytes`,
        `live_max_age_s`: when a live segment is sealed. `merge_at_close`: merge this host's sealed
        segments of the run into one file per table at close. The writer id is prefixed with the
        host's tag (host_tag)."""
        if roll_interval_s <= 0:
            raise ValueError("roll_interval_s must be positive")
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"run_id {run_id!r} cannot name a folder")
        if problem := run_id_size_problem(run_id):  # refused here, not at every write that follows
            raise ValueError(problem)
        self.root = Path(root)
        self.run_id = run_id
        self.host_tag = host_tag()
        self.writer_id = f"{self.host_tag}-{writer_id or f'p{os.getpid()}-{secrets.token_hex(3)}'}"
        self.roll_interval_s = roll_interval_s
        self.live_max_bytes = live_max_bytes
        self.live_max_age_s = live_max_age_s
        self._merge_at_close = merge_at_close
        self._live: dict[str, LiveSegment] = {}
        self.compression = compression
        self.stats = WriterStats()
        self._width = {name: len(t.columns) for name, t in TABLES.items()}
        # rows laid end to end: one list append per value is cheaper than a list of tuples
        # to transpose later, and slicing recovers the columns at C speed. Never replaced, and
        # taken without a lock (see _take).
        self._bufs: dict[str, list[Any]] = {name: [] for name in TABLES}
        self._limit = {name: max_buffer_rows * w for name, w in self._width.items()}
        self._taking = threading.Lock()  # takers only (see _take); an append never waits on it
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued_batches)
        self._seq = 0
        self._made_dirs: set[Path] = set()
        self._not_yet_written = set(prompt_tables) & set(TABLES)
        self._clean_leftovers = clean_leftovers
        self._closed = False
        self._sources: list[tuple[Callable[[], Mapping[str, Any]], bool]] = []  # (pull, flat)
        self._groups = GroupIds()  # comm's members become ids, each group written once (process_groups)
        self._thread = threading.Thread(target=self._run, name="perfscope-writer", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------
    def append(self, table: str, row: Row) -> None:
        # the hot path of every recorded row: no lock (see _take)
        if type(row) is not tuple or len(row) != self._width[table]:
            fitted = self._fit(table, row)
            if fitted is None:
                return
            row = fitted
        buf = self._bufs[table]
        buf.extend(row)  # a tuple: one C call, so the row lands whole, never interleaved
        if len(buf) >= self._limit[table]:
            self._hand_over(table)

    def extend(self, table: str, rows: Iterable[Row]) -> None:
        good = self._whole(table, rows)
        if good and self._add(table, good):
            self._hand_over(table)

    def extend_flat(self, table: str, values: list[Any]) -> None:
        """Whole rows of `table` as one flat list of their values, row after row (add_source's `flat`)."""
        if values and self._add_flat(table, values):
            self._hand_over(table)

    def _whole(self, table: str, rows: Iterable[Row]) -> list[Row]:
        """`rows` as rows of the table's width: a row of another width (rare) is fitted or dropped.
        One row short in a buffer would shift every later one: its batch fails to write, all lost."""
        width = self._width[table]
        good: list[Row] = rows if isinstance(rows, list) else list(rows)
        if set(map(len, good)) - {width}:
            fitted = [r if len(r) == width else self._fit(table, r) for r in good]
            good = [r for r in fitted if r is not None]
        return good

    def add_source(self, pull: Callable[[], Mapping[str, Any]], *, flat: bool = False) -> None:
        """`pull()` returns rows by table, taken with the buffers (at each roll, flush and close) by
        whichever thread takes them: a producer that builds its rows late (the collector's step
        rows) builds them off its own thread. It must not raise. With `flat`, each table's rows come
        as one flat list of their values, row after row, each row of the table's full width (what
        the buffer holds: added in one C call, no tuple per row made or kept)."""
        self._sources.append((pull, flat))

    def pull_soon(self) -> None:
        """Have the writer thread take the sources' rows now, not at the next roll (cheap, never waits)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_PULL)

    def write_arrow(self, table: str, data: pa.Table) -> None:
        """Queue a ready-made Arrow table (bulk producers such as the simulator)."""
        schema = TABLES[table].arrow_schema
        for c in TABLES[table].columns[TABLES[table].min_width :]:  # added since version 1: NULL
            if c.name not in data.column_names:
                data = data.append_column(c.name, pa.nulls(len(data), c.type))
        self._enqueue((table, data.select(list(schema.names)).cast(schema)))

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

    def _fit(self, table: str, row: Row) -> Row | None:
        """The row as a tuple; a row written for an older schema, without the columns added since
        (they are NULL); None (and a warning) for a row of any other width."""
        if type(row) is not tuple:
            try:
                row = tuple(row)
            except Exception:
                self._bad_row(table, row)
                return None
        if len(row) == self._width[table]:
            return row
        if TABLES[table].min_width <= len(row) < self._width[table]:
            return tuple(row) + (None,) * (self._width[table] - len(row))
        self._bad_row(table, row)
        return None

    def _bad_row(self, table: str, row: Row) -> None:
        self.stats.rows_dropped += 1
        warn_once(
            f"writer-bad-row-{table}",
            f"perfscope: dropped a {table} row with {len(row)} values (the schema has "
            f"{self._width[table]}); this is a bug in the code that produced it.",
        )

    def _add(self, table: str, rows: Iterable[Row]) -> bool:
        """Add rows of `table`'s width to its buffer at once; whether it is full."""
        flat = list(chain.from_iterable(rows))  # built first: the extend below is one C call
        buf = self._bufs[table]
        buf.extend(flat)
        return len(buf) >= self._limit[table]

    def _add_flat(self, table: str, flat: list[Any]) -> bool:
        """Add whole rows given as one flat list of values to `table`'s buffer; whether it is full.
        A list that is not whole rows (a bug of its producer) is dropped: it would shift every row."""
        width = self._width[table]
        if len(flat) % width:
            self.stats.rows_dropped += len(flat) // width + 1
            warn_once(
                f"writer-bad-flat-{table}",
                f"perfscope: dropped {table} values that do not make whole rows of {width} values; "
                "this is a bug in the code that produced them.",
            )
            return False
        buf = self._bufs[table]
        buf.extend(flat)
        return len(buf) >= self._limit[table]

    def _take(self, table: str) -> list[Any]:
        """Remove and return the rows buffered for `table`, without a lock against appends: a copy,
        then a delete of exactly what was copied, each one C call (atomic under the GIL, and under the
        list's own lock without it), leave what any thread appends meanwhile for the next take. Appends
        are whole rows in one C call each (a tuple or a list), so a take holds whole rows. Two takes
        (a full buffer handed over on the job's thread, a roll on the writer's) are one at a time: one
        running between the other's copy and delete would double those rows and delete newer ones."""
        buf = self._bufs[table]
        with self._taking:
            flat = buf[:]
            del buf[: len(flat)]
        return flat

    def _hand_over(self, table: str) -> None:
        flat = self._take(table)
        if flat:  # another thread may have taken them first
            self._enqueue((table, flat))

    def _pull_sources(self) -> list[tuple[str, list[Any]]]:
        """Add the sources' rows to the buffers; returns the buffers this filled up, taken."""
        full = {
            table
            for pull, flat in self._sources
            for table, rows in pull().items()
            if (self._add_flat(table, rows) if flat else self._add(table, self._whole(table, rows)))
        }
        return [(t, flat) for t in full if (flat := self._take(t))]

    def _take_all(self) -> list[tuple[str, list[Any]]]:
        full = self._pull_sources()
        return full + [(t, flat) for t in self._bufs if (flat := self._take(t))]

    def _swap_all(self) -> None:
        for item in self._take_all():
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

    def _rows(self, table: str, data: list[Any] | pa.Table) -> int:
        return data.num_rows if isinstance(data, pa.Table) else len(data) // self._width[table]

    def _drop(self, item: Any, why: str) -> None:
        if isinstance(item, tuple):
            self.stats.rows_dropped += self._rows(*item)
            warn_once(
                f"writer-drop-{self.writer_id}-{why}", f"perfscope: dropping rows for {self.root}: {why}."
            )
        elif isinstance(item, threading.Event):
            item.set()

    # -- writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        _warm_up()
        next_roll = time.monotonic() + self.roll_interval_s
        while True:
            wait = next_roll - time.monotonic()
            if self._not_yet_written:
                wait = min(wait, FIRST_ROWS_POLL_S)
            try:
                item = self._queue.get(timeout=max(0.0, wait))
            except queue.Empty:
                # a read of the buffers without the lock: at worst one poll late
                first = any(self._bufs[t] for t in self._not_yet_written)
                if first or time.monotonic() >= next_roll:
                    next_roll = time.monotonic() + self.roll_interval_s
                    for table, flat in self._take_all():
                        self._write(table, flat)
                    self._seal_old()
                    if not first and self._clean_leftovers:
                        self._clean_leftovers = False
                        # its own thread: a scan of a large store must not hold up the segments
                        threading.Thread(
                            target=self._remove_leftovers, name="perfscope-leftovers", daemon=True
                        ).start()
                continue
            if item is _STOP:
                self._drain()
                # rows a pull on this thread added after close() took the buffers (pull_soon racing it)
                for table, flat in self._take_all():
                    self._write(table, flat)
                for table in list(self._live):
                    self._seal(table)
                self._merge_host()
                if self._clean_leftovers:  # a writer closed before its first roll
                    self._clean_leftovers = False
                    self._remove_leftovers()
                return
            if isinstance(item, threading.Event):  # flush(): also what a pull racing it added
                for table, flat in self._take_all():
                    self._write(table, flat)
                item.set()
                continue
            if item is _PULL:
                for table, flat in self._pull_sources():
                    self._write(table, flat)
                continue
            self._write(*item)

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

    def _remove_leftovers(self) -> None:
        """Once, after the first roll (or at close): off the path of the first segment."""
        # best effort: what is left is removed by the next start or compact
        with contextlib.suppress(Exception):
            leftovers.clean_leftovers(self.root)

    def _write(self, table: str, data: list[Any] | pa.Table) -> None:
        n = self._rows(table, data)
        self._not_yet_written.discard(table)  # tried: a failing disk is not retried every poll
        try:
            if table == "comm":  # the groups first: a call never names a group not yet written
                data, groups = self._groups.take_members(data)
                if groups:
                    self._write("process_groups", groups)
            arrow = data if isinstance(data, pa.Table) else flat_to_table(table, data)
            live = self._append(table, arrow)
        except Exception as exc:  # disk full, read-only store, a bug of ours: never the job's problem
            self.stats.rows_dropped += n
            self.stats.write_errors += 1
            self._abandon(table)
            warn_once(
                f"writer-error-{self.writer_id}",
                f"perfscope: could not write to the store {self.root} ({type(exc).__name__}: {exc}); "
                "rows of this run are being dropped, training continues. Free space or pick a "
                "writable folder for the store.",
            )
            return
        self.stats.rows_written += n
        self.stats.batches_written += 1
        if live.size_bytes >= self.live_max_bytes:
            self._seal(table)

    def _append(self, table: str, arrow: pa.Table) -> LiveSegment:
        """Append `arrow` to the table's live segment, opening one when there is none (or when
        someone deleted it, or its folder, under the running writer)."""
        live = self._live.get(table)
        if live is not None and not live.path.exists():
            self._abandon(table)  # its rows went with it; an open file would take the rest unseen
            self._folder_gone(live.path.parent)
            live = None
        if live is None:
            directory = segment_dir(self.root, table, self.run_id)
            if directory not in self._made_dirs:
                directory.mkdir(parents=True, exist_ok=True)
                self._made_dirs.add(directory)
            self._seq += 1
            path = directory / f"{self.writer_id}-{self._seq:06d}{LIVE_SUFFIX}"
            live = LiveSegment(path, TABLES[table].arrow_schema, compression=self.compression)
            self._live[table] = live
        try:
            live.append(arrow)
        except FileNotFoundError:
            if live.rows or live.path.parent.is_dir():
                raise
            # someone deleted the store or this table's folder: the rest of the run still counts
            self._folder_gone(live.path.parent)
            live.path.parent.mkdir(parents=True, exist_ok=True)
            live.append(arrow)
        return live

    def _folder_gone(self, directory: Path, *, remake: bool = True) -> None:
        if remake:
            directory.mkdir(parents=True, exist_ok=True)
        warn_once(
            f"writer-folder-gone-{self.writer_id}",
            f"perfscope: the store folder {directory} was deleted while the run was recording; "
            "made it again. Rows written before the deletion are gone, the rest are kept.",
        )

    def _abandon(self, table: str) -> None:
        """Stop appending to the table's live segment after a failure: its complete batches stay
        readable, and `perfscope compact` seals it."""
        live = self._live.pop(table, None)
        if live is not None:
            with contextlib.suppress(Exception):
                live.close()

    def _seal_old(self) -> None:
        now = time.monotonic()
        for table, live in list(self._live.items()):
            if now - live.opened_s >= self.live_max_age_s:
                self._seal(table)

    def _seal(self, table: str) -> None:
        """Put the table's live segment's Parquet twin in place (encoded as the rows came; read
        back from the stream when that failed), then remove the segment. On failure it stays
        readable, for `perfscope compact` to seal."""
        live = self._live.pop(table)
        try:
            if not live.path.exists():  # deleted under the running writer, with its rows
                live.close()
                self._folder_gone(live.path.parent, remake=False)
                return
            sealed = live.seal()
            if not sealed:
                try:
                    data = read_live(live.path)
                    if data is not None and data.num_rows:
                        write_segment(twin(live.path), data, compression=self.compression)
                        sealed = True
                finally:
                    live.close()  # the lock let go once the twin is in place
            self.stats.segments_written += int(sealed)
            live.path.unlink(missing_ok=True)
        except Exception as exc:
            self.stats.write_errors += 1
            warn_once(
                f"writer-seal-{self.writer_id}",
                f"perfscope: could not seal {live.path} into Parquet ({type(exc).__name__}: {exc}); "
                f"its rows stay readable, and `perfscope compact {self.root}` seals it later.",
            )

    def _merge_host(self) -> None:
        """Merge the sealed segments this host wrote for the run into one file per table; the last
        writer of a host to close leaves one. Skipped quietly when another process holds the store's
        lock too long or the store cannot be locked; any other failure is one warning."""
        if not self._merge_at_close or not self.stats.segments_written:
            return
        from .compact import compact_host  # DuckDB and the listing: imported only at close

        try:
            result = compact_host(
                self.root, self.run_id, self.host_tag, max_bytes=MERGE_MAX_BYTES, wait_s=MERGE_WAIT_S
            )
        except Exception as exc:
            warn_once(
                f"writer-merge-{self.writer_id}",
                f"perfscope: could not merge this run's segments in {self.root} ({type(exc).__name__}: "
                f"{exc}); they are all readable, and `perfscope compact {self.root}` merges them.",
            )
            return
        if result is not None:
            self.stats.files_merged = result.files_merged


def _warm_up() -> None:
    """Encode an empty batch in memory once: the first IPC write of a process pays for lazy
    initialisation, which should not delay the first rows. (Parquet, whose first write imports far
    more, is written only when a segment is sealed.)"""
    with contextlib.suppress(Exception):
        empty = flat_to_table("steps", [])  # Schema.empty_table would import pandas
        with pa.ipc.new_stream(pa.BufferOutputStream(), empty.schema) as stream:
            stream.write_table(empty)
