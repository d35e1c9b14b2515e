"""What-if views (issue 23): the charts carry the `what_if` analysis' numbers, the report's
What-if section and the dashboard's What-if tab show them, on op tables imported through the CLI
(tests/analysis/test_what_if.py's synthetic GPipe jobs) and on the bundled sample store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_charts import _datasets
from test_dashboard_app import clean, metric, open_page
from test_what_if import _cli, synthetic

import perfscope.sample_traces as samples
from perfscope.analysis import Selection, run_analysis
from perfscope.charts import CHARTS, to_svg
from perfscope.charts.what_if import (
    TOP_WORKERS,
    attribution_rows,
    what_if_attribution,
    what_if_heatmap,
    what_if_step_heatmap,
    what_if_steps,
)
from perfscope.explain import explain
from perfscope.exporters.perfetto_ideal import IDEAL_PID, IDEAL_STEP_TID
from perfscope.report import collect, render_report
from perfscope.report.model import ChartBlock, Num, TableBlock, format_value
from perfscope.report.text import literal
from perfscope.store.open import open_store

PATTERNS = Path(samples.__file__).resolve().parent / "patterns-cpu"
#: the pipeline run of the bundled sample store (2 stages, 1 dp rank each)
PIPELINE_RUN = "20261123T191847Z-1d9e057d"


def _store(tmp_path: Path, table: pa.Table, dp: int, pp: int, name: str) -> Path:
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    store = tmp_path / f"store-{name}"
    res = _cli("import", "op-table", path, "--dp", dp, "--pp", pp, "--store", store)
    assert res.returncode == 0, res.stderr
    return store


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dp 4 × pp 2, dp rank 2 at stage 1 (rank 6) 1.6× slower."""
    return _store(tmp_path_factory.mktemp("slow"), synthetic(4, 2, slow={(2, 1): 1.6}), 4, 2, "slow")


def _what_if(store: Path) -> pa.Table:
    with open_store(store) as s:
        return run_analysis("what_if", s, Selection())


def test_heatmap_is_every_worker_with_its_slowdown(slow_worker: Path) -> None:
    table = _what_if(slow_worker)
    (row,) = table.to_pylist()
    cells = [r for r in _datasets(what_if_heatmap(table)) if "dp_rank" in r]
    assert len(cells) == 8  # 4 dp ranks × 2 stages
    want = {(w["dp_rank"], w["stage"]): w["slowdown"] for w in row["by_worker"]}
    assert {(c["dp_rank"], c["stage"]) for c in cells} == set(want)
    for c in cells:
        assert c["slowdown"] == pytest.approx(want[(c["dp_rank"], c["stage"])], rel=1e-9)
        assert c["cost_ms"] == pytest.approx((c["slowdown"] - 1) * row["ideal_step_ns"] / 1e6, rel=1e-9)
    hottest = max(cells, key=lambda c: c["slowdown"])
    assert (hottest["dp_rank"], hottest["stage"], hottest["ranks"]) == (2, 1, "6")
    assert to_svg(what_if_heatmap(table)).count('class="mark-') > 3


def test_attribution_is_the_excess_by_stage_op_type_and_worker(slow_worker: Path) -> None:
    table = _what_if(slow_worker)
    (row,) = table.to_pylist()
    bars = [r for r in _datasets(what_if_attribution(table)) if "by" in r]
    by = {k: [b for b in bars if b["by"] == k] for k in ("stage", "op type", "worker")}
    assert [b["part"] for b in by["stage"]] == [f"stage {r['stage']}" for r in row["by_stage"]]
    assert [b["part"] for b in by["op type"]] == [r["op_type"] for r in row["by_op_type"]]
    assert len(by["worker"]) == min(TOP_WORKERS, len(row["by_worker"]))
    assert by["worker"][0]["part"] == "dp 2 · stage 1 (rank 6)"
    for b in bars:
        assert b["cost_ms"] == pytest.approx((b["slowdown"] - 1) * row["ideal_step_ns"] / 1e6, rel=1e-9)
    # the slow worker alone costs about the whole excess (the rule in the chart marks it)
    (rule,) = [r for r in _datasets(what_if_attribution(table)) if "excess_ms" in r]
    excess = (row["actual_step_ns"] - row["ideal_step_ns"]) / 1e6
    assert rule["excess_ms"] == pytest.approx(excess, rel=1e-9)
    assert by["worker"][0]["cost_ms"] == pytest.approx(excess, rel=0.25)
    # more workers than the chart lists: only the costliest
    many = {**row, "by_worker": [{**row["by_worker"][0], "dp_rank": k} for k in range(40)]}
    assert sum(r["by"] == "worker" for r in attribution_rows(many)) == TOP_WORKERS


def test_ideal_beside_recorded_step(slow_worker: Path) -> None:
    table = _what_if(slow_worker)
    (row,) = table.to_pylist()
    bars = {r["step"]: r["ms"] for r in _datasets(what_if_steps(table)) if "step" in r}
    assert bars["recorded"] == pytest.approx(row["actual_step_ns"] / 1e6, rel=1e-9)
    assert bars["ideal (replayed)"] == pytest.approx(row["ideal_step_ns"] / 1e6, rel=1e-9)
    assert bars["recorded"] > 1.2 * bars["ideal (replayed)"]  # the 1.6× worker slows the job


def test_stage_imbalance_puts_the_long_stage_first(tmp_path: Path) -> None:
    store = _store(tmp_path, synthetic(2, 3, slow={(0, 1): 1.8, (1, 1): 1.8}), 2, 3, "stage")
    table = _what_if(store)
    stages = [r for r in _datasets(what_if_attribution(table)) if r.get("by") == "stage"]
    assert stages[0]["part"] == "stage 1"
    assert stages[0]["cost_ms"] > 3 * max(s["cost_ms"] for s in stages[1:])
    cells = [r for r in _datasets(what_if_heatmap(table)) if "dp_rank" in r]
    assert {c["stage"] for c in cells} == {0, 1, 2} and {c["dp_rank"] for c in cells} == {0, 1}
    # the report's words give the stage the cost its finding gives it (at most the whole excess)
    with open_store(store) as st:
        (f,) = [g for top in explain(st) for g in top.flatten() if g.rule == "what-if"]
    sec = _section(store)
    words = " ".join(str(b) for block in sec.blocks if isinstance(block, list) for b in block)
    assert f"stage 1 costs {format_value('cost_ns', f.numbers['cost_ns'])}" in words


@pytest.mark.parametrize("name", ["what_if_heatmap", "what_if_attribution", "what_if_steps"])
def test_charts_say_why_without_a_what_if_row(name: str, slow_worker: Path) -> None:
    table = _what_if(slow_worker)
    for tables, run_id in (({"what_if": None}, None), ({"what_if": table.slice(0, 0)}, None),
                           ({"what_if": table}, "no-such-run")):  # fmt: skip
        text = " ".join(r.get("text", "") for r in _datasets(CHARTS[name].build(tables, run_id=run_id)))
        assert "what-if row" in text and ("no run" in text or "has no" in text)


def _section(store: Path) -> Any:
    with open_store(store) as s:
        report = collect(s).report
    found = [sec for sec in report.sections if sec.id == "what-if"]
    return found[0] if found else None


def test_report_section_shows_the_numbers_and_charts(slow_worker: Path) -> None:
    (row,) = _what_if(slow_worker).to_pylist()
    sec = _section(slow_worker)
    assert sec is not None and sec.heading == "What-if"
    nums = {
        b.column: b.value
        for block in sec.blocks
        if isinstance(block, list)
        for b in block
        if isinstance(b, Num)
    }
    assert nums["actual_step_ns"] == pytest.approx(row["actual_step_ns"], rel=1e-9)
    assert nums["ideal_step_ns"] == pytest.approx(row["ideal_step_ns"], rel=1e-9)
    assert nums["slowdown"] == pytest.approx(row["slowdown"], rel=1e-9)
    words = " ".join(str(b) for block in sec.blocks if isinstance(block, list) for b in block)
    assert "Cause: slow-worker" in words and "dp 2 · stage 1 (rank 6)" in words
    # the explainer's what-if finding is linked, not judged again
    assert any(getattr(b, "anchor", "").startswith("finding-") for blk in sec.blocks if isinstance(blk, list)
               for b in blk)  # fmt: skip
    charts = [b.name for b in sec.blocks if isinstance(b, ChartBlock)]
    assert charts == [
        "what_if_steps",
        "what_if_timeline",
        "what_if_heatmap",
        "what_if_step_heatmap",
        "what_if_attribution",
    ]
    (tbl,) = [b for b in sec.blocks if isinstance(b, TableBlock)]
    assert [r["run_id"] for r in tbl.rows] == [row["run_id"]]
    assert format_value("ideal_step_ns", tbl.rows[0]["ideal_step_ns"]) == format_value(
        "ideal_step_ns", row["ideal_step_ns"]
    )


def test_step_heatmap_is_each_workers_slowdown_step_by_step(slow_worker: Path) -> None:
    """The heat map over steps holds every step of every worker, from the analysis' own per-step
    slowdowns; the slow worker is the hottest row in every step."""
    table = _what_if(slow_worker)
    (row,) = table.to_pylist()
    cells = [r for r in _datasets(what_if_step_heatmap(table)) if "worker" in r]
    assert len(cells) == len(row["by_worker"]) * row["steps"]
    hottest = {}
    for c in cells:
        if c["slowdown"] > hottest.get(c["step"], ("", 0.0))[1]:
            hottest[c["step"]] = (c["worker"], c["slowdown"])
    assert {w for w, _ in hottest.values()} == {"dp 2 · stage 1 (rank 6)"}, hottest
    top = next(w for w in row["by_worker"] if (w["dp_rank"], w["stage"]) == (2, 1))
    assert sorted(c["slowdown"] for c in cells if c["worker"] == "dp 2 · stage 1 (rank 6)") == pytest.approx(
        sorted(top["step_slowdown"]), rel=1e-12
    )


def test_report_leaves_the_section_out_without_what_if_rows(tmp_path: Path) -> None:
    """One dp rank and one stage: no peers, no what-if row, no section (and no error)."""
    store = _store(tmp_path, synthetic(1, 1), 1, 1, "one")
    assert _what_if(store).num_rows == 0
    assert _section(store) is None


def test_report_on_the_sample_store() -> None:
    table = _what_if(PATTERNS)
    ids = set(table.column("run_id").to_pylist())
    assert PIPELINE_RUN in ids
    sec = _section(PATTERNS)
    assert sec is not None
    (tbl,) = [b for b in sec.blocks if isinstance(b, TableBlock)]
    assert {r["run_id"] for r in tbl.rows} == ids
    # the pipeline run's two stages are two columns of its heat map
    cells = [r for r in _datasets(what_if_heatmap(table, PIPELINE_RUN)) if "dp_rank" in r]
    assert sorted((c["dp_rank"], c["stage"]) for c in cells) == [(0, 0), (0, 1)]


def test_dashboard_tab_shows_the_analysis(slow_worker: Path) -> None:
    (row,) = _what_if(slow_worker).to_pylist()
    at = clean(open_page(slow_worker, "run", run=row["run_id"], run_tab="What-if"))
    assert metric(at, "Slowdown S") == f"{row['slowdown']:.3f}"
    assert metric(at, "Ideal step") == f"{row['ideal_step_ns'] / 1e6:,.2f} ms"
    assert metric(at, "Recorded step") == f"{row['actual_step_ns'] / 1e6:,.2f} ms"
    # the cause in words, in full: a metric cut it off (issue 34)
    assert any(m.value.startswith(f"**Cause: {literal('slow-worker')}.**") for m in at.markdown)
    assert len(list(at.get("vega_lite_chart"))) == 5
    assert any("rank 6" in w.value for w in at.warning)  # the explainer's finding
    df = at.dataframe[0].value
    assert len(df) == 8


def test_dashboard_tab_on_the_sample_store() -> None:
    at = clean(open_page(PATTERNS, "run", run=PIPELINE_RUN, run_tab="What-if"))
    (row,) = [r for r in _what_if(PATTERNS).to_pylist() if r["run_id"] == PIPELINE_RUN]
    assert metric(at, "Slowdown S") == f"{row['slowdown']:.3f}"
    assert len(list(at.get("vega_lite_chart"))) == 5
    # a run without a what-if row (the parameter server) says why, draws nothing
    at = clean(open_page(PATTERNS, "run", run="20261123T191907Z-d4a36cbc", run_tab="What-if"))
    assert any("No what-if for this run" in i.value for i in at.info)
    assert not list(at.get("vega_lite_chart"))


def _export(store: Path, out: Path, *extra: str) -> dict[str, Any]:
    res = _cli("export", "perfetto", store, "-o", out, *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(out.read_text())


def test_perfetto_writes_the_ideal_step_beside_each_rank(slow_worker: Path, tmp_path: Path) -> None:
    (row,) = _what_if(slow_worker).to_pylist()
    doc = _export(slow_worker, tmp_path / "t.json", "--run", row["run_id"])
    ev = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert {p: n for p, n in names.items() if p >= IDEAL_PID} == {
        IDEAL_PID + r: f"ideal/rank {r}" for r in range(8)
    }
    assert sorted(p for p in names if p < IDEAL_PID) == list(range(8))
    assert all(e["ts"] >= 0 for e in ev if e["ph"] == "X")
    ideal_steps = [e for e in ev if e["ph"] == "X" and e["cat"] == "ideal" and e["tid"] == IDEAL_STEP_TID]
    per_step = {e["args"]["step"]: e["args"]["ideal_step_ns"] for e in ideal_steps}
    assert len(per_step) == row["steps"] and len(ideal_steps) == 8 * row["steps"]
    # the ideal steps are the analysis' ideal step: the replay's, each step's span; the analysis' is the
    # run's step time (the steady window's elapsed time over its steps, the gaps between steps in it)
    # over S, so they agree to within those gaps
    assert sum(per_step.values()) / len(per_step) == pytest.approx(row["ideal_step_ns"], rel=0.02)
    recorded = [e["dur"] for e in ev if e["ph"] == "X" and e["cat"] == "step"]
    assert sum(recorded) / len(recorded) > 1.2 * sum(per_step.values()) / len(per_step) / 1000
    # the slow worker (rank 6, dp 2 at stage 1) computes as its dp peers do in the ideal, 1.6× in the record

    def compute_us(pid: int, cat: str) -> float:
        return sum(e["dur"] for e in ev if e["ph"] == "X" and e["pid"] == pid and e["cat"] == cat
                   and e["name"] == "forward-compute")  # fmt: skip

    assert compute_us(IDEAL_PID + 6, "ideal") == pytest.approx(compute_us(IDEAL_PID + 4, "ideal"), rel=0.05)
    assert compute_us(6, "span") > 1.4 * compute_us(4, "span")
    # a step window holds only its ideal steps (the steady ones: 6 to 11 of the table's 12); every
    # ideal op lies inside its ideal step
    one = _export(slow_worker, tmp_path / "one.json", "--run", row["run_id"], "--steps", "3:8")
    ideal = [e for e in one["traceEvents"] if e["ph"] == "X" and e["cat"] == "ideal"]
    assert {e["args"]["step"] for e in ideal} == {6, 7, 8}
    bounds = {e["args"]["step"]: (e["ts"], e["ts"] + e["dur"]) for e in ideal if e["tid"] == IDEAL_STEP_TID}
    for e in ideal:
        lo, hi = bounds[e["args"]["step"]]
        assert lo - 0.01 <= e["ts"] and e["ts"] + e["dur"] <= hi + 0.01


def test_perfetto_without_a_what_if_has_no_ideal_group(tmp_path: Path) -> None:
    """The sample store's parameter-server run has no what-if row: no ideal process."""
    doc = _export(PATTERNS, tmp_path / "ps.json", "--run", "20261123T191907Z-d4a36cbc")
    assert not [e for e in doc["traceEvents"] if e["pid"] >= IDEAL_PID]
    assert [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    pipe = _export(PATTERNS, tmp_path / "pipe.json", "--run", PIPELINE_RUN)
    assert {
        e["args"]["name"]
        for e in pipe["traceEvents"]
        if e["name"] == "process_name" and e["pid"] >= IDEAL_PID
    } == {
        "ideal/rank 0",
        "ideal/rank 1",
    }


#: an op type name that Markdown would turn into bold, an image fetched from a host, a colour and HTML
EVIL = "**b** [x](http://h.example/x.png) :red[y] <i>"


def test_store_strings_are_shown_literally(tmp_path: Path) -> None:
    """An op table names its op types: the costliest one is quoted in the words of the dashboard and
    the report, literally."""
    t = synthetic(2, 1, slow={(1, 0): 1.5})
    i = t.column_names.index("optype")
    t = t.set_column(i, "optype", pc.if_else(pc.equal(t["optype"], "backward-compute"), EVIL, t["optype"]))
    store = _store(tmp_path, t, 2, 1, "evil")
    (row,) = _what_if(store).to_pylist()
    assert row["by_op_type"][0]["op_type"] == EVIL
    at = clean(open_page(store, "run", run=row["run_id"], run_tab="What-if"))
    words = [m.value for m in at.markdown if "costliest op type" in m.value]
    assert words and literal(EVIL) in words[0] and EVIL not in words[0]
    with open_store(store) as s:
        html = render_report(s, fmt="html").decode()
    section = html[html.index('id="what-if"') :]
    assert "&lt;i&gt;" in section and "<i>" not in section.split("<figure")[0]
