"""Spark reads a perfscope store as it is (docs/other_engines.md) and finds, with Spark SQL alone, the
same median steady step time, steady-state step time and throughput per run and scaling table
(speedup and efficiency against each group's smallest world size) perfscope reports, on the bundled
demo store and on a store whose ranks' step boundaries are not aligned. One Spark session for the
module (it takes seconds to start). Skips with one line without pyspark or without a Java runtime (neither
is a perfscope dependency: pip install pyspark; apt-get install default-jre-headless)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_store_is_plain_parquet import (
    DEMO,
    MEDIAN_STEADY_STEP_SQL,
    RUN_STATS_SQL,
    SCALING_SQL,
    assert_same_run_stats,
    assert_same_scaling,
    build_misaligned_store,
    perfscope_medians,
    perfscope_run_stats,
    perfscope_scaling,
)

from perfscope.store.open import open_store

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark)")
if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("no Java runtime for Spark (apt-get install default-jre-headless)", allow_module_level=True)


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    local = tmp_path_factory.mktemp("spark")
    try:
        session = (
            SparkSession.builder.master("local[1]")
            .appName("perfscope-test")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.local.dir", str(local))
            .config("spark.sql.warehouse.dir", str(local / "warehouse"))
            .config("spark.sql.shuffle.partitions", "1")
            .config("spark.sql.session.timeZone", "UTC")
            # run ids are names: never let Spark turn run_id=20240101 into a number
            .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
            .getOrCreate()
        )
    except Exception as exc:  # a Java too old for this pyspark, a broken JAVA_HOME
        pytest.skip(f"Spark could not start here: {str(exc).splitlines()[0][:200]}")
    yield session
    session.stop()


def spark_views(spark: Any, root: Path) -> None:
    """The views the doc's SQL reads: `steps` and `runs` of the store at `root`, and `run_stats`."""
    for table in ("steps", "runs"):
        frame = (
            spark.read.option("mergeSchema", "true")  # segments of older schema versions lack new columns
            .option("pathGlobFilter", "*.parquet")  # a running job's .arrows segments are not Parquet
            .parquet(str(root / table))
        )
        frame.createOrReplaceTempView(table)
    spark.sql(RUN_STATS_SQL).createOrReplaceTempView("run_stats")


def spark_rows(spark: Any, sql: str) -> list[dict[str, Any]]:
    return [r.asDict() for r in spark.sql(sql).collect()]


def spark_medians(spark: Any, root: Path) -> dict[str, float]:
    spark_views(spark, root)
    return {r["run_id"]: float(r["step_median_ns"]) for r in spark.sql(MEDIAN_STEADY_STEP_SQL).collect()}


def test_spark_finds_the_median_steady_step_time_perfscope_reports(spark: Any) -> None:
    ours = perfscope_medians(DEMO)
    theirs = spark_medians(spark, DEMO)
    assert len(ours) >= 4
    assert theirs.keys() == ours.keys()
    for run_id, median in ours.items():
        assert theirs[run_id] == pytest.approx(median, rel=1e-9), run_id


@pytest.mark.parametrize("store", ["demo", "misaligned"])
def test_spark_sql_finds_the_step_time_throughput_and_scaling_perfscope_reports(
    spark: Any, store: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Per run the steady window's wall clock / steps and global samples / elapsed; per group and N
    the speedup and efficiency against N0: Spark SQL over the store equals `perfscope analyze`. The
    misaligned store's per-step maxima are a fifth off its wall clock, so a sum of them would fail."""
    root = DEMO if store == "demo" else build_misaligned_store(tmp_path_factory.mktemp("spark-store") / "s")
    ours = perfscope_run_stats(root)
    assert len(ours) >= 6
    spark_views(spark, root)
    assert_same_run_stats(spark_rows(spark, "SELECT * FROM run_stats"), ours)
    scaling = perfscope_scaling(root)
    assert max(r["world_size"] for r in scaling) == 4
    assert_same_scaling(spark_rows(spark, SCALING_SQL), scaling)


def test_the_dataframe_api_gives_the_same_medians(spark: Any) -> None:
    """The DataFrame form docs/other_engines.md gives beside the SQL."""
    from pyspark.sql import functions as F

    steps = (
        spark.read.option("mergeSchema", "true")
        .option("pathGlobFilter", "*.parquet")
        .parquet(str(DEMO / "steps"))
    )
    b = steps.groupBy("run_id").agg(F.min("step").alias("first_step"), F.max("step").alias("last_step"))
    n = F.col("last_step") - F.col("first_step") + 1
    warmup = F.greatest(F.lit(10), F.ceil(0.05 * n))
    b = b.withColumn(
        "first_steady_step", F.col("first_step") + F.when(n - warmup < 5, F.floor(n / 2)).otherwise(warmup)
    )
    per_step = (
        steps.join(b, "run_id")
        .where((F.col("step") >= F.col("first_steady_step")) & (F.col("step_ns") >= 0))
        .groupBy("run_id", "step")
        .agg(F.max("step_ns").alias("step_max_ns"))
    )
    rows = per_step.groupBy("run_id").agg(F.percentile("step_max_ns", 0.5).alias("step_median_ns")).collect()
    ours = perfscope_medians(DEMO)
    assert {r["run_id"] for r in rows} == ours.keys()
    for r in rows:
        assert float(r["step_median_ns"]) == pytest.approx(ours[r["run_id"]], rel=1e-9)


def test_spark_reads_every_step_row_with_run_id_a_string(spark: Any) -> None:
    steps = spark.read.option("pathGlobFilter", "*.parquet").parquet(str(DEMO / "steps"))
    assert dict(steps.dtypes)["run_id"] == "string"
    with open_store(DEMO) as store:
        expected = store.query("SELECT run_id, count(*) AS n FROM steps GROUP BY run_id").to_pylist()
    counted = {r["run_id"]: r["count"] for r in steps.groupBy("run_id").count().collect()}
    assert counted == {r["run_id"]: r["n"] for r in expected}
