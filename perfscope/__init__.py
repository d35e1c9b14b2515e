"""perfscope: why a data-parallel training job does not scale.

Collect with `perfscope.profile(...)` on every rank, read with `perfscope.open_store(path)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import PerfscopeError, PerfscopeWarning, StoreError
from .store.open import open_store
from .store.reader import Store
from .store.schema import SCHEMA_VERSION
from .store.writer import StoreWriter
from .version import __version__

if TYPE_CHECKING:
    from perfscope.collectors import profile


__all__ = [
    "SCHEMA_VERSION",
    "PerfscopeError",
    "PerfscopeWarning",
    "Store",
    "StoreError",
    "StoreWriter",
    "__version__",
    "open_store",
    "profile",
]


def __getattr__(name: str) -> Any:
    """`perfscope.profile` is the collector's own function (its signature and docstring in help()),
    imported on first use: the analysis side and the CLI never pay for the collectors' imports."""
    if name == "profile":
        from perfscope.collectors import profile

        globals()["profile"] = profile
        return profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
