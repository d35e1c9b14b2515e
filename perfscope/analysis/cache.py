"""Per-store memo of intermediate temp tables and analysis results, dropped when the store re-lists."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ..store import Listing, Store

T = TypeVar("T")

_names = itertools.count()


class StoreCache:
    """What one open store has computed: keys are (kind, Selection, ...); valid for one listing."""

    def __init__(self) -> None:
        self.listing: Listing | None = None
        self.values: dict[Any, Any] = {}
        self.temp_tables: list[str] = []
        self.lock = threading.RLock()


_caches: weakref.WeakKeyDictionary[Store, StoreCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def store_cache(store: Store) -> StoreCache:
    with _caches_lock:
        cache = _caches.get(store)
        if cache is None:
            cache = _caches[store] = StoreCache()
    with cache.lock:
        if cache.listing is not store.listing:
            # The store re-listed its files (new segments, a compaction): everything is stale.
            for name in cache.temp_tables:
                # a closed connection has nothing left to drop
                with contextlib.suppress(Exception):
                    store.query(f"DROP TABLE IF EXISTS {name}")
            cache.temp_tables.clear()
            cache.values.clear()
            cache.listing = store.listing
    return cache


def memo(store: Store, key: Any, compute: Callable[[], T]) -> T:
    cache = store_cache(store)
    with cache.lock:
        if key in cache.values:
            return cache.values[key]
        value = compute()
        cache.values[key] = value
        return value


def temp_table(store: Store, key: Any, sql: str) -> str:
    """Create (once per store listing and key) a temp table `AS sql`; return its name."""

    def create() -> str:
        name = f"_ps_{next(_names)}"
        store.query(f"CREATE OR REPLACE TEMP TABLE {name} AS {sql}")
        store_cache(store).temp_tables.append(name)
        return name

    return memo(store, ("temp", key), create)
