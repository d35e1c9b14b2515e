"""The store: a folder of Parquet files, one table per folder, hive-partitioned by run, that any
engine reads as it is. Its modules are read in the order of LAYERS; each imports only earlier ones
(and never perfscope.analysis and the rooms above it), which tests/project/test_layers.py checks.

What it promises, and where each promise is kept:
- The contract: every table, column, type and unit (schema.py); each process group's members stored
  once, its calls naming it by id (process_groups.py); the warm-up cut the rollups and the analysis
  share (warmup.py).
- Crash safety: a killed process loses at most its last interval of rows; the live Arrow stream is
  readable up to its last complete batch (live.py), a sealed file appears whole or not at all
  (segments.write_segment), an import is published whole or not at all (imports.py), compaction
  never leaves rows missing or doubled (compact.py), and what killed processes left behind is
  cleaned up (leftovers.py, imports.recover_stale_imports).
- Off the job's thread: rows are written by one background thread, bounded (writer.py).
- Files per host: the sealed segments one host wrote for a run are merged into one file per table
  when its last writer closes (writer.py, compact.compact_host); `perfscope compact` does the rest.
- Untrusted input: a store's files are, so a truncated, corrupt or foreign file is skipped and named,
  never read outside the folder (listing.py, manifest.py); a user's SQL runs read-only and bounded
  (user_sql.py); an object store's keys are (objectstore.py).
- Reading: one DuckDB view per table over the current listing (reader.Store); `open_store` opens a
  folder or an s3:// store through its mirror (open.py).
"""

from __future__ import annotations

from .open import open_store
from .reader import Store
from .schema import SCHEMA_VERSION
from .writer import StoreWriter

#: the store's modules, earliest first: each imports only modules before it
LAYERS = (
    "schema",
    "process_groups",
    "warmup",
    "live",
    "segments",
    "leftovers",
    "manifest",
    "listing",
    "sql_worker",
    "user_sql",
    "reader",
    "rollups",
    "imports",
    "compact",
    "writer",
    "objectstore",
    "open",
)

__all__ = ["LAYERS", "SCHEMA_VERSION", "Store", "StoreWriter", "open_store"]
