"""Merges a store's small finished segments into large files, never leaving data missing or doubled;
seals the live segments of killed writers.

A compacted file is renamed into place carrying the names, row counts, sizes and hashes of the
segments it replaces; from that moment readers ignore those segments (no double counting), and only
then are they deleted: only those whose bytes are still the ones it rewrote. A reader still holding
the old list re-lists when a file disappears (Store.query does).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import StoreError
from .imports import IMPORTS_DIR, recover_stale_imports
from .leftovers import clean_leftovers
from .listing import check_root, list_store, rows_contained
from .live import LIVE_SUFFIX, dictionary_columns, read_live, twin, writer_alive
from .rollups import write_rollups
from .schema import META_REPLACES, META_TABLE, META_VERSION, PARTITION_KEY, SCHEMA_VERSION, TABLES
from .segments import LIVE_MAX_AGE_S, Segment, SkippedFile, content_digest, replaces_metadata, write_segment

ROW_GROUP_ROWS = 1_000_000
#: how long `compact` waits for the store's lock before saying another compaction holds it
COMPACT_WAIT_S = 30.0


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
    #: temporary files of killed writers and compactions, DuckDB spill folders (perfscope.store.leftovers)
    leftovers_removed: list[Path] = field(default_factory=list)
    #: live segments of killed writers sealed into Parquet (or removed: their twin held their rows)
    live_sealed: list[Path] = field(default_factory=list)


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
        values = con.sql(f"SELECT {col.migrated} AS v FROM segment").to_arrow_table()
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
        with pq.ParquetWriter(
            tmp, schema, compression="zstd", use_dictionary=dictionary_columns(schema)
        ) as w:
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
    """Seal the live segments of killed writers, then merge every partition holding two or more
    segments into one file per partition.

    The replaced segments stay on disk for `grace_s` seconds after the merged files appear, so a
    reader that listed the folder just before is not left holding names of files already gone.
    """
    root_path = Path(root).resolve()
    check_root(root_path)
    try:
        # a closing writer's merge holds the lock for seconds (capped): wait that long, not a compaction's
        with _store_lock(root_path, wait_s=COMPACT_WAIT_S) as locked:
            if not locked:
                raise StoreError(
                    f"another `perfscope compact` (or a closing writer's merge) is running on {root_path}; "
                    "wait for it."
                )
            result = CompactResult()
            if not dry_run:  # temporary files of killed compactions and writers, DuckDB spill folders
                result.leftovers_removed = clean_leftovers(root_path)
                # and what killed importers staged (their claims' locks are free)
                if recover_stale_imports(root_path):
                    with contextlib.suppress(OSError):
                        (root_path / IMPORTS_DIR).rmdir()  # when empty
                _seal_crashed(root_path, result)
            _compact_locked(root_path, result, dry_run=dry_run, grace_s=grace_s)
            if not dry_run:  # per-run aggregates of the steps the analyses read (perfscope.store.rollups)
                write_rollups(root_path)
                list_store(root_path, save_manifest=True)  # the manifest: merged files in, removed out
            return result
    except OSError as exc:
        raise StoreError(f"cannot compact {root_path}: {exc.strerror}; is the store writable?") from None


def compact_host(
    root: str | os.PathLike[str],
    run_id: str,
    host: str,
    *,
    max_bytes: int | None = None,
    wait_s: float = 0.0,
    grace_s: float = 0.5,
) -> CompactResult | None:
    """Merge the sealed segments of one run that one host wrote (names led by its tag, see
    writer.host_tag) into one file per table: what a writer does at close. A table whose files come
    to more than `max_bytes` is left to `perfscope compact`; so is the rollup of a run whose steps do
    (perfscope.store.rollups, written here once the run has no live segment left). None when the store's
    lock was not had within `wait_s`, or flock is not available there."""
    root_path = Path(root).resolve()
    try:
        with _store_lock(root_path, wait_s=wait_s) as locked:
            if not locked:
                return None
            result = CompactResult()
            _compact_locked(
                root_path,
                result,
                dry_run=False,
                grace_s=grace_s,
                run_id=run_id,
                host=host,
                max_bytes=max_bytes,
            )
            # the run's rollups, once its last writer on the last host has sealed (the listing shows
            # no live segment of it): analyses of a store nobody compacted read them too
            if not _still_live(root_path, run_id):
                write_rollups(root_path, run_ids={run_id}, max_bytes=max_bytes)
            return result
    except OSError:  # no flock on this file system (some network mounts)
        return None


@contextlib.contextmanager
def _store_lock(root: Path, *, wait_s: float) -> Iterator[bool]:
    """The store's exclusive compaction lock, waited for at most `wait_s`: yields whether it is held."""
    with open(root / ".compact.lock", "a+") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True  # released when the file closes


def _still_live(root: Path, run_id: str) -> bool:
    """Whether a writer of the run may still add steps: a live segment not yet sealed (no twin)."""
    part = root / "steps" / f"{PARTITION_KEY}={run_id}"
    return any(not twin(p).exists() for p in part.glob(f"*{LIVE_SUFFIX}"))


def _of_host(name: str, host: str) -> bool:
    return name.startswith((f"{host}-", f"c-{host}-"))


def _seal_crashed(root: Path, result: CompactResult) -> None:
    """Seal the live segments whose writer is gone into their Parquet twins, and remove those a
    seal was interrupted after (their twin holds their rows); a running writer's are left alone."""
    listing = list_store(root)
    # hostile or broken live segments are named here: the merge's listing leaves `.arrows` unread
    result.skipped += [s for s in listing.skipped if s.path.endswith(LIVE_SUFFIX)]
    for path in listing.sealed_live:
        # the twin hides it from readers already; it goes once the twin holds every row it has
        try:
            live = read_live(path)
            held = pq.read_metadata(twin(path)).num_rows
        except (OSError, ValueError, pa.ArrowException):
            continue
        if live is None or live.num_rows <= held:
            path.unlink(missing_ok=True)
            result.live_sealed.append(path)
    stale = time.time() - 2 * LIVE_MAX_AGE_S
    for segs in listing.segments.values():
        for seg in segs:
            if seg.live is None:
                continue
            alive = writer_alive(seg.path)
            if twin(seg.path).exists():  # not a valid segment, or the listing would have hidden this one
                why = f"its twin {twin(seg.path).name} is no valid segment: remove it, and compact again"
                result.skipped.append(SkippedFile(str(seg.path), f"not sealed: {why}"))
                continue
            try:
                if alive or (alive is None and seg.path.stat().st_mtime > stale):
                    continue  # its writer is running (or, without flock, may be)
                data = read_live(seg.path)  # again: it may have grown since the listing
                if data is not None and data.num_rows:
                    write_segment(twin(seg.path), data, compression="zstd")
                seg.path.unlink(missing_ok=True)
            except (OSError, ValueError, pa.ArrowException) as exc:
                result.skipped.append(SkippedFile(str(seg.path), f"not sealed: {exc}"))
                continue
            result.live_sealed.append(seg.path)


def _compact_locked(
    root: Path,
    result: CompactResult,
    *,
    dry_run: bool,
    grace_s: float,
    run_id: str | None = None,
    host: str | None = None,
    max_bytes: int | None = None,
) -> None:
    """Merge, with the store's lock held: every partition (or `run_id`'s), every sealed segment (or
    the ones `host` wrote) of two or more."""
    listing = list_store(root, run_id=run_id, read_live=False)  # only sealed segments are merged
    result.skipped += listing.skipped
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
    # a twin whose live segment is still there (its writer killed between the two) stays as it is:
    # merged away, it would leave the live segment to be read, and sealed, again
    unsealed = {twin(p) for p in listing.sealed_live}
    replaced: list[tuple[Path, str]] = []
    for table, segs in listing.segments.items():
        by_part: dict[Path, list[Segment]] = {}
        for seg in segs:
            mine = host is None or _of_host(seg.path.name, host)
            if seg.live is None and seg.path not in unsealed and mine:
                by_part.setdefault(seg.path.parent, []).append(seg)
        for part, group in sorted(by_part.items()):
            if len(group) < 2:
                continue
            size = sum(s.path.stat().st_size for s in group)
            if max_bytes is not None and size > max_bytes:
                result.skipped.append(
                    SkippedFile(str(part), f"{size >> 20} MiB: left to `perfscope compact`")
                )
                continue
            result.partitions += 1
            result.files_merged += len(group)
            result.bytes_before += size
            if dry_run:
                result.rows += sum(s.num_rows for s in group)
                continue
            out = part / (
                f"c-{host}-{secrets.token_hex(6)}.parquet" if host else f"c-{secrets.token_hex(6)}.parquet"
            )
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
