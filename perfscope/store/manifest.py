"""The store's manifest: what was learnt from each Parquet segment's footer (table, schema version,
columns, rows, compaction claim, footprint, column ranges), keyed by the file's partition folder,
name, size and mtime_ns, so opening a store of 100,000 segments reads no footer it has read before.

It is `<store>/.perfscope-manifest`, an Arrow IPC file (zstd; folders, column lists and footprints
dictionary-encoded), entries sorted by folder and name. It stays in Arrow columns once loaded: a
partition folder whose files (names, sizes, mtime_ns) equal its entries, compared a folder at a time,
is listed as a `Entries` slice of those columns, and its Segment objects are made only when a caller
asks for them (`perfscope info` counts from the columns). It is written to a temporary name and
renamed, so a reader sees the old one or the new one, never half.

A cache, never a source of truth: a missing, truncated, foreign or other-version manifest is
ignored; an entry is used only for a file found in the folder whose size and mtime_ns match it,
so an entry cannot add a file or keep one that is gone, and a file without a matching entry is
read from its footer (a manifest cannot hide one). What it may still change is what a listing says
of a file whose name, size and mtime_ns it matches: the row count `perfscope info` shows, the
column ranges, which columns are selected, the schema version (a forged one above ours refuses the
store), the footprint (whether two files are taken for identical copies before their bytes are
compared). Queries always read the real file's rows, and a compaction claim it carries is checked
against the real bytes of the segments claimed, as a file's own claim is. Writing a matching entry
needs write access to the store, which lets one rewrite the segments themselves: it grants nothing
more.

Only immutable `.parquet` segments are kept; live `.arrows` segments are never entered.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from .segments import RANGE_COLUMNS, Segment, parse_replaces

MANIFEST_NAME = ".perfscope-manifest"
#: the format of the file; another value (an older or newer perfscope's) is ignored and rewritten
MANIFEST_VERSION = b"2"
_META_KEY = b"perfscope.manifest"
#: a manifest larger than this is not ours (100,000 entries take about 1 MB)
MANIFEST_MAX_BYTES = 1 << 28
#: opening a store saves the manifest only when it read at least this many footers the manifest
#: lacked (or dropped as many gone files): a write into the user's folder, only when it pays off
SAVE_MIN_CHANGES = 1000
_RANGE_FIELDS = tuple(f"{c}_{end}" for c in RANGE_COLUMNS for end in ("min", "max"))

_DICT = pa.dictionary(pa.int32(), pa.string())
_SCHEMA = pa.schema(
    [
        ("folder", _DICT),
        ("name", pa.string()),
        ("size_bytes", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("version", pa.int64()),
        ("columns", _DICT),
        ("num_rows", pa.int64()),
        ("replaces", pa.binary()),
        ("footprint", _DICT),
    ]
    + [(name, pa.int64()) for name in _RANGE_FIELDS]
)
#: what an entry must hold to be used (the claim and the ranges may be missing)
_REQUIRED = ("folder", "name", "size_bytes", "mtime_ns", "version", "columns", "num_rows", "footprint")


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
        t = reader.read_all().combine_chunks()
        t.validate(full=True)  # dictionary indices in range, offsets sane: a forged file fails here
        return t
    except Exception:  # truncated, corrupt, foreign: rebuilt from the files
        return None


def _valid(arr: pa.Array) -> np.ndarray:
    """Which values of `arr` are not null (its validity bitmap, unpacked)."""
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    bits = np.frombuffer(arr.buffers()[0], dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[arr.offset : arr.offset + len(arr)].astype(bool)


def _ints(arr: pa.Array) -> np.ndarray:
    """An int64 (or int32 dictionary index) array's values as numpy, whatever lies under its nulls
    (from its buffer: pyarrow's to_numpy imports pandas, 0.3 s and 45 MB)."""
    width = arr.type.bit_width // 8
    if not len(arr):
        return np.zeros(0, dtype=f"<i{width}")
    values = np.frombuffer(arr.buffers()[1], dtype=f"<i{width}", count=arr.offset + len(arr))
    return values[arr.offset :]


def _parse_columns(stored: str | None) -> frozenset[str] | None:
    """The column names an entry lists (a JSON list of strings), or None when it is not one."""
    try:
        names = json.loads(stored) if stored is not None else None
    except ValueError:
        return None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return None
    return frozenset(names)


class _Columns:
    """A loaded manifest's columns: numbers as numpy arrays, Python objects made a slice at a time."""

    def __init__(self, t: pa.Table):
        arrays = {
            name: t.column(name).chunk(0) if t.column(name).num_chunks else pa.array([], f.type)
            for name, f in zip(t.column_names, t.schema, strict=True)
        }
        self.names: pa.Array = arrays["name"]
        self.num_rows = _ints(arrays["num_rows"])
        self.versions = _ints(arrays["version"])
        self.mtimes = _ints(arrays["mtime_ns"])
        self.replaces: pa.Array = arrays["replaces"]
        self.ranges = [(_ints(arrays[n]), _valid(arrays[n])) for n in _RANGE_FIELDS]
        cols = arrays["columns"]
        self.columns = [_parse_columns(v) for v in cols.dictionary.to_pylist()]
        self.columns_index = _ints(cols.indices)
        fps = arrays["footprint"]
        self.footprint_index = _ints(fps.indices)
        self._footprints: pa.Array = fps.dictionary
        usable = self.num_rows >= 0
        for name in _REQUIRED:
            usable &= _valid(arrays[name])
        if None in self.columns:
            parsed = np.array([c is not None for c in self.columns], dtype=bool)
            usable &= parsed[np.clip(self.columns_index, 0, len(parsed) - 1)]
        self.usable = int(usable.sum())
        #: -1 where an entry cannot be used, so that it matches no file
        self.sizes = np.where(usable, _ints(arrays["size_bytes"]), -1)
        folders = arrays["folder"]
        index = np.where(_valid(folders), _ints(folders.indices), -1)
        folder_names = folders.dictionary.to_pylist()
        starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]]) if len(index) else index[:0]
        stops = np.r_[starts[1:], len(index)]
        #: relative folder -> (its first entry, the entry after its last); a folder whose entries are
        #: not all together (not a manifest we wrote) is not used
        self.folders: dict[str, tuple[int, int]] = {}
        twice: set[str] = set()
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            if index[a] >= 0:
                folder = folder_names[index[a]]
                twice.update([folder] if folder in self.folders else [])
                self.folders[folder] = (a, b)
        for folder in twice:
            del self.folders[folder]
        self._by_name: dict[str, dict[str, int]] = {}

    @functools.cached_property
    def footprints(self) -> list[str]:
        return self._footprints.to_pylist()

    def name_index(self, folder: str) -> dict[str, int]:
        """A folder's entries by file name (for a folder whose files do not all match them)."""
        found = self._by_name.get(folder)
        if found is None:
            a, b = self.folders[folder]
            found = self._by_name[folder] = {
                n: a + k for k, n in enumerate(self.names.slice(a, b - a).to_pylist())
            }
        return found


@dataclass(frozen=True, eq=False)
class Entries:
    """Entries `start` to `stop` of a loaded manifest: the segments of one partition folder, every
    file of which they match. Counted and summed as columns; Segment objects made on demand."""

    cols: _Columns = field(repr=False)
    start: int
    stop: int
    #: the partition folder, absolute, ending in a separator
    folder: str
    table: str

    def __len__(self) -> int:
        return self.stop - self.start

    def name(self, i: int) -> str:
        return str(self.cols.names[self.start + i].as_py())

    def names(self) -> list[str]:
        return self.cols.names.slice(self.start, len(self)).to_pylist()

    @property
    def num_rows(self) -> np.ndarray:
        return self.cols.num_rows[self.start : self.stop]

    @property
    def versions(self) -> np.ndarray:
        return self.cols.versions[self.start : self.stop]

    def range_of(self, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Smallest values, largest values, and where both are known with the smallest <= the largest."""
        k = 2 * RANGE_COLUMNS.index(column)
        (lo, lo_ok), (hi, hi_ok) = self.cols.ranges[k : k + 2]
        lo, hi = lo[self.start : self.stop], hi[self.start : self.stop]
        return lo, hi, lo_ok[self.start : self.stop] & hi_ok[self.start : self.stop] & (lo <= hi)

    @property
    def plain(self) -> bool:
        """No entry claims to replace segments and no two have the same footprint: nothing for the
        listing to check between the files of the folder."""
        fps = self.cols.footprint_index[self.start : self.stop]
        claims = self.cols.replaces.slice(self.start, len(self))
        return claims.null_count == len(self) and len(np.unique(fps)) == len(fps)

    def segments(self) -> list[Segment]:
        a, b = self.start, self.stop
        cols = self.cols
        names = self.names()
        claims = cols.replaces.slice(a, b - a)
        raws = [None] * (b - a) if claims.null_count == b - a else claims.to_pylist()
        parsed = [parse_replaces(r) if r is not None else ((), "") for r in raws]
        ends = [
            values[a:b].tolist()
            if ok[a:b].all()
            else [v if k else None for v, k in zip(values[a:b].tolist(), ok[a:b].tolist(), strict=True)]
            for values, ok in cols.ranges
        ]
        fps = cols.footprints
        return list(
            map(
                Segment,
                [self.folder + n for n in names],
                names,
                repeat(self.table),
                cols.versions[a:b].tolist(),
                [cols.columns[i] for i in cols.columns_index[a:b].tolist()],
                cols.num_rows[a:b].tolist(),
                [p[0] for p in parsed],
                [fps[i] for i in cols.footprint_index[a:b].tolist()],
                [p[1] for p in parsed],
                repeat(None),
                list(zip(*ends, strict=True)),
                raws,
            )
        )


@dataclass
class Manifest:
    """One store's manifest as loaded, and what a listing learnt beside it (to save)."""

    root: str
    _cols: _Columns | None = None
    #: Parquet segments the listing found one by one: (absolute path, size, mtime_ns, segment)
    seen: list[tuple[str, int, int, Segment]] = field(default_factory=list)
    #: partition folders the listing took whole from the manifest
    blocks: list[Entries] = field(default_factory=list)
    #: segments whose entry matched their file
    hits: int = 0

    @classmethod
    def load(cls, root: str) -> Manifest:
        """The store's manifest; an empty one when it is missing or unusable."""
        t = _read_table(manifest_path(root))
        try:
            return cls(root, _Columns(t) if t is not None else None)
        except Exception:  # valid Arrow, but not as we write it: rebuilt from the files
            return cls(root)

    def __len__(self) -> int:
        return self._cols.usable if self._cols is not None else 0

    @functools.cached_property
    def _prefix(self) -> str:
        return self.root + os.sep

    def _span(self, folder: str) -> tuple[int, int] | None:
        """Where the entries of partition `folder` (absolute, ending in a separator) lie."""
        cols = self._cols
        if cols is None or not folder.startswith(self._prefix):
            return None
        return cols.folders.get(folder[len(self._prefix) : -1])

    def match(
        self, folder: str, table: str, names: list[str], sizes: list[int], mtimes: list[int]
    ) -> Entries | None:
        """The entries of partition `folder` (absolute, ending in a separator), when they are exactly
        its Parquet files `names` (sorted) with these sizes and mtime_ns; else None."""
        cols = self._cols
        span = self._span(folder)
        if span is None or cols is None:
            return None
        a, b = span
        if (
            b - a != len(names)
            or cols.sizes[a:b].tolist() != sizes
            or cols.mtimes[a:b].tolist() != mtimes
            or cols.names.slice(a, b - a).to_pylist() != names
        ):
            return None
        return Entries(cols, a, b, folder, table)

    def take(self, entries: Entries) -> None:
        """Count matched entries the listing used as they are (hits, kept by the next save)."""
        self.blocks.append(entries)
        self.hits += len(entries)

    def _index(self, path: str, size: int, mtime_ns: int) -> int | None:
        cols = self._cols
        folder, _, name = path.rpartition(os.sep)
        if cols is None or not path.startswith(self._prefix):
            return None
        rel = folder[len(self._prefix) :]
        if rel not in cols.folders:
            return None
        i = cols.name_index(rel).get(name)
        return i if i is not None and cols.sizes[i] == size and cols.mtimes[i] == mtime_ns else None

    def folder(self, folder: str, table: str) -> dict[str, tuple[int, Segment]] | None:
        """Every entry of partition `folder` (absolute, ending in a separator) as a Segment, by file
        name, with its index, made at once: for a folder whose files do not all match its entries
        (a file added since), `lookup(..., known=)` then finds each without making one at a time.
        None when an entry cannot be made into one (each file is then looked up on its own)."""
        cols = self._cols
        span = self._span(folder)
        if span is None or cols is None:
            return {}
        a, b = span
        try:
            segs = Entries(cols, a, b, folder, table).segments()
        except Exception:  # an entry no save of ours wrote (no name, say): each file on its own
            return None
        return {seg.name: (a + k, seg) for k, seg in enumerate(segs)}

    def lookup(
        self,
        path: str,
        table: str,
        size: int,
        mtime_ns: int,
        known: dict[str, tuple[int, Segment]] | None = None,
    ) -> Segment | None:
        """The segment at `path` as its entry describes it, when the entry matches the file's size
        and mtime_ns; else None (read the footer). `known`: its folder's entries (`folder`)."""
        if known is not None and self._cols is not None:
            found = known.get(path[path.rfind(os.sep) + 1 :])
            if found is None:
                return None
            k, seg = found
            if self._cols.sizes[k] != size or self._cols.mtimes[k] != mtime_ns:
                return None
            self.hits += 1
            return seg
        i = self._index(path, size, mtime_ns)
        if i is None or self._cols is None:
            return None
        self.hits += 1
        folder = path[: path.rfind(os.sep) + 1]
        return Entries(self._cols, i, i + 1, folder, table).segments()[0]

    def confirm(self, path: str, size: int, mtime_ns: int) -> None:
        """Count a segment found in this process's cache whose entry matches too."""
        if self._index(path, size, mtime_ns) is not None:
            self.hits += 1

    def note(self, path: str, size: int, mtime_ns: int, seg: Segment) -> None:
        """Record a Parquet segment the listing found one by one, for the next save."""
        self.seen.append((path, size, mtime_ns, seg))

    @property
    def changes(self) -> int:
        """Entries a save would add or replace (footers read), and drop (files gone)."""
        found = len(self.seen) + sum(len(e) for e in self.blocks)
        return (found - self.hits) + (len(self) - self.hits)

    def save(self) -> bool:
        """Write the segments seen by the last listing as the store's manifest; False when the store
        cannot be written (a read-only store is read without one, silently)."""
        prefix = self._prefix
        rows: list[tuple[str, str, int, int, Segment]] = []
        for path, size, mtime_ns, seg in self.seen:
            if path.startswith(prefix):
                folder, _, name = path[len(prefix) :].rpartition(os.sep)
                rows.append((folder, name, size, mtime_ns, seg))
        for e in self.blocks:
            folder = e.folder[len(prefix) : -1]
            sizes, mtimes = e.cols.sizes[e.start : e.stop].tolist(), e.cols.mtimes[e.start : e.stop].tolist()
            rows += zip(repeat(folder), e.names(), sizes, mtimes, e.segments(), strict=False)
        rows.sort(key=lambda r: (r[0], r[1]))
        columns_json: dict[frozenset[str], str] = {}
        for r in rows:
            if r[4].columns not in columns_json:
                columns_json[r[4].columns] = json.dumps(sorted(r[4].columns))
        segs = [r[4] for r in rows]
        values: dict[str, list[Any]] = {
            "folder": [r[0] for r in rows],
            "name": [r[1] for r in rows],
            "size_bytes": [r[2] for r in rows],
            "mtime_ns": [r[3] for r in rows],
            "version": [s.version for s in segs],
            "columns": [columns_json[s.columns] for s in segs],
            "num_rows": [s.num_rows for s in segs],
            "replaces": [s.replaces_raw for s in segs],
            "footprint": [s.footprint for s in segs],
        }
        for k, name in enumerate(_RANGE_FIELDS):
            values[name] = [s.ranges[k] if len(s.ranges) > k else None for s in segs]
        arrays = [
            pa.array(values[f.name], pa.string()).dictionary_encode()
            if f.type == _DICT
            else pa.array(values[f.name], f.type)
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
