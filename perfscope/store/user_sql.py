"""A user's SQL, run so that it can change nothing and cannot exhaust the machine.

DuckDB's own parse admits one plain query (SELECT, WITH ... SELECT, EXPLAIN without ANALYZE). It runs
on a private connection that holds only the store's views and may open only the store's segment files
(no COPY target, no ATTACH, no SET), under a memory limit and an optional time limit, and its result is
read in batches, so a 400 M-row answer streams to a file instead of filling memory.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from ..duckdb_check import configure as configure_duckdb
from ..errors import PerfscopeError
from .listing import Listing, create_views, spill_dir

if TYPE_CHECKING:
    from .reader import Store  # the store this session reads (reader.py builds on this module)

#: DuckDB's memory for one user query; beyond it, sorts and joins spill to disk or the query fails
DEFAULT_MEMORY_LIMIT = "2GB"
#: disk a user query may spill to
SPILL_LIMIT = "8GB"
#: rows read from DuckDB at a time: DuckDB's own vector size, so a batch of rows as wide as DuckDB's
#: memory limit allows stays small in Python (65,536 rows of 20,000 characters took `perfscope sql -o`
#: to 6.7 GB); narrow rows lose nothing, DuckDB produces them 2,048 at a time anyway
BATCH_ROWS = 2_048
#: what `fetch` may hold in Python for one query (Arrow results live outside DuckDB's memory limit)
FETCH_MAX_BYTES = 256 * 2**20
#: exit status of every refused query (a write, several statements, a file outside the store):
#: PerfscopeError's default, the status of a usage error; a query that fails while it runs exits 1
REFUSED_EXIT = 2
#: user queries running at once in one process (the dashboard's sessions share them), and how long a
#: query waits for one before it is refused
RUNNING_QUERIES = 2
SLOT_WAIT_S = 10.0
_slots = threading.BoundedSemaphore(RUNNING_QUERIES)
#: the largest query planned (planning ignores the time limit): characters, tokens, SELECTs (a
#: UNION ALL of 1,000 SELECTs planned in 0.75 s, of 3,000 in 7 s) and parentheses deep
MAX_QUERY_CHARS = 100_000
MAX_QUERY_TOKENS = 20_000
MAX_QUERY_SELECTS = 250
MAX_QUERY_DEPTH = 100
#: a query meeting files that vanish (a compaction) or turn out corrupt is tried this often
_ATTEMPTS = 4

_LEADING_COMMENTS = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.S)
_EXPLAIN = re.compile(r"EXPLAIN\b\s*(?:\((?P<options>[^()]*)\))?(?P<rest>.*)\Z", re.I | re.S)
_ANALYZE = re.compile(r"\bANALY[SZ]E\b", re.I)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _parse(sql: str) -> list[duckdb.Statement]:
    try:
        return duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise PerfscopeError(f"cannot parse the query: {_first_line(exc)}") from None


def _size_problem(sql: str) -> str:
    """Why `sql` is too large to plan within the time limit, or ''. DuckDB's planner is not stopped by
    an interrupt, and its time grows with the square of the SELECTs (120,000 `UNION ALL SELECT 1`
    planned for 121 s past a 30 s limit), so the text is measured before DuckDB sees it."""
    if len(sql) > MAX_QUERY_CHARS:
        return f"the query holds {len(sql):,} characters; at most {MAX_QUERY_CHARS:,} are planned"
    try:
        tokens = duckdb.tokenize(sql)
    except duckdb.Error:
        return ""  # the parser says what is wrong
    if len(tokens) > MAX_QUERY_TOKENS:
        return f"the query holds {len(tokens):,} tokens; at most {MAX_QUERY_TOKENS:,} are planned"
    selects = depth = deepest = 0
    ends = [off for off, _ in tokens[1:]] + [len(sql)] if tokens else []
    for (off, kind), end in zip(tokens, ends, strict=True):
        if kind == duckdb.token_type.keyword:
            selects += sql[off : off + 6].upper() == "SELECT"
        elif kind == duckdb.token_type.operator:
            span = sql[off:end]
            depth += span.count("(") - span.count(")")
            deepest = max(deepest, depth)
    if selects > MAX_QUERY_SELECTS:
        return f"the query holds {selects:,} SELECTs; at most {MAX_QUERY_SELECTS:,} are planned"
    if deepest > MAX_QUERY_DEPTH:
        return f"the query nests {deepest:,} parentheses deep; at most {MAX_QUERY_DEPTH:,} are planned"
    return ""


def check_query(sql: str) -> str:
    """The one statement of `sql`, when DuckDB parses it as a plain query and it is small enough to
    plan in time; a PerfscopeError saying what is refused otherwise. The statement's kind comes from
    the parser, never from its first word."""
    problem = _size_problem(sql)
    if problem:
        raise PerfscopeError(f"{problem}: split it into smaller queries")
    statements = _parse(sql)
    if not statements:
        raise PerfscopeError("the query is empty; give a SELECT statement")
    for st in statements:
        kind = st.type.name
        if kind not in ("SELECT", "EXPLAIN"):
            raise PerfscopeError(
                f"only reading queries are allowed (SELECT, WITH, EXPLAIN); got a {kind} statement"
            )
    if len(statements) > 1:
        raise PerfscopeError(f"give one query at a time; the text holds {len(statements)} statements")
    text = statements[0].query
    if statements[0].type.name == "EXPLAIN":
        _check_explain(text)
    return text


def _check_explain(text: str) -> None:
    m = _EXPLAIN.match(text, _LEADING_COMMENTS.match(text).end())  # type: ignore[union-attr]
    if m is None:
        raise PerfscopeError("only reading queries are allowed; EXPLAIN must begin the statement")
    if _ANALYZE.search(m["options"] or "") or _ANALYZE.match(m["rest"].lstrip()):
        raise PerfscopeError(
            "only reading queries are allowed: EXPLAIN ANALYZE runs the statement; use EXPLAIN alone"
        )
    inner = _parse(m["rest"])
    if len(inner) != 1 or inner[0].type.name != "SELECT":
        kind = inner[0].type.name if inner else "empty"
        raise PerfscopeError(f"only reading queries are allowed; EXPLAIN of a {kind} statement is refused")


def _quoted(items: list[str]) -> str:
    return "[" + ", ".join("'" + s.replace("'", "''") + "'" for s in items) + "]"


def _connect(
    listing: Listing, spill: str, memory_limit: str, threads: int | None
) -> duckdb.DuckDBPyConnection:
    """A connection holding the listing's views, able to open only the listed segments, then locked."""
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_progress_bar=false")
        con.execute(f"SET temp_directory={_quoted([spill])[1:-1]}")
        con.execute(f"SET max_temp_directory_size='{SPILL_LIMIT}'")
        con.execute("SET memory_limit=?", [memory_limit])
        if threads is not None:
            con.execute(f"SET threads={int(threads)}")
        files = [str(seg.path) for segs in listing.segments.values() for seg in segs]
        con.execute(f"SET allowed_paths={_quoted(files)}")
        con.execute(f"SET allowed_directories={_quoted([spill])}")
        con.execute("SET enable_external_access=false")
        create_views(con, listing)
        configure_duckdb(con)
        con.execute("SET lock_configuration=true")
    except duckdb.Error as exc:
        con.close()
        if "memory" in str(exc).lower():
            raise PerfscopeError(f"invalid memory limit {memory_limit!r}: {_first_line(exc)}") from None
        raise
    return con


@dataclass
class Fetched:
    """The first rows of a result, and whether there were more."""

    table: pa.Table
    complete: bool
    #: why the rows stop short of `max_rows` when a bound other than rows stopped them ('' otherwise)
    bound: str = ""


class UserSql:
    """One private connection for a user's queries over a store: one per CLI call or dashboard session,
    so nothing one session does reaches another, and a slow query blocks no one else's."""

    def __init__(self, store: Store, *, memory_limit: str = DEFAULT_MEMORY_LIMIT, threads: int | None = None):
        self.store = store
        self._memory_limit = memory_limit
        self._threads = threads
        self._con: duckdb.DuckDBPyConnection | None = None
        self._listing: Listing | None = None
        self._lock = threading.Lock()
        self._timed_out = False
        self._spill = tempfile.mkdtemp(prefix="sql-", dir=spill_dir())
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._spill, True)

    def _connection(self) -> duckdb.DuckDBPyConnection:
        """The connection, rebuilt when the store re-listed its segments (the allowed files changed)."""
        if self._con is None or self._listing is not self.store.listing:
            if self._con is not None:
                self._con.close()
            self._listing = self.store.listing
            self._con = _connect(self._listing, self._spill, self._memory_limit, self._threads)
        return self._con

    def batches(self, sql: str, *, timeout_s: float | None = None) -> Rows:
        """The result of `sql`, read batch by batch; close it (or use it as a context manager)."""
        text = check_query(sql)
        if timeout_s is not None and not timeout_s > 0:
            raise PerfscopeError("the time limit must be a positive number of seconds")
        # One query at a time on this connection, released by Rows.close. A query still running (a
        # dashboard user ran another meanwhile) is stopped: the newer one is what they want. Again
        # and again, as an interrupt that arrives before it starts executing is lost.
        while not self._lock.acquire(timeout=0.1):
            self._interrupt_running()
        # every session's query takes one of the process's slots: a dashboard's total memory is
        # bounded by RUNNING_QUERIES x (DuckDB's limit + FETCH_MAX_BYTES), however many tabs are open
        if not _slots.acquire(timeout=SLOT_WAIT_S):
            self._lock.release()
            raise PerfscopeError(
                f"{RUNNING_QUERIES} queries are already running on this server, its bound on queries at "
                f"once (each may hold {self._memory_limit} in DuckDB); try again when one ends",
                exit_code=1,
            )
        self._timed_out = False
        timer = threading.Timer(timeout_s, self._interrupt) if timeout_s is not None else None
        rows = Rows(self, timer, timeout_s)
        try:
            if timer is not None:
                timer.daemon = True
                timer.start()
            rows._start(text)
        except BaseException:
            rows.close()
            raise
        return rows

    def _interrupt(self) -> None:
        self._timed_out = True
        self._interrupt_running()

    def _interrupt_running(self) -> None:
        con = self._con
        if con is not None:
            con.interrupt()

    def fetch(
        self,
        sql: str,
        *,
        timeout_s: float | None = None,
        max_rows: int | None = None,
        max_bytes: int = FETCH_MAX_BYTES,
    ) -> Fetched:
        """The result of `sql` as one table: all of it, or its first `max_rows` rows, or the rows
        read before they held `max_bytes` (Arrow's buffers, outside DuckDB's memory limit)."""
        with self.batches(sql, timeout_s=timeout_s) as rows:
            got: list[pa.RecordBatch] = []
            n = held = 0
            bounded = False
            for batch in rows:
                got.append(batch)
                n += batch.num_rows
                held += batch.nbytes
                if max_rows is not None and n > max_rows:
                    break
                if held > max_bytes:
                    bounded = True
                    break
            table = pa.Table.from_batches(got, schema=rows.schema)
        if max_rows is not None and table.num_rows > max_rows:
            return Fetched(table.slice(0, max_rows), complete=False)
        if bounded:
            return Fetched(table, complete=False, bound=f"its rows passed {max_bytes // 2**20} MB")
        return Fetched(table, complete=True)

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None
        self._cleanup()

    def __enter__(self) -> UserSql:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Rows:
    """A running user query: `schema`, then its record batches; errors come out as PerfscopeError."""

    def __init__(self, session: UserSql, timer: threading.Timer | None, timeout_s: float | None):
        self._session = session
        self._timer = timer
        self._timeout_s = timeout_s
        self._reader: pa.RecordBatchReader | None = None
        self._first: pa.RecordBatch | None = None
        self._closed = False
        self.schema = pa.schema([])

    def _start(self, text: str) -> None:
        for attempt in range(_ATTEMPTS):
            try:
                con = self._session._connection()
                # a relation's reader: Arrow from a DB-API result (con.execute) copies every row, and
                # DuckDB 2 prints a warning for it on the user's console
                rel = con.sql(text)
                self._reader = (
                    rel.to_arrow_reader(BATCH_ROWS)
                    if rel is not None
                    else pa.RecordBatchReader.from_batches(pa.schema([]), [])  # a statement without rows
                )
                self.schema = self._reader.schema
                self._first = self._next()
                return
            except PerfscopeError:
                raise
            except (duckdb.Error, OSError) as exc:
                if (
                    self._session._timed_out
                    or attempt == _ATTEMPTS - 1
                    or not self._session.store.recover(exc)
                ):
                    raise self._error(exc) from None

    def _next(self) -> pa.RecordBatch | None:
        assert self._reader is not None
        try:
            return self._reader.read_next_batch()
        except StopIteration:
            return None

    def _error(self, exc: BaseException) -> PerfscopeError:
        if self._session._timed_out:
            return PerfscopeError(
                f"the query was stopped after its time limit of {self._timeout_s:g} s; narrow it "
                "(WHERE, LIMIT, fewer columns) or allow more time",
                exit_code=1,
            )
        if isinstance(exc, duckdb.PermissionException):  # a file outside the store: refused, not failed
            return PerfscopeError(
                f"only the store's tables may be read: {_first_line(exc)}", exit_code=REFUSED_EXIT
            )
        return PerfscopeError(f"query failed: {_first_line(exc)}", exit_code=1)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while not self._closed:
            try:
                batch = self._next()
            except (duckdb.Error, OSError) as exc:
                raise self._error(exc) from None
            if batch is None:
                return
            yield batch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._reader is not None:
            self._reader.close()
            self._release_result()
        _slots.release()
        self._session._lock.release()

    def _release_result(self) -> None:
        """DuckDB keeps a connection's last result, and the memory it took, until the next statement:
        a dashboard session that read 100,000 wide rows held 600 MB while idle, and six sessions 4 GB
        (benchmarks/dashboard_memory.py). A trivial statement frees it now."""
        con = self._session._con
        if con is not None:
            with contextlib.suppress(duckdb.Error):
                con.execute("SELECT 1").fetchall()

    def __enter__(self) -> Rows:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
