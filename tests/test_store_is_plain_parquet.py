"""The store is a plain hive-partitioned Parquet dataset: DuckDB and pyarrow alone (no perfscope code
in the read path) read `steps` and find the median steady step time perfscope reports.

The SQL here is the one docs/other_engines.md gives to users (a test keeps the two the same);
tests/test_spark.py runs it on Spark."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from perfscope.analysis import run_analysis
from perfscope.compact import compact
from perfscope.simulate import plan_runs, write_runs
from perfscope.simulate.presets import parse_config
from perfscope.store import open_store

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "sample_traces" / "demo-cpu"
DOC = REPO / "docs" / "other_engines.md"

#: DESIGN's steady state and step time, in SQL that DuckDB and Spark SQL both run over a view
#: `steps` with a `run_id` column: drop the first 10 steps or 5% (whichever is larger; the first
#: half when fewer than 5 steps would be left), a step's time is its slowest rank's, and the median
#: interpolates between the two middle steps.
MEDIAN_STEADY_STEP_SQL = """\
WITH b AS (
    SELECT run_id, min(step) AS first_step, max(step) - min(step) + 1 AS n_steps
    FROM steps GROUP BY run_id
), w AS (
    SELECT run_id, first_step + CASE
             WHEN n_steps - greatest(10, ceil(0.05 * n_steps)) < 5 THEN floor(n_steps / 2)
             ELSE greatest(10, ceil(0.05 * n_steps)) END AS first_steady_step
    FROM b
), per_step AS (
    SELECT s.run_id, s.step, max(s.step_ns) AS step_max_ns
    FROM steps s JOIN w ON s.run_id = w.run_id AND s.step >= w.first_steady_step
    WHERE s.step_ns >= 0
    GROUP BY s.run_id, s.step
)
SELECT run_id, percentile_cont(0.5) WITHIN GROUP (ORDER BY step_max_ns) AS step_median_ns
FROM per_step GROUP BY run_id"""


def perfscope_medians(root: Path) -> dict[str, float]:
    """What perfscope itself reports: run_summary's step_median_ns per run."""
    with open_store(root) as store:
        rows = run_analysis("run_summary", store).to_pylist()
    return {r["run_id"]: r["step_median_ns"] for r in rows if r["step_median_ns"] is not None}


def parquet_files(table_dir: Path) -> list[str]:
    """Data files only: live `.arrows` segments, temporary and hidden files are not Parquet data."""
    return sorted(str(p) for p in table_dir.glob("run_id=*/*.parquet") if not p.name.startswith((".", "_")))


def duckdb_medians(root: Path) -> dict[str, float]:
    """The glob the doc gives: `*.parquet` leaves out live `.arrows` and temporary `.tmp` files."""
    glob = str(root / "steps" / "*" / "*.parquet").replace("'", "''")
    con = duckdb.connect()
    con.execute(
        f"CREATE VIEW steps AS SELECT * FROM read_parquet('{glob}', hive_partitioning = true, "
        "union_by_name = true, hive_types = {'run_id': 'VARCHAR'})"
    )
    return dict(con.execute(MEDIAN_STEADY_STEP_SQL).fetchall())


def pyarrow_medians(root: Path) -> dict[str, float]:
    """The same rule with pyarrow's dataset and compute functions, and numpy for the median."""
    dataset = ds.dataset(
        parquet_files(root / "steps"),
        format="parquet",
        partitioning=ds.partitioning(pa.schema([("run_id", pa.string())]), flavor="hive"),
        partition_base_dir=str(root / "steps"),
    )
    steps = dataset.to_table(columns=["run_id", "rank", "step", "step_ns"])
    out: dict[str, float] = {}
    for run_id in pc.unique(steps["run_id"]).to_pylist():
        run = steps.filter(pc.equal(steps["run_id"], run_id))
        first, last = (v.as_py() for v in pc.min_max(run["step"]).values())
        n_steps = last - first + 1
        warmup = max(10, int(np.ceil(0.05 * n_steps)))
        if n_steps - warmup < 5:
            warmup = n_steps // 2
        valid = run.filter(
            pc.and_(pc.greater_equal(run["step"], first + warmup), pc.greater_equal(run["step_ns"], 0))
        )
        per_step = valid.group_by("step").aggregate([("step_ns", "max")])
        out[run_id] = float(np.median(per_step["step_ns_max"].to_numpy()))
    return out


def _assert_same(plain: dict[str, float], ours: dict[str, float]) -> None:
    assert ours, "perfscope found no runs with steady steps"
    assert plain.keys() == ours.keys()
    for run_id, median in ours.items():
        assert plain[run_id] == pytest.approx(median, rel=1e-9), run_id


@pytest.mark.parametrize("reader", [duckdb_medians, pyarrow_medians])
def test_bundled_store_read_as_plain_parquet(reader) -> None:
    _assert_same(reader(DEMO), perfscope_medians(DEMO))


@pytest.fixture(scope="module")
def compacted_simulated_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by perfscope simulate (StoreWriter), then compacted (merged segments, rollups)."""
    root = tmp_path_factory.mktemp("plain") / "store"
    cfg = parse_config(
        {
            "experiments": [
                {"name": "plain", "partitions": ["hpdlf"], "world_sizes": [1, 2, 8], "steps": 40},
                {"name": "min-steps", "partitions": ["hpdlf"], "world_sizes": [2], "steps": 20},
            ]
        }
    )
    write_runs(root, plan_runs(cfg), cfg.seed, cfg.start_ns)
    compact(root, grace_s=0)
    return root


@pytest.mark.parametrize("reader", [duckdb_medians, pyarrow_medians])
def test_compacted_store_read_as_plain_parquet(compacted_simulated_store: Path, reader) -> None:
    ours = perfscope_medians(compacted_simulated_store)
    assert len(ours) == 4
    _assert_same(reader(compacted_simulated_store), ours)


def test_a_live_or_foreign_file_is_left_out_by_the_glob(tmp_path: Path) -> None:
    """What the doc says to watch for: a running job's `.arrows` segment, a temporary or hidden
    file and `_` folders beside the data are not Parquet, and the `*.parquet` glob never opens them."""
    root = tmp_path / "store"
    cfg = parse_config(
        {"experiments": [{"name": "x", "partitions": ["hpdlf"], "world_sizes": [2], "steps": 30}]}
    )
    (run_id,) = write_runs(root, plan_runs(cfg), cfg.seed, cfg.start_ns)
    expected = perfscope_medians(root)
    part = root / "steps" / f"run_id={run_id}"
    (part / "r0-p1-abc.arrows").write_bytes(b"ARROW1\x00\x00not parquet")
    (part / ".r0-p1-abc-000002.parquet.1a2b.tmp").write_bytes(b"half a file")
    (part / "_SUCCESS").write_bytes(b"")
    _assert_same(duckdb_medians(root), expected)
    _assert_same(pyarrow_medians(root), expected)


def test_the_doc_gives_the_tested_sql() -> None:
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)
    assert MEDIAN_STEADY_STEP_SQL + "\n" in blocks
