"""The store is a plain hive-partitioned Parquet dataset: DuckDB and pyarrow alone (no perfscope code
in the read path) read `steps` and `runs` and find the median steady step time, the steady-state
step time and throughput per run and the scaling table (speedup, efficiency) perfscope reports.

The SQL here is the one docs/other_engines.md gives to users (a test keeps the two the same);
tests/analysis/test_spark.py runs it on Spark."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
from storegen import MS, T0_NS, make_run, row

from perfscope.analysis import run_analysis
from perfscope.simulate import plan_runs, write_runs
from perfscope.simulate.presets import parse_config
from perfscope.store.compact import compact
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

REPO = Path(__file__).resolve().parents[2]
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

#: DESIGN's steady-state step time and throughput per run, in SQL that DuckDB and Spark SQL both run
#: over views `steps` and `runs` (with their `run_id` column): the warm-up cut as above; the steady
#: window's elapsed time is its wall clock (latest end of a step on any rank minus earliest start,
#: ranks' step boundaries are not aligned), or the sum of the per-step slowest rank where the rows
#: carry no start times or the ranks' clocks visibly disagree; step time = elapsed / steps; global
#: samples per step from `global_batch_size`, else the ranks' recorded samples, else per-rank batch x
#: world size (data-parallel runs: pipeline stages and parameter servers count samples differently).
RUN_STATS_SQL = """\
WITH r AS (
    SELECT * FROM (
        SELECT *, row_number() OVER (PARTITION BY run_id ORDER BY ended_ns DESC NULLS LAST) AS nth
        FROM runs
    ) latest WHERE nth = 1
), b AS (
    SELECT run_id, min(step) AS first_step, max(step) - min(step) + 1 AS n_steps
    FROM steps GROUP BY run_id
), w AS (
    SELECT run_id, first_step + CASE
             WHEN n_steps - greatest(10, ceil(0.05 * n_steps)) < 5 THEN floor(n_steps / 2)
             ELSE greatest(10, ceil(0.05 * n_steps)) END AS first_steady_step
    FROM b
), steady AS (
    SELECT s.run_id, s.rank, s.step, s.start_ns, s.step_ns, s.samples
    FROM steps s JOIN w ON s.run_id = w.run_id AND s.step >= w.first_steady_step
    WHERE s.step_ns >= 0
), per_step AS (
    SELECT run_id, step, max(step_ns) AS step_max_ns,
           min(start_ns) AS start_min_ns, max(start_ns + step_ns) AS end_max_ns
    FROM steady GROUP BY run_id, step
), win AS (
    SELECT run_id, count(*) AS steady_steps,
           min(start_min_ns) AS window_start_ns, max(end_max_ns) AS window_end_ns,
           max(CASE WHEN end_max_ns IS NOT NULL THEN step END)
             - min(CASE WHEN start_min_ns IS NOT NULL THEN step END) + 1 AS span_steps,
           avg(step_max_ns) AS step_max_mean_ns, max(step_max_ns) AS step_max_top_ns,
           sum(step_max_ns) AS step_max_sum_ns
    FROM per_step GROUP BY run_id
), el AS (
    SELECT run_id, steady_steps, wall_clock,
           CASE WHEN wall_clock THEN window_end_ns - window_start_ns
                ELSE step_max_sum_ns END AS elapsed_ns,
           CASE WHEN wall_clock THEN span_steps ELSE steady_steps END AS elapsed_steps
    FROM (
        SELECT *, coalesce(span_steps >= 1 AND window_end_ns > window_start_ns
                           AND window_end_ns - window_start_ns
                               <= step_max_mean_ns * span_steps + step_max_top_ns, false) AS wall_clock
        FROM win
    ) checked
), per_rank AS (
    SELECT run_id, rank, sum(samples) / nullif(count(samples), 0) AS samples_mean
    FROM steady GROUP BY run_id, rank
), k AS (
    SELECT run_id, count(*) AS ranks_seen, sum(samples_mean) AS samples_recorded
    FROM per_rank GROUP BY run_id
), j AS (
    SELECT r.run_id, coalesce(r.experiment, '') AS experiment, coalesce(r.cluster, '') AS cluster,
           coalesce(r.backend, '') AS backend, coalesce(r.model, '') AS model,
           coalesce(r.scaling_mode, '') AS scaling_mode,
           coalesce(r.world_size, k.ranks_seen) AS world_size,
           r.batch_size_per_rank, r.global_batch_size,
           el.steady_steps, el.wall_clock, el.elapsed_ns, el.elapsed_steps,
           coalesce(CAST(r.global_batch_size AS DOUBLE),
                    k.samples_recorded * greatest(1.0, coalesce(r.world_size, k.ranks_seen) / k.ranks_seen),
                    CAST(r.batch_size_per_rank AS DOUBLE) * r.world_size) AS samples_per_step
    FROM r JOIN el ON r.run_id = el.run_id JOIN k ON r.run_id = k.run_id
)
SELECT *, elapsed_ns / elapsed_steps AS step_ns,
       samples_per_step * elapsed_steps / (elapsed_ns / 1e9) AS throughput_samples_per_s
FROM j"""

#: DESIGN's scaling table over a view `run_stats` (the query above): runs are grouped by experiment,
#: cluster, backend and model, and by the per-rank batch (weak scaling) or the global batch (strong
#: scaling) as the batches say (a declared `scaling_mode` wins unless the batches contradict it);
#: N0 is a group's smallest world size; speedup S(N) = X(N) / X(N0) with X(N0) the baseline runs'
#: median samples per step over their median step time, efficiency E(N) = S(N) N0 / N.
SCALING_SQL = """\
WITH f AS (
    SELECT *, coalesce(global_batch_size, batch_size_per_rank * world_size) AS gbs FROM run_stats
), weak AS (
    SELECT experiment, cluster, backend, model, coalesce(batch_size_per_rank, -1) AS bpr,
           count(DISTINCT world_size) >= 2 AS sizes
    FROM f GROUP BY experiment, cluster, backend, model, coalesce(batch_size_per_rank, -1)
), strong AS (
    SELECT experiment, cluster, backend, model, coalesce(gbs, -1) AS gbs,
           count(DISTINCT world_size) >= 2 AS sizes
    FROM f GROUP BY experiment, cluster, backend, model, coalesce(gbs, -1)
), m AS (
    SELECT f.*, CASE
             WHEN f.scaling_mode = 'weak' AND NOT weak.sizes AND strong.sizes THEN 'strong'
             WHEN f.scaling_mode = 'strong' AND NOT strong.sizes AND weak.sizes THEN 'weak'
             WHEN f.scaling_mode IN ('weak', 'strong') THEN f.scaling_mode
             WHEN weak.sizes THEN 'weak'
             WHEN strong.sizes THEN 'strong'
             ELSE 'weak' END AS mode
    FROM f
    JOIN weak ON f.experiment = weak.experiment AND f.cluster = weak.cluster
         AND f.backend = weak.backend AND f.model = weak.model
         AND coalesce(f.batch_size_per_rank, -1) = weak.bpr
    JOIN strong ON f.experiment = strong.experiment AND f.cluster = strong.cluster
         AND f.backend = strong.backend AND f.model = strong.model AND coalesce(f.gbs, -1) = strong.gbs
), g AS (
    SELECT *, concat_ws('/', experiment, cluster, backend, model, CASE WHEN mode = 'strong'
               THEN 'strong:g' || coalesce(CAST(gbs AS STRING), '-')
               ELSE 'weak:b' || coalesce(CAST(batch_size_per_rank AS STRING), '-') END) AS group_key
    FROM m
), n0 AS (
    SELECT group_key, min(world_size) AS n0 FROM g GROUP BY group_key
), base AS (
    SELECT g.group_key, n0.n0,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY g.samples_per_step)
             / (percentile_cont(0.5) WITHIN GROUP (ORDER BY g.step_ns) / 1e9) AS x0
    FROM g JOIN n0 ON g.group_key = n0.group_key AND g.world_size = n0.n0
    GROUP BY g.group_key, n0.n0
)
SELECT g.group_key, g.run_id, g.world_size, base.n0 AS baseline_world_size,
       g.step_ns, g.throughput_samples_per_s,
       g.throughput_samples_per_s / base.x0 AS speedup,
       g.throughput_samples_per_s / base.x0 * base.n0 / g.world_size AS efficiency
FROM g JOIN base ON g.group_key = base.group_key
ORDER BY g.group_key, g.world_size, g.run_id"""


def perfscope_medians(root: Path) -> dict[str, float]:
    """What perfscope itself reports: run_summary's step_median_ns per run."""
    with open_store(root) as store:
        rows = run_analysis("run_summary", store).to_pylist()
    return {r["run_id"]: r["step_median_ns"] for r in rows if r["step_median_ns"] is not None}


def perfscope_run_stats(root: Path) -> dict[str, dict[str, Any]]:
    """What perfscope itself reports per run with steady steps: run_summary's rows."""
    with open_store(root) as store:
        rows = run_analysis("run_summary", store).to_pylist()
    return {str(r["run_id"]): r for r in rows if r["step_ns"] is not None}


def perfscope_scaling(root: Path) -> list[dict[str, Any]]:
    with open_store(root) as store:
        return run_analysis("scaling", store).to_pylist()


def assert_same_run_stats(theirs: list[dict[str, Any]], ours: dict[str, dict[str, Any]]) -> None:
    """RUN_STATS_SQL's rows (any engine) against perfscope's run_summary: the same runs, step time,
    throughput and elapsed-time source within float tolerance."""
    assert ours, "perfscope found no runs with steady steps"
    by_run = {str(r["run_id"]): r for r in theirs}
    assert by_run.keys() == ours.keys()
    for run_id, o in ours.items():
        t = by_run[run_id]
        assert t["step_ns"] == pytest.approx(o["step_ns"], rel=1e-9), run_id
        assert t["throughput_samples_per_s"] == pytest.approx(o["throughput_samples_per_s"], rel=1e-9), run_id
        assert t["elapsed_ns"] == pytest.approx(o["elapsed_s"] * 1e9, rel=1e-9), run_id
        assert bool(t["wall_clock"]) == (o["elapsed_source"] == "wall_clock"), run_id


def assert_same_scaling(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> None:
    """SCALING_SQL's rows against perfscope's scaling analysis: the same runs compared with each other,
    the same baseline world size N0, speedup and efficiency within float tolerance."""
    assert ours, "perfscope found no scaling rows"
    mine = {str(r["run_id"]): r for r in ours}
    by_run = {str(r["run_id"]): r for r in theirs}
    assert by_run.keys() == mine.keys()

    def grouping(rows: dict[str, dict[str, Any]], key: str) -> set[frozenset[str]]:
        groups: dict[object, set[str]] = {}
        for run_id, r in rows.items():
            groups.setdefault(r[key], set()).add(run_id)
        return {frozenset(g) for g in groups.values()}

    assert grouping(by_run, "group_key") == grouping(mine, "group_id")
    for run_id, o in mine.items():
        t = by_run[run_id]
        assert t["baseline_world_size"] == o["baseline_world_size"], run_id
        assert t["speedup"] == pytest.approx(o["speedup"], rel=1e-9), run_id
        assert t["efficiency"] == pytest.approx(o["efficiency"], rel=1e-9), run_id


def build_misaligned_store(root: Path) -> Path:
    """Runs whose ranks each run their steps back to back on their own clock, out of phase: rank r's
    step k takes 1.2 x or 0.8 x the run's base step time in turn ((r + k) even: the long one) and
    rank r starts r x 3 ms late, so every step's slowest rank takes 1.2 x base while the window moves
    at about 1 x base a step: a sum (or mean) of per-step maxima is a fifth off the wall clock.
    Weak scaling (per-rank batch 32 at 1, 2, 4 ranks; the 4-rank run 400 steps, so 5% of them are
    warm-up), strong scaling (global batch 120 at 1, 2, 4 ranks), a run without batch sizes
    (samples from the rows) and one without start times (the sum of maxima stands in)."""
    plan = [
        # run_id, experiment, world size, per-rank batch, global batch, steps, start times
        ("weak-1", "weak", 1, 32, None, 60, True),
        ("weak-2", "weak", 2, 32, None, 60, True),
        ("weak-4", "weak", 4, 32, None, 400, True),
        ("strong-1", "strong", 1, 120, 120, 60, True),
        ("strong-2", "strong", 2, 60, 120, 60, True),
        ("strong-4", "strong", 4, 30, 120, 60, True),
        ("unrecorded-2", "unrecorded", 2, None, None, 60, True),
        ("no-start-4", "no-start", 4, 32, None, 60, False),
    ]
    for run_id, experiment, n, per_rank, global_batch, steps, with_start in plan:
        make_run(root, run_id, world_size=n, steps=0, experiment=experiment,
                 batch_size_per_rank=per_rank, global_batch_size=global_batch)  # fmt: skip
        base_ms = (20.0 + 5.0 * n) if experiment != "strong" else 120.0 / n + 10.0
        rows = []
        for r in range(n):
            t = T0_NS + r * 3 * MS
            for k in range(steps):
                d = int(base_ms * (1.2 if (r + k) % 2 == 0 else 0.8) * MS)
                rows.append(row("steps", rank=r, step=k, start_ns=t if with_start else None, step_ns=d,
                                forward_ns=d // 2, backward_ns=d - d // 2,
                                samples=per_rank if per_rank is not None else 16, clock="host"))  # fmt: skip
                t += d
        with StoreWriter(root, run_id, writer_id=f"misaligned-{run_id}") as w:
            w.extend("steps", rows)
    return root


def parquet_files(table_dir: Path) -> list[str]:
    """Data files only: live `.arrows` segments, temporary and hidden files are not Parquet data."""
    return sorted(str(p) for p in table_dir.glob("run_id=*/*.parquet") if not p.name.startswith((".", "_")))


def duckdb_views(root: Path) -> duckdb.DuckDBPyConnection:
    """DuckDB alone over the store, as the doc gives it: views `steps` and `runs` (the `*.parquet` glob
    leaves out live `.arrows` and temporary `.tmp` files) and `run_stats` (RUN_STATS_SQL)."""
    con = duckdb.connect()
    for table in ("steps", "runs"):
        glob = str(root / table / "*" / "*.parquet").replace("'", "''")
        con.execute(
            f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{glob}', hive_partitioning = true, "
            "union_by_name = true, hive_types = {'run_id': 'VARCHAR'})"
        )
    con.execute(f"CREATE VIEW run_stats AS {RUN_STATS_SQL}")
    return con


def records(con: duckdb.DuckDBPyConnection, sql: str) -> list[dict[str, Any]]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def duckdb_medians(root: Path) -> dict[str, float]:
    return dict(duckdb_views(root).execute(MEDIAN_STEADY_STEP_SQL).fetchall())


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


@pytest.fixture(scope="module")
def misaligned_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_misaligned_store(tmp_path_factory.mktemp("misaligned") / "store")


def test_the_stores_step_time_and_throughput_in_plain_sql() -> None:
    con = duckdb_views(DEMO)
    assert_same_run_stats(records(con, "SELECT * FROM run_stats"), perfscope_run_stats(DEMO))


def test_the_stores_scaling_table_in_plain_sql() -> None:
    ours = perfscope_scaling(DEMO)
    assert {r["world_size"] for r in ours} == {1, 2, 4} and len({r["group_id"] for r in ours}) == 2
    assert_same_scaling(records(duckdb_views(DEMO), SCALING_SQL), ours)


def test_misaligned_ranks_step_time_throughput_and_scaling_in_plain_sql(misaligned_store: Path) -> None:
    """Ranks' step boundaries out of phase: the SQL's wall clock, not a sum of per-step maxima, is
    what perfscope reports (a fifth apart here), and the scaling table follows it."""
    ours = perfscope_run_stats(misaligned_store)
    assert len(ours) == 8
    for run_id, o in ours.items():
        wall = o["elapsed_source"] == "wall_clock"
        assert wall == (run_id != "no-start-4"), run_id
        if wall and o["world_size"] > 1:  # the definition matters: the per-step maxima are 1.2 x base
            assert o["step_ns"] < 0.9 * o["step_median_ns"], run_id
    con = duckdb_views(misaligned_store)
    assert_same_run_stats(records(con, "SELECT * FROM run_stats"), ours)
    scaling = perfscope_scaling(misaligned_store)
    assert {r["scaling_mode"] for r in scaling} >= {"weak", "strong"}
    assert_same_scaling(records(con, SCALING_SQL), scaling)


def test_the_doc_gives_the_tested_sql() -> None:
    blocks = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)
    for sql in (MEDIAN_STEADY_STEP_SQL, RUN_STATS_SQL, SCALING_SQL):
        assert sql + "\n" in blocks
