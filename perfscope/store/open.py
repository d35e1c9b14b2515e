"""The door: `open_store` opens a local folder, or an s3:// store through its local mirror."""

from __future__ import annotations

import os

from .objectstore import is_s3_url, mirror_source, open_mirrored
from .reader import Store


def open_store(path: str | os.PathLike[str], *, allow_empty: bool = False, warn: bool = True) -> Store:
    """Open the store at `path` for reading: `store.con` has one view per table, `store.query`
    returns Arrow tables. Raises StoreError with what to do when the path holds no store. An
    s3://bucket/prefix, or the folder that mirrors one, is read through that mirror, synced first
    (objectstore.py)."""
    url = str(path) if is_s3_url(path) else mirror_source(path)
    if url is not None:
        return open_mirrored(url, allow_empty=allow_empty, warn=warn)
    return Store(path, allow_empty=allow_empty, warn=warn)
