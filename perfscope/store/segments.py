"""The sealed segment: one Parquet file of one table of one run, written atomically, and what a
reader knows of it (Segment), including the segments a compacted file says it replaces.

The live segment (an Arrow stream being appended to) is live.py; a listing of many is listing.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .live import dictionary_columns

#: a live segment is sealed into Parquet once it is this old (the writer's rule; compaction seals a
#: dead writer's older ones)
LIVE_MAX_AGE_S = 600.0
#: columns whose smallest and largest values (from the footer statistics) are kept: `perfscope
#: info` takes ranks, first step and last step from them instead of reading every file
RANGE_COLUMNS = ("rank", "start_ns", "step_ns")


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str


@dataclass(frozen=True)
class Replaced:
    """One segment a compacted file says it holds the rows of: the claim checked before it is honoured."""

    name: str
    rows: int
    size_bytes: int
    blake2b: str


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment read. (manifest.Entries.segments makes them with positional arguments, in the
    order of these fields.)"""

    #: the file's absolute path (`path` makes it a Path on demand: a listing of 100,000 segments
    #: builds no Path objects; slots, not a __dict__, for the same reason)
    file: str
    #: the file's name (the last part of `file`)
    name: str
    table: str
    version: int
    columns: frozenset[str]
    num_rows: int
    replaces: tuple[Replaced, ...]
    #: size and footer of the file, hashed: equal for identical copies (confirmed by content_digest)
    footprint: str = ""
    #: why the file's `perfscope.replaces` cannot be honoured, when it cannot
    claim_problem: str = ""
    #: a live segment's complete batches, read when it was listed (None for a Parquet segment)
    live: pa.Table | None = field(default=None, compare=False, repr=False)
    #: smallest and largest value of each of the manifest's RANGE_COLUMNS, in turn, from the footer
    #: statistics (None where a row group has none; a row group of NULLs only adds nothing)
    ranges: tuple[int | None, ...] = ()
    #: the file's `perfscope.replaces` metadata as written (kept in the manifest)
    replaces_raw: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def path(self) -> Path:
        return Path(self.file)

    def range_of(self, column: str) -> tuple[int, int] | None:
        """The smallest and largest value of `column` (one of RANGE_COLUMNS) in the file, when the
        footer gave them."""
        k = 2 * RANGE_COLUMNS.index(column)
        lo, hi = self.ranges[k : k + 2] or (None, None)
        return (lo, hi) if lo is not None and hi is not None and lo <= hi else None


def write_segment(
    path: Path, table: pa.Table, *, compression: str = "zstd", row_group_size: int | None = None
) -> None:
    """Write `table` to `path` atomically: temporary hidden name, close, rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        pq.write_table(
            table,
            tmp,
            compression=compression,
            row_group_size=row_group_size,
            use_dictionary=dictionary_columns(table.schema),
        )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def content_digest(path: Path) -> str:
    """The blake2b hash of the file's bytes: what a compacted file records of each segment it replaces."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def parse_replaces(raw: bytes | None) -> tuple[tuple[Replaced, ...], str]:
    """The segments a compacted file claims to replace, or () and why its claim cannot be read."""
    if raw is None:
        return (), ""
    try:
        entries = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return (), "its perfscope.replaces metadata is not JSON"
    if not isinstance(entries, list):
        return (), "its perfscope.replaces metadata is not a list"
    claims: list[Replaced] = []
    for e in entries:
        if isinstance(e, str):
            # written by an older perfscope: names only; harmless once they are gone, never honoured
            claims.append(Replaced(e, -1, -1, ""))
            continue
        if not (
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and all(type(e.get(k)) is int and e[k] >= 0 for k in ("rows", "size_bytes"))
            and isinstance(e.get("blake2b"), str)
        ):
            return (), "its perfscope.replaces metadata has an entry without name, rows, size and hash"
        claims.append(Replaced(e["name"], e["rows"], e["size_bytes"], e["blake2b"]))
    return tuple(claims), ""


def replaces_metadata(segments: list[Segment]) -> bytes:
    """What a compacted file records of the segments it replaces: names, row counts, sizes, hashes."""
    entries = [
        {
            "name": s.path.name,
            "rows": s.num_rows,
            "size_bytes": s.path.stat().st_size,
            "blake2b": content_digest(s.path),
        }
        for s in sorted(segments, key=lambda s: s.path.name)
    ]
    return json.dumps(entries).encode()
