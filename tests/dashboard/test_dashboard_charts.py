"""The run-level and comparison chart builders: valid Vega-Lite for real, empty and large tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import vl_convert as vlc
from storegen import MS, Comm, Gpu, Host, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.charts.compare import (
    Quantity,
    difference_table,
    phase_compare_chart,
    scaling_compare_chart,
    verdict,
)
from perfscope.charts.timeline import (
    MAX_LINES,
    gpu_timeline_chart,
    host_timeline_chart,
    steady_window,
    step_series_chart,
)
from perfscope.store.open import open_store


def svg(chart: Any) -> str:
    """Compile and render the chart as the report does: an invalid spec raises here."""
    return str(vlc.vegalite_to_svg(chart.to_json()))


def texts(chart: Any) -> str:
    return json.dumps(chart.to_dict())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("charts") / "store"
    comm = Comm(bucket_bytes=[1_000_000], transfer_ns=lambda b: MS)
    # rank 0's first steps are slow (a warm-up that compiles): the steady part must stay readable
    slow_start = {"data": 1 * MS, "forward": 10 * MS, "backward": 20 * MS}
    make_run(
        root,
        "n2",
        world_size=2,
        steps=60,
        comm=comm,
        gpu=Gpu(),
        host=Host(),
        phase_fn=lambda r, s: {"forward": 400 * MS} if s < 3 else slow_start,
    )
    make_run(root, "n20", world_size=20, steps=30, gpus_per_node=4, host=Host())
    return root


def test_step_series_marks_warm_up_and_fits_the_steady_steps(store: Path) -> None:
    with open_store(store) as s:
        series = run_analysis("step_series", s, Selection(run_ids=("n2",)))
    chart = step_series_chart(series)
    spec = texts(chart)
    assert "warm-up: not in the statistics" in spec
    assert "run off the top" in spec  # 400 ms warm-up steps against ~34 ms steady ones
    assert "rank 1" in spec
    assert "<svg" in svg(chart)


def test_many_ranks_are_drawn_as_a_band(store: Path) -> None:
    with open_store(store) as s:
        series = run_analysis("step_series", s, Selection(run_ids=("n20",)))
    assert len(set(series.column("rank").to_pylist())) > MAX_LINES
    spec = texts(step_series_chart(series))
    assert "min-max band over 20 ranks" in spec and "rank 7" not in spec


def test_steady_window_lies_inside_the_run(store: Path) -> None:
    with open_store(store) as s:
        sel = Selection(run_ids=("n2",))
        window = steady_window(run_analysis("step_series", s, sel))
        gpu = run_analysis("gpu_timeline", s, sel)
        host = run_analysis("host_timeline", s, sel)
    assert window is not None
    # 10 warm-up steps, three of them 400 ms long: the window starts after them
    assert 1.2 < window.start_s < window.end_s <= max(gpu.column("t_s").to_pylist()) + 0.2
    for chart in (gpu_timeline_chart(gpu, window), host_timeline_chart(host, window)):
        assert "steady state" in texts(chart)
        assert "<svg" in svg(chart)


def test_empty_tables_give_a_chart_that_says_why() -> None:
    empty = pa.table({})
    for chart, words in (
        (step_series_chart(empty), "no steps recorded"),
        (gpu_timeline_chart(empty), "no GPU samples"),
        (host_timeline_chart(None), "no host samples"),
        (phase_compare_chart(empty, "a", "b"), "pick two runs"),
        (scaling_compare_chart(empty, "a", "b"), "pick two groups"),
    ):
        assert words in texts(chart)
        assert "<svg" in svg(chart)
    assert steady_window(empty) is None


def test_phase_comparison_labels_the_differences(store: Path) -> None:
    with open_store(store) as s:
        phases = run_analysis("phase_breakdown", s, Selection())
    chart = phase_compare_chart(phases, "n2", "n20")
    spec = texts(chart)
    assert "A = n2" in spec and "B = n20" in spec and " ms (" in spec
    assert "<svg" in svg(chart)


def test_verdicts_follow_the_direction_and_the_threshold() -> None:
    assert verdict(10.0, 10.4, "lower") == "same"
    assert verdict(10.0, 12.0, "lower") == "worse"
    assert verdict(10.0, 12.0, "higher") == "better"
    assert verdict(10.0, 12.0, "") == "different"
    assert verdict(None, 12.0, "lower") == ""
    assert verdict(0.0, 0.0, "lower") == "same"
    table = difference_table(
        {"step_ns": 10e6, "x": None},
        {"step_ns": 8e6, "x": 3.0},
        [Quantity("step_ns", "step", "ms", 1e-6, "lower"), Quantity("x", "x")],
    ).to_pylist()
    assert table[0] == {
        "quantity": "step",
        "unit": "ms",
        "a": 10.0,
        "b": 8.0,
        "difference": -2.0,
        "change": pytest.approx(-0.2),
        "verdict": "better",
    }
    assert table[1]["difference"] is None and table[1]["verdict"] == ""


def test_heat_map_steps_are_coarsened_for_drawing_only() -> None:
    from perfscope.dashboard.run import coarsen_steps

    n_steps, ranks = 1000, 4
    wait = pa.table(
        {
            "run_id": ["r"] * (n_steps * ranks),
            "rank": [r for _ in range(n_steps) for r in range(ranks)],
            "step": [s for s in range(n_steps) for _ in range(ranks)],
            "steps_in_bucket": [1] * (n_steps * ranks),
            "wait_ns": [float(r * 1000 + s % 7) for s in range(n_steps) for r in range(ranks)],
        }
    )
    small = coarsen_steps(wait, 120)
    assert small.num_rows <= 120 * ranks
    assert sum(small["steps_in_bucket"].to_pylist()) == n_steps * ranks  # every step is in a bucket
    for r in range(ranks):  # each rank keeps its own level of wait
        own = [
            v for k, v in zip(small["rank"].to_pylist(), small["wait_ns"].to_pylist(), strict=True) if k == r
        ]
        assert min(own) >= r * 1000 and max(own) <= r * 1000 + 6
    assert coarsen_steps(wait.slice(0, 40), 120).equals(wait.slice(0, 40))
