"""`perfscope compare` without training jobs (issue 34): the moving-block bootstrap's interval on series of
known shape, an op added between two imported op tables listed by op type, and hostile input (stores
with no runs, a run id that does not exist, a store of several runs without --base-run) one line, exit 2.
The real jobs are in test_compare_jobs.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_what_if import _cli, synthetic

from perfscope.analysis.compare import block_length, ratio_interval, resampled_means, verdict_of


def _ar1(n: int, mean: float, sd: float, phi: float, seed: int) -> np.ndarray:
    """An autocorrelated series (AR(1) with coefficient phi) around `mean`."""
    rng = np.random.default_rng(seed)
    e = rng.normal(0, sd * np.sqrt(1 - phi**2), n)
    x = np.empty(n)
    x[0] = rng.normal(0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + e[i]
    return mean + x


def test_the_interval_holds_the_ratio_and_is_reproducible() -> None:
    base = _ar1(400, 100.0, 5.0, 0.6, 1)
    cand = _ar1(400, 120.0, 5.0, 0.6, 2)
    (lo, hi), block = ratio_interval(base, cand)
    assert block == block_length(400) == 8  # ceil(400^(1/3))
    assert lo < cand.mean() / base.mean() < hi
    assert lo > 1.15 and hi < 1.25
    assert verdict_of((lo, hi), 0.02) == "slower"
    assert ratio_interval(base, cand)[0] == (lo, hi)  # seeded: the same answer every time
    same = ratio_interval(_ar1(400, 100.0, 2.0, 0.6, 5), _ar1(400, 100.0, 2.0, 0.6, 3))[0]
    # two draws of one process: the interval near 1, within the practical threshold
    assert same[0] > 0.98 and same[1] < 1.02 and verdict_of(same, 0.02) == "no-change"
    assert verdict_of((0.90, 0.95), 0.02) == "faster"
    assert verdict_of((1.005, 1.015), 0.02) == "no-change"  # beyond noise, within the practical threshold


def test_blocks_widen_the_interval_of_an_autocorrelated_series() -> None:
    """Resampling single steps of a strongly autocorrelated series understates its mean's spread; blocks
    of consecutive steps keep more of it (why compare uses them)."""
    x = _ar1(1000, 100.0, 5.0, 0.9, 4)
    rng = np.random.default_rng(0)
    single = resampled_means(x, 1, 2000, rng).std()
    blocks = resampled_means(x, block_length(1000), 2000, rng).std()
    assert blocks > 1.5 * single


def _op_table(tmp_path: Path, table: pa.Table, name: str) -> Path:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    store = tmp_path / f"store-{name}"
    res = _cli("import", "op-table", path, "--dp", 2, "--pp", 2, "--store", store)
    assert res.returncode == 0, res.stderr
    return store


def test_an_op_added_between_two_imported_op_tables_is_listed(tmp_path: Path) -> None:
    base = synthetic(2, 2, steps=14)
    # the candidate: the same job with a 4 ms garbage collection at the end of every rank's step
    ends = (
        base.append_column("end", pc.add(base["start_ts"], base["duration"]))
        .group_by(["dp_rank", "stage", "rank", "step"])
        .aggregate([("end", "max"), ("seq_id", "max")])
    )
    gc = pa.table(
        {
            "dp_rank": ends["dp_rank"], "stage": ends["stage"], "rank": ends["rank"], "step": ends["step"],
            "optype": pa.array(["gc"] * ends.num_rows), "start_ts": ends["end_max"],
            "duration": pa.array([0.004] * ends.num_rows), "seq_id": pc.add(ends["seq_id_max"], 1),
            "mc": pa.nulls(ends.num_rows, base.schema.field("mc").type),
            "mb_id": pa.nulls(ends.num_rows, base.schema.field("mb_id").type),
            "gmc": pa.nulls(ends.num_rows, base.schema.field("gmc").type),
        },
        schema=base.schema,
    )  # fmt: skip
    a = _op_table(tmp_path, base, "base")
    b = _op_table(tmp_path, pa.concat_tables([base, gc]), "cand")
    res = _cli("compare", a, b, "--json")
    assert res.returncode == 0, res.stderr
    ops = {r["op_type"]: r for r in json.loads(res.stdout)["by_op_type"]}
    assert ops["gc"]["change"] == "added"
    assert ops["gc"]["base_calls_per_step"] == 0 and ops["gc"]["candidate_calls_per_step"] == pytest.approx(
        1.0
    )
    assert ops["gc"]["candidate_mean_ns"] == pytest.approx(4e6, rel=0.01)
    assert ops["forward-compute"]["change"] == "unchanged"
    text = " ".join(_cli("compare", a, b).stdout.split())
    assert "gc added" in text


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("two-runs")
    store = _op_table(tmp, synthetic(2, 2, steps=14), "one")
    pq.write_table(synthetic(2, 2, steps=14, seed=1), tmp / "two.parquet")
    res = _cli("import", "op-table", tmp / "two.parquet", "--dp", 2, "--pp", 2, "--store", store)
    assert res.returncode == 0, res.stderr
    return store


def _one_line_exit_2(*args: str | Path) -> str:
    res = _cli("compare", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_hostile_input_is_one_line_and_exit_2(tmp_path: Path, two_runs: Path) -> None:
    empty_a, empty_b = tmp_path / "a", tmp_path / "b"
    empty_a.mkdir()
    empty_b.mkdir()
    assert "perfscope compare: error:" in _one_line_exit_2(empty_a, empty_b)
    assert "no run nope" in _one_line_exit_2(two_runs, two_runs, "--base-run", "nope")
    assert "--base-run" in _one_line_exit_2(two_runs, two_runs)
    assert "not a number" in _one_line_exit_2(two_runs, two_runs, "--fail-if-slower", "x")
    ids = [r["run_id"] for r in json.loads(_cli("info", two_runs, "--json").stdout)["runs"]]
    assert "same run" in _one_line_exit_2(two_runs, two_runs, "--base-run", ids[0], "--candidate-run", ids[0])
    res = _cli("compare", two_runs, two_runs, "--base-run", ids[0], "--candidate-run", ids[1], "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"] in ("slower", "faster", "no-change")


def test_report_compare_opens_with_the_comparison_and_its_two_charts(tmp_path: Path) -> None:
    base = synthetic(2, 2, steps=14)
    a = _op_table(tmp_path, base, "base")
    slow = synthetic(2, 2, steps=14, slow={(1, 1): 1.5})  # dp rank 1 at stage 1 half as slow again
    b = _op_table(tmp_path, slow, "cand")
    out = tmp_path / "r.html"
    res = _cli("report", b, "--compare", a, "-o", out)
    assert res.returncode == 0, res.stderr
    html = out.read_text()
    first = html.index("Compared with a base run")
    assert first < html.index('data-chart="compare_steps"') < html.index('data-chart="compare_waterfall"')
    assert first < html.index("Speedup")  # the comparison is the report's first section
    want = json.loads(_cli("compare", a, b, "--json").stdout)["verdict"]
    assert f"Verdict: {want}." in html
    assert "perfscope report: error:" in _cli("report", b, "--compare", tmp_path / "none", "-o", out).stderr


KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto-w2-allreduce-rank0.json.gz"


def test_an_op_added_between_two_imported_kineto_traces_is_listed(tmp_path: Path) -> None:
    """The bundled Kineto trace, and the same trace with one more operator in every ProfilerStep, imported
    with --ops: the op is listed as added, with its calls and time per step; the trace's own ops are
    unchanged."""
    import gzip

    doc = json.loads(gzip.decompress(KINETO.read_bytes()))
    events = doc["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert len(steps) == 3
    added = [
        {**{k: s[k] for k in ("pid", "tid")}, "ph": "X", "cat": "cpu_op", "name": "aten::added_op",
         "ts": s["ts"] + 1, "dur": 250.0, "args": {}}
        for s in steps
    ]  # fmt: skip
    cand = tmp_path / "cand.json.gz"
    with gzip.open(cand, "wt") as f:
        json.dump({**doc, "traceEvents": events + added}, f)
    stores = []
    for name, path in (("base", KINETO), ("cand", cand)):
        store = tmp_path / f"store-{name}"
        res = _cli("import", "kineto", path, "--store", store, "--ops")
        assert res.returncode == 0, res.stderr
        stores.append(store)
    res = _cli("compare", *stores, "--json")
    assert res.returncode == 0, res.stderr
    ops = {r["op_type"]: r for r in json.loads(res.stdout)["by_op_type"]}
    assert ops["aten::added_op"]["change"] == "added"
    assert ops["aten::added_op"]["candidate_calls_per_step"] == pytest.approx(1.0)
    assert ops["aten::added_op"]["candidate_mean_ns"] == pytest.approx(250e3, rel=1e-3)
    assert ops["aten::added_op"]["delta_ns_per_step"] == pytest.approx(250e3, rel=1e-3)
    assert all(r["change"] == "unchanged" for n, r in ops.items() if n != "aten::added_op")
    assert ops["aten::mul"]["base_calls_per_step"] > 0
