"""Whether the installed DuckDB answers the store's queries right, and the setting that makes it.

DuckDB 2.0.0 and 2.0.1 answer a window over a hive-partition filter wrongly: with
`WHERE run_id = 'R'`, `min(start_ns) OVER (PARTITION BY step)` returns another run's minimum. Their
`window_self_join` optimizer rewrites the window into a self-join that loses the partition filter.
pyproject excludes both releases, but a user's environment may hold one (or a later release with the
same fault), and users' own SQL over a store is full of such windows.

So, once per process, a tiny hive-partitioned store in a temporary folder is asked the failing query.
Where the answer is wrong, every store connection disables that optimizer; where it is still wrong, one
warning says so. Every connection that reads a store's files calls `configure`.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings

import duckdb

from perfscope.errors import PerfscopeWarning

#: the optimizer whose rewrite loses a hive-partition filter under a window (DuckDB 2.0.x)
SUSPECT_OPTIMIZER = "window_self_join"

_QUERY = "SELECT DISTINCT min(start_ns) OVER (PARTITION BY step) FROM t WHERE run_id = 'R' AND step = 1"
_RIGHT = [(100,)]


@functools.cache
def needed_setting() -> str | None:
    """The optimizer to disable on this DuckDB (None: none needed), found once per process."""
    try:
        with tempfile.TemporaryDirectory(prefix="perfscope-duckdb-check-") as root, duckdb.connect() as con:
            for run_id, start in (("R", 100), ("other", 5)):
                part = os.path.join(root, f"run_id={run_id}")
                os.mkdir(part)
                con.execute(
                    f"COPY (SELECT * FROM (VALUES (0, {start}), (1, {start}), (1, {start + 1})) "
                    f"v(step, start_ns)) TO '{part}/a.parquet' (FORMAT parquet)"
                )
            con.execute(
                "CREATE VIEW t AS SELECT * FROM read_parquet("
                f"'{root}/*/*.parquet', hive_partitioning=true, hive_types={{'run_id': 'VARCHAR'}})"
            )
            if con.execute(_QUERY).fetchall() == _RIGHT:
                return None
            try:
                con.execute(f"SET disabled_optimizers='{SUSPECT_OPTIMIZER}'")
                if con.execute(_QUERY).fetchall() == _RIGHT:
                    return SUSPECT_OPTIMIZER
            except duckdb.Error:
                pass  # a release without that optimizer: nothing known fixes it
    except (OSError, duckdb.Error) as exc:
        warnings.warn(
            f"perfscope could not check the installed DuckDB {duckdb.__version__} ({type(exc).__name__}); "
            "its answers are trusted unchecked",
            PerfscopeWarning,
            stacklevel=2,
        )
        return None
    warnings.warn(
        f"the installed DuckDB {duckdb.__version__} answers a window over a filtered run_id wrongly (it "
        "sees other runs' rows) and no setting perfscope knows fixes it: numbers from SQL with windows may "
        "be wrong; install the release perfscope tests, `pip install duckdb==1.5.6`",
        PerfscopeWarning,
        stacklevel=2,
    )
    return None


def configure(con: duckdb.DuckDBPyConnection) -> None:
    """Make `con` answer windows over partition filters right (before its configuration is locked)."""
    setting = needed_setting()
    if setting is not None:
        con.execute(f"SET disabled_optimizers='{setting}'")
