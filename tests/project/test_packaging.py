"""Every package folder is listed in pyproject.toml, so a wheel (and an editable install used by the
CLI in a subprocess) carries it: a folder left out imports in-tree and fails once installed."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = {name: ROOT / folder for name, folder in config["package-dir"].items()}
    found = set()
    for name, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            sub = ".".join((name, *rel.parts)) if rel.parts else name
            # a sub-package that has its own package-dir entry is found from there
            if sub in dirs and dirs[sub] != init.parent:
                continue
            found.add(sub)
    assert found - listed == set(), "add these to [tool.setuptools] packages"


def test_the_lock_pins_registry_packages_only() -> None:
    """A `pkg @ file://...` line (pip-compile writes one for the project itself) would replace the
    editable install with a copy of whatever the tree held when the lock was made."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-lock.txt").read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("-")]
    assert pins, "the lock is empty"
    assert [p for p in pins if "==" not in p or "@" in p] == []
    assert not [p for p in pins if p.split("==")[0].lower() == "perfscope"]
