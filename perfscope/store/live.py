"""The live segment format: an Arrow IPC stream a writer appends one record batch to per roll,
readable up to its last complete batch after a crash (a torn tail is the batch in flight).

`<stem>.arrows` is sealed into `<stem>.parquet`; from the moment that twin exists readers take it
instead. The writer encodes the twin as the rows arrive (a Parquet file under a temporary hidden
name, a row group per ROW_GROUP_ROWS rows or ROW_GROUP_BYTES), so sealing is a footer and a
rename; the IPC stream stays the crash-safe record (a killed writer's is sealed from it by
`perfscope compact`). While its writer lives it holds an exclusive `flock` on the file, so
`perfscope compact` can tell a crashed writer's segment (seal it) from a running one's (leave it
alone); a forked child (a DataLoader worker) lets go of its copy of that lock at once, so it never
keeps a killed writer's segment "live". Reading a segment is bounded in memory: its compressed
batches may not declare more bytes than `decoded_max_bytes` (a decompression bomb is refused, not
decoded).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import struct
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

LIVE_SUFFIX = ".arrows"
#: a file larger than this is not a live segment (writers seal theirs at 64 MiB by default)
LIVE_READ_MAX_BYTES = 1 << 30
#: rows of a Parquet row group of a sealed segment (the last one holds the rest)
ROW_GROUP_ROWS = 131_072
#: ... or of this many bytes of Arrow data, whichever comes first (what a segment holds in memory)
ROW_GROUP_BYTES = 16 << 20


def twin(path: Path) -> Path:
    """The sealed Parquet segment of the live segment `path`."""
    return path.with_suffix(".parquet")


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns a Parquet segment dictionary-encodes: text and integers of at most 32 bits (names,
    ranks, counts), which repeat. 64-bit times and sizes and floats rarely do: trying costs more CPU
    than the rest of the encoding, and the file comes out no smaller."""
    return [
        f.name
        for f in schema
        if pa.types.is_string(f.type) or (pa.types.is_integer(f.type) and f.type.bit_width <= 32)
    ]


def decoded_max_bytes(file_bytes: int) -> int:
    """What the compressed batches of a live segment of `file_bytes` may declare, in all, as their
    decompressed size: 16 times the file, at least 16 MiB, at most LIVE_READ_MAX_BYTES. (Writers of
    perfscope write no compressed batch; a ratio beyond this is a bomb, not data.)"""
    return min(LIVE_READ_MAX_BYTES, max(16 * file_bytes, 16 << 20))


#: the live segments of this process with files open (made harmless in a forked child: _after_fork)
_OPEN: weakref.WeakSet[LiveSegment] = weakref.WeakSet()


class LiveSegment:
    """The writer's end of one live segment: created at the first batch, a batch per `append`,
    its Parquet twin encoded alongside and renamed into place by `seal`."""

    def __init__(self, path: Path, schema: pa.Schema, *, compression: str = "snappy") -> None:
        self.path = path
        self.schema = schema
        self.compression = compression
        self.opened_s = time.monotonic()
        self.rows = 0
        self._file: pa.NativeFile | None = None
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None
        self._hold: int | None = None
        # the twin in progress: rows not yet in a row group, then the open Parquet file under a
        # temporary hidden name; `_twin_ok` False once it failed (the seal reads the stream back)
        self._pending: list[pa.Table] = []
        self._pending_rows = self._pending_bytes = 0
        self._twin_file: pa.NativeFile | None = None
        self._twin_writer: pq.ParquetWriter | None = None
        self._twin_ok = True
        self._forked = False  # a forked child's copy: never touches the parent's files
        self._twin_tmp = path.with_name(f".{twin(path).name}.{secrets.token_hex(4)}.tmp")

    @property
    def size_bytes(self) -> int:
        return self._file.tell() if self._file is not None else 0

    def append(self, data: pa.Table) -> None:
        """Write `data` as record batches; each goes straight to the OS (no fsync: a SIGKILL keeps
        the page cache), so a reader sees it at once. Then hand it to the twin in progress."""
        if self._stream is None:
            self._file = pa.OSFile(str(self.path), "wb")  # unbuffered: every write is a write(2)
            _OPEN.add(self)
            self._hold = _hold(self.path)
            self._stream = pa.ipc.new_stream(self._file, self.schema)
        self._stream.write_table(data)
        self.rows += data.num_rows
        if self._twin_ok:
            self._pending.append(data)
            self._pending_rows += data.num_rows
            self._pending_bytes += data.nbytes
            if self._pending_rows >= ROW_GROUP_ROWS or self._pending_bytes >= ROW_GROUP_BYTES:
                self._row_group()

    def _row_group(self) -> None:
        """Encode the pending rows as one row group of the twin (pyarrow does it off the GIL); a
        failure only means the seal reads the stream back."""
        data = pa.concat_tables(self._pending)
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0
        try:
            if self._twin_writer is None:
                self._twin_file = pa.OSFile(str(self._twin_tmp), "wb")
                self._twin_writer = pq.ParquetWriter(
                    self._twin_file,
                    self.schema,
                    compression=self.compression,
                    use_dictionary=dictionary_columns(self.schema),
                )
            self._twin_writer.write_table(data, row_group_size=max(1, min(data.num_rows, 1 << 20)))
        except Exception:
            self._drop_twin()

    def _close_twin(self) -> None:
        try:
            if self._twin_writer is not None:
                self._twin_writer.close()  # the footer
        finally:
            self._twin_writer = None
            if self._twin_file is not None:
                self._twin_file.close()
                self._twin_file = None

    def _drop_twin(self) -> None:
        self._twin_ok, self._pending, self._pending_rows, self._pending_bytes = False, [], 0, 0
        with contextlib.suppress(Exception):
            self._close_twin()
        with contextlib.suppress(OSError):
            self._twin_tmp.unlink(missing_ok=True)

    def seal(self) -> bool:
        """End the stream, finish the twin and rename it into place, then let go of the lock (so
        `perfscope compact` never seals it meanwhile). False, the twin dropped, when it could not be
        encoded alongside or the segment has no rows: the caller seals from the stream instead, and
        then calls `close` (the lock is held until then, for the same reason)."""
        if self._forked:
            return False
        try:
            self._end_stream()
            if not self._twin_ok or not self.rows:
                self._drop_twin()
                return False
            if self._pending_rows:
                self._row_group()
            if not self._twin_ok:
                return False
            self._close_twin()
            os.replace(self._twin_tmp, twin(self.path))
        except Exception:
            self._drop_twin()
            return False
        self._let_go()
        _OPEN.discard(self)
        self._twin_ok = False
        return True

    def _end_stream(self) -> None:
        try:
            if self._stream is not None:
                self._stream.close()
        finally:
            if self._file is not None:
                self._file.close()
            self._stream = self._file = None

    def _let_go(self) -> None:
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None

    def close_stream(self) -> None:
        """End the stream and let go of the file (and of its lock)."""
        try:
            self._end_stream()
        finally:
            self._let_go()

    def close(self) -> None:
        """Stop writing: end the stream, let go of its lock, drop the twin in progress (the stream's
        complete batches stay readable, for `perfscope compact` to seal)."""
        if self._forked:
            return
        try:
            self.close_stream()
        finally:
            self._drop_twin()
            _OPEN.discard(self)


def _after_fork() -> None:
    """In a forked child (a DataLoader worker): close the child's copy of each lock (never unlock:
    the lock belongs to the open file description the parent shares, and still holds) and point
    its copies of the segment files at /dev/null, so that nothing the child does or finalizes
    (pyarrow closes a Parquet writer it collects: a footer) reaches the parent's files. Without
    this a worker outliving a killed writer kept that writer's segments locked, "live"."""
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    for seg in list(_OPEN):
        if seg._hold is not None:
            with contextlib.suppress(OSError):
                os.close(seg._hold)
            seg._hold = None
        for f in (seg._file, seg._twin_file):
            if f is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(null, f.fileno(), inheritable=False)
        seg._forked = True
    _OPEN.clear()
    os.close(null)


os.register_at_fork(after_in_child=_after_fork)


def _hold(path: Path) -> int | None:
    """An exclusive lock on `path` for the writer's lifetime; None where the file system has no flock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def writer_alive(path: Path) -> bool | None:
    """Whether a live writer still holds `path`: True, False, or None when flock cannot tell."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


# -- reading: a hostile file is bounded ---------------------------------------------------------
# The few fields of Arrow's Message flatbuffer (format/Message.fbs) a decompression bound needs.
_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2  # MessageHeader union tags
_MAX_BUFFERS = 4096  # per batch: three per column at most, and a table of ours has under a hundred


class _Malformed(Exception):
    pass


def _field(buf: bytes, table: int, index: int) -> int | None:
    """The position of field `index` of the flatbuffer table at `table`; None when absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    (vt_size,) = struct.unpack_from("<H", buf, vtable)
    if 4 + 2 * index >= vt_size:
        return None
    (off,) = struct.unpack_from("<H", buf, vtable + 4 + 2 * index)
    return table + off if off else None


def _deref(buf: bytes, pos: int) -> int:
    return pos + struct.unpack_from("<I", buf, pos)[0]


def _declared_bytes(meta: bytes, body: pa.Buffer | None) -> int:
    """The decompressed size the compressed buffers of one IPC message declare (0 when it is not a
    compressed batch). Raises _Malformed where the metadata or the body does not add up."""
    try:
        msg = _deref(meta, 0)
        kind_at, header_at = _field(meta, msg, 1), _field(meta, msg, 2)
        kind = meta[kind_at] if kind_at is not None else 0
        if kind not in (_RECORD_BATCH, _DICTIONARY_BATCH) or header_at is None:
            return 0
        batch = _deref(meta, header_at)
        if kind == _DICTIONARY_BATCH:
            data_at = _field(meta, batch, 1)
            if data_at is None:
                return 0
            batch = _deref(meta, data_at)
        buffers_at = _field(meta, batch, 2)
        if _field(meta, batch, 3) is None or buffers_at is None:  # no BodyCompression: read in place
            return 0
        vec = _deref(meta, buffers_at)
        (count,) = struct.unpack_from("<I", meta, vec)
        if count > _MAX_BUFFERS:  # no table of ours comes near: a loop over millions is refused
            raise _Malformed
        total = 0
        for i in range(count):
            offset, length = struct.unpack_from("<qq", meta, vec + 4 + 16 * i)
            if length == 0:
                continue
            if body is None or offset < 0 or length < 8 or offset + length > body.size:
                raise _Malformed
            (size,) = struct.unpack_from("<q", body.slice(offset, 8).to_pybytes())
            if size < -1:
                raise _Malformed
            total += length - 8 if size == -1 else size  # -1: this buffer is stored uncompressed
        return total
    except (struct.error, IndexError):
        raise _Malformed from None


def _messages(data: pa.Buffer) -> Iterator[pa.ipc.Message]:
    """The complete messages of the stream in `data` (a torn tail ends it)."""
    reader = pa.ipc.MessageReader.open_stream(data)
    while True:
        try:
            yield reader.read_next_message()
        except StopIteration:
            return
        except (pa.ArrowException, OSError):
            return


def _check_decoded_size(data: pa.Buffer) -> None:
    """Refuse (ValueError) a stream whose compressed batches declare more than decoded_max_bytes."""
    budget, total = decoded_max_bytes(data.size), 0
    for message in _messages(data):
        try:
            total += _declared_bytes(message.metadata.to_pybytes(), message.body)
        except _Malformed:
            raise ValueError("a batch's compressed buffers do not add up") from None
        if total > budget:
            raise ValueError(
                f"its compressed batches declare over {budget >> 20} MiB decompressed, from a file of "
                f"{data.size:,} bytes: refused unread (a decompression bomb, not a live segment)"
            )


def read_live(path: Path) -> pa.Table | None:
    """The complete record batches of the live segment at `path`, as one table (the stream's schema
    and metadata); None for an empty file (a writer killed before its first batch). A torn last
    batch is left out. Raises ValueError when the file is no readable Arrow IPC stream (or would
    decompress beyond decoded_max_bytes), OSError when it cannot be read."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > LIVE_READ_MAX_BYTES:
            raise ValueError(f"larger than {LIVE_READ_MAX_BYTES >> 20} MiB, which no live segment is")
        data = f.read(LIVE_READ_MAX_BYTES + 1)  # bounded even if it grows meanwhile
    if not data:
        return None
    if len(data) > LIVE_READ_MAX_BYTES:
        raise ValueError(f"larger than {LIVE_READ_MAX_BYTES >> 20} MiB, which no live segment is")
    buf = pa.py_buffer(data)
    try:
        # read from memory: a length in a hostile header past the end fails, it allocates nothing
        reader = pa.ipc.open_stream(buf)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"not a readable Arrow IPC stream: {exc}") from None
    _check_decoded_size(buf)
    batches: list[pa.RecordBatch] = []
    while True:
        try:
            batch = reader.read_next_batch()
            batch.validate(full=True)  # buffers that do not make valid arrays end it too
        except StopIteration:
            break
        except (pa.ArrowException, OSError):
            break  # the batch a killed writer was writing
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)
