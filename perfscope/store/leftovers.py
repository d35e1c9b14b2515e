"""Removes what killed processes of ours left behind: temporary segment files inside a store and
DuckDB spill folders in the temporary folder, once older than a grace period.

Only our own name patterns, only in the places we write them, never through a symbolic link: a
store is untrusted input, and a cleaner that followed a link could delete anything.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from .schema import TABLES

#: a leftover younger than this may belong to a process still writing it
LEFTOVER_GRACE_S = 600.0

# `.c-[<host tag>-]<hex>.parquet.tmp`: a compaction's (or a closing writer's) merged file in progress
# (compact.py); `.<segment>.parquet.<8 hex>.tmp`: a segment being written or sealed (segments.write_segment).
# A live segment (`.arrows`) is no leftover: `perfscope compact` seals a killed writer's.
_STORE_TMP = re.compile(r"\.c-(?:h[0-9a-f]{6}-)?[0-9a-f]+\.parquet\.tmp|\..+\.parquet\.[0-9a-f]{8}\.tmp")
# `.perfscope-manifest.<8 hex>.tmp`: a manifest being saved, in the store's root (manifest.py)
_MANIFEST_TMP = re.compile(r"\.perfscope-manifest\.[0-9a-f]{8}\.tmp")
# `perfscope-duckdb-<pid>-<random>` (listing.spill_dir); older versions had no pid
_SPILL_DIR = re.compile(r"perfscope-duckdb-(?:(\d+)-)?[A-Za-z0-9_]+")
SPILL_PREFIX = "perfscope-duckdb-"


def _old_regular(entry: os.DirEntry[str], cutoff: float) -> bool:
    st = entry.stat(follow_symlinks=False)
    return stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff


def _subdirs(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def store_leftovers(root: str | os.PathLike[str], *, grace_s: float = LEFTOVER_GRACE_S) -> list[Path]:
    """Temporary segment files in the store's partition folders (and manifests being saved, in its root)
    last modified over `grace_s` ago."""
    cutoff = time.time() - grace_s
    found: list[Path] = []
    try:
        with os.scandir(root) as it:
            found += [Path(e.path) for e in it if _MANIFEST_TMP.fullmatch(e.name) and _old_regular(e, cutoff)]
    except OSError:
        pass
    for table in _subdirs(os.fspath(root)):
        if table.name not in TABLES:
            continue
        for part in _subdirs(table.path):
            try:
                with os.scandir(part.path) as it:
                    found += [
                        Path(e.path) for e in it if _STORE_TMP.fullmatch(e.name) and _old_regular(e, cutoff)
                    ]
            except OSError:
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def spill_leftovers(
    temp_root: str | os.PathLike[str] | None = None, *, grace_s: float = LEFTOVER_GRACE_S
) -> list[Path]:
    """Our DuckDB spill folders in `temp_root` (default: the system's) whose process is gone (or,
    for a name without a pid, last modified over `grace_s` ago), owned by this user."""
    base = os.fspath(temp_root) if temp_root is not None else tempfile.gettempdir()
    cutoff = time.time() - grace_s
    found: list[Path] = []
    for entry in _subdirs(base):
        m = _SPILL_DIR.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != os.getuid() or st.st_mtime >= cutoff:
            continue
        if m.group(1) is not None and _alive(int(m.group(1))):
            continue
        found.append(Path(entry.path))
    return found


def clean_leftovers(
    root: str | os.PathLike[str] | None,
    *,
    grace_s: float = LEFTOVER_GRACE_S,
    temp_root: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Remove the store's (when `root` is given) and the temporary folder's leftovers; returns
    what was removed. Best effort: an entry that vanished or cannot be removed is left alone."""
    removed: list[Path] = []
    for path in store_leftovers(root, grace_s=grace_s) if root is not None else []:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    for path in spill_leftovers(temp_root, grace_s=grace_s):
        # rmtree refuses a symlink and never follows one inside (it works on file descriptors)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed
