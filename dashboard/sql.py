"""SQL page: a read-only query box over the store's tables, with the schema beside it.

Each browser session runs its queries on its own bounded connection (state.session_sql): a time limit,
a memory limit, and only the rows it draws are fetched; the whole result is a download away.
"""

from __future__ import annotations

import streamlit as st

from perfscope.errors import PerfscopeError
from perfscope.output import csv_text
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
#: rows in the CSV download: the server holds the file while the browser fetches it
DOWNLOAD_ROWS = 1_000_000


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
        data=lambda: _csv(download, text),
        file_name="perfscope-query.csv",
        mime="text/csv",
        icon=":material/download:",
        on_click="ignore",  # the page stays as it is: no rerun, no second run of the query
    )


def _csv(session: UserSql, text: str) -> bytes:
    """The result as CSV, made when the download is asked for, under the same time limit, on the
    session's download connection (session_sql)."""
    try:
        table = session.fetch(text, timeout_s=TIME_LIMIT_S, max_rows=DOWNLOAD_ROWS).table
    except PerfscopeError as exc:
        return f"perfscope: {exc.message}\n".encode()
    return csv_text(table).encode()


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
