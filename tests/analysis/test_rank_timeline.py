"""The per-rank timeline of a window of steps: the analysis by value on a real store, its window and
cap, the chart's encodings, and the dashboard's Run page Timeline tab under AppTest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run, row
from test_dashboard_app import charts, clean, open_page

from perfscope.analysis import Selection, run_analysis
from perfscope.analysis import rank_timeline as rank_timeline_module
from perfscope.analysis.rank_timeline import MAX_WINDOW_STEPS, window_intervals
from perfscope.charts import rank_timeline_chart
from perfscope.charts.style import PHASE_COLOURS
from perfscope.store.open import open_store
from perfscope.store.writer import StoreWriter

SLOW_STEP, SLOW_RANK, SLOW_FORWARD_NS = 25, 1, 30 * MS
BUCKETS = 2
STEP_NS = int(sum(DEFAULT_PHASES.values()))


def _spans(root: Path, run_id: str) -> None:
    """Per rank and step: forward and backward spans (depth 0) and an attention span inside forward,
    placed from the steps the store holds (so they follow the slow step)."""
    with open_store(root) as store:
        steps = store.query(
            "SELECT rank, step, start_ns, forward_ns FROM steps WHERE run_id = ?", [run_id]
        ).to_pylist()
    w = StoreWriter(root, run_id, writer_id=f"spans-{run_id}")
    rows = []
    for s in steps:
        fwd_start = s["start_ns"] + DEFAULT_PHASES["data"]
        bwd_start = fwd_start + s["forward_ns"]
        for name, parent, depth, start, dur in (
            ("forward", None, 0, fwd_start, s["forward_ns"]),
            ("attention", "forward", 1, fwd_start + MS, 2 * MS),
            ("backward", None, 0, bwd_start, DEFAULT_PHASES["backward"]),
        ):
            rows.append(
                row(
                    "spans",
                    rank=s["rank"],
                    step=s["step"],
                    name=name,
                    parent=parent,
                    depth=depth,
                    start_ns=int(start),
                    dur_ns=int(dur),
                    clock="cuda",
                )
            )
    w.extend("spans", rows)
    w.close()


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("timeline")
    make_run(
        root,
        "a",
        world_size=2,
        steps=60,
        phase_fn=lambda r, s: {"forward": SLOW_FORWARD_NS} if (r, s) == (SLOW_RANK, SLOW_STEP) else {},
        comm=Comm([2**20] * BUCKETS, lambda nb: 1 * MS),
    )
    _spans(root, "a")
    make_run(root, "b", world_size=1, steps=30, device=False)  # steps only: no spans, no comm
    return root


@pytest.fixture(scope="module")
def store(store_root: Path):
    with open_store(store_root) as s:
        yield s


def _steps(table) -> list[int]:
    return sorted(set(table["step"].to_pylist()))


def _by(table, **match):
    return [r for r in table.to_pylist() if all(r[k] == v for k, v in match.items())]


def test_default_window_is_the_slowest_steady_step_plus_minus_two(store) -> None:
    t = run_analysis("rank_timeline", store, Selection(run_ids=("a",)))
    assert _steps(t) == list(range(SLOW_STEP - 2, SLOW_STEP + 3))
    for rank in (0, 1):
        assert len(_by(t, rank=rank, kind="step")) == 5
        assert len(_by(t, rank=rank, kind="collective")) == 5 * BUCKETS
        assert len(_by(t, rank=rank, kind="span")) == 5 * 3
        assert {r["hostname"] for r in _by(t, rank=rank)} == {"node0"}
    assert {r["name"] for r in _by(t, kind="span", depth=1)} == {"attention"}
    assert {r["name"] for r in _by(t, kind="collective")} == {"allreduce"}
    # times from the window's first step start: step 23 starts at 0, each step lasts the slowest rank's
    first = _by(t, kind="step", step=SLOW_STEP - 2)
    assert {r["start_ns"] for r in first} == {0}
    slow = _by(t, kind="step", step=SLOW_STEP, rank=SLOW_RANK)[0]
    assert slow["start_ns"] == 2 * STEP_NS
    assert slow["dur_ns"] == STEP_NS - DEFAULT_PHASES["forward"] + SLOW_FORWARD_NS
    after = _by(t, kind="step", step=SLOW_STEP + 1, rank=0)[0]
    assert after["start_ns"] == slow["start_ns"] + slow["dur_ns"]
    fwd = _by(t, kind="span", name="forward", step=SLOW_STEP, rank=SLOW_RANK)[0]
    assert fwd["start_ns"] == slow["start_ns"] + DEFAULT_PHASES["data"]
    assert fwd["dur_ns"] == SLOW_FORWARD_NS


def test_window_from_the_selection_and_its_origin(store) -> None:
    t = run_analysis("rank_timeline", store, Selection(run_ids=("a",), steps=(3, 5)))
    assert _steps(t) == [3, 4, 5]
    absolute = window_intervals(store, "a", 3, 5)
    t0 = min(r["start_ns"] for r in absolute.to_pylist() if r["kind"] == "step")
    assert absolute.num_rows == t.num_rows
    rel = {(r["rank"], r["kind"], r["name"], r["step"], r["start_ns"]) for r in t.to_pylist()}
    assert rel == {
        (r["rank"], r["kind"], r["name"], r["step"], r["start_ns"] - t0) for r in absolute.to_pylist()
    }
    assert min(r["start_ns"] for r in _by(t, kind="step")) == 0


def test_window_is_capped_and_clipped_to_the_run(store) -> None:
    t = run_analysis("rank_timeline", store, Selection(run_ids=("a",), steps=(-10, 10_000)))
    assert _steps(t) == list(range(MAX_WINDOW_STEPS))
    outside = run_analysis("rank_timeline", store, Selection(run_ids=("a",), steps=(500, 600)))
    assert outside.num_rows == 0
    assert "start_ns" in outside.column_names


def test_run_without_spans_or_comm_has_its_steps(store) -> None:
    t = run_analysis("rank_timeline", store, Selection(run_ids=("b",), steps=(0, 2)))
    assert set(t["kind"].to_pylist()) == {"step"}
    assert [r["start_ns"] for r in t.to_pylist()] == [0, STEP_NS, 2 * STEP_NS]


def test_selection_rejects_a_reversed_window() -> None:
    with pytest.raises(ValueError, match="before the first"):
        Selection(steps=(5, 3))


def test_chart_encodings(store) -> None:
    t = run_analysis("rank_timeline", store, Selection(run_ids=("a",)))
    spec = rank_timeline_chart(t, "a").to_dict()
    enc = spec["encoding"]
    assert enc["x"]["field"] == "start_ms" and enc["x2"]["field"] == "end_ms"
    assert enc["y"]["field"] == "rank_label" and enc["yOffset"]["field"] == "lane"
    scale = enc["color"]["scale"]
    colours = dict(zip(scale["domain"], scale["range"], strict=True))
    assert colours["forward"] == PHASE_COLOURS["forward"]
    assert {"step", "backward", "attention", "allreduce"} <= set(colours)
    assert {"name", "dur_ms"} <= {tip["field"] for tip in enc["tooltip"]}
    values = spec["data"]["values"] if "values" in spec["data"] else spec["datasets"][spec["data"]["name"]]
    slow = [v for v in values if v["kind"] == "step" and v["step"] == SLOW_STEP and v["rank"] == SLOW_RANK]
    assert slow[0]["dur_ms"] == pytest.approx((STEP_NS - 10 * MS + SLOW_FORWARD_NS) / 1e6)
    assert sorted({v["lane"] for v in values}) == ["collectives", "span 0", "span 1", "steps"]


def test_chart_without_rows_says_so() -> None:
    spec = rank_timeline_chart(None).to_dict()
    assert spec["data"]["values"][0]["text"] == "no steps in this window"


def test_run_page_timeline_tab(store_root: Path) -> None:
    at = clean(open_page(store_root, "run", run="a", run_tab="Timeline"))
    assert len(charts(at)) == 1
    slider = at.slider(key="timeline_steps_a")
    assert tuple(slider.value) == (SLOW_STEP - 2, SLOW_STEP + 2)
    assert (slider.min, slider.max) == (0, 59)
    at = clean(slider.set_value((3, 5)).run())
    subtitle = json.loads(charts(at)[0].spec)["title"]["subtitle"]
    assert subtitle[0] == "run a, steps 3–5; lanes per rank: steps, span 0, span 1, collectives"
    assert not at.caption or "Showing steps" not in " ".join(c.value for c in at.caption)
    at = clean(at.slider(key="timeline_steps_a").set_value((0, 59)).run())
    assert "Showing steps 0–49 of the 0–59 chosen" in " ".join(c.value for c in at.caption)


def test_window_ends_early_past_the_interval_cap(store_root: Path, monkeypatch) -> None:
    # 2 ranks x (1 step + 3 spans + 2 collectives) = 12 intervals a step: 30 keeps two steps
    monkeypatch.setattr(rank_timeline_module, "MAX_INTERVALS", 30)
    with open_store(store_root) as fresh:
        t = run_analysis("rank_timeline", fresh, Selection(run_ids=("a",), steps=(3, 9)))
        assert _steps(t) == [3, 4]
        assert t.num_rows == 24
        monkeypatch.setattr(rank_timeline_module, "MAX_INTERVALS", 1)
        one = run_analysis("rank_timeline", fresh, Selection(run_ids=("a",), steps=(6, 9)))
        assert _steps(one) == [6]  # the first step is always kept
