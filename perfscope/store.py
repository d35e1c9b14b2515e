"""Reads a store: validates its segments and exposes one DuckDB view per table.

A truncated, corrupt or foreign file is skipped and named in a warning; it never breaks a query.
The connection can read only the store's own folder.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import PerfscopeError, PerfscopeWarning, StoreError
from .schema import (
    META_REPLACES,
    META_TABLE,
    META_VERSION,
    MIN_READABLE_VERSION,
    PARTITION_KEY,
    SCHEMA_VERSION,
    TABLES,
)

_DUCK_TYPES = {
    pa.int16(): "SMALLINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.string(): "VARCHAR",
}

READ_STATEMENTS = {"SELECT", "EXPLAIN"}


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass(frozen=True)
class Segment:
    path: Path
    table: str
    version: int
    columns: frozenset[str]
    num_rows: int
    replaces: tuple[str, ...]


@dataclass
class Listing:
    segments: dict[str, list[Segment]] = field(default_factory=dict)
    skipped: list[SkippedFile] = field(default_factory=list)
    superseded: list[Path] = field(default_factory=list)


# (path, size, mtime_ns) -> Segment | SkippedFile; files are immutable once renamed into place.
_inspect_cache: dict[tuple[str, int, int], Segment | SkippedFile] = {}
_cache_lock = threading.Lock()


def _inspect(path: Path, table: str) -> Segment | SkippedFile | None:
    """None when the file vanished meanwhile (a compaction removed it)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return SkippedFile(str(path), f"cannot stat: {exc.strerror}")
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        hit = _inspect_cache.get(key)
    if hit is not None:
        return hit
    result = _inspect_uncached(path, table)
    if isinstance(result, SkippedFile) and not path.exists():
        return None
    with _cache_lock:
        _inspect_cache[key] = result
    return result


def _inspect_uncached(path: Path, table: str) -> Segment | SkippedFile:
    try:
        meta = pq.read_metadata(path)
    except Exception as exc:
        return SkippedFile(str(path), f"not a readable Parquet file (truncated or corrupt): {exc}")
    kv = meta.metadata or {}
    if META_TABLE not in kv or META_VERSION not in kv:
        return SkippedFile(str(path), "foreign Parquet file: no perfscope metadata")
    file_table = kv[META_TABLE].decode(errors="replace")
    if file_table != table:
        return SkippedFile(str(path), f"holds table {file_table!r} but lies in the {table!r} folder")
    try:
        version = int(kv[META_VERSION])
    except ValueError:
        return SkippedFile(str(path), f"unreadable schema version {kv[META_VERSION]!r}")
    replaces = tuple(json.loads(kv[META_REPLACES])) if META_REPLACES in kv else ()
    return Segment(
        path=path,
        table=table,
        version=version,
        columns=frozenset(meta.schema.to_arrow_schema().names),
        num_rows=meta.num_rows,
        replaces=replaces,
    )


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


def _partition_dirs(table_dir: Path) -> Iterator[Path]:
    for entry in sorted(table_dir.iterdir()):
        if entry.is_dir() and entry.name.startswith(f"{PARTITION_KEY}="):
            yield entry


def list_store(root: Path) -> Listing:
    """Every valid segment per table, the files skipped and why, and segments a compaction replaced."""
    listing = Listing()
    for name in TABLES:
        table_dir = root / name
        segs: list[Segment] = []
        listing.segments[name] = segs
        if not table_dir.is_dir():
            continue
        for stray in sorted(table_dir.glob("*.parquet")):
            listing.skipped.append(SkippedFile(str(stray), f"not inside a {PARTITION_KEY}=... folder"))
        for part in _partition_dirs(table_dir):
            found: list[Segment] = []
            for path in sorted(part.glob("*.parquet")):
                if path.name.startswith("."):
                    continue  # a segment still being written
                res = _inspect(path, name)
                if res is None:
                    continue
                if isinstance(res, SkippedFile):
                    listing.skipped.append(res)
                else:
                    _check_version(res)
                    found.append(res)
            replaced = {r for seg in found for r in seg.replaces}
            for seg in found:
                if seg.path.name in replaced:
                    listing.superseded.append(seg.path)
                else:
                    segs.append(seg)
    return listing


def _view_sql(table: str, segments: list[Segment]) -> str:
    cols = TABLES[table].columns
    if not segments:
        select = ", ".join(
            [f"CAST(NULL AS VARCHAR) AS {PARTITION_KEY}"]
            + [f'CAST(NULL AS {_DUCK_TYPES[c.type]}) AS "{c.name}"' for c in cols]
        )
        return f"SELECT {select} WHERE false"
    present = frozenset().union(*(s.columns for s in segments))
    # Columns added after a segment was written read as NULL: the migration of older versions.
    parts = [PARTITION_KEY] + [
        f'"{c.name}"' if c.name in present else f'CAST(NULL AS {_DUCK_TYPES[c.type]}) AS "{c.name}"'
        for c in cols
    ]
    files = ", ".join("'" + str(s.path).replace("'", "''") + "'" for s in segments)
    src = (
        f"read_parquet([{files}], hive_partitioning=true, union_by_name=true, "
        f"hive_types={{'{PARTITION_KEY}': 'VARCHAR'}})"
    )
    sql = f"SELECT {', '.join(parts)} FROM {src}"
    if table == "runs":
        # runs are rewritten at close with their final values: the latest row per run wins.
        sql += (
            f" QUALIFY row_number() OVER (PARTITION BY {PARTITION_KEY} ORDER BY ended_ns DESC NULLS LAST) = 1"
        )
    return sql


_FILE_IN_ERROR = re.compile(r"""["']?(/[^"'\s]+?\.parquet)["']?""")


class Store:
    """A store opened for reading. `con` has one view per table; `query` survives concurrent compaction."""

    def __init__(self, root: str | os.PathLike[str], *, allow_empty: bool = False, warn: bool = True):
        self.root = Path(root).resolve()
        self._allow_empty = allow_empty
        self._warn = warn
        self._forced_skips: dict[str, str] = {}
        self._lock = threading.RLock()
        self._spill_dir = _spill_dir()
        self.con = duckdb.connect(":memory:")
        self.con.execute(f"SET temp_directory='{self._spill_dir}'")
        # DuckDB draws a progress bar on stdout for long queries, which would corrupt --json output
        self.con.execute("SET enable_progress_bar=false")
        self.con.execute(
            "SET allowed_directories=["
            + ", ".join("'" + str(p).replace("'", "''") + "'" for p in (self.root, self._spill_dir))
            + "]"
        )
        self.con.execute("SET enable_external_access=false")
        self.con.execute("SET lock_configuration=true")
        self.listing = Listing()
        self.refresh()

    @property
    def skipped(self) -> list[SkippedFile]:
        return self.listing.skipped + [SkippedFile(p, r) for p, r in self._forced_skips.items()]

    def segments(self, table: str) -> list[Segment]:
        return self.listing.segments.get(table, [])

    def row_count(self, table: str) -> int:
        return sum(s.num_rows for s in self.segments(table))

    def refresh(self) -> None:
        """Re-list the folder (new segments, compactions) and rebuild the views."""
        with self._lock:
            for attempt in range(8):
                try:
                    self._rebuild()
                    return
                except duckdb.IOException:
                    # a file vanished between listing and binding: a compaction finished; list again
                    if attempt == 7:
                        raise

    def _rebuild(self) -> None:
        _check_root(self.root)
        listing = list_store(self.root)
        for segs in listing.segments.values():
            segs[:] = [s for s in segs if str(s.path) not in self._forced_skips]
        if not self._allow_empty and not any(listing.segments.values()):
            reasons = "; ".join(f"{Path(s.path).name}: {s.reason}" for s in listing.skipped[:3])
            raise StoreError(
                f"{self.root} holds no perfscope data"
                + (f" (skipped {len(listing.skipped)} files: {reasons})" if listing.skipped else "")
                + ". Record a run into it with perfscope.profile(...) or try `perfscope demo`."
            )
        new_skips = {s.path for s in listing.skipped} - {s.path for s in self.listing.skipped}
        self.listing = listing
        for name, segs in listing.segments.items():
            self.con.execute(f"CREATE OR REPLACE VIEW {name} AS {_view_sql(name, segs)}")
        if self._warn and new_skips:
            self._warn_skipped([s for s in listing.skipped if s.path in new_skips])

    def _warn_skipped(self, skipped: list[SkippedFile]) -> None:
        lines = "\n".join(f"  {s.path}: {s.reason}" for s in skipped[:10])
        more = f"\n  ... and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        warnings.warn(
            f"perfscope: skipped {len(skipped)} file(s) in {self.root}:\n{lines}{more}",
            PerfscopeWarning,
            stacklevel=3,
        )

    def query(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run `sql` and return an Arrow table; a segment compacted away or found corrupt mid-query
        is handled by re-listing the store and trying again."""
        last: Exception | None = None
        for _ in range(20):
            with self._lock:
                try:
                    rel = self.con.sql(sql, params=params)
                    if rel is None:  # a statement that returns nothing
                        return pa.table({})
                    return rel.to_arrow_table()
                except (duckdb.IOException, duckdb.InvalidInputException) as exc:
                    last = exc
                    bad = self._file_named_in(str(exc))
                    if bad is not None and Path(bad).exists():
                        self._forced_skips[bad] = f"unreadable during a query: {str(exc).splitlines()[0]}"
                        if self._warn:
                            self._warn_skipped([SkippedFile(bad, self._forced_skips[bad])])
                    elif bad is None:
                        raise
                    self.refresh()
        assert last is not None
        raise last

    def _file_named_in(self, message: str) -> str | None:
        for m in _FILE_IN_ERROR.finditer(message):
            if m.group(1).startswith(str(self.root)):
                return m.group(1)
        return None

    def read_only_query(self, sql: str) -> pa.Table:
        """Run a user's SQL: one or more reading statements only (SELECT, WITH, EXPLAIN)."""
        try:
            statements = duckdb.extract_statements(sql)
        except duckdb.Error as exc:
            raise PerfscopeError(f"cannot parse the query: {exc}") from None
        if not statements:
            raise PerfscopeError("the query is empty; give a SELECT statement")
        for st in statements:
            kind = st.type.name
            if kind not in READ_STATEMENTS:
                raise PerfscopeError(
                    f"only reading queries are allowed (SELECT, WITH, EXPLAIN); got a {kind} statement"
                )
        try:
            result = None
            for st in statements:
                result = self.query(st.query)
            assert result is not None
            return result
        except duckdb.Error as exc:
            raise PerfscopeError(f"query failed: {exc}", exit_code=1) from None

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_spill: list[str] = []


def _spill_dir() -> str:
    """One folder per process where DuckDB may spill large aggregations; removed at exit."""
    with _cache_lock:
        if not _spill:
            _spill.append(tempfile.mkdtemp(prefix="perfscope-duckdb-"))
            atexit.register(shutil.rmtree, _spill[0], True)
        return _spill[0]


def _check_root(root: Path) -> None:
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


def open_store(path: str | os.PathLike[str], *, allow_empty: bool = False, warn: bool = True) -> Store:
    """Open the store at `path` for reading: `store.con` has one view per table, `store.query`
    returns Arrow tables. Raises StoreError with what to do when the path holds no store."""
    return Store(path, allow_empty=allow_empty, warn=warn)
