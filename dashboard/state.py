"""Which store the dashboard shows, opened once per process; its analyses and findings cached per listing;
each browser session's own connection for the SQL page."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import streamlit as st

from perfscope.analysis import ANALYSES, Selection, run_analysis
from perfscope.charts.rows import group_labels, rows
from perfscope.errors import PerfscopeError, one_line
from perfscope.report.text import literal as md
from perfscope.store.open import open_store
from perfscope.store.reader import Store
from perfscope.store.user_sql import UserSql

from . import ENV_STORE

log = logging.getLogger("perfscope.dashboard")


SelectionKey = tuple[Any, ...]


def store_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The store to show: the one given, else $PERFSCOPE_DASHBOARD_STORE, else the bundled default."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get(ENV_STORE)
    if env:
        return Path(env).expanduser().resolve()
    import perfscope.sample_traces as sample_traces

    try:
        return sample_traces.path(sample_traces.DEFAULT)
    except KeyError:
        # an install without the bundled traces: say so in the page instead of failing
        return sample_traces.HERE / sample_traces.DEFAULT


@st.cache_resource(show_spinner=False, max_entries=8)
def _open(path: str) -> Store:
    """One open store (DuckDB connection) per path and process, shared by every browser session."""
    return open_store(path, warn=False)


def closed_by_owner(path: Path, euid: int | None = None) -> str:
    """Why the server should not show the store at `path`, or '': its owner did not open it to others.
    A dashboard run by a privileged account can read every user's files; it serves a store only when
    its folder is the server user's own or readable by group or others, and every folder above it the
    server user's own or open (x) to group or others. `euid` is the server's user (tests set it)."""
    me = os.geteuid() if euid is None else euid
    for i, folder in enumerate([path, *path.parents]):
        try:
            info = folder.stat()
        except OSError:
            return ""  # the store's opening says what is wrong
        wanted = 0o044 if i == 0 else 0o011  # the store's folder read; the folders above it passed
        if info.st_uid != me and not info.st_mode & wanted:
            what = "the store's folder" if i == 0 else f"the folder above it, {one_line(str(folder))},"
            return (
                f"{one_line(str(path))} is not served: {what} belongs to {_user(info.st_uid)} and is closed "
                f"to others (mode {stat.S_IMODE(info.st_mode):o}); its owner can open it (chmod go+rX) or "
                "run a dashboard of their own"
            )
    return ""


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def open_or_message(path: Path) -> tuple[Store | None, str]:
    """The open store, or None and what is wrong in words (missing, empty, foreign, unreadable, or
    closed by its owner to others: closed_by_owner)."""
    closed = closed_by_owner(path)
    if closed:
        return None, closed
    try:
        return _open(str(path)), ""
    except PerfscopeError as exc:
        return None, exc.message
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"


def forget(path: Path) -> None:
    """Drop the cached store (and with it its connection), e.g. after its folder was replaced."""
    _open.clear(str(path))


#: where a browser session keeps its SQL connections
_SESSION_SQL = "perfscope_user_sql"


def session_sql(store: Store, purpose: str = "page") -> UserSql:
    """This browser session's own connection for user SQL: nothing one session runs reaches another,
    and a slow query in one session holds up no other (each has its own DuckDB). One per `purpose`:
    a CSV download runs on its own connection, so the page's next query (the download button's rerun,
    or a new query) does not stop it, as a query on the same connection stops the one running."""
    key = f"{_SESSION_SQL}:{purpose}"
    held = st.session_state.get(key)
    if isinstance(held, UserSql) and held.store is store:
        return held
    if isinstance(held, UserSql):
        held.close()  # the store was reopened: a connection to the old listing is of no use
    fresh = UserSql(store, warm=True)  # a session runs many queries: take workers started ahead
    st.session_state[key] = fresh
    return fresh


def listing_token(store: Store) -> str:
    """Changes whenever the store's readable segments change: the cache key of every result."""
    h = hashlib.blake2b(digest_size=12)
    for table in sorted(store.listing.segments):
        for seg in store.listing.segments[table]:
            h.update(f"{seg.path}\0{seg.num_rows}\n".encode())
    for skipped in store.skipped:
        h.update(f"skip\0{skipped.path}\n".encode())
    return h.hexdigest()


def selection_key(sel: Selection) -> SelectionKey:
    return dataclasses.astuple(sel)


@st.cache_data(show_spinner=False, max_entries=512)
def _analysis(path: str, token: str, name: str, sel: SelectionKey) -> pa.Table:
    # `token` is only part of the key: a store that re-listed new segments computes afresh.
    return run_analysis(name, _open(path), Selection(*sel))


@st.cache_data(show_spinner=False, max_entries=64)
def _findings(path: str, token: str, sel: SelectionKey) -> list[Any]:
    from perfscope.explain import explain

    return list(explain(_open(path), Selection(*sel)))


@dataclass
class Problem:
    """An analysis that could not be shown, in words; pages show each once."""

    what: str
    detail: str


@dataclass
class Context:
    """What every page works from: the store, its listing token, the selection and the page objects."""

    path: Path
    store: Store
    token: str
    sel: Selection
    pages: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def table(self, name: str, sel: Selection | None = None) -> pa.Table:
        """The analysis' table for the selection (cached), or an empty table after saying what failed."""
        return self._guard(
            name, lambda: _analysis(str(self.path), self.token, name, selection_key(sel or self.sel))
        )

    def findings(self) -> list[Any] | None:
        """The explainer's ranked findings, or None (and a message) when the explainer failed."""
        result = self._guard(
            "explain", lambda: _findings(str(self.path), self.token, selection_key(self.sel))
        )
        return result if isinstance(result, list) else None

    def group_labels(self) -> dict[str, str]:
        """group_id -> the group's name in the charts and the report (never the raw id)."""
        scaling = rows(self.table("scaling"), ("group_id", "world_size", "mixed"))
        return group_labels((r["group_id"] for r in scaling if r["group_id"]), scaling)

    def _guard(self, name: str, compute: Callable[[], Any]) -> Any:
        try:
            return compute()
        except PerfscopeError as exc:  # a problem with the data, said in words by the analysis
            self._report(Problem(name, exc.message))
        except Exception as exc:  # an analysis bug must not take the whole page down
            log.exception("perfscope dashboard: %s failed", name)
            self._report(Problem(name, f"{type(exc).__name__}: {exc}"))
        return pa.table({})

    def _report(self, problem: Problem) -> None:
        if any(p.what == problem.what for p in self.problems):
            return
        self.problems.append(problem)
        title = ANALYSES[problem.what].title if problem.what in ANALYSES else problem.what
        st.error(f"Could not compute **{md(title)}**: {md(problem.detail)}", icon=":material/error:")

    def refine(self, **changes: Any) -> Selection:
        """The page's selection narrowed further, e.g. to one run."""
        return dataclasses.replace(self.sel, **changes)
