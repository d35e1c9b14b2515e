"""A dashboard run by a privileged account serves only the stores their owners opened to others (issue 33,
item 14): root reads a mode-700 store of another user, and served it to any holder of the URL."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from storegen import make_run

#: a uid no one here has: the other user whose store it is
OTHER_UID = 54_321


def _app(store: str) -> None:
    from perfscope.dashboard.app import main

    main(store=store)


def _errors(store: Path) -> list[str]:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_app, args=(str(store),), default_timeout=120).run()
    assert not at.exception, [e.message for e in at.exception]
    return [e.value.replace("\\", "") for e in at.error]  # as read: markdown's escapes dropped


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another uid needs root")
def test_another_users_closed_store_is_not_served(tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    home = tmp_path / "home"
    store = home / "store"
    make_run(store, "r1", world_size=2)
    try:
        for p in [home, *home.rglob("*")]:
            os.chown(p, OTHER_UID, OTHER_UID)
        store.chmod(0o700)  # closed by its owner: root can read it, others cannot
        errors = _errors(store)
        assert len(errors) == 1 and "is not served" in errors[0] and f"uid {OTHER_UID}" in errors[0], errors
        assert "\n" not in errors[0] and "700" in errors[0]
        store.chmod(0o755)  # opened to others: served
        assert _errors(store) == []
        home.chmod(0o700)  # open, inside a folder its owner closed
        errors = _errors(store)
        assert len(errors) == 1 and "the folder above it" in errors[0] and str(home) in errors[0], errors
        home.chmod(0o755)
        os.chown(store, 0, 0)  # the server user's own
        store.chmod(0o700)
        assert _errors(store) == []

    finally:  # nothing left owned by the made-up uid
        for p in [home, *home.rglob("*")]:
            os.chown(p, 0, 0)


def test_the_owner_check_reads_owner_and_mode() -> None:
    """The same rule without root: the server's user given (a store of this user, seen as another's),
    in a folder open to all (pytest's own temporary folders are closed to others)."""
    pytest.importorskip("streamlit")
    from perfscope.dashboard.state import closed_by_owner

    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        Path(top).chmod(0o755)
        _check_modes(Path(top) / "store", closed_by_owner)


def _check_modes(store: Path, closed_by_owner: Callable[..., str]) -> None:
    store.mkdir()
    me = store.stat().st_uid
    store.chmod(0o700)
    assert closed_by_owner(store, euid=me) == ""
    assert "is not served" in closed_by_owner(store, euid=me + 1)
    store.chmod(0o750)
    assert closed_by_owner(store, euid=me + 1) == ""  # readable by its group
    store.chmod(0o705)
    assert closed_by_owner(store, euid=me + 1) == ""  # readable by others
