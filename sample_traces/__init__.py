"""The stores bundled with perfscope: `perfscope.sample_traces.bundled()` names them."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The store the dashboard opens when none is given, and `make sample` analyses.
DEFAULT = "seed-study"


def bundled() -> dict[str, Path]:
    """Every bundled store by name (a folder holding a runs/ table)."""
    return {p.name: p for p in sorted(HERE.iterdir()) if p.is_dir() and (p / "runs").is_dir()}


def path(name: str = DEFAULT) -> Path:
    stores = bundled()
    if name not in stores:
        raise KeyError(f"no bundled store {name!r}; bundled: {', '.join(stores) or 'none'}")
    return stores[name]
