"""A user's SQL, run so that it can change nothing and cannot exhaust the machine.

DuckDB's own parse admits one plain query (SELECT, WITH ... SELECT, EXPLAIN without ANALYZE). It runs
on a private connection that holds only the store's views and may open only the store's segment files
(no COPY target, no ATTACH, no SET), under a memory limit and an optional time limit, and its result is
read in batches, so a 400 M-row answer streams to a file instead of filling memory.
Each query runs in a worker process (sql_worker.py) under a watchdog that kills it past the time
limit or past its memory bound (worker_memory_bound): DuckDB's interrupt does not stop a list lambda,
and its memory limit does not cover `repeat`, so neither is trusted alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TYPE_CHECKING

import duckdb
import psutil
import pyarrow as pa

from ..duckdb_check import needed_setting
from ..errors import PerfscopeError
from ..sizes import parse_size
from .listing import spill_dir
from .sql_worker import ERROR_MARK, MAX_BATCH_BYTES, Request, _first_line

if TYPE_CHECKING:
    from .reader import Store  # the store this session reads (reader.py builds on this module)

#: DuckDB's memory for one user query; beyond it, sorts and joins spill to disk or the query fails
DEFAULT_MEMORY_LIMIT = "2GB"
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
#: the resident memory of a query's worker process beyond DuckDB's limit: the interpreter, DuckDB,
#: Arrow and the store's views (measured: 150-200 MB), with room to spare; the watchdog looks every
#: WATCH_INTERVAL_S, and a worker that failed is given GRACE_S to end before it is killed
WORKER_BASE_BYTES = 384 * 2**20
WATCH_INTERVAL_S = 0.02
GRACE_S = 5.0
#: a query meeting files that vanish (a compaction) or turn out corrupt is tried this often
_ATTEMPTS = 4

_LEADING_COMMENTS = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.S)
_EXPLAIN = re.compile(r"EXPLAIN\b\s*(?:\((?P<options>[^()]*)\))?(?P<rest>.*)\Z", re.I | re.S)
_ANALYZE = re.compile(r"\bANALY[SZ]E\b", re.I)


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


@dataclass
class Fetched:
    """The first rows of a result, and whether there were more."""

    table: pa.Table
    complete: bool
    #: why the rows stop short of `max_rows` when a bound other than rows stopped them ('' otherwise)
    bound: str = ""


class UserSql:
    """One private session for a user's queries over a store: one per CLI call or dashboard session,
    so nothing one session does reaches another, and a slow query blocks no one else's. Each query runs
    in a worker process of its own (sql_worker.py) that a watchdog kills past the time limit or past
    the memory bound (worker_memory_bound), whether or not DuckDB would stop it."""

    def __init__(
        self,
        store: Store,
        *,
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
        threads: int | None = None,
        warm: bool = False,
    ):
        """`warm`: take workers started ahead of the query (_Spares), for a session that runs many."""
        self.store = store
        self._warm = warm
        self._memory_limit = memory_limit
        self._threads = threads
        limit = parse_size(memory_limit)
        if limit is None:
            raise PerfscopeError(f"invalid memory limit {memory_limit!r}: give a size such as 500MB or 8GB")
        #: the resident memory the worker may reach before it is killed
        self.rss_bound = worker_memory_bound(limit)
        self._lock = threading.Lock()
        self._running: Rows | None = None
        self._spill = tempfile.mkdtemp(prefix="sql-", dir=spill_dir())
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._spill, True)

    def batches(self, sql: str, *, timeout_s: float | None = None) -> Rows:
        """The result of `sql`, read batch by batch; close it (or use it as a context manager)."""
        text = check_query(sql)
        if timeout_s is not None and not timeout_s > 0:
            raise PerfscopeError("the time limit must be a positive number of seconds")
        # One query at a time per session, released by Rows.close. A query still running (a dashboard
        # user ran another meanwhile) is stopped: the newer one is what they want.
        while not self._lock.acquire(timeout=0.1):
            running = self._running
            if running is not None:
                running._stop("replaced")
        # every session's query takes one of the process's slots: a dashboard's total memory is
        # bounded by RUNNING_QUERIES x (the worker's bound + FETCH_MAX_BYTES), however many tabs are open
        if not _slots.acquire(timeout=SLOT_WAIT_S):
            self._lock.release()
            raise PerfscopeError(
                f"{RUNNING_QUERIES} queries are already running on this server, its bound on queries at "
                f"once (each may hold {self._memory_limit} in DuckDB); try again when one ends",
                exit_code=1,
            )
        rows = Rows(self, timeout_s)
        self._running = rows
        try:
            rows._start(text)
        except BaseException:
            rows.close()
            raise
        return rows

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

    def _clear_spill(self) -> None:
        """What a killed worker spilled stays behind it: removed before the next query."""
        shutil.rmtree(self._spill, ignore_errors=True)
        os.makedirs(self._spill, exist_ok=True)

    def close(self) -> None:
        running = self._running
        if running is not None:
            running._stop("closed")
        with self._lock:
            pass
        self._cleanup()

    def __enter__(self) -> UserSql:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_memory_bound(memory_limit: int) -> int:
    """The resident memory a query's worker may reach: DuckDB's limit, the interpreter and its
    libraries, and one batch on its way out (sql_worker.MAX_BATCH_BYTES, twice: Arrow and the pipe)."""
    return memory_limit + WORKER_BASE_BYTES + 2 * MAX_BATCH_BYTES


#: the worker's command (not `-m`: perfscope.store imports the module before runpy would run it)
_WORKER = [sys.executable, "-c", "import sys; from perfscope.store.sql_worker import main; sys.exit(main())"]

Worker = tuple["subprocess.Popen[bytes]", IO[bytes]]


def _new_worker(warm: bool = False) -> Worker:
    """A worker process, importing its libraries (`warm`: and making a first connection), then waiting
    for its request; its standard error goes to an unnamed file (closed with it, Rows._end_worker)."""
    errors = tempfile.TemporaryFile(dir=spill_dir())  # noqa: SIM115
    proc = subprocess.Popen(
        [*_WORKER, *(["--warm"] if warm else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        close_fds=True,
    )
    return proc, errors


class _Spares:
    """Workers started ahead of the queries of long-lived sessions (the dashboard's): starting one
    (Python, DuckDB, Arrow) took 1-2 s on a loaded machine, before every query. At most
    RUNNING_QUERIES wait at once, idle (about 200 MB each), whatever the number of sessions; each
    serves one query. They
    are started by one thread that lives as long as the process: a worker ends with the thread that
    started it (sql_worker._die_with_parent)."""

    def __init__(self) -> None:
        self._ready: list[Worker] = []
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> Worker | None:
        """A started worker, or None (one is then started for the next query)."""
        got = None
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._keep, name="perfscope-sql-spares", daemon=True)
                self._thread.start()
            while self._ready and got is None:
                proc, errors = self._ready.pop()
                if proc.poll() is None:
                    got = (proc, errors)
                else:
                    errors.close()
        self._wanted.set()
        return got

    def _keep(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            while True:
                with self._lock:
                    if len(self._ready) >= RUNNING_QUERIES:
                        break
                try:
                    worker = _new_worker(warm=True)
                except OSError:
                    break  # out of processes: queries start their own
                with self._lock:
                    self._ready.append(worker)


_spares = _Spares()


class Rows:
    """A running user query: `schema`, then its record batches; errors come out as PerfscopeError."""

    def __init__(self, session: UserSql, timeout_s: float | None):
        self._session = session
        self._timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._errors: IO[bytes] | None = None
        self._reader: pa.RecordBatchReader | None = None
        self._first: pa.RecordBatch | None = None
        self._closed = False
        self._done = threading.Event()
        self._watchdog: threading.Thread | None = None
        #: why the watchdog or a newer query stopped the worker ('' while it was not)
        self.stopped = ""
        #: the worker's largest resident memory the watchdog saw
        self.peak_rss = 0
        self.schema = pa.schema([])

    def _start(self, text: str) -> None:
        for attempt in range(_ATTEMPTS):
            try:
                self._spawn(text)
                assert self._proc is not None and self._proc.stdout is not None
                self._reader = pa.ipc.open_stream(self._proc.stdout)
                self.schema = self._reader.schema
                self._first = self._next()
                return
            except (pa.ArrowException, OSError) as exc:
                failure = self._failure(exc)
                if (
                    self.stopped
                    or attempt == _ATTEMPTS - 1
                    or failure.kind == "PerfscopeError"
                    or not self._session.store.recover(Exception(failure.message))
                ):
                    raise self._error(failure) from None
                self._end_worker()

    def _spawn(self, text: str) -> None:
        listing = self._session.store.listing
        request = Request(
            listing=dataclasses.replace(listing, derived={}),
            spill=self._session._spill,
            memory_limit=self._session._memory_limit,
            threads=self._session._threads,
            text=text,
            batch_rows=BATCH_ROWS,
            disabled_optimizers=needed_setting(),  # found once here, not again in every worker
        )
        warm = _spares.take() if self._session._warm else None
        self._proc, self._errors = warm or _new_worker()
        self._done.clear()
        self._watchdog = threading.Thread(target=self._watch, args=(self._proc,), daemon=True)
        self._watchdog.start()
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: its error says why
            self._proc.stdin.write(pickle.dumps(request))
            self._proc.stdin.close()

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill the worker past the time limit or past its memory bound."""
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        try:
            ps = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not self._done.wait(WATCH_INTERVAL_S):
            if deadline is not None and time.monotonic() > deadline:
                self._stop("time")
                return
            try:
                rss = ps.memory_info().rss
            except psutil.Error:
                return  # it ended
            self.peak_rss = max(self.peak_rss, rss)
            if rss > self._session.rss_bound:
                self._stop("memory")
                return

    def _stop(self, why: str) -> None:
        """Kill the worker (its reader then ends), saying why."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            if not self.stopped:
                self.stopped = why
            with contextlib.suppress(OSError):
                proc.kill()

    def _next(self) -> pa.RecordBatch | None:
        assert self._reader is not None
        try:
            return self._reader.read_next_batch()
        except StopIteration:
            self._end_of_stream()
            return None

    def _end_of_stream(self) -> None:
        """The stream ended: a result read whole, or a worker that failed or was killed (raises)."""
        assert self._proc is not None
        code = self._proc.wait()
        if code != 0 or self.stopped:
            raise self._error(self._failure(None))
        return None

    def _failure(self, exc: BaseException | None) -> _Failure:
        """What the worker said went wrong, once it ended."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=GRACE_S)
            if self._proc.poll() is None:
                self._stop("failed")
                self._proc.wait()
        said = b""
        if self._errors is not None:
            self._errors.seek(0)
            said = self._errors.read()[-65536:]
        for line in reversed(said.decode("utf-8", "replace").splitlines()):
            if line.startswith(ERROR_MARK):
                with contextlib.suppress(ValueError, KeyError):
                    got = json.loads(line[len(ERROR_MARK) :])
                    return _Failure(str(got["kind"]), str(got["message"]), int(got["exit_code"]))
        code = self._proc.returncode if self._proc is not None else None
        detail = _first_line(exc) if exc is not None else f"its process ended with status {code}"
        return _Failure("", f"the query's process failed: {detail}", 1)

    def _error(self, failure: _Failure) -> PerfscopeError:
        if self.stopped == "time":
            return PerfscopeError(
                f"the query was stopped after its time limit of {self._timeout_s:g} s; narrow it "
                "(WHERE, LIMIT, fewer columns) or allow more time",
                exit_code=1,
            )
        if self.stopped == "memory":
            return PerfscopeError(
                f"the query was stopped when it held {self.peak_rss / 2**20:,.0f} MB, past its bound of "
                f"{self._session.rss_bound / 2**20:,.0f} MB (memory limit {self._session._memory_limit} "
                "and the query's process); narrow it or allow more with --memory-limit",
                exit_code=1,
            )
        if self.stopped == "replaced":
            return PerfscopeError(
                "the query was stopped: a newer query of this session replaced it", exit_code=1
            )
        if self.stopped:
            return PerfscopeError("the query was stopped", exit_code=1)
        if failure.kind == "PerfscopeError":
            return PerfscopeError(failure.message, exit_code=failure.exit_code)
        if failure.kind == "PermissionException":  # a file outside the store: refused, not failed
            return PerfscopeError(
                f"only the store's tables may be read: {_first_line(Exception(failure.message))}",
                exit_code=REFUSED_EXIT,
            )
        return PerfscopeError(f"query failed: {_first_line(Exception(failure.message))}", exit_code=1)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while not self._closed:
            try:
                batch = self._next()
            except (pa.ArrowException, OSError) as exc:
                raise self._error(self._failure(exc)) from None
            if batch is None:
                return
            yield batch

    def _end_worker(self) -> None:
        self._done.set()
        if self._proc is not None:
            if self._proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdout, self._proc.stdin):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        if self._errors is not None:
            self._errors.close()
        if self._watchdog is not None:
            self._watchdog.join()
        killed = self._proc is not None and self._proc.returncode not in (0, 3)
        self._proc = self._errors = self._reader = self._watchdog = None
        if killed:
            self._session._clear_spill()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._end_worker()  # a worker still writing rows nobody reads is killed: its memory goes with it
        finally:
            self._session._running = None
            _slots.release()
            self._session._lock.release()

    def __enter__(self) -> Rows:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass
class _Failure:
    kind: str
    message: str
    exit_code: int
