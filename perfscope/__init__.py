"""perfscope: why a data-parallel training job does not scale.

Collect with `perfscope.profile(...)` on every rank, read with `perfscope.open_store(path)`.
"""

from __future__ import annotations

from typing import Any

from .errors import PerfscopeError, PerfscopeWarning, StoreError
from .schema import SCHEMA_VERSION
from .store import Store, open_store
from .writer import StoreWriter

__version__ = "0.1.0"

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


def profile(*args: Any, **kwargs: Any) -> Any:
    """Instrument a training loop on this rank; see perfscope.collectors.profile."""
    from perfscope.collectors import profile as _profile

    return _profile(*args, **kwargs)
