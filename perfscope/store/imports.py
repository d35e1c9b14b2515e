"""Imports in progress: the hidden staging area inside a store (`.imports/`, which no reader lists),
and the recovery of what a killed importer left there.

An importer (perfscope.importers.common.Staging) claims a run id with a file in `.imports/`, held
under an exclusive flock for its life, writes the run into a staging store beside it and renames the
run's partitions into the store, `runs` last. A claim whose lock is free belongs to a killed importer:
whoever finds it (the next import, `perfscope compact`) removes its staging store and, when it had
begun to publish, the partitions it had renamed so far.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

from .rollups import ROLLUP_DIR
from .schema import PARTITION_KEY, TABLES

#: imports in progress, in the store's root: a claim file per run id and a staging store per import.
#: A hidden folder: the listing reads only the tables' folders, so no reader sees a run being imported
IMPORTS_DIR = ".imports"
#: a claim's states: rows being written to the staging store; its partitions being renamed into the
#: store; all of them renamed
STAGING, PUBLISHING, PUBLISHED = "staging", "publishing", "published"


def run_partitions(root: Path, run_id: str) -> list[Path]:
    """The partition folders of `run_id` in every table of the store at `root`, and its rollups';
    `runs` last: the run is listed once its other rows are all in place."""
    names = [t for t in TABLES if t != "runs"] + [ROLLUP_DIR, "runs"]
    return [root / t / f"{PARTITION_KEY}={run_id}" for t in names]


def same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def undo_import(root: Path, fd: int, key: str) -> None:
    """Remove what the killed importer whose claim `fd` holds (locked) left: its staging stores, and
    the partitions it had begun to publish (all renamed: they stay, the import had completed)."""
    try:
        claim = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8", "surrogateescape") or "{}")
    except (OSError, ValueError):
        claim = {}
    if claim.get("state") == PUBLISHING and isinstance(claim.get("run_id"), str):
        for part in run_partitions(root, claim["run_id"]):
            shutil.rmtree(part, ignore_errors=True)
    with contextlib.suppress(OSError):
        for entry in os.scandir(root / IMPORTS_DIR):
            if entry.name.startswith(f"{key}.") and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


def recover_stale_imports(root: Path) -> list[str]:
    """Remove what killed importers left in the store (see Staging); returns the run ids cleaned."""
    done: list[str] = []
    folder = root / IMPORTS_DIR
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return done
    for name in names:
        if not name.endswith(".claim"):
            continue
        path = folder / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its importer is running
            if not same_file(fd, path):
                continue
            undo_import(root, fd, name.removesuffix(".claim"))
            path.unlink(missing_ok=True)
            done.append(name)
        finally:
            os.close(fd)
    return done
