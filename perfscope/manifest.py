"""The store's manifest: what was learnt from each Parquet segment's footer (table, schema version,
columns, rows, compaction claim, footprint, column ranges), keyed by the file's path in the store,
size and mtime_ns, so opening a store of 100,000 segments reads no footer it has read before.

It is `<store>/.perfscope-manifest`, an Arrow IPC file (zstd; column lists dictionary-encoded):
100,000 entries take about 1.4 MB and load in about 20 ms of CPU as a few columns, with no
per-entry parsing (JSON lines would parse every line) and without the Parquet reader, whose first
use alone costs a process about 50 MB. It is written to a temporary name and renamed, so a reader
sees the old one or the new one, never half.

A cache, never a source of truth: a missing, truncated, foreign or other-version manifest is
ignored; an entry is used only for a file found in the folder whose size and mtime_ns match it,
so an entry cannot add a file or keep one that is gone, and a file without a matching entry is
read from its footer (a manifest cannot hide one). What it may still change is what a listing says
of a file whose name, size and mtime_ns it matches: the row count `perfscope info` shows, the
column ranges, which columns are selected, the schema version (a forged one above ours refuses the
store). Queries always read the real file's rows, and a compaction claim it carries is checked
against the real bytes of the segments claimed, as a file's own claim is. Writing a matching entry
needs write access to the store, which lets one rewrite the segments themselves: it grants nothing
more.

Only immutable `.parquet` segments are kept; live `.arrows` segments are read afresh every time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.ipc

if TYPE_CHECKING:
    from collections.abc import Callable

    from .store import Replaced, Segment

MANIFEST_NAME = ".perfscope-manifest"
#: the format of the file; another value (a newer perfscope's) is ignored and rewritten
MANIFEST_VERSION = b"1"
_META_KEY = b"perfscope.manifest"
#: a manifest larger than this is not ours (100,000 entries take about 3 MB)
MANIFEST_MAX_BYTES = 1 << 28
#: opening a store saves the manifest only when it read at least this many footers the manifest
#: lacked (or dropped as many gone files): a write into the user's folder, only when it pays off
SAVE_MIN_CHANGES = 1000
#: columns whose smallest and largest values (from the footer statistics) are kept: `perfscope
#: info` takes ranks, first step and last step from them instead of reading every file
RANGE_COLUMNS = ("rank", "start_ns", "step_ns")

_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("size_bytes", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("version", pa.int64()),
        ("columns", pa.dictionary(pa.int32(), pa.string())),
        ("num_rows", pa.int64()),
        ("replaces", pa.binary()),
        ("footprint", pa.string()),
    ]
    + [(f"{c}_{end}", pa.int64()) for c in RANGE_COLUMNS for end in ("min", "max")]
)


class _Store:
    """store.py's Segment and claim parser, looked up once: store.py imports this module, so this one
    cannot import it at the top (and an import inside `lookup` costs more than the rest of it)."""

    @functools.cached_property
    def Segment(self) -> type[Segment]:
        from .store import Segment

        return Segment

    @functools.cached_property
    def parse_replaces(self) -> Callable[[bytes | None], tuple[tuple[Replaced, ...], str]]:
        from .store import _parse_replaces

        return _parse_replaces


_store = _Store()


_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


def manifest_path(root: str) -> str:
    return os.path.join(root, MANIFEST_NAME)


def _read_table(path: str) -> pa.Table | None:
    """The manifest's table, or None when there is none or it is not one we wrote (never follows a
    link, never blocks on a FIFO, never reads a huge file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MANIFEST_MAX_BYTES:
                return None
            data = f.read()
        reader = pa.ipc.open_file(pa.BufferReader(data))
        meta = reader.schema.metadata or {}
        if meta.get(_META_KEY) != MANIFEST_VERSION or not reader.schema.remove_metadata().equals(_SCHEMA):
            return None
        return reader.read_all()
    except Exception:  # truncated, corrupt, foreign: rebuilt from the files
        return None


#: what an entry holds, in the order `Manifest._entries` keeps it (all but the last required)
_ENTRY = ("size_bytes", "mtime_ns", "version", "columns", "num_rows", "footprint", "replaces")


@dataclass
class Manifest:
    """The entries of one store's manifest, and what a listing learnt beside them (to save)."""

    root: str
    #: relative path -> (size, mtime_ns, version, columns, num_rows, footprint, replaces, ranges)
    _entries: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: what the next save writes: (absolute path, size, mtime_ns, segment)
    seen: list[tuple[str, int, int, Segment]] = field(default_factory=list)
    #: segments whose entry matched their file
    hits: int = 0

    @classmethod
    def load(cls, root: str) -> Manifest:
        """The store's manifest; an empty one when it is missing or unusable. Entries with a missing
        field or a column list that is not one are dropped here, once."""
        m = cls(root)
        t = _read_table(manifest_path(root))
        if t is None:
            return m
        stored = t.column("columns").to_pylist()
        parsed = {v: _parse_columns(v) for v in set(stored) if v is not None}
        cols = [
            [parsed.get(v) for v in stored] if name == "columns" else t.column(name).to_pylist()
            for name in _ENTRY
        ]
        ends = [t.column(f"{c}_{end}").to_pylist() for c in RANGE_COLUMNS for end in ("min", "max")]
        rows = zip(*cols, zip(*ends, strict=True), strict=True)
        paths = t.column("path").to_pylist()
        if (
            t.column("path").null_count
            or any(t.column(n).null_count for n in _ENTRY[:-1])
            or None in parsed.values()
        ):
            m._entries = {
                p: row for p, row in zip(paths, rows, strict=True) if p is not None and None not in row[:6]
            }
        else:  # the usual case: nothing missing, no check per entry
            m._entries = dict(zip(paths, rows, strict=True))
        del t
        pa.default_memory_pool().release_unused()  # the table's buffers, back to the system
        return m

    def __len__(self) -> int:
        return len(self._entries)

    @functools.cached_property
    def _prefix(self) -> str:
        return self.root + os.sep

    def _entry(self, path: str, size: int, mtime_ns: int) -> tuple[Any, ...] | None:
        prefix = self._prefix
        e = self._entries.get(path[len(prefix) :]) if path.startswith(prefix) else None
        return e if e is not None and e[0] == size and e[1] == mtime_ns else None

    def lookup(self, path: str, table: str, size: int, mtime_ns: int) -> Segment | None:
        """The segment at `path` as its entry describes it, when the entry matches the file's size
        and mtime_ns; else None (read the footer)."""
        prefix = self._prefix
        e = self._entries.get(path[len(prefix) :]) if path.startswith(prefix) else None
        if e is None or e[0] != size or e[1] != mtime_ns or e[4] < 0:
            return None
        _, _, version, columns, num_rows, footprint, raw, ranges = e
        replaces, claim_problem = _store.parse_replaces(raw) if raw is not None else ((), "")
        self.hits += 1
        return _store.Segment(
            file=path,
            name=path[path.rfind(os.sep) + 1 :],
            table=table,
            version=version,
            columns=columns,
            num_rows=num_rows,
            replaces=replaces,
            footprint=footprint,
            claim_problem=claim_problem,
            ranges=ranges,
            replaces_raw=raw,
        )

    def confirm(self, path: str, size: int, mtime_ns: int) -> None:
        """Count a segment found in this process's cache whose entry matches too."""
        if self._entry(path, size, mtime_ns) is not None:
            self.hits += 1

    def note(self, path: str, size: int, mtime_ns: int, seg: Segment) -> None:
        """Record a Parquet segment the listing found, for the next save."""
        self.seen.append((path, size, mtime_ns, seg))

    @property
    def changes(self) -> int:
        """Entries a save would add or replace (footers read), and drop (files gone)."""
        return (len(self.seen) - self.hits) + (len(self._entries) - self.hits)

    def save(self) -> bool:
        """Write the segments seen by the last listing as the store's manifest; False when the store
        cannot be written (a read-only store is read without one, silently)."""
        prefix = self._prefix
        columns_json: dict[frozenset[str], str] = {}
        cols: dict[str, list[object]] = {name: [] for name in _SCHEMA.names}
        for path, size, mtime_ns, seg in sorted(self.seen, key=lambda x: x[0]):
            if not path.startswith(prefix):
                continue
            if seg.columns not in columns_json:
                columns_json[seg.columns] = json.dumps(sorted(seg.columns))
            values: dict[str, object] = {
                "path": path[len(prefix) :],
                "size_bytes": size,
                "mtime_ns": mtime_ns,
                "version": seg.version,
                "columns": columns_json[seg.columns],
                "num_rows": seg.num_rows,
                "replaces": seg.replaces_raw,
                "footprint": seg.footprint,
            }
            for k, col in enumerate(RANGE_COLUMNS):
                values[f"{col}_min"], values[f"{col}_max"] = seg.ranges[2 * k : 2 * k + 2] or (None, None)
            for name, v in values.items():
                cols[name].append(v)
        arrays = [
            pa.array(cols[f.name], pa.string()).dictionary_encode()
            if f.name == "columns"
            else pa.array(cols[f.name], f.type)
            for f in _SCHEMA
        ]
        table = pa.Table.from_arrays(arrays, schema=_SCHEMA.with_metadata({_META_KEY: MANIFEST_VERSION}))
        final = manifest_path(self.root)
        tmp = os.path.join(self.root, f"{MANIFEST_NAME}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f, pa.ipc.new_file(f, table.schema, options=_WRITE_OPTIONS) as w:
                w.write_table(table)
            os.replace(tmp, final)  # replaces a link itself, never what it points to
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True


def _parse_columns(stored: str) -> frozenset[str] | None:
    """The column names an entry lists (a JSON list of strings), or None when it is not one."""
    try:
        names = json.loads(stored)
    except ValueError:
        return None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return None
    return frozenset(names)
