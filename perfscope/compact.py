"""Merges a store's small finished segments into large files, never leaving data missing or doubled.

A compacted file is renamed into place carrying the names, row counts, sizes and hashes of the
segments it replaces; from that moment readers ignore those segments (no double counting), and only
then are they deleted: only those whose bytes are still the ones it rewrote. A reader still holding
the old list re-lists when a file disappears (Store.query does).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import StoreError
from .leftovers import clean_leftovers
from .schema import META_REPLACES, META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES
from .store import (
    Segment,
    SkippedFile,
    _check_root,
    content_digest,
    list_store,
    replaces_metadata,
    rows_contained,
)

ROW_GROUP_ROWS = 1_000_000


@dataclass
class CompactResult:
    partitions: int = 0
    files_merged: int = 0
    files_written: int = 0
    rows: int = 0
    files_removed: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    #: temporary files of killed writers and compactions, DuckDB spill folders (perfscope.leftovers)
    leftovers_removed: list[Path] = field(default_factory=list)


class _Changed(Exception):
    """A segment's bytes changed between listing and merging: its partition is left for next time."""


def _migrated(t: pa.Table, table: str, name: str, version: int) -> pa.ChunkedArray | pa.Array:
    """Column `name` for rows of a segment written with schema `version`, which lacked it."""
    col = next(c for c in TABLES[table].columns if c.name == name)
    if col.migrated is None or version >= col.since or t.num_rows == 0:
        return pa.nulls(t.num_rows, col.type)
    import duckdb

    with duckdb.connect(":memory:") as con:
        con.register("segment", t)
        values = con.execute(f"SELECT {col.migrated} AS v FROM segment").to_arrow_table()
    return values.column("v").cast(col.type)


def _merge(table: str, segs: list[Segment], out: Path) -> int:
    """Write `segs`' rows into `out`, recording what it replaces; the rows are read from the very
    bytes whose hash is recorded, so the claim is true of what was rewritten."""
    schema = TABLES[table].arrow_schema
    meta = dict(schema.metadata or {})
    replaces = replaces_metadata(segs)
    digests = {e["name"]: e["blake2b"] for e in json.loads(replaces)}
    meta[META_REPLACES] = replaces
    meta[META_VERSION] = str(SCHEMA_VERSION).encode()
    meta[META_TABLE] = table.encode()
    schema = schema.with_metadata(meta)
    tmp = out.with_name(f".{out.name}.tmp")
    rows = 0
    pending: list[pa.Table] = []
    pending_rows = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
            for seg in segs:
                data = seg.path.read_bytes()
                if hashlib.blake2b(data, digest_size=16).hexdigest() != digests[seg.path.name]:
                    raise _Changed(f"{seg.path.name} changed while being merged")
                t = pq.read_table(pa.BufferReader(data))
                # older segments may lack columns added since: fill them with NULL, or with their
                # migrated value (the merged file is stamped with the current version)
                cols = [
                    t.column(f.name).cast(f.type)
                    if f.name in t.column_names
                    else _migrated(t, table, f.name, seg.version)
                    for f in schema
                ]
                pending.append(pa.Table.from_arrays(cols, schema=schema))
                pending_rows += t.num_rows
                if pending_rows >= ROW_GROUP_ROWS:
                    w.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
                    rows += pending_rows
                    pending, pending_rows = [], 0
            if pending:
                w.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
                rows += pending_rows
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return rows


def compact(root: str | os.PathLike[str], *, dry_run: bool = False, grace_s: float = 1.0) -> CompactResult:
    """Merge every partition holding two or more segments into one file per partition.

    The replaced segments stay on disk for `grace_s` seconds after the merged files appear, so a
    reader that listed the folder just before is not left holding names of files already gone.
    """
    root_path = Path(root).resolve()
    _check_root(root_path)
    result = CompactResult()
    lock_path = root_path / ".compact.lock"
    try:
        lock = open(lock_path, "a+")  # noqa: SIM115 - held for the whole compaction
    except OSError as exc:
        raise StoreError(f"cannot compact {root_path}: {exc.strerror}; is the store writable?") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"another `perfscope compact` is running on {root_path}; wait for it.") from None
        if not dry_run:  # temporary files of killed compactions and writers, DuckDB spill folders
            result.leftovers_removed = clean_leftovers(root_path)
        listing = list_store(root_path)
        result.skipped = listing.skipped
        # Finish what an interrupted compaction left: segments already replaced by a merged file,
        # deleted only once every one of their rows is found in it.
        if not dry_run:
            for path in listing.superseded:
                merged = listing.superseded_by[path]
                if rows_contained(path, merged):
                    path.unlink(missing_ok=True)
                    result.files_removed += 1
                else:
                    why = f"{merged.name} claims to replace it, but does not hold all its rows"
                    result.skipped.append(SkippedFile(str(path), why))
        result.skipped += listing.doubtful
        replaced: list[tuple[Path, str]] = []
        for table, segs in listing.segments.items():
            by_part: dict[Path, list[Segment]] = {}
            for seg in segs:
                by_part.setdefault(seg.path.parent, []).append(seg)
            for part, group in sorted(by_part.items()):
                if len(group) < 2:
                    continue
                result.partitions += 1
                result.files_merged += len(group)
                result.bytes_before += sum(s.path.stat().st_size for s in group)
                if dry_run:
                    result.rows += sum(s.num_rows for s in group)
                    continue
                out = part / f"c-{secrets.token_hex(6)}.parquet"
                try:
                    result.rows += _merge(table, group, out)
                except (_Changed, OSError, pa.ArrowException) as exc:
                    result.skipped.append(SkippedFile(str(part), f"not merged: {exc}"))
                    continue
                result.files_written += 1
                result.bytes_after += out.stat().st_size
                claims = json.loads(pq.read_metadata(out).metadata[META_REPLACES])
                replaced.extend((part / e["name"], e["blake2b"]) for e in claims)
        if replaced:
            time.sleep(grace_s)
            for path, digest in replaced:
                # never delete rows it did not rewrite: a file put in a segment's place meanwhile stays
                try:
                    same = content_digest(path) == digest
                except FileNotFoundError:
                    continue
                if same:
                    path.unlink(missing_ok=True)
                    result.files_removed += 1
                else:
                    result.skipped.append(SkippedFile(str(path), "changed after it was merged; left alone"))
    return result
