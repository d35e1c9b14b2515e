"""The sidebar: the store shown, the run selection, live mode, and the report download."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import streamlit as st

from perfscope.analysis import Selection
from perfscope.charts.rows import rows
from perfscope.errors import PerfscopeError, one_line
from perfscope.report.text import literal as md
from perfscope.store import objectstore
from perfscope.store.reader import Store
from perfscope.words import counted

from . import ENV_ROOT, state

log = logging.getLogger("perfscope.dashboard")

LIVE_INTERVALS_S = (1, 2, 5, 10, 30, 60)
_ALL_SOURCES = "measured and simulated"


def _options(summary_rows: list[dict[str, Any]], column: str) -> list[str]:
    return sorted({str(r[column]) for r in summary_rows if r.get(column) not in (None, "")})


def _multiselect(label: str, options: list[str], key: str, help: str) -> tuple[str, ...]:
    # A live store can lose a value (a run was removed); a kept value outside the options would raise.
    if key in st.session_state:
        st.session_state[key] = [v for v in st.session_state[key] if v in options]
    picked = st.multiselect(label, options, key=key, placeholder="all", help=help, disabled=not options)
    return tuple(picked)


def selection(ctx_all: state.Context) -> Selection:
    """The selection widgets, with options from the store's runs; empty means all."""
    summary = rows(ctx_all.table("run_summary"), ("experiment", "cluster", "backend", "source"))
    st.subheader("Selection")
    experiments = _multiselect(
        "Experiment", _options(summary, "experiment"), "sel_experiments", "the runs' experiment label"
    )
    clusters = _multiselect(
        "Cluster", _options(summary, "cluster"), "sel_clusters", "cluster or partition label"
    )
    backends = _multiselect(
        "Backend",
        _options(summary, "backend"),
        "sel_backends",
        "collective backend (nccl, mpi, gloo, horovod-…)",
    )
    source = st.radio(
        "Source",
        [_ALL_SOURCES, "measured", "simulated"],
        key="sel_source",
        help="measured runs were recorded by perfscope.profile; simulated ones by perfscope simulate",
    )
    warmup = st.number_input(
        "Warm-up steps to drop",
        min_value=0,
        value=None,
        step=1,
        key="sel_warmup",
        placeholder="auto: max(10, 5%)",  # longer text is cut off in the sidebar's field
        help="Leave empty for the steady-state rule (drop the first 10 steps or 5 %, whichever is larger).",
    )
    return Selection(
        experiments=experiments,
        clusters=clusters,
        backends=backends,
        source=None if source == _ALL_SOURCES else source,
        warmup_steps=None if warmup is None else int(warmup),
    )


#: session state: the store this browser session switched to, and why the last switch was refused
_CHOSEN = "store_chosen"
_SWITCH_INPUT = "store_switch"
_SWITCH_ERROR = "store_switch_error"


def chosen_store(default: str | None) -> str | None:
    """The store this session switched to in the sidebar, else `default`."""
    chosen = st.session_state.get(_CHOSEN)
    return chosen if isinstance(chosen, str) else default


def store_root(started: str | None) -> str:
    """The folder (or s3:// prefix) the sidebar opens stores under: `perfscope dashboard --root`, by
    default the store the dashboard was started with (`started`, else the default store)."""
    return os.environ.get(ENV_ROOT) or str(state.store_path(started))


def _under_root(typed: str, root: str) -> Path | None:
    """The folder to open for `typed` (a path under the root, relative ones from the root, or an s3://
    prefix under an s3:// root, as its mirror folder), or None when it is outside the root. The check is
    made on the words first, so nothing outside the root is looked at; links are followed only after."""
    if objectstore.is_s3_url(root) or objectstore.is_s3_url(typed):
        inside = (
            objectstore.is_s3_url(root)
            and objectstore.is_s3_url(typed)
            and (typed.rstrip("/") + "/").startswith(root.rstrip("/") + "/")
        )
        # an s3:// store is shown from its mirror folder, which open_store syncs and reads as the store
        return objectstore.mirror_path(typed) if inside else None
    base = Path(root)
    wanted = Path(os.path.normpath(base / Path(typed).expanduser()))
    if not wanted.is_relative_to(base):
        return None
    path = wanted.resolve()  # a link inside the root may point out of it
    return path if path.is_relative_to(base.resolve()) else None


def _switch(root: str) -> None:
    """Open the typed path; keep it only when it is a readable store under `root`, else say why in one
    line."""
    typed = str(st.session_state.get(_SWITCH_INPUT) or "").strip()
    st.session_state.pop(_SWITCH_ERROR, None)
    if not typed:
        return
    try:
        path = _under_root(typed, root)
        if path is None:  # the same words whatever is there: nothing outside the root is told
            st.session_state[_SWITCH_ERROR] = f"only stores under {one_line(root)} can be opened here"
            return
        # an s3:// store's mirror is made by its first sync, once the prefix was listed
        is_dir = objectstore.is_s3_url(typed) or path.is_dir()
        exists = is_dir or path.exists()
    except PerfscopeError as exc:
        st.session_state[_SWITCH_ERROR] = one_line(exc.message)
        return
    except (OSError, ValueError, RuntimeError) as exc:  # NUL byte, a loop of links, a name too long
        st.session_state[_SWITCH_ERROR] = f"not a usable path: {one_line(str(exc))}"
        return
    if not is_dir:
        what = "is not a folder" if exists else "does not exist"
        st.session_state[_SWITCH_ERROR] = f"{one_line(str(path))} {what}: a store is a folder of runs"
        return
    opened, problem = state.open_or_message(path)
    if opened is None:
        st.session_state[_SWITCH_ERROR] = one_line(problem)
        return
    st.session_state[_CHOSEN] = str(path)
    st.session_state[_SWITCH_INPUT] = ""


def store_info(path: Path, store: Store | None, root: str) -> None:
    st.caption("Store")
    st.code(objectstore.mirror_source(path) or str(path), language=None, wrap_lines=True)
    st.text_input(
        "Open another store",
        key=_SWITCH_INPUT,
        placeholder="path/to/store, then Enter",
        on_change=_switch,
        args=(root,),
        help="a store folder under the dashboard's root (perfscope dashboard --root; relative paths "
        "start there), or an s3://bucket/prefix under an s3:// root; this browser tab switches to it",
    )
    error = st.session_state.get(_SWITCH_ERROR)
    if error:
        st.error(md(error), icon=":material/folder_off:")
    if store is None:
        return
    files = sum(len(s) for s in store.listing.segments.values())
    st.caption(f"{files:,} segments · {store.row_count('steps'):,} step rows")
    if store.skipped:
        st.warning(
            f"{counted(len(store.skipped), 'unreadable or foreign file')} skipped; see Overview.",
            icon=":material/warning:",
        )


def live_controls(path: Path, store: Store | None, token: str) -> None:
    """Live mode: re-list the store every few seconds and rerun the app when new segments arrived."""
    live = st.toggle("Live: follow a store a job is writing", key="live", help="re-lists the store's folder")
    every = st.select_slider(
        "Check every (s)",
        LIVE_INTERVALS_S,
        value=5,
        key="live_every",
        disabled=not live,
        format_func=lambda s: f"every {s} s",
        label_visibility="collapsed",
    )
    if not live:
        if st.button(
            "Reload store",
            key="reload_store",
            icon=":material/refresh:",
            help="pick up segments written since the page opened",
        ):
            _check(path, store, token)
            st.toast("No new segments since the page was drawn.")
        return

    @st.fragment(run_every=every)
    def _poll() -> None:
        _check(path, store, token)
        st.caption(f"live · checked at {time.strftime('%H:%M:%S')}, every {every} s")

    _poll()


def _check(path: Path, store: Store | None, token: str) -> None:
    """Re-list; rerun the whole app when what the page shows is out of date."""
    if store is None:
        # no data yet (or the path appeared only now): try to open it afresh
        if state.open_or_message(path)[0] is not None:
            st.rerun(scope="app")
        return
    try:
        store.refresh()  # a job may still be writing it
    except Exception:
        state.forget(path)  # the folder was removed or replaced: reopen on the rerun
        st.rerun(scope="app")
    if state.listing_token(store) != token:
        st.rerun(scope="app")


def report_download(render: Callable[[], bytes]) -> None:
    """The report in two steps: made in this run (a failure, the store gone mid-build included, is said
    here in one line), then downloaded. A deferred download that fails shows the user nothing."""
    if not st.button(
        "Make report (HTML)",
        key="make_report",
        icon=":material/description:",
        help="the same analyses and charts as a single HTML file; takes a few seconds",
    ):
        return
    try:
        with st.spinner("Making the report…"):
            data = render()
    except PerfscopeError as exc:
        st.error(f"The report could not be made: {md(exc.message)}", icon=":material/error:")
        return
    except Exception as exc:  # the store went away mid-build, a bug: words here, the traceback in the log
        log.exception("perfscope dashboard: the report failed")
        st.error(
            f"The report could not be made: {md(type(exc).__name__)}: {md(exc)}", icon=":material/error:"
        )
        return
    st.download_button(
        "Download report (HTML)",
        data=data,
        file_name="perfscope-report.html",
        mime="text/html",
        icon=":material/download:",
        on_click="ignore",
    )
