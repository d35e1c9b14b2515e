"""The dashboard's entry point: page set-up, the sidebar, and the navigation between the pages.

`perfscope dashboard [STORE]` runs this file with `streamlit run` and names the store in
$PERFSCOPE_DASHBOARD_STORE.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import streamlit as st

from perfscope.analysis import Selection
from perfscope.dashboard import batch, compare, overview, run, scaling, sidebar, sql, state
from perfscope.report.text import literal as md
from perfscope.store.reader import Store

log = logging.getLogger("perfscope.dashboard")

Render = Callable[[state.Context], None]

#: the browser tab's icon: an emoji, which Streamlit draws locally (see main)
PAGE_ICON = "📈"

#: url path, title, icon, page function
PAGES: tuple[tuple[str, str, str, Render], ...] = (
    ("overview", "Overview", ":material/dashboard:", overview.render),
    ("scaling", "Scaling", ":material/trending_up:", scaling.render),
    ("run", "Run", ":material/timeline:", run.render),
    ("batch", "Batch size", ":material/stacked_bar_chart:", batch.render),
    ("compare", "Compare", ":material/compare_arrows:", compare.render),
    ("sql", "SQL", ":material/database:", sql.render),
)


def _show(render: Render, ctx: state.Context | None, path: Path, problem: str) -> None:
    if ctx is None:
        _store_problem(path, problem)
        return
    try:
        render(ctx)
    except Exception as exc:  # a page bug shows as words; the traceback goes to the server log
        log.exception("perfscope dashboard: page failed")
        st.error(
            f"This page could not be drawn: {md(type(exc).__name__)}: {md(exc)}", icon=":material/error:"
        )


def _store_problem(path: Path, problem: str) -> None:
    st.title("No data to show")
    st.error(md(problem), icon=":material/folder_off:")
    st.markdown(
        f"The dashboard reads the store at {md(path)}.\n\n"
        "- Record a run into a folder with `perfscope.profile('traces/')` in the training script, then "
        "`perfscope dashboard traces/`.\n"
        "- Or make a simulated study: `perfscope simulate traces/`.\n"
        "- A job that has only just started writes its first segments within a few seconds: turn on "
        "**Live** in the sidebar and the pages appear when they arrive."
    )


def report_renderer(store: Store, sel: Selection) -> Callable[[], bytes]:
    """The report of the selection, made only when the download button is pressed (seconds of work)."""

    def render() -> bytes:
        from perfscope.report import render_report

        return render_report(store, sel, fmt="html")

    return render


def main(store: str | None = None, page: str = "overview") -> None:
    """Draw the app for the store at `store` (else $PERFSCOPE_DASHBOARD_STORE, else the bundled one);
    `page` is the url path of the page the root URL opens."""
    # an emoji favicon is drawn in the browser; a :material/...: one is fetched from fonts.gstatic.com
    st.set_page_config(page_title="perfscope", page_icon=PAGE_ICON, layout="wide")
    path = state.store_path(sidebar.chosen_store(store))
    opened, problem = state.open_or_message(path)
    ctx: state.Context | None = None
    with st.sidebar:
        st.markdown("### perfscope")
        sidebar.store_info(path, opened, sidebar.store_root(store))
        if opened is not None:
            token = state.listing_token(opened)
            sel = sidebar.selection(state.Context(path, opened, token, Selection()))
            ctx = state.Context(path, opened, token, sel)
            sidebar.report_download(report_renderer(opened, sel))
        sidebar.live_controls(path, opened, ctx.token if ctx else "")
    pages = {
        url: st.Page(
            functools.partial(_show, render, ctx, path, problem), title=title, icon=icon, url_path=url
        )
        for url, title, icon, render in PAGES
    }
    if ctx is not None:
        ctx.pages = pages
    # Streamlit serves its default page at "/" only, never at its url path: a hidden root page that
    # forwards to `page` lets every page, the first included, open by its own URL (/overview).
    root = st.Page(
        functools.partial(_forward, pages.get(page, pages["overview"])),
        title="perfscope",
        url_path="home",
        default=True,
        visibility="hidden",
    )
    st.navigation([root, *pages.values()], position="top").run()


def _forward(page: Any) -> None:
    st.switch_page(page, query_params=st.query_params.to_dict())


if __name__ == "__main__":
    main()
