"""Per-store memo of intermediate temp tables and analysis results, one generation per store listing.

A store opened by the dashboard is shared by every session, and one session's refresh (Live mode) may
re-list the folder while another session's analysis is using temp tables of the listing before. So a
listing's temp tables are never dropped while anything computing over them still holds that
generation (a thread's outermost `memo` call holds its generation until its value is computed, and
everything computed inside reads that generation; an analysis runs inside one): a generation that
nothing holds any more queues its tables, and the next caller drops them. A refresh that finds
nothing new keeps the same listing (Store.refresh), so it changes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..store.listing import Listing
from ..store.reader import Store

T = TypeVar("T")

_names = itertools.count()


class StoreCache:
    """What one open store has computed over one listing: keys are (kind, Selection, ...)."""

    def __init__(self, listing: Listing) -> None:
        self.listing = listing
        self.values: dict[Any, Any] = {}
        self.temp_tables: list[str] = []
        self.lock = threading.RLock()


_caches: weakref.WeakKeyDictionary[Store, StoreCache] = weakref.WeakKeyDictionary()
#: per store, temp tables of generations nothing holds any more: dropped by the next caller
_unused: weakref.WeakKeyDictionary[Store, collections.deque[str]] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def _queue(unused: collections.deque[str], names: list[str]) -> None:
    unused.extend(names)  # a finalizer: may run on any thread, so only an atomic append


def store_cache(store: Store) -> StoreCache:
    """The generation of `store`'s current listing (a new one when the store re-listed its files)."""
    with _caches_lock:
        cache = _caches.get(store)
        unused = _unused.setdefault(store, collections.deque())
        if cache is None or cache.listing is not store.listing:
            if cache is not None:
                # its tables go once the last computation holding it is done
                weakref.finalize(cache, _queue, unused, cache.temp_tables)
            cache = _caches[store] = StoreCache(store.listing)
    while unused:
        name = unused.popleft()
        with contextlib.suppress(Exception):  # a closed connection has nothing left to drop
            store.query(f"DROP TABLE IF EXISTS {name}")
    return cache


class _Held(threading.local):
    """Per thread, the generation each store's outermost computation holds (id(store) -> cache)."""

    def __init__(self) -> None:
        self.by_store: dict[int, StoreCache] = {}


_held = _Held()


@contextlib.contextmanager
def _generation(store: Store) -> Iterator[StoreCache]:
    """The generation this thread's computation over `store` reads: the one its outermost `memo`
    took (so an analysis sees one listing throughout and holds every table it made), else the
    current one."""
    outer = _held.by_store.get(id(store))
    if outer is not None:
        yield outer
        return
    cache = _held.by_store[id(store)] = store_cache(store)
    try:
        yield cache
    finally:
        del _held.by_store[id(store)]


def memo(store: Store, key: Any, compute: Callable[[], T]) -> T:
    """`compute()` once per listing generation and key; the generation is held while it runs."""
    with _generation(store) as cache, cache.lock:
        if key in cache.values:
            return cache.values[key]
        value = compute()
        cache.values[key] = value
        return value


def temp_table(store: Store, key: Any, sql: str) -> str:
    """Create (once per store listing and key) a temp table `AS sql`; return its name."""
    with _generation(store) as cache, cache.lock:
        if ("temp", key) in cache.values:
            return str(cache.values[("temp", key)])
        name = f"_ps_{next(_names)}"
        store.query(f"CREATE OR REPLACE TEMP TABLE {name} AS {sql}")
        cache.temp_tables.append(name)
        cache.values[("temp", key)] = name
        return name
