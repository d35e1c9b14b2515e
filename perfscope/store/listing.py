"""Lists a store: which segments are read, per table and partition (`list_store`, `Listing`), checked
against the untrusted folder, and the SQL of the DuckDB views over them (`create_views`); the open
store that holds a connection is reader.py.

A truncated, corrupt or foreign file is skipped and named; it never breaks a query. Nothing outside
the store's own folder is read. Live segments (`.arrows`, perfscope.store.live) are read up to their
last complete batch and registered on the connection beside the Parquet files.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StoreError, one_line, warn_once
from ..sizes import parse_size
from .live import LIVE_SUFFIX, read_live, twin
from .manifest import SAVE_MIN_CHANGES, Entries, Manifest
from .schema import (
    META_REPLACES,
    META_TABLE,
    META_VERSION,
    MIN_READABLE_VERSION,
    PARTITION_KEY,
    SCHEMA_VERSION,
    TABLES,
)
from .segments import RANGE_COLUMNS, Segment, SkippedFile, content_digest, parse_replaces

_DUCK_TYPES = {
    pa.int16(): "SMALLINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.string(): "VARCHAR",
    pa.bool_(): "BOOLEAN",
}


@dataclass(eq=False)
class Block:
    """The segments read of one partition folder: either a slice of the manifest's columns, whose
    Segment objects are made only when asked for (`perfscope info` counts and sums the columns), or
    Segment objects (footers read, live segments, compaction claims checked)."""

    #: the partition folder, absolute, ending in a separator
    folder: str
    _segments: list[Segment] | None = None
    entries: Entries | None = None

    def __len__(self) -> int:
        return len(self.entries) if self.entries is not None else len(self.segments())

    def segments(self) -> list[Segment]:
        if self._segments is None:
            assert self.entries is not None
            self._segments = self.entries.segments()
        return self._segments

    @property
    def live(self) -> bool:
        """Whether a live segment is among them (its rows may grow: no column range is final)."""
        return self.entries is None and any(s.live is not None for s in self.segments())

    @property
    def num_rows(self) -> np.ndarray:
        if self.entries is not None:
            return self.entries.num_rows
        return np.array([s.num_rows for s in self.segments()], dtype=np.int64)

    def range_of(self, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each segment's smallest and largest value of `column` (one of RANGE_COLUMNS), and where
        both are known (see Segment.range_of)."""
        if self.entries is not None:
            return self.entries.range_of(column)
        found = [s.range_of(column) for s in self.segments()]
        ok = np.array([r is not None for r in found], dtype=bool)
        lo = np.array([r[0] if r else 0 for r in found], dtype=np.int64)
        hi = np.array([r[1] if r else 0 for r in found], dtype=np.int64)
        return lo, hi, ok

    def file(self, i: int) -> str:
        """The `i`th segment's file."""
        if self.entries is not None and self._segments is None:
            return self.folder + self.entries.name(i)
        return self.segments()[i].file

    def files(self) -> list[str]:
        if self.entries is not None and self._segments is None:
            return [self.folder + n for n in self.entries.names()]
        return [s.file for s in self.segments()]


@dataclass
class Listing:
    #: per table, the segments read, a Block per partition folder
    blocks: dict[str, list[Block]] = field(default_factory=dict)
    skipped: list[SkippedFile] = field(default_factory=list)
    superseded: list[Path] = field(default_factory=list)
    #: replaced segment -> the compacted file whose checked claim hides it
    superseded_by: dict[Path, Path] = field(default_factory=dict)
    #: files that are read, but whose claim to replace other segments was ignored, and why
    doubtful: list[SkippedFile] = field(default_factory=list)
    #: live segments not read because their sealed Parquet twin is (a seal was interrupted, or is under way)
    sealed_live: list[Path] = field(default_factory=list)
    #: facts computed from this listing by the layers above (rollups.rollup_index), kept with it
    derived: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def segments(self) -> dict[str, list[Segment]]:
        """Every segment read, per table (made Segment objects here when the manifest described them)."""
        return {table: self.of(table) for table in self.blocks}

    def of(self, table: str) -> list[Segment]:
        """The segments read of one table."""
        return [seg for block in self.blocks.get(table, ()) for seg in block.segments()]

    def count(self, table: str) -> int:
        return sum(len(b) for b in self.blocks.get(table, ()))

    def row_count(self, table: str) -> int:
        return sum(int(b.num_rows.sum()) for b in self.blocks.get(table, ()))

    def live_segments(self) -> list[Segment]:
        return [
            s
            for blocks in self.blocks.values()
            for b in blocks
            if b.live
            for s in b.segments()
            if s.live is not None
        ]

    def signature(self) -> tuple[object, ...]:
        """What a refresh compares with the listing before: the files read per table, their rows and
        footprints (a live segment's rows grow), and the files skipped, doubted or superseded."""
        read = tuple(
            (
                table,
                b.folder,
                tuple(b.entries.names())
                if b.entries is not None and b._segments is None
                else tuple((s.file, s.footprint) for s in b.segments()),
                b.num_rows.tobytes(),
            )
            for table, blocks in sorted(self.blocks.items())
            for b in blocks
        )
        others = (self.skipped, self.doubtful, self.superseded, self.superseded_by, self.sealed_live)
        return (read, *(repr(o) for o in others))

    def reread(self, table: str) -> None:
        """Take the facts of `table`'s Parquet segments from their footers, not from the manifest: a
        view over them failed to bind (an entry named a column its file lacks)."""
        blocks = self.blocks.get(table, [])
        for k, b in enumerate(blocks):
            found: list[Segment] = []
            for seg in b.segments():
                _admit(seg if seg.live is not None else _inspect_uncached(seg.path, table), self, found)
            blocks[k] = Block(b.folder, _partition_segments(found, self))

    def drop(self, files: set[str] | dict[str, str]) -> None:
        """Leave `files` out of the segments read."""
        for blocks in self.blocks.values():
            for k, b in enumerate(blocks):
                if any(f.startswith(b.folder) for f in files) and any(s.file in files for s in b.segments()):
                    blocks[k] = Block(b.folder, [s for s in b.segments() if s.file not in files])


# (path, size, mtime_ns) -> Segment | SkippedFile; files are immutable once renamed into place.
_inspect_cache: dict[tuple[str, int, int], Segment | SkippedFile] = {}
_cache_lock = threading.Lock()
#: live segment's path -> (size, mtime_ns, Segment) as last read; dropped when a listing of its
#: folder no longer finds it (sealed). An append changes the size: the rows of a file whose size and
#: mtime_ns are unchanged are the rows read, and a refresh reads only the live segments that grew.
_live_cache: dict[str, tuple[int, int, Segment]] = {}


def outside(path: Path, root: Path) -> Path | None:
    """Where `path` really leads when that is outside `root` (a symbolic link out of the store)."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a loop of links
        return path
    return None if real == root or real.is_relative_to(root) else real


def _look(
    path: str | Path,
    table: str,
    root: Path,
    manifest: Manifest | None = None,
    entries: dict[str, tuple[int, Segment]] | None = None,
) -> Segment | SkippedFile | _Unread | None:
    """_inspect, less the footer read: a Parquet file neither cached nor in the manifest comes back
    as _Unread (its footer to be read, then _learnt). `entries`: its folder's manifest entries, made
    at once (Manifest.folder)."""
    file = os.fspath(path)
    try:
        st = os.lstat(file)
        if stat.S_ISLNK(st.st_mode):
            real = outside(Path(file), root)
            if real is not None:
                return SkippedFile(file, f"a symbolic link to {real}, outside the store")
            st = os.stat(file)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return SkippedFile(file, f"cannot stat: {exc.strerror}")
    if not stat.S_ISREG(st.st_mode):
        return SkippedFile(file, "not a regular file")
    if file.endswith(LIVE_SUFFIX):  # still growing: read again whenever its size or mtime changed
        known = _live_cache.get(file)
        if known is not None and known[0] == st.st_size and known[1] == st.st_mtime_ns:
            return known[2]
        res = _inspect_live(Path(file), table)
        if isinstance(res, Segment):
            _live_cache[file] = (st.st_size, st.st_mtime_ns, res)
        return res
    key = (file, st.st_size, st.st_mtime_ns)
    hit = _inspect_cache.get(key)  # one get or set of a dict is atomic: no lock, 100,000 times
    if manifest is not None and isinstance(hit, Segment):
        manifest.confirm(file, st.st_size, st.st_mtime_ns)
    elif hit is None and manifest is not None:
        hit = manifest.lookup(file, table, st.st_size, st.st_mtime_ns, entries)  # not kept here: it is there
    if hit is None:
        return _Unread(file, table, key)
    if manifest is not None and isinstance(hit, Segment):
        manifest.note(file, st.st_size, st.st_mtime_ns, hit)
    return hit


@dataclass(frozen=True, slots=True)
class _Unread:
    """A Parquet file whose footer must be read: neither this process's cache nor the manifest
    knows it (its lstat as `key`: path, size, mtime_ns)."""

    file: str
    table: str
    key: tuple[str, int, int]


def _inspect(
    path: str | Path, table: str, root: Path, manifest: Manifest | None = None
) -> Segment | SkippedFile | None:
    """None when the file vanished meanwhile (a compaction removed it). A Parquet segment's facts
    come from this process's cache, else from the store's `manifest` (when its entry matches the
    file's size and mtime_ns), else from its footer; the manifest notes each for its next save."""
    res = _look(path, table, root, manifest)
    if isinstance(res, _Unread):
        return _learnt(res, _inspect_uncached(res.file, res.table), manifest)
    return res


def _learnt(
    unread: _Unread, hit: Segment | SkippedFile, manifest: Manifest | None
) -> Segment | SkippedFile | None:
    """What its footer said of an unread file, kept in this process's cache and noted in the
    manifest; None when the file is gone (removed while it was read)."""
    if isinstance(hit, SkippedFile) and not os.path.exists(unread.file):
        return None
    _inspect_cache[unread.key] = hit
    if manifest is not None and isinstance(hit, Segment):
        manifest.note(unread.file, unread.key[1], unread.key[2], hit)
    return hit


#: a partition folder of at least this many Parquet files that its manifest entries do not match
#: as a whole has them made into segments at once (Manifest.folder), not one file at a time
_KNOWN_MIN = 64
#: footers read at once on a cold open (pyarrow opens and parses a footer without the GIL)
FOOTER_READERS = min(
    8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)
#: fewer footers to read than this are read in the listing's own thread
_PARALLEL_MIN = 64
#: footers one task of the pool reads
_CHUNK = 64
#: a cold open reading at least this many footers reports its progress (footer_progress)
PROGRESS_MIN_FOOTERS = 2000
#: seconds between two progress reports
_PROGRESS_EVERY_S = 0.1

FooterProgress = Callable[[int, int], None]
_progress: contextvars.ContextVar[FooterProgress | None] = contextvars.ContextVar(
    "perfscope_footer_progress", default=None
)


@contextlib.contextmanager
def footer_progress(report: FooterProgress) -> Iterator[None]:
    """While inside, a listing that reads at least PROGRESS_MIN_FOOTERS footers (a store nobody
    opened before: no manifest) calls `report(read, to_read)` as it goes, at most every 0.1 s, and
    once with read == to_read when done. The command line's terminal progress line; the library
    itself never writes to a terminal."""
    token = _progress.set(report)
    try:
        yield
    finally:
        _progress.reset(token)


def _read_chunk(chunk: list[_Unread]) -> list[Segment | SkippedFile]:
    return [_inspect_uncached(u.file, u.table) for u in chunk]


def _read_footers(unread: list[_Unread]) -> list[Segment | SkippedFile]:
    """The footers of `unread`, in order: FOOTER_READERS threads at a time when there are many."""
    total = len(unread)
    report = _progress.get() if total >= PROGRESS_MIN_FOOTERS else None
    parallel = total >= _PARALLEL_MIN and FOOTER_READERS > 1
    if not parallel and report is None:
        return _read_chunk(unread)
    chunks = [unread[i : i + _CHUNK] for i in range(0, total, _CHUNK)]
    out: list[Segment | SkippedFile] = []
    if report is not None:
        report(0, total)  # at once: the line says why the first open takes a while
    shown = time.monotonic()
    pool = ThreadPoolExecutor(FOOTER_READERS, thread_name_prefix="perfscope-footers") if parallel else None
    try:
        for got in pool.map(_read_chunk, chunks) if pool is not None else map(_read_chunk, chunks):
            out += got
            if report is not None and time.monotonic() - shown >= _PROGRESS_EVERY_S:
                report(len(out), total)
                shown = time.monotonic()
    finally:
        if pool is not None:  # an interrupt waits for the chunks being read, not for the rest
            pool.shutdown(wait=True, cancel_futures=True)
        if report is not None:
            report(total, total)
    return out


def _inspect_uncached(path: str | Path, table: str) -> Segment | SkippedFile:
    """A Parquet segment's facts from its footer (safe to call from several threads at once)."""
    try:
        quick = _read_footer(path)
        if isinstance(quick, SkippedFile):
            return quick
        meta, footprint = quick if quick is not None else (pq.read_metadata(path), _footprint(path))
        arrow_schema = meta.schema.to_arrow_schema()
    except Exception as exc:
        return SkippedFile(str(path), f"not a readable Parquet file (truncated or corrupt): {exc}")
    kv = meta.metadata or {}
    facts = _schema_facts(arrow_schema, table, meta.num_columns)
    version = _check_meta(path, kv, arrow_schema, table, "Parquet file", facts.problem)
    if isinstance(version, SkippedFile):
        return version
    replaces, claim_problem = parse_replaces(kv.get(META_REPLACES))
    file = str(path)
    return Segment(
        file=file,
        name=file[file.rfind(os.sep) + 1 :],
        table=table,
        version=version,
        columns=facts.columns,
        num_rows=meta.num_rows,
        replaces=replaces,
        footprint=footprint,
        claim_problem=claim_problem,
        ranges=_ranges(meta, facts.leaves),
        replaces_raw=kv.get(META_REPLACES),
    )


@dataclass(frozen=True)
class _SchemaFacts:
    """What a listing checks of a segment's columns, the same for every file of one Arrow schema."""

    #: why the columns cannot enter the table's view (_type_problem), or ''
    problem: str
    #: the column names (one frozenset shared by the segments of the schema)
    columns: frozenset[str]
    #: each RANGE_COLUMNS name's Parquet leaf column, when the schema is flat (a leaf per field)
    leaves: dict[str, int] | None


#: (table, number of Parquet leaf columns, serialized Arrow schema) -> its facts; files of one
#: writer share a schema, so the checks run once per schema, not once per file
_schema_cache: dict[tuple[str, int, bytes], _SchemaFacts] = {}
_SCHEMA_CACHE_MAX = 256


def _schema_facts(arrow_schema: pa.Schema, table: str, leaves: int) -> _SchemaFacts:
    try:
        key: tuple[str, int, bytes] | None = (table, leaves, arrow_schema.serialize().to_pybytes())
    except Exception:  # a type Arrow cannot write back: checked on its own
        key = None
    facts = _schema_cache.get(key) if key is not None else None
    if facts is None:
        names = arrow_schema.names
        flat = len(names) == leaves and not any(pa.types.is_nested(t) for t in arrow_schema.types)
        leaf = {n: i for i, n in enumerate(names) if n in RANGE_COLUMNS} if flat else None
        facts = _SchemaFacts(_type_problem(arrow_schema, table), frozenset(names), leaf)
        if key is not None:
            if len(_schema_cache) >= _SCHEMA_CACHE_MAX:
                _schema_cache.clear()
            _schema_cache[key] = facts
    return facts


def _ranges(meta: pq.FileMetaData, leaf: dict[str, int] | None = None) -> tuple[int | None, ...]:
    """Smallest and largest value of each of the manifest's RANGE_COLUMNS, from every row group's
    statistics; None and None for a column absent, or without them in some row group. `leaf`: each
    column's leaf index, when known (else found by path in the footer's schema)."""
    if leaf is None:
        leaf = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    cols = [leaf.get(col) for col in RANGE_COLUMNS]
    ok = [i is not None for i in cols]
    lo: list[int | None] = [None] * len(cols)
    hi: list[int | None] = [None] * len(cols)
    for g in range(meta.num_row_groups):
        if not any(ok):
            break
        rg = meta.row_group(g)
        for k, i in enumerate(cols):
            if not ok[k] or i is None:
                continue
            st = rg.column(i).statistics
            if st is not None and st.has_min_max and isinstance(st.min, int) and isinstance(st.max, int):
                low, high = st.min, st.max
                lo[k] = low if lo[k] is None else min(lo[k], low)  # type: ignore[type-var]
                hi[k] = high if hi[k] is None else max(hi[k], high)  # type: ignore[type-var]
            elif not (st is not None and st.has_null_count and st.null_count == rg.num_rows):
                ok[k] = False
    found: list[int | None] = []
    for k in range(len(cols)):
        found += [lo[k], hi[k]] if ok[k] else [None, None]
    return tuple(found)


def _check_meta(
    path: str | Path,
    kv: dict[bytes, bytes],
    arrow_schema: pa.Schema,
    table: str,
    kind: str,
    wrong: str | None = None,
) -> int | SkippedFile:
    """The schema version a segment's metadata gives, or why it cannot enter the table's view
    (`wrong`: _type_problem's answer, when already known)."""
    if META_TABLE not in kv or META_VERSION not in kv:
        return SkippedFile(str(path), f"foreign {kind}: no perfscope metadata")
    file_table = kv[META_TABLE].decode(errors="replace")
    if file_table != table:
        return SkippedFile(str(path), f"holds table {file_table!r} but lies in the {table!r} folder")
    try:
        version = int(kv[META_VERSION])
    except ValueError:
        return SkippedFile(str(path), f"unreadable schema version {kv[META_VERSION]!r}")
    if wrong is None:
        wrong = _type_problem(arrow_schema, table)
    if wrong:
        return SkippedFile(str(path), wrong)
    return version


def _inspect_live(path: Path, table: str) -> Segment | SkippedFile | None:
    """A live segment's complete batches, validated as a Parquet segment is; None when it vanished
    (sealed meanwhile: its twin is listed instead) or holds no batch yet."""
    try:
        data = read_live(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return SkippedFile(str(path), f"cannot read: {exc.strerror}")
    except ValueError as exc:
        return SkippedFile(str(path), f"not a live segment: {exc}")
    if data is None:
        return None
    version = _check_meta(path, data.schema.metadata or {}, data.schema, table, "Arrow IPC stream")
    if isinstance(version, SkippedFile):
        return version
    return Segment(
        file=str(path),
        name=path.name,
        table=table,
        version=version,
        columns=frozenset(data.schema.names),
        num_rows=data.num_rows,
        replaces=(),
        footprint=f"live:{path}",
        live=data,
    )


#: bytes read from a file's end at first: a segment's whole footer, mostly (one read per file)
_TAIL_BYTES = 1 << 16


def _read_footer(path: str | Path) -> tuple[pq.FileMetaData, str] | SkippedFile | None:
    """The file's Parquet footer and footprint (as _footprint hashes it) from one open and one or two
    reads of its end, parsed without the GIL held; None when the footer is not where its length says
    or does not parse, so that the caller reads the file as before and gives the same reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # never blocks on a FIFO
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since the listing looked at it
            return SkippedFile(str(path), "not a regular file")
        size = st.st_size
        n = min(size, _TAIL_BYTES)
        tail = os.pread(fd, n, size - n)
        if n < 12 or len(tail) != n or tail[-4:] != b"PAR1":
            return None
        footer_len = int.from_bytes(tail[-8:-4], "little")
        if footer_len + 8 > size - 4:  # not inside the file after its leading magic
            return None
        if footer_len + 8 > n:
            tail = os.pread(fd, footer_len + 8, size - footer_len - 8)
            if len(tail) != footer_len + 8:
                return None
        end = memoryview(tail)[len(tail) - footer_len - 8 :]
        meta = _parse_footer(pa.BufferReader(pa.py_buffer(end)))
    except Exception:
        return None
    finally:
        os.close(fd)
    digest = hashlib.blake2b(f"{size}\0".encode(), digest_size=16)
    digest.update(end[:footer_len])
    return meta, digest.hexdigest()


def _parse_footer(source: pa.NativeFile) -> pq.FileMetaData:
    """A footer's metadata (pq.read_metadata, less what ParquetFile builds beside it for reading)."""
    reader_type = getattr(pq, "ParquetReader", None)
    if reader_type is None:  # pragma: no cover (pyarrow 14 to 26 have it)
        return pq.read_metadata(source)
    reader = reader_type()
    reader.open(source)
    return reader.metadata


def _footprint(path: str | Path) -> str:
    """The file's size and Parquet footer, hashed: two files that differ here differ in content."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - 8, 0))
        tail = f.read(8)
        footer_len = int.from_bytes(tail[:4], "little")
        f.seek(max(size - 8 - footer_len, 0))
        footer = f.read(footer_len)
    return hashlib.blake2b(f"{size}\0".encode() + footer, digest_size=16).hexdigest()


def _same_type(found: pa.DataType, expected: pa.DataType) -> bool:
    if found == expected:
        return True
    return pa.types.is_large_string(found) and expected == pa.string()


def _type_problem(arrow_schema: pa.Schema, table: str) -> str:
    """Why the file's columns cannot enter the table's view (wrong type, partition key inside), or ''."""
    names = arrow_schema.names
    if len(set(names)) != len(names):
        return "holds two columns of the same name"
    if PARTITION_KEY in names:
        return f"holds a {PARTITION_KEY!r} column, which only its folder name may give"
    expected = {c.name: c.type for c in TABLES[table].columns}
    for f in arrow_schema:
        want = expected.get(f.name)
        if want is not None and not _same_type(f.type, want):
            return f"column {f.name!r} has type {f.type}, but the {table} table's schema says {want}"
    return ""


def _check_version(seg: Segment) -> None:
    if seg.version > SCHEMA_VERSION:
        raise StoreError(
            f"{seg.path} was written with perfscope schema version {seg.version}, but this perfscope "
            f"reads versions {MIN_READABLE_VERSION} to {SCHEMA_VERSION}. Upgrade perfscope "
            "(pip install -U perfscope) to read this store."
        )
    if seg.version < MIN_READABLE_VERSION:
        raise StoreError(
            f"{seg.path} was written with perfscope schema version {seg.version}, which this perfscope "
            f"(schema version {SCHEMA_VERSION}) cannot migrate. Read it with an older perfscope, or "
            "record the run again."
        )


def partition_value_problem(value: str) -> str:
    """Why DuckDB would not read `value` back verbatim from a `run_id=<value>` folder name, or ''.
    (It refuses every query over a table with a folder `run_id=a=b`, decodes `%3D` to `=`, cuts
    `a\\b` at the backslash, and reads `NULL` as no run id.)"""
    if not value:
        return "its run id is empty"
    if "=" in value or "%" in value or "\\" in value:
        return "its run id holds '=', '%' or '\\', which DuckDB does not read back as written"
    if value.lower() == "null":
        return "its run id reads as NULL in DuckDB"
    return ""


def _partition_dirs(table_dir: Path, root: Path, skipped: list[SkippedFile]) -> Iterator[Path]:
    for entry in sorted(table_dir.iterdir()):
        if entry.is_dir() and entry.name.startswith(f"{PARTITION_KEY}="):
            problem = partition_value_problem(entry.name[len(PARTITION_KEY) + 1 :])
            if problem:
                skipped.append(SkippedFile(str(entry), f"a foreign folder: {problem}"))
                continue
            real = outside(entry, root)
            if real is not None:
                skipped.append(SkippedFile(str(entry), f"a folder leading to {real}, outside the store"))
                continue
            yield entry


def _claim_problem(seg: Segment, present: dict[str, Segment]) -> str:
    """Why `seg`'s claim to replace segments present beside it cannot be honoured, or ''."""
    if seg.claim_problem:
        return seg.claim_problem
    if any(r.rows < 0 for r in seg.replaces):
        return "it names the segments without their row counts and hashes (an older perfscope wrote it)"
    total = sum(r.rows for r in seg.replaces)
    if total != seg.num_rows:
        return f"it claims to replace {total} rows but holds {seg.num_rows}"
    for r in seg.replaces:
        other = present.get(r.name)
        if other is None:
            continue
        try:
            size = other.path.stat().st_size
            same = (
                other.num_rows == r.rows and size == r.size_bytes and content_digest(other.path) == r.blake2b
            )
        except OSError:
            continue  # removed meanwhile: nothing left to hide
        if not same:
            return f"{r.name} is not the segment it claims to replace (rows, size or hash differ)"
        if not _contained_cached(other, seg):
            if not other.path.exists():
                continue  # removed meanwhile (the read failed): nothing left to hide
            return f"it does not hold all the rows of {r.name}"
    return ""


#: (segment footprint, merged file footprint) -> whether every row of the one is in the other
_contained_cache: dict[tuple[str, str], bool] = {}


def _contained_cached(segment: Segment, merged: Segment) -> bool:
    key = (segment.footprint, merged.footprint)
    with _cache_lock:
        hit = _contained_cache.get(key)
    if hit is None:
        hit = rows_contained(segment.path, merged.path)
        if not hit and not (segment.path.exists() and merged.path.exists()):
            return False  # a compaction removed one meanwhile: no answer to keep
        with _cache_lock:
            _contained_cache[key] = hit
    return hit


def _partition_segments(found: list[Segment], listing: Listing) -> list[Segment]:
    """The segments of one partition that are read: checked compaction claims honoured, identical copies
    counted once; the rest recorded in `listing` with the reason."""
    present = {seg.name: seg for seg in found}
    hidden: dict[str, Segment] = {}
    merged_copies: dict[tuple[int, int, str], Segment] = {}
    for seg in found:
        if not seg.replaces and not seg.claim_problem:
            continue  # claims nothing (most segments): nothing to check
        claimed = [r for r in seg.replaces if r.name in present and r.name != seg.name]
        if not seg.claim_problem and not claimed:
            if sum(r.rows for r in seg.replaces) == seg.num_rows:
                for r in seg.replaces:  # a copy of a segment merged long ago is recognised by its hash
                    merged_copies[(r.rows, r.size_bytes, r.blake2b)] = seg
            continue
        problem = _claim_problem(seg, present)
        if problem:
            listing.doubtful.append(SkippedFile(seg.file, f"claim to replace segments ignored: {problem}"))
            continue
        for r in seg.replaces:
            merged_copies[(r.rows, r.size_bytes, r.blake2b)] = seg
        for r in claimed:
            hidden[r.name] = seg
    kept: list[Segment] = []
    first_of: dict[str, Segment] = {}
    for seg in found:
        if seg.name in hidden:
            listing.superseded.append(seg.path)
            listing.superseded_by[seg.path] = hidden[seg.name].path
            continue
        copy_of = _copy_of(seg, first_of, merged_copies) if seg.footprint in first_of or merged_copies else ""
        if copy_of:
            listing.skipped.append(SkippedFile(seg.file, f"identical copy of {copy_of}: counted once"))
            continue
        first_of.setdefault(seg.footprint, seg)
        kept.append(seg)
    return kept


def _copy_of(seg: Segment, first_of: dict[str, Segment], merged: dict[tuple[int, int, str], Segment]) -> str:
    """The name of the segment `seg` is a byte-for-byte copy of, or ''."""
    try:
        first = first_of.get(seg.footprint)
        if first is not None and content_digest(first.path) == content_digest(seg.path):
            return first.name
        if merged:
            size = seg.path.stat().st_size
            if any(rows == seg.num_rows and nbytes == size for rows, nbytes, _ in merged):
                owner = merged.get((seg.num_rows, size, content_digest(seg.path)))
                if owner is not None and owner is not seg and rows_contained(seg.path, owner.path):
                    return f"a segment already merged into {owner.name}"
    except OSError:
        pass  # removed meanwhile: the next listing settles it
    return ""


def rows_contained(segment: Path, merged: Path) -> bool:
    """Whether every row of `segment` is in `merged` (as many times): checked before a compacted file's
    claim lets a copy of a merged segment be ignored, and before `compact` deletes a replaced one."""
    names = pq.read_schema(segment).names
    cols = ", ".join('"' + n.replace('"', '""') + '"' for n in names)
    con = duckdb.connect(":memory:")
    try:
        left = f"SELECT {cols} FROM read_parquet(?)"
        sql = f"SELECT count(*) FROM ({left} EXCEPT ALL SELECT {cols} FROM read_parquet(?))"
        row = con.execute(sql, [str(segment), str(merged)]).fetchone()
        return row is not None and row[0] == 0
    except duckdb.Error:
        return False
    finally:
        con.close()


def list_store(
    root: Path, *, run_id: str | None = None, save_manifest: bool | None = None, read_live: bool = True
) -> Listing:
    """Every valid segment per table (of one run, when `run_id` is given), the files skipped and why,
    and segments a compaction replaced. `read_live=False` leaves live segments (`.arrows`) unread and
    out of the listing (a merge of sealed segments does not need other writers' live rows).

    The store's manifest (perfscope.store.manifest) spares reading the footers of segments already seen;
    it is saved when `save_manifest` is True and anything changed, or when None and at least
    SAVE_MIN_CHANGES footers were read (or gone files dropped); never for one run's listing."""
    root = Path(root).resolve()
    listing = Listing()
    manifest = Manifest.load(str(root))
    folders: list[str] = []
    live_seen: set[str] = set()
    # First every folder is scanned and each Parquet file looked up (cache, manifest); then the
    # footers nobody knows are read, in threads; then the partitions are settled in the order found.
    plan: list[SkippedFile | _Partition] = []
    for name in TABLES:
        table_dir = root / name
        listing.blocks[name] = []
        if not table_dir.is_dir():
            continue
        real = outside(table_dir, root)
        if real is not None:
            plan.append(SkippedFile(str(table_dir), f"a folder leading to {real}, outside the store"))
            continue
        for stray in sorted([*table_dir.glob("*.parquet"), *table_dir.glob(f"*{LIVE_SUFFIX}")]):
            plan.append(SkippedFile(str(stray), f"not inside a {PARTITION_KEY}=... folder"))
        foreign: list[SkippedFile] = []
        for part in _partition_dirs(table_dir, root, foreign):
            plan += foreign
            foreign.clear()
            if run_id is not None and part.name != f"{PARTITION_KEY}={run_id}":
                continue
            folder = f"{part}{os.sep}"
            folders.append(folder)
            scan = _partition_entries(part)
            whole = None if scan.live else _whole(manifest, folder, name, scan)
            looked: list[Segment | SkippedFile | _Unread | None] = []
            if whole is None:  # a file added or changed since the manifest: the others are taken from it
                known = manifest.folder(folder, name) if len(scan.parquet) >= _KNOWN_MIN else None
                looked = [_look(folder + f, name, root, manifest, known) for f in scan.parquet]
            plan.append(_Partition(name, part, scan, whole, looked))
        plan += foreign
    unread = [x for p in plan if isinstance(p, _Partition) for x in p.looked if isinstance(x, _Unread)]
    read = iter(_read_footers(unread))
    for item in plan:
        if isinstance(item, SkippedFile):
            listing.skipped.append(item)
            continue
        name, part, scan, live = item.table, item.part, item.scan, item.scan.live
        blocks = listing.blocks[name]
        folder = f"{part}{os.sep}"
        if item.whole is not None:
            if len(item.whole):
                blocks.append(Block(folder, entries=item.whole))
            continue
        found: list[Segment] = []
        for res in item.looked:
            _admit(_learnt(res, next(read), manifest) if isinstance(res, _Unread) else res, listing, found)
        sealed = {seg.name.removesuffix(".parquet") for seg in found} if live else set()
        for fname in live:
            path = part / fname
            if path.stem in sealed:  # a valid twin holds its rows
                listing.sealed_live.append(path)
                continue
            if not read_live:
                continue
            live_seen.add(str(path))
            res = _inspect(path, name, root)
            if res is None and twin(path).name not in scan.names:
                res = _inspect(twin(path), name, root, manifest)  # sealed since the scan
            _admit(res, listing, found)
        kept = _partition_segments(found, listing)
        if kept:
            blocks.append(Block(folder, kept))
    if read_live:
        _forget_live(folders, live_seen)
    worth = 1 if save_manifest else SAVE_MIN_CHANGES
    if run_id is None and save_manifest is not False and manifest.changes >= worth:
        manifest.save()
    return listing


@dataclass
class _Partition:
    """A partition folder as the first pass of list_store found it."""

    table: str
    part: Path
    scan: _Folder
    #: the manifest's entries for the whole folder, when they match it
    whole: Entries | None
    #: else each Parquet file as looked up (_look), in the scan's order
    looked: list[Segment | SkippedFile | _Unread | None]


def _whole(manifest: Manifest, folder: str, table: str, scan: _Folder) -> Entries | None:
    """The manifest's entries for a partition folder without live segments, when they match every
    one of its Parquet files (regular files of the sizes and mtime_ns they say, a schema version
    this perfscope reads) and there is nothing to check between the files (no compaction claim, no
    footprint twice); else None (each file is then looked at on its own)."""
    if None in scan.stats:
        return None
    stats = cast("list[os.stat_result]", scan.stats)
    if not all(stat.S_ISREG(mode) for mode in {st.st_mode for st in stats}):
        return None
    sizes = [st.st_size for st in stats]
    mtimes = [st.st_mtime_ns for st in stats]
    whole = manifest.match(folder, table, scan.parquet, sizes, mtimes)
    if whole is None or not whole.plain:
        return None
    versions = whole.versions
    if len(versions) and (versions.min() < MIN_READABLE_VERSION or versions.max() > SCHEMA_VERSION):
        return None  # read one by one: the first such segment refuses the store with the reason
    manifest.take(whole)
    return whole


def _forget_live(folders: list[str], seen: set[str]) -> None:
    """Drop the live segments kept from earlier listings that a listing of their folder no longer read."""
    if _live_cache:
        listed = set(folders)
        for file in [f for f in list(_live_cache) if f not in seen and f[: f.rfind(os.sep) + 1] in listed]:
            _live_cache.pop(file, None)


def _admit(res: Segment | SkippedFile | None, listing: Listing, found: list[Segment]) -> None:
    """Add an inspected file to the partition's segments, or to the listing's skipped files."""
    if isinstance(res, SkippedFile):
        listing.skipped.append(res)
    elif res is not None:
        _check_version(res)
        found.append(res)


#: a partition folder changed this recently may have a live segment being sealed in it
_SEAL_RACE_S = 5.0


@dataclass
class _Folder:
    """What one scan of a partition folder found."""

    #: every name in it
    names: set[str]
    #: the Parquet segments' names (not hidden), sorted, and their lstat (None where it failed)
    parquet: list[str]
    stats: list[os.stat_result | None]
    #: the live segments' names (not hidden), sorted
    live: list[str]


def _partition_entries(part: Path) -> _Folder:
    """The files of a partition folder. A scan racing a seal (the twin renamed in, then the live
    segment removed) may see neither file; when a writer may be sealing there, a second scan (which
    sees the twin) is added to the first."""
    first = _scan(part)
    try:
        recent = part.stat().st_mtime > time.time() - _SEAL_RACE_S
    except OSError:
        recent = False
    if not (recent or first.live):
        return first
    second = _scan(part)
    stats = dict(zip(first.parquet, first.stats, strict=True)) | dict(
        zip(second.parquet, second.stats, strict=True)
    )
    parquet = sorted(stats)
    live = sorted({*first.live, *second.live})
    return _Folder(first.names | second.names, parquet, [stats[n] for n in parquet], live)


def _scan(part: Path) -> _Folder:
    """One scan of a partition folder: its names, and an lstat of each Parquet segment through the
    folder's descriptor (the kernel does not walk the whole path again)."""
    try:
        fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return _Folder(set(), [], [], [])
    try:
        names = sorted(os.listdir(fd))
        parquet = [n for n in names if n.endswith(".parquet") and n[0] != "."]
        live = (
            [n for n in names if n.endswith(LIVE_SUFFIX) and n[0] != "."] if len(parquet) < len(names) else []
        )
        try:
            stats: list[os.stat_result | None] = [
                os.stat(n, dir_fd=fd, follow_symlinks=False) for n in parquet
            ]
        except OSError:  # one vanished meanwhile, or cannot be looked at: each on its own
            stats = [_lstat(n, fd) for n in parquet]
        return _Folder(set(names), parquet, stats, live)
    except OSError:
        return _Folder(set(), [], [], [])
    finally:
        os.close(fd)


def _lstat(name: str, folder_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return None


def view_sql(table: str, segments: list[Segment]) -> str:
    if not segments:
        return f"SELECT {_every_column(table, 'NULL')} WHERE false"
    # Each schema version is read on its own: columns added after a segment was written read as
    # NULL there, or as their `migrated` value (the migration of older versions).
    by_version: dict[int, list[Segment]] = {}
    for seg in segments:
        by_version.setdefault(seg.version, []).append(seg)
    sql = " UNION ALL ".join(_version_sql(table, v, segs) for v, segs in sorted(by_version.items()))
    if table == "runs":
        # runs are rewritten at close with their final values: the latest row per run wins.
        sql = (
            f"SELECT * FROM ({sql}) QUALIFY row_number() OVER "
            f"(PARTITION BY {PARTITION_KEY} ORDER BY ended_ns DESC NULLS LAST) = 1"
        )
    return sql


def unread_view_sql(table: str) -> str:
    """A view of `table`'s columns (DESCRIBE and SHOW TABLES see them) whose every row and column is
    an error saying why: a user query binds only the tables it names (sql_worker.named_tables), so one
    that builds a table's name from pieces is refused in one line, never answered from no rows."""
    error = sql_text(f"the query reads table {table} without naming it; write its name in the query")
    return f"SELECT {_every_column(table, f'error({error})')} FROM range(1) WHERE error({error}) IS NULL"


def _every_column(table: str, value: str) -> str:
    """The partition key and every column of `table`, each `value` cast to its type."""
    return ", ".join(
        [f"CAST({value} AS VARCHAR) AS {PARTITION_KEY}"]
        + [f'CAST({value} AS {_DUCK_TYPES[c.type]}) AS "{c.name}"' for c in TABLES[table].columns]
    )


def _version_sql(table: str, version: int, segments: list[Segment]) -> str:
    parquet = [s for s in segments if s.live is None]
    selects = [_parquet_sql(table, version, parquet)] if parquet else []
    for seg in segments:
        if seg.live is not None:  # registered on the connection (create_views)
            run = seg.path.parent.name.partition("=")[2].replace("'", "''")
            cols = _columns_sql(table, version, [seg], f"'{run}' AS {PARTITION_KEY}")
            selects.append(f"SELECT {cols} FROM {live_relation(seg)}")
    return " UNION ALL ".join(selects)


def live_relation(seg: Segment) -> str:
    """The name a live segment's rows are registered under on a connection."""
    return "_perfscope_live_" + hashlib.blake2b(seg.file.encode(), digest_size=8).hexdigest()


def create_views(
    con: duckdb.DuckDBPyConnection,
    listing: Listing,
    *,
    replace: bool = False,
    tables: Iterable[str] | None = None,
) -> set[str]:
    """Register the listing's live segments on `con` and create one view per table (of `tables`,
    default all) over them and the Parquet segments; returns the names registered."""
    chosen = [t for t in listing.blocks if tables is None or t in tables]
    registered: set[str] = set()
    for name in chosen:
        for seg in listing.live_segments():
            if seg.table == name:
                con.register(live_relation(seg), seg.live)
                registered.add(live_relation(seg))
    verb = "CREATE OR REPLACE VIEW" if replace else "CREATE VIEW"
    for name in chosen:
        try:
            con.execute(f"{verb} {name} AS {view_sql(name, listing.of(name))}")
        except duckdb.BinderException:  # a manifest entry named a column its file lacks
            listing.reread(name)
            con.execute(f"{verb} {name} AS {view_sql(name, listing.of(name))}")
    return registered


def _parquet_sql(table: str, version: int, segments: list[Segment]) -> str:
    files = ", ".join(sql_text(s.file) for s in segments)
    cols = TABLES[table].columns
    every = frozenset(c.name for c in cols)
    # Files that each hold every column are bound by the first one's schema and read by name: DuckDB's
    # union_by_name reads every file's schema at bind, 8.8 s and 3 GB for a long run's 100,000 steps
    # segments. A file that lacks a column its listing said it holds then fails the query.
    union = "" if all(every <= s.columns for s in segments) else "union_by_name=true, "
    src = (
        f"read_parquet([{files}], hive_partitioning=true, {union}hive_types={{'{PARTITION_KEY}': 'VARCHAR'}})"
    )
    present = frozenset().union(*(s.columns for s in segments))
    if any(c.name not in present for c in cols):
        # The listing says no file holds a column (a footer said so, or the manifest's memory of one,
        # which a forged manifest may edit): bound from the files all the same, by name against an
        # empty row of every column, so it is NULL only where the files themselves lack it.
        skeleton = ", ".join(f'CAST(NULL AS {_DUCK_TYPES[c.type]}) AS "{c.name}"' for c in cols)
        src = f"(SELECT * FROM {src} UNION ALL BY NAME SELECT {skeleton} WHERE false)"
        present = frozenset(c.name for c in cols)
    return f"SELECT {_columns_sql(table, version, segments, PARTITION_KEY, present)} FROM {src}"


def sql_text(value: str) -> str:
    """`value` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _columns_sql(
    table: str, version: int, segments: list[Segment], partition: str, present: frozenset[str] | None = None
) -> str:
    if present is None:
        present = frozenset().union(*(s.columns for s in segments))
    parts = [partition]
    for c in TABLES[table].columns:
        if c.migrated is not None and version < c.since:  # written before the column existed
            parts.append(f'CAST({c.migrated} AS {_DUCK_TYPES[c.type]}) AS "{c.name}"')
        elif c.name in present:
            parts.append(f'"{c.name}"')
        else:
            parts.append(f'CAST(NULL AS {_DUCK_TYPES[c.type]}) AS "{c.name}"')
    return ", ".join(parts)


def is_utf8(text: str) -> bool:
    """Whether `text` is valid UTF-8 (an undecodable file name comes back as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_spill: list[str] = []


#: the analysis connection's DuckDB memory limit unless PERFSCOPE_MEMORY_LIMIT says otherwise
DEFAULT_ANALYSIS_MEMORY_LIMIT = "2GB"
#: the share of PERFSCOPE_MEMORY_LIMIT that DuckDB's buffer pool gets: the limit bounds the whole
#: process of a command (memory_guard.py), and Arrow results, Python objects and DuckDB's own
#: per-thread allocations need the rest, so DuckDB spills well before the process is stopped
DUCKDB_SHARE = 0.5


def analysis_memory_limit() -> str:
    """DuckDB's memory limit for analyses: half of PERFSCOPE_MEMORY_LIMIT when that is a size
    ("4GB", "512MiB"), else the default."""
    value = os.environ.get("PERFSCOPE_MEMORY_LIMIT", "").strip()
    size = parse_size(value)
    if size is not None:
        return f"{int(size * DUCKDB_SHARE)}B"  # digits and a unit: safe as a literal
    if value:
        warn_once(
            "memory-limit-env",
            f"perfscope: PERFSCOPE_MEMORY_LIMIT={one_line(value)} is not a size such as 4GB or 512MiB; "
            f"DuckDB uses {DEFAULT_ANALYSIS_MEMORY_LIMIT} (the perfscope commands refuse such a value)",
        )
    return DEFAULT_ANALYSIS_MEMORY_LIMIT


def spill_dir() -> str:
    """One folder per process where DuckDB may spill large aggregations; removed at exit."""
    with _cache_lock:
        if not _spill:
            # the pid lets a later start tell a live process's folder from a killed one's (leftovers.py)
            _spill.append(tempfile.mkdtemp(prefix=f"perfscope-duckdb-{os.getpid()}-"))
            atexit.register(shutil.rmtree, _spill[0], True)
        return _spill[0]


def check_root(root: Path) -> None:
    if not root.exists():
        raise StoreError(
            f"{root} does not exist. Give the folder a run was recorded into "
            "(perfscope.profile('traces/') writes one), or run `perfscope demo` to make one."
        )
    if not root.is_dir():
        raise StoreError(f"{root} is a file, not a store; a store is a folder with runs/, steps/ ... inside.")
    if not any((root / name).is_dir() for name in TABLES):
        raise StoreError(
            f"{root} is not a perfscope store: it has none of the table folders "
            f"({', '.join(TABLES)}). Point at the folder given to perfscope.profile(...)."
        )
