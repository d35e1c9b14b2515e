"""The ideal against the actual timeline of one step (issue 23): the `what_if_timeline` analysis and
its chart carry the replay's numbers (the recorded lane ends at the recorded step, within the replay
error; the ideal lane at the ideal step), on the straggler study's op table imported through the CLI,
on a storegen DDP store with a slow rank and on a synthetic op table too big to draw whole; the
report's What-if section and the dashboard's What-if tab show it; the Perfetto export's ideal
processes are the same replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run
from test_charts import _datasets
from test_dashboard_app import charts, clean, open_page
from test_what_if import STUDY, _cli, synthetic

from perfscope.analysis import Selection, run_analysis
from perfscope.analysis.what_if_timeline import MAX_BARS_PER_LANE, MAX_WORKERS, median_step
from perfscope.charts import CHARTS, to_svg
from perfscope.charts.what_if_timeline import ENDS, MERGED, what_if_timeline_chart
from perfscope.exporters.perfetto_ideal import IDEAL_STEP_TID
from perfscope.report import collect, render_report
from perfscope.report.model import ChartBlock
from perfscope.store.open import open_store

#: the DDP store's slow rank and what it adds to its forward (the other ranks wait for it at the sync)
SLOW_RANK, SLOW_NS = 1, 8 * MS


def _tables(store: Path) -> tuple[pa.Table, pa.Table]:
    with open_store(store) as s:
        return run_analysis("what_if", s, Selection()), run_analysis("what_if_timeline", s, Selection())


def _bars(table: pa.Table, run_id: str) -> list[dict[str, Any]]:
    return [r for r in _datasets(what_if_timeline_chart(table, run_id)) if "lane" in r]


def _ends(table: pa.Table, run_id: str) -> dict[str, float]:
    return {r["end"]: r["ms"] for r in _datasets(what_if_timeline_chart(table, run_id)) if "end" in r}


def _subtitle(chart: Any) -> str:
    return " ".join(chart.to_dict()["title"]["subtitle"])


def _check_lanes(w: dict[str, Any], timeline: pa.Table, tol: float) -> dict[str, Any]:
    """The chart's numbers against the analysis: every worker shown has both lanes, the recorded lane
    ends at the recorded step (within `tol`, the replay error allowed), the ideal lane at the ideal
    step, and the marked step ends are the two replays' ends. Returns the step's row."""
    run = w["run_id"]
    (head,) = {
        (r["step"], r["recorded_step_ns"], r["actual_end_ns"], r["ideal_end_ns"], r["step_slowdown"])
        for r in timeline.to_pylist()
        if r["run_id"] == run
    }
    step, recorded, actual_end, ideal_end, step_slowdown = head
    bars = _bars(timeline, run)
    last = {lane: max(b["end_ms"] for b in bars if b["lane"] == lane) for lane in ("recorded", "ideal")}
    ends = _ends(timeline, run)
    assert ends[ENDS[0]] == pytest.approx(actual_end / 1e6, rel=1e-12)
    assert ends[ENDS[1]] == pytest.approx(ideal_end / 1e6, rel=1e-12)
    assert last["recorded"] == pytest.approx(recorded / 1e6, rel=tol)
    assert last["recorded"] == pytest.approx(actual_end / 1e6, rel=1e-9)
    assert last["ideal"] == pytest.approx(ideal_end / 1e6, rel=1e-9)
    # the drawn step is a typical one of the run: its slowdown and ideal step are the run's
    assert step_slowdown == pytest.approx(w["slowdown"], rel=0.05)
    assert ideal_end == pytest.approx(w["ideal_step_ns"], rel=0.05)
    workers = {b["worker"] for b in bars}
    for lane in ("recorded", "ideal"):
        assert {b["worker"] for b in bars if b["lane"] == lane} == workers
    return {"step": step, "recorded": recorded, "actual_end": actual_end, "ideal_end": ideal_end}


# -- the straggler study ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (STUDY / "trace-ST.parquet").exists():
        pytest.skip("the straggler study's trace is not here")
    store = tmp_path_factory.mktemp("study") / "s"
    res = _cli(
        "import", "op-table", STUDY / "trace-ST.parquet", "--meta", STUDY / "meta-ST.yaml", "--store", store
    )
    assert res.returncode == 0, res.stderr
    return store


def test_study_timeline_is_the_replay_of_its_median_step(study: Path) -> None:
    what_if, timeline = _tables(study)
    (w,) = what_if.to_pylist()
    step = _check_lanes(w, timeline, tol=0.03)
    # the recorded lane ends where the study's own clock ends that step (its raw file, not the store)
    raw = pq.read_table(STUDY / "trace-ST.parquet").to_pandas()
    mine = raw[raw["step"] == step["step"]]
    raw_ns = float((mine["start_ts"] + mine["duration"]).max() - mine["start_ts"].min()) * 1e9
    assert step["actual_end"] == pytest.approx(raw_ns, rel=0.03)
    bars = _bars(timeline, w["run_id"])
    assert len({b["worker"] for b in bars}) == 8  # 2 dp ranks × 4 stages, all drawn

    def compute_ms(stage: int, lane: str) -> float:
        return sum(b["dur_ms"] for b in bars if b["worker"].startswith(f"dp 0 · stage {stage} ")
                   and b["lane"] == lane and b["name"].endswith("-compute"))  # fmt: skip

    # stage 3 holds too many layers: its compute is longer as recorded than in the ideal, stage 0's not
    assert compute_ms(3, "recorded") > 1.1 * compute_ms(3, "ideal")
    assert compute_ms(0, "recorded") < compute_ms(0, "ideal")
    chart = CHARTS["what_if_timeline"].build({"what_if_timeline": timeline})
    words = _subtitle(chart)
    assert w["run_id"] in words and f"step {step['step']}" in words and "median" in words
    assert to_svg(chart).count("<path") > 100


def test_the_median_step() -> None:
    """The step of median slowdown: the lower middle of an even count, the earlier of equal ones."""
    assert median_step(np.array([3.0, 1.0, 2.0]), np.ones(3)) == 2
    assert median_step(np.array([4.0, 1.0, 3.0, 2.0]), np.ones(4)) == 3
    assert median_step(np.array([4.0, 1.0, 4.0, 3.0]), np.array([2.0, 1.0, 2.0, 1.0])) == 0


# -- a storegen DDP store --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks in lockstep, rank 1's forward 8 ms longer in every step. Each rank enters the gradient
    allreduce when its backward ends (DDP's last bucket) and leaves 1 ms after the last one entered:
    the others wait for rank 1 there (their exposed sync)."""
    root = tmp_path_factory.mktemp("ddp")
    backward = DEFAULT_PHASES["backward"]

    def phases(rank: int, step: int) -> dict[str, float]:
        if rank == SLOW_RANK:
            return {"forward": DEFAULT_PHASES["forward"] + SLOW_NS, "sync_exposed": 1.0 * MS}
        return {"sync_exposed": 1.0 * MS + SLOW_NS}

    make_run(
        root,
        "ddp-slow",
        world_size=4,
        steps=30,
        phase_fn=phases,
        comm=Comm([8 * 2**20], lambda nbytes: 1.0 * MS, delay_ns=lambda rank, step: backward),
    )
    return root


def test_ddp_timeline_is_the_step_without_the_slow_rank(ddp: Path) -> None:
    what_if, timeline = _tables(ddp)
    (w,) = what_if.to_pylist()
    step = _check_lanes(w, timeline, tol=max(3 * w["replay_error"], 1e-3))
    # the store's own steps row of that step (every rank's start and step time) is the recorded step
    with open_store(ddp) as s:
        (got,) = s.query(
            "SELECT max(start_ns + step_ns) - min(start_ns) AS ns FROM steps WHERE run_id = 'ddp-slow' "
            f"AND step = {int(step['step'])}"
        ).to_pylist()
    assert step["actual_end"] == pytest.approx(got["ns"], rel=1e-3)
    # the ideal is the same job without the slow rank's 8 ms
    assert step["ideal_end"] == pytest.approx(got["ns"] - SLOW_NS, rel=0.10)
    bars = _bars(timeline, "ddp-slow")

    def forward_ms(rank: int, lane: str) -> float:
        (b,) = [b for b in bars if b["worker"].endswith(f"rank {rank}") and b["lane"] == lane
                and b["name"] == "forward"]  # fmt: skip
        return float(b["dur_ms"])

    assert forward_ms(SLOW_RANK, "recorded") == pytest.approx(
        forward_ms(0, "recorded") + SLOW_NS / 1e6, rel=0.01
    )
    assert forward_ms(SLOW_RANK, "ideal") == pytest.approx(forward_ms(0, "recorded"), rel=0.01)
    assert {b["worker"] for b in bars} == {f"dp {r} · stage 0 · rank {r}" for r in range(4)}
    # the phases keep their colours (forward, backward ... as every chart draws them)
    domain = what_if_timeline_chart(timeline, "ddp-slow").to_dict()["layer"][0]["encoding"]["color"]["scale"]
    assert {"forward", "backward", "optimizer", "allreduce"} <= set(domain["domain"])


def test_report_and_dashboard_show_the_timeline(ddp: Path) -> None:
    with open_store(ddp) as s:
        report = collect(s).report
        html = render_report(s, fmt="html").decode()
    (sec,) = [sec for sec in report.sections if sec.id == "what-if"]
    blocks = [b for b in sec.blocks if isinstance(b, ChartBlock)]
    (tl,) = [b for b in blocks if b.name == "what_if_timeline"]
    assert tl.analyses == ("what_if_timeline",) and "ddp-slow" in tl.caption
    assert "What-if: recorded against ideal timeline of one step" in html
    # the dashboard's What-if tab draws the same chart
    at = clean(open_page(ddp, "run", run="ddp-slow", run_tab="What-if"))
    specs = [json.loads(c.spec) for c in charts(at)]
    (spec,) = [
        s
        for s in specs
        if s["title"]["text"] == "What-if: the recorded against the ideal timeline of one step"
    ]
    _, timeline = _tables(ddp)
    assert (
        spec["title"]["subtitle"]
        == what_if_timeline_chart(timeline, "ddp-slow").to_dict()["title"]["subtitle"]
    )


def test_perfetto_ideal_steps_are_the_timelines_ideal(ddp: Path, tmp_path: Path) -> None:
    """The export's ideal process and the chart's ideal lane are one replay: the same step end."""
    _, timeline = _tables(ddp)
    step = int(timeline.column("step")[0].as_py())
    out = tmp_path / "t.json"
    res = _cli("export", "perfetto", ddp, "-o", out, "--run", "ddp-slow")
    assert res.returncode == 0, res.stderr
    ev = json.loads(out.read_text())["traceEvents"]
    ideal = {e["args"]["ideal_step_ns"] for e in ev if e.get("cat") == "ideal" and e["tid"] == IDEAL_STEP_TID
             and e["args"]["step"] == step}  # fmt: skip
    assert len(ideal) == 1
    assert ideal.pop() == pytest.approx(timeline.column("ideal_end_ns")[0].as_py(), abs=1.0)


# -- bounded ---------------------------------------------------------------------------------------


def test_a_big_step_is_drawn_bounded(tmp_path: Path) -> None:
    """18 dp ranks × 2 stages, 48 micro-batches a step: more workers than drawn and more ops than a
    lane holds. The costliest workers are drawn, short ops merged; every op of a drawn rank is in
    exactly one bar and the caption says so."""
    table = synthetic(18, 2, m=48, steps=3, slow={(5, 1): 1.5})
    path = tmp_path / "big.parquet"
    pq.write_table(table, path)
    store = tmp_path / "s"
    res = _cli("import", "op-table", path, "--dp", 18, "--pp", 2, "--store", store)
    assert res.returncode == 0, res.stderr
    what_if, timeline = _tables(store)
    (w,) = what_if.to_pylist()
    rows = timeline.to_pylist()
    assert rows[0]["workers"] == 36 and rows[0]["workers_shown"] == MAX_WORKERS
    assert {(r["dp_rank"], r["stage"]) for r in rows} >= {(5, 1)}  # the slow worker is drawn
    step = rows[0]["step"]
    raw_step = table.filter(pc.equal(table["step"], step))
    for (d, st), lane in {((r["dp_rank"], r["stage"]), r["lane"]) for r in rows}:
        mine = [r for r in rows if (r["dp_rank"], r["stage"], r["lane"]) == (d, st, lane)]
        assert len(mine) <= MAX_BARS_PER_LANE
        ops = raw_step.filter(pc.equal(raw_step["rank"], mine[0]["rank"])).num_rows
        assert sum(r["ops"] for r in mine) == ops
    assert any(r["op_type"] == MERGED for r in rows)
    assert len(rows) <= 2 * MAX_WORKERS * MAX_BARS_PER_LANE
    # the lanes end at the step's ends (the workers not drawn may end a little later)
    last = {lane: max(r["end_ns"] for r in rows if r["lane"] == lane) for lane in ("recorded", "ideal")}
    assert last["recorded"] == pytest.approx(rows[0]["actual_end_ns"], rel=0.01)
    assert last["recorded"] == pytest.approx(rows[0]["recorded_step_ns"], rel=0.03)
    assert last["ideal"] == pytest.approx(rows[0]["ideal_end_ns"], rel=0.01)
    assert rows[0]["step_slowdown"] == pytest.approx(w["slowdown"], rel=0.05)
    words = _subtitle(what_if_timeline_chart(timeline))
    assert f"the {MAX_WORKERS} of 36 workers" in words and "merged" in words
