"""Every package folder is listed in pyproject.toml, so a wheel (and an editable install used by the
CLI in a subprocess) carries it: a folder left out imports in-tree and fails once installed."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


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
