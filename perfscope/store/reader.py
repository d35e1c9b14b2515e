"""The reader: an open store, one DuckDB view per table over its current listing.

A truncated, corrupt or foreign file is skipped and named in a warning; it never breaks a query.
The connection can read only the store's own folder.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from ..duckdb_check import configure as configure_duckdb
from ..errors import PerfscopeWarning, StoreError, one_line
from .listing import (
    Listing,
    analysis_memory_limit,
    check_root,
    create_views,
    is_utf8,
    list_store,
    live_relation,
    spill_dir,
    sql_text,
)
from .segments import Segment, SkippedFile
from .user_sql import UserSql

_FILE_IN_ERROR = re.compile(r"""["']?(/[^"'\s]+?\.parquet)["']?""")


class Store:
    """A store opened for reading. `con` has one view per table; `query` survives concurrent compaction."""

    def __init__(self, root: str | os.PathLike[str], *, allow_empty: bool = False, warn: bool = True):
        self.root = Path(root).resolve()
        if not is_utf8(str(self.root)):  # DuckDB takes only UTF-8 paths: say so before it fails
            raise StoreError(
                f"the store path {one_line(str(self.root))} is not valid UTF-8, and perfscope reads "
                "stores through DuckDB, which takes only UTF-8 paths; rename the folder (or link to it "
                "from a UTF-8 name)"
            )
        self._allow_empty = allow_empty
        self._warn = warn
        self._forced_skips: dict[str, str] = {}
        self._lock = threading.RLock()
        self._spill_dir = spill_dir()
        self._con = duckdb.connect(":memory:")
        self._con.execute(f"SET temp_directory='{self._spill_dir}'")
        # DuckDB's default limit is 80 % of the machine: analyses of a store of thousands of ranks
        # would take that much before spilling. PERFSCOPE_MEMORY_LIMIT ("4GB", "512MiB") moves it.
        # (a literal, as every statement of an open: DuckDB's first bound parameter imports pandas,
        # 0.3 s and 45 MB; analysis_memory_limit() returns only a size it checked)
        self._con.execute(f"SET memory_limit={sql_text(analysis_memory_limit())}")
        # DuckDB draws a progress bar on stdout for long queries, which would corrupt --json output
        self._con.execute("SET enable_progress_bar=false")
        self._con.execute(
            "SET allowed_directories=["
            + ", ".join(sql_text(str(p)) for p in (self.root, self._spill_dir))
            + "]"
        )
        self._con.execute("SET enable_external_access=false")
        configure_duckdb(self._con)
        self._con.execute("SET lock_configuration=true")
        self.listing = Listing()
        self._listed = False
        self._live_names: set[str] = set()
        #: tables whose view is (re)created when a query first names one: binding a view reads a
        #: footer per file, which a store of 100,000 segments cannot afford at every open
        self._views_due: set[str] = set()
        self.refresh()

    @property
    def skipped(self) -> list[SkippedFile]:
        return self.listing.skipped + [SkippedFile(p, r) for p, r in self._forced_skips.items()]

    @property
    def doubtful(self) -> list[SkippedFile]:
        """Files read whose claim to replace other segments was ignored, and why."""
        return self.listing.doubtful

    @property
    def warns(self) -> bool:
        """Whether this store warns about what it skips (open_store(warn=...))."""
        return self._warn

    def segments(self, table: str) -> list[Segment]:
        return self.listing.of(table)

    def row_count(self, table: str) -> int:
        return self.listing.row_count(table)

    def refresh(self) -> None:
        """Re-list the folder (new segments, compactions) and rebuild the views."""
        with self._lock:
            for attempt in range(8):
                try:
                    self._rebuild()
                    return
                except (duckdb.IOException, FileNotFoundError):
                    # a file vanished between listing and binding (DuckDB's or pyarrow's message): a
                    # compaction or a seal finished; list again
                    if attempt == 7:
                        raise

    def _rebuild(self) -> None:
        check_root(self.root)
        listing = list_store(self.root)
        if self._forced_skips:
            listing.drop(set(self._forced_skips))
        if not self._allow_empty and not any(listing.blocks.values()):
            reasons = "; ".join(f"{Path(s.path).name}: {s.reason}" for s in listing.skipped[:3])
            raise StoreError(
                f"{self.root} holds no perfscope data"
                + (f" (skipped {len(listing.skipped)} files: {reasons})" if listing.skipped else "")
                + ". Record a run into it with perfscope.profile(...) or try `perfscope demo`."
            )
        if self._listed and listing.signature() == self.listing.signature():
            return  # nothing new: the views, live relations and what analyses built over them stand
        self._listed = True
        new_skips = {s.path for s in listing.skipped} - {s.path for s in self.listing.skipped}
        new_doubts = {s.path for s in listing.doubtful} - {s.path for s in self.listing.doubtful}
        self.listing = listing
        live = {live_relation(seg) for seg in listing.live_segments()}
        for gone in self._live_names - live:
            self._con.unregister(gone)
        self._live_names &= live
        self._views_due = set(listing.blocks)
        if self._warn and new_skips:
            self._warn_skipped([s for s in listing.skipped if s.path in new_skips])
        if self._warn and new_doubts:
            self._warn_skipped([s for s in listing.doubtful if s.path in new_doubts], verb="read, but")

    def _warn_skipped(self, skipped: list[SkippedFile], verb: str = "skipped") -> None:
        lines = "\n".join(f"  {s.path}: {s.reason}" for s in skipped[:10])
        more = f"\n  ... and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        warnings.warn(
            f"perfscope: {verb} {len(skipped)} file(s) in {self.root}:\n{lines}{more}",
            PerfscopeWarning,
            stacklevel=3,
        )

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The connection, with one view per table."""
        with self._lock:
            for attempt in range(8):
                try:
                    self._create_views(None)
                    break
                except duckdb.IOException:
                    # a file vanished between listing and binding: a compaction finished; list again
                    if attempt == 7:
                        raise
                    self.refresh()
            return self._con

    def _create_views(self, sql: str | None) -> None:
        """Create the views `sql` may name (a word of the text, so a mention in a string counts too,
        but not a folder in a file path; all of them when `sql` is None) that are not up to date
        with the listing."""
        due = {
            t
            for t in self._views_due
            if sql is None or re.search(rf"(?<![/\\])\b{t}\b(?![/\\])", sql, re.IGNORECASE)
        }
        if due:
            self._live_names |= create_views(self._con, self.listing, replace=True, tables=due)
            self._views_due -= due

    def query(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run `sql` and return an Arrow table; a segment compacted away or found corrupt mid-query
        is handled by re-listing the store and trying again."""
        last: Exception | None = None
        for _ in range(20):
            with self._lock:
                try:
                    self._create_views(sql)
                    rel = self._con.sql(sql, params=params)
                    if rel is None:  # a statement that returns nothing
                        return pa.table({})
                    return rel.to_arrow_table()
                except (duckdb.IOException, duckdb.InvalidInputException, FileNotFoundError) as exc:
                    last = exc  # FileNotFoundError: pyarrow found a segment gone (a compaction)
                    if not self.recover(exc):
                        raise
        assert last is not None
        raise last

    def recover(self, exc: BaseException) -> bool:
        """After a query failed with `exc`: True when a store file named in it vanished (a compaction
        finished) or fails when read on its own (skipped from now on) and the views were rebuilt, so
        the query may run again; False when the failure is the query's own. A file a query merely
        failed to read some other way (`read_csv` of a segment) is never marked bad."""
        bad = self._file_named_in(str(exc))
        listed = {f for blocks in self.listing.blocks.values() for b in blocks for f in b.files()}
        if bad is None or bad not in listed:
            return False  # only the store's own segments are re-listed or marked, never a path a query named
        with self._lock:
            if Path(bad).exists():
                if bad in self._forced_skips or not _unreadable(Path(bad)):
                    return False
                self._forced_skips[bad] = f"unreadable during a query: {str(exc).splitlines()[0]}"
                if self._warn:
                    self._warn_skipped([SkippedFile(bad, self._forced_skips[bad])])
            self.refresh()
        return True

    def _file_named_in(self, message: str) -> str | None:
        for m in _FILE_IN_ERROR.finditer(message):
            if m.group(1).startswith(str(self.root)):
                return m.group(1)
        return None

    def read_only_query(self, sql: str, *, timeout_s: float | None = None) -> pa.Table:
        """Run a user's SQL (one plain query) on a private read-only connection; see `user_sql`."""
        with UserSql(self) as session:
            fetched = session.fetch(sql, timeout_s=timeout_s)
        if fetched.bound:
            raise StoreError(
                f"the result is larger than perfscope holds in memory ({fetched.bound}); narrow it "
                "(WHERE, LIMIT, fewer columns) or stream it to a file with `perfscope sql -o`"
            )
        return fetched.table

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unreadable(path: Path) -> bool:
    """Whether DuckDB fails to read every row of the Parquet file at `path` on a connection of its own."""
    con = duckdb.connect(":memory:")
    try:
        for _ in con.sql("SELECT * FROM read_parquet(?)", params=[str(path)]).to_arrow_reader(65536):
            pass
        return False
    except Exception:
        return True
    finally:
        con.close()
