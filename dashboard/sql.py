"""SQL page: a read-only query box over the store's tables, with the schema beside it.

Each browser session runs its queries on its own bounded connection (state.session_sql): a time limit,
a memory limit, and only the rows it draws are fetched; the first DOWNLOAD_ROWS rows and
DOWNLOAD_BYTES of CSV are a download away.
"""

from __future__ import annotations

import pyarrow as pa
import streamlit as st

from perfscope.errors import PerfscopeError
from perfscope.output import csv_pieces, csv_text
from perfscope.report.text import literal as md
from perfscope.store.schema import TABLES
from perfscope.store.user_sql import UserSql
from perfscope.words import counted

from .state import Context, session_sql

EXAMPLE = """SELECT run_id, world_size, backend, cluster, batch_size_per_rank
FROM runs
ORDER BY experiment, cluster, backend, batch_size_per_rank, world_size
LIMIT 50"""

#: Rows drawn in the page: the browser holds every row it shows; `perfscope sql -o` writes them all.
SHOWN_ROWS = 10_000
#: ... and at most this many bytes of them: a page of wide rows is read in the download, and each
#: session's table is held by the server while the page is drawn (benchmarks/dashboard_memory.py)
SHOWN_BYTES = 32 * 2**20
#: a query of the page is stopped after this long
TIME_LIMIT_S = 30.0
#: the CSV download: at most this many rows and bytes of CSV, made a few rows at a time while the
#: query holds its slot; the server holds the file while the browser fetches it
DOWNLOAD_ROWS = 1_000_000
DOWNLOAD_BYTES = 64 * 2**20
#: said beside the download button
DOWNLOAD_BOUND = f"the first {DOWNLOAD_ROWS:,} rows and at most {DOWNLOAD_BYTES // 2**20} MB of CSV"


def render(ctx: Context) -> None:
    st.title("SQL")
    st.caption(
        "Read-only SQL (DuckDB) over the store's tables. One SELECT, WITH or EXPLAIN runs, for at most "
        f"{TIME_LIMIT_S:g} s, on this session's own connection, which can read nothing but the store's "
        'files. From a shell, without those limits: `perfscope sql STORE "SELECT …" -o result.csv`.'
    )
    query_col, schema_col = st.columns([3, 2])
    with query_col:
        with st.form("sql_form", border=False):
            text = st.text_area("Query", EXAMPLE, height=180, key="sql_text")
            st.form_submit_button("Run query", icon=":material/play_arrow:", type="primary")
        # the example runs on arrival too, so the page shows what a result looks like at once
        _run(ctx, text)
    with schema_col:
        _schema()


def _run(ctx: Context, text: str) -> None:
    session = session_sql(ctx.store)
    try:
        fetched = session.fetch(text, timeout_s=TIME_LIMIT_S, max_rows=SHOWN_ROWS, max_bytes=SHOWN_BYTES)
    except PerfscopeError as exc:
        st.error(md(exc.message), icon=":material/block:")
        return
    n = fetched.table.num_rows
    if fetched.complete:
        st.caption(counted(n, "row"))
    elif fetched.bound:
        st.caption(
            f"the first {n:,} rows are shown: {fetched.bound}, the most this page shows; download the rest"
        )
    else:
        st.caption(f"more than {SHOWN_ROWS:,} rows; the first {SHOWN_ROWS:,} are shown")
    st.dataframe(fetched.table, hide_index=True)
    download = session_sql(ctx.store, purpose="download")
    st.download_button(
        "Download result (CSV)" if fetched.complete else f"Download up to {DOWNLOAD_ROWS:,} rows (CSV)",
        data=lambda: csv_download(download, text),
        file_name="perfscope-query.csv",
        mime="text/csv",
        icon=":material/download:",
        on_click="ignore",  # the page stays as it is: no rerun, no second run of the query
        help=f"The file holds {DOWNLOAD_BOUND}; `perfscope sql -o` writes all of a result.",
    )
    st.caption(f"The download holds {DOWNLOAD_BOUND}.")


def csv_download(session: UserSql, text: str, limit: int = DOWNLOAD_BYTES) -> bytes:
    """The result as CSV, made when the download is asked for, under the same time limit, on the
    session's download connection (session_sql): whole rows, a few at a time, while the query holds
    its slot, up to DOWNLOAD_ROWS rows and `limit` bytes; never a Python string of every value."""
    out = bytearray()
    n = 0
    try:
        with session.batches(text, timeout_s=TIME_LIMIT_S) as rows:
            out += csv_text(rows.schema.empty_table()).encode()  # the header
            for batch in rows:
                batch = batch.slice(0, DOWNLOAD_ROWS - n)
                at = 0
                for count, piece in csv_pieces(batch, header=False):
                    data = piece.encode()
                    if len(out) + len(data) > limit:  # the rows of this piece that still fit, and stop
                        out += _fitting(batch.slice(at, count), limit - len(out))
                        return bytes(out)
                    out += data
                    at += count
                n += batch.num_rows
                if n >= DOWNLOAD_ROWS:
                    break
    except PerfscopeError as exc:
        return f"perfscope: {exc.message}\n".encode()
    return bytes(out)


def _fitting(rows: pa.RecordBatch, room: int) -> bytes:
    """The CSV of the first rows of `rows` that fit in `room` bytes, whole rows only (found by halving:
    a few conversions, not one per row)."""
    lo, hi, best = 0, rows.num_rows, b""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        data = csv_text(pa.Table.from_batches([rows.slice(0, mid)]), header=False).encode()
        if len(data) <= room:
            lo, best = mid, data
        else:
            hi = mid - 1
    return best


def _schema() -> None:
    st.subheader("Tables")
    for name, table in TABLES.items():
        with st.expander(f"`{name}`: {table.doc}"):
            lines = ["| column | type | unit | meaning |", "|---|---|---|---|"]
            lines.append("| `run_id` | string | | run identifier (partition key) |")
            for c in table.columns:
                meaning = c.doc.replace("|", "\\|")
                lines.append(f"| `{c.name}` | {c.type} | {c.unit} | {meaning} |")
            st.markdown("\n".join(lines))
