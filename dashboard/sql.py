"""SQL page: a read-only query box over the store's tables, with the schema beside it."""

from __future__ import annotations

import streamlit as st

from perfscope.errors import PerfscopeError
from perfscope.schema import TABLES

from .state import Context

EXAMPLE = """SELECT run_id, world_size, backend, cluster, batch_size_per_rank
FROM runs
ORDER BY experiment, cluster, backend, batch_size_per_rank, world_size
LIMIT 50"""

#: Rows drawn in the page: the browser holds every row it shows; `perfscope sql -o` writes them all.
SHOWN_ROWS = 10_000


def render(ctx: Context) -> None:
    st.title("SQL")
    st.caption(
        "Read-only SQL (DuckDB) over the store's tables. Only SELECT, WITH and EXPLAIN run; the connection "
        'can read nothing outside the store\'s folder. From a shell: `perfscope sql STORE "SELECT …"`.'
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
    try:
        result = ctx.store.read_only_query(text)
    except PerfscopeError as exc:
        st.error(exc.message, icon=":material/block:")
        return
    n = result.num_rows
    st.caption(f"{n:,} row(s)" + (f"; the first {SHOWN_ROWS:,} are shown" if n > SHOWN_ROWS else ""))
    st.dataframe(result.slice(0, SHOWN_ROWS), hide_index=True)


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
