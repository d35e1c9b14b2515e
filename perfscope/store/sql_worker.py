"""The process one user query runs in (user_sql.UserSql starts it, calling `main`).

DuckDB's interrupt does not stop work that never yields (a list lambda: `list_reduce` of 10^8 items
ran 340 s past a 5 s limit), and its memory limit does not cover every function (`repeat('x', 2e9)`
held 4 GB past a 2 GB limit), so the query runs here, where the server can kill it: the process
reads its request (a pickle the parent wrote) from standard input, writes the result as an Arrow IPC
stream to standard output, and on failure one line `perfscope-error {json}` to standard error.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from ..duckdb_check import configure as configure_duckdb
from ..errors import PerfscopeError
from .listing import Listing, create_views, unread_view_sql

#: the prefix of the line that says why a query failed
ERROR_MARK = "perfscope-error "
#: the largest record batch sent to the parent: a wider one is split by rows; one row larger than this
#: is refused (the parent would hold it whole in Python)
MAX_BATCH_BYTES = 64 * 2**20


@dataclass
class Request:
    listing: Listing
    spill: str
    memory_limit: str
    threads: int | None
    text: str
    batch_rows: int
    #: duckdb_check.needed_setting() of the parent (the same DuckDB): the worker does not probe again
    disabled_optimizers: str | None


def pieces(batch: pa.RecordBatch, limit: int = MAX_BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """`batch` in slices of at most `limit` bytes each; a PerfscopeError for a row larger than that."""
    if batch.nbytes <= limit or batch.num_rows == 0:
        yield batch
        return
    if batch.num_rows == 1:
        raise PerfscopeError(
            f"a row of the result holds {batch.nbytes / 2**20:,.0f} MB, more than the "
            f"{limit // 2**20} MB a row may hold; select less of it (e.g. left(column, 1000))",
            exit_code=1,
        )
    half = batch.num_rows // 2
    yield from pieces(batch.slice(0, half), limit)
    yield from pieces(batch.slice(half), limit)


#: disk a user query may spill to
SPILL_LIMIT = "8GB"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _quoted(items: list[str]) -> str:
    return "[" + ", ".join("'" + s.replace("'", "''") + "'" for s in items) + "]"


def _connect(
    listing: Listing,
    spill: str,
    memory_limit: str,
    threads: int | None,
    *,
    checked: bool = False,
    disabled_optimizers: str | None = None,
    query: str | None = None,
) -> duckdb.DuckDBPyConnection:
    """A connection holding the listing's views, able to open only the listed segments, then locked.
    `checked`: DuckDB was checked already, and `disabled_optimizers` is what it needs (a worker is
    handed its parent's finding: probing again cost each worker most of a second). `query`: only the
    tables it names are bound to their files (named_tables); the others are views of the same columns
    that refuse to be read."""
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET enable_progress_bar=false")
        con.execute(f"SET temp_directory={_quoted([spill])[1:-1]}")
        con.execute(f"SET max_temp_directory_size='{SPILL_LIMIT}'")
        con.execute("SET memory_limit=?", [memory_limit])
        if threads is not None:
            con.execute(f"SET threads={int(threads)}")
        named = named_tables(listing, query)
        files = [str(seg.path) for table in named for seg in listing.of(table)]
        con.execute(f"SET allowed_paths={_quoted(files)}")
        con.execute(f"SET allowed_directories={_quoted([spill])}")
        con.execute("SET enable_external_access=false")
        create_views(con, listing, tables=named)
        for table in set(listing.blocks) - set(named):
            con.execute(f"CREATE VIEW {table} AS {unread_view_sql(table)}")
        if checked:
            if disabled_optimizers is not None:
                con.execute(f"SET disabled_optimizers={_quoted([disabled_optimizers])[1:-1]}")
        else:
            configure_duckdb(con)
        con.execute("SET lock_configuration=true")
    except duckdb.Error as exc:
        con.close()
        if "memory" in str(exc).lower():
            raise PerfscopeError(f"invalid memory limit {memory_limit!r}: {_first_line(exc)}") from None
        raise
    return con


def named_tables(listing: Listing, query: str | None) -> list[str]:
    """The store's tables whose name `query` holds as a word (any case, quoted or not, in a FROM, a
    subquery or query_table('...')): a superset of those it reads. Binding a view to its files costs
    DuckDB time and memory per file (1.5 s and 650 MB for 100,000 segments, plus as much again to
    allow their paths), so `SELECT 1`, or a query of `runs` beside a long run's 100,000 steps
    segments, binds none of them. Every table when there is no query."""
    if query is None:
        return list(listing.blocks)
    return [t for t in listing.blocks if re.search(rf"(?<![A-Za-z0-9_$]){t}(?![A-Za-z0-9_$])", query, re.I)]


def _say(kind: str, message: str, exit_code: int = 1) -> None:
    line = json.dumps({"kind": kind, "message": message, "exit_code": exit_code})
    sys.stderr.write(ERROR_MARK + line + "\n")
    sys.stderr.flush()


def _run(request: Request) -> None:
    con = _connect(
        request.listing,
        request.spill,
        request.memory_limit,
        request.threads,
        checked=True,
        disabled_optimizers=request.disabled_optimizers,
        query=request.text,
    )
    rel = con.sql(request.text)
    reader = (
        rel.to_arrow_reader(request.batch_rows)
        if rel is not None
        else pa.RecordBatchReader.from_batches(pa.schema([]), [])  # a statement without rows
    )
    out = sys.stdout.buffer
    with pa.ipc.new_stream(out, reader.schema) as writer:
        for batch in reader:
            for piece in pieces(batch):
                writer.write_batch(piece)
    out.flush()


def _die_with_parent() -> None:
    """On Linux, end with the process that started this one (a CLI killed by SIGKILL, a server that
    crashed): its watchdog went with it, and a query that never yields would run on unbounded."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent was gone before the call
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def _warm_up() -> None:
    """A worker started ahead of its query (user_sql._Spares) makes one connection with views while it
    waits: the first in a process took 0.5-1 s, the next 40 ms."""
    import tempfile

    with contextlib.suppress(duckdb.Error, OSError, PerfscopeError):
        _connect(Listing(), tempfile.gettempdir(), "100MB", 1, checked=True).close()


def main() -> int:
    _die_with_parent()
    if "--warm" in sys.argv[1:]:
        _warm_up()
    try:
        request = pickle.load(sys.stdin.buffer)  # written by the parent process, never by a user
    except EOFError:
        return 0  # a worker started ahead, never used: its process ended
    try:
        _run(request)
    except BrokenPipeError:
        return 0  # the parent read what it wanted and closed the stream
    except PerfscopeError as exc:
        _say("PerfscopeError", exc.message, exc.exit_code)
        return 3
    except (duckdb.Error, OSError, pa.ArrowException) as exc:
        _say(type(exc).__name__, str(exc))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
