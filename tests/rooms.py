"""The test folders mirror perfscope's rooms (tests/store/ for perfscope/store/, ...). Each folder is put
on sys.path, with tests/ itself for the shared helpers (storegen, tables, browser, collect_helpers,
nodes), so a test or a benchmark may use a fixture that another room's tests define, by its module
name: test file names are unique across the folders (tests/project/test_layers.py checks)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOMS = tuple(sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))))


def on_path() -> None:
    for folder in (TESTS, *ROOMS):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
