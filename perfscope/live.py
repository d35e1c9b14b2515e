"""The live segment format: an Arrow IPC stream a writer appends one record batch to per roll,
readable up to its last complete batch after a crash (a torn tail is the batch in flight).

`<stem>.arrows` is sealed into `<stem>.parquet`; from the moment that twin exists readers take it
instead. While its writer lives it holds an exclusive `flock` on the file, so `perfscope compact`
can tell a crashed writer's segment (seal it) from a running one's (leave it alone).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pyarrow as pa

LIVE_SUFFIX = ".arrows"
#: a file larger than this is not a live segment (writers seal theirs at 64 MiB by default)
LIVE_READ_MAX_BYTES = 1 << 30


def twin(path: Path) -> Path:
    """The sealed Parquet segment of the live segment `path`."""
    return path.with_suffix(".parquet")


class LiveSegment:
    """The writer's end of one live segment: created at the first batch, a batch per `append`."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.opened_s = time.monotonic()
        self.rows = 0
        self._file: pa.NativeFile | None = None
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None
        self._hold: int | None = None

    @property
    def size_bytes(self) -> int:
        return self._file.tell() if self._file is not None else 0

    def append(self, data: pa.Table) -> None:
        """Write `data` as record batches; each goes straight to the OS (no fsync: a SIGKILL keeps
        the page cache), so a reader sees it at once."""
        if self._stream is None:
            self._file = pa.OSFile(str(self.path), "wb")  # unbuffered: every write is a write(2)
            self._hold = _hold(self.path)
            self._stream = pa.ipc.new_stream(self._file, self.schema)
        self._stream.write_table(data)
        self.rows += data.num_rows

    def close(self) -> None:
        """End the stream and let go of the file (and of its lock)."""
        try:
            if self._stream is not None:
                self._stream.close()
        finally:
            if self._file is not None:
                self._file.close()
            if self._hold is not None:
                os.close(self._hold)
            self._stream = self._file = self._hold = None


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


def read_live(path: Path) -> pa.Table | None:
    """The complete record batches of the live segment at `path`, as one table (the stream's schema
    and metadata); None for an empty file (a writer killed before its first batch). A torn last
    batch is left out. Raises ValueError when the file is no readable Arrow IPC stream, OSError
    when it cannot be read."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > LIVE_READ_MAX_BYTES:
            raise ValueError(f"larger than {LIVE_READ_MAX_BYTES >> 20} MiB, which no live segment is")
        data = f.read(LIVE_READ_MAX_BYTES + 1)  # bounded even if it grows meanwhile
    if not data:
        return None
    if len(data) > LIVE_READ_MAX_BYTES:
        raise ValueError(f"larger than {LIVE_READ_MAX_BYTES >> 20} MiB, which no live segment is")
    try:
        # read from memory: a length in a hostile header past the end fails, it allocates nothing
        reader = pa.ipc.open_stream(pa.py_buffer(data))
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"not a readable Arrow IPC stream: {exc}") from None
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
