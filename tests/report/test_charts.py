"""The shared chart builders: every chart from real analysis tables, every chart from empty tables,
the marks for simulated runs and predictions, the phase colours, and SVG/PNG rendering."""

from __future__ import annotations

import inspect
import json
import re
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from test_report_store import STRAGGLER_RANK, STRAGGLER_RUN, build_study

from perfscope.analysis import ANALYSES, Selection, run_analysis
from perfscope.charts import CHARTS, speedup_chart, to_png, to_svg, utilisation_chart
from perfscope.charts.style import PHASE_COLOURS, PHASES, SOURCE_SHAPES
from perfscope.store.open import open_store

USED = sorted({a for spec in CHARTS.values() for a in spec.analyses})


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pa.Table]:
    root = build_study(tmp_path_factory.mktemp("study"))
    with open_store(root) as store:
        return {name: run_analysis(name, store, Selection()) for name in USED}


def _datasets(chart: Any) -> list[dict[str, Any]]:
    """Every inline row the chart's spec carries (named datasets and inline `data.values`)."""
    spec = chart.to_dict()
    rows: list[dict[str, Any]] = []
    for values in spec.get("datasets", {}).values():
        rows += values

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            data = node.get("data")
            if isinstance(data, dict) and isinstance(data.get("values"), list):
                rows.extend(data["values"])
            for k, v in node.items():
                if k != "datasets":
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    return rows


def _marks(svg: str) -> int:
    """Drawn marks in a vl-convert SVG: paths, rects or text inside mark groups."""
    return svg.count('class="mark-')


def test_registry_names_real_analyses_and_matching_parameters() -> None:
    for name, spec in CHARTS.items():
        assert spec.analyses, name
        for a in spec.analyses:
            assert a in ANALYSES, f"{name} reads unknown analysis {a}"
        params = list(inspect.signature(spec.builder).parameters.values())
        # one positional parameter per analysis, in the registry's order; the rest are options
        assert len(params) >= len(spec.analyses), name
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[: len(spec.analyses)]), name


@pytest.mark.parametrize("name", list(CHARTS))
def test_every_chart_renders_from_the_study(name: str, tables: dict[str, pa.Table]) -> None:
    chart = CHARTS[name].build(tables)
    spec = chart.to_dict()  # validates against the Vega-Lite schema
    assert spec["$schema"].startswith("https://vega.github.io/schema/vega-lite/")
    svg = to_svg(chart)
    assert svg.startswith("<svg")
    assert "no data" not in svg and "no scaling group" not in svg and "fewer than two" not in svg
    assert _marks(svg) > 3


@pytest.mark.parametrize("name", list(CHARTS))
@pytest.mark.parametrize("how", ["zero rows", "None"])
def test_every_chart_says_no_data_for_empty_tables(name: str, how: str, tables: dict[str, pa.Table]) -> None:
    empty = {a: (tables[a].slice(0, 0) if how == "zero rows" else None) for a in CHARTS[name].analyses}
    chart = CHARTS[name].build(empty)
    chart.to_dict()
    svg = to_svg(chart)
    text = " ".join(r.get("text", "") for r in _datasets(chart))
    assert text and ("no " in text or "fewer than" in text), text
    assert "<text" in svg


def test_simulated_runs_are_hollow_and_named(tables: dict[str, pa.Table]) -> None:
    chart = speedup_chart(tables["scaling"])
    spec = json.dumps(chart.to_dict())
    rows = _datasets(chart)
    assert {r["source"] for r in rows if "source" in r} >= {"measured", "simulated"}
    assert "simulated runs: hollow triangles" in spec
    assert SOURCE_SHAPES["simulated"] in spec


def test_predictions_are_drawn_and_labelled(tables: dict[str, pa.Table]) -> None:
    with_pred = speedup_chart(tables["scaling"], tables["scaling_prediction"])
    rows = _datasets(with_pred)
    # the dashed model line and the diamonds carry the same rows
    predicted = {
        (r["group_id"], r["world_size"], r["value"]) for r in rows if r.get("source") == "prediction"
    }
    expected = {
        (r["group_id"], r["world_size"], r["model_speedup"])
        for r in tables["scaling_prediction"].to_pylist()
        if r["kind"] == "prediction"
    }
    assert expected and predicted == expected
    subtitle = " ".join(with_pred.to_dict()["title"]["subtitle"])  # lines wrapped to the chart's width
    assert "model predictions: hollow diamonds, dashed" in subtitle
    without = speedup_chart(tables["scaling"])
    assert not [r for r in _datasets(without) if r.get("source") == "prediction"]


def test_chart_values_are_the_analysis_values(tables: dict[str, pa.Table]) -> None:
    chart = speedup_chart(tables["scaling"])
    drawn = {(r["run_id"], r["speedup"]) for r in _datasets(chart) if "speedup" in r and "run_id" in r}
    expected = {
        (r["run_id"], r["speedup"]) for r in tables["scaling"].to_pylist() if r["experiment"] == "study"
    }
    assert drawn == expected


def test_utilisation_is_never_called_efficiency(tables: dict[str, pa.Table]) -> None:
    spec = json.dumps(utilisation_chart(tables["utilisation"]).to_dict())
    assert "kernel-active time share (NVML)" in spec
    assert "utilisation efficiency" not in spec.lower() and "gpu efficiency" not in spec.lower()


def test_phase_colours_are_the_canonical_ones(tables: dict[str, pa.Table]) -> None:
    for name in ("phase_breakdown", "lost_time"):
        spec = CHARTS[name].build(tables).to_dict()
        text = json.dumps(spec)
        scale = {"domain": list(PHASES), "range": [PHASE_COLOURS[p] for p in PHASES]}
        assert json.dumps(scale)[1:-1] in text, name


def test_straggler_charts_show_the_chosen_run(tables: dict[str, pa.Table]) -> None:
    chart = CHARTS["last_rank"].build(tables, run_id=STRAGGLER_RUN)
    assert {r["run_id"] for r in _datasets(chart) if "run_id" in r} == {STRAGGLER_RUN}
    # without a run asked for, the last-rank chart picks the run with a straggler
    chart = CHARTS["last_rank"].build(tables)
    assert {r["run_id"] for r in _datasets(chart) if "run_id" in r} == {STRAGGLER_RUN}
    heat = CHARTS["wait_heatmap"].build(tables, run_id=STRAGGLER_RUN)
    assert f"run {STRAGGLER_RUN};" in json.dumps(heat.to_dict())
    cells = [r for r in _datasets(heat) if "wait_ms" in r]
    by_rank: dict[int, list[float]] = {}
    for r in cells:
        by_rank.setdefault(r["rank"], []).append(r["wait_ms"])
    assert sorted(by_rank) == [0, 1, 2, 3]
    # everyone waits for the straggler, the straggler waits for no one
    assert min(by_rank, key=lambda k: sum(by_rank[k])) == STRAGGLER_RANK
    steps = tables["collective_wait"].filter(pc.equal(tables["collective_wait"]["run_id"], STRAGGLER_RUN))
    expected = sum(steps["wait_ns"].to_pylist()) / 1e6
    # every step lands in exactly one bin: the bin means weighted by their step counts add back up
    assert sum(r["wait_ms"] * (r["step_to"] - r["step_from"]) for r in cells) == pytest.approx(expected)
    # the default run is the one with the most ranks
    default = json.dumps(CHARTS["wait_heatmap"].build(tables).to_dict())
    assert "-n4;" in default


def test_png_is_a_real_png(tables: dict[str, pa.Table], tmp_path: Path) -> None:
    png = to_png(CHARTS["efficiency"].build(tables), scale=1.0)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 300 and height > 200
    png2 = to_png(CHARTS["efficiency"].build(tables), scale=2.0)
    assert struct.unpack(">II", png2[16:24])[0] == pytest.approx(2 * width, abs=2)


#: DejaVu Sans: what a Linux browser without Helvetica or Arial draws the charts' text in, about 13%
#: wider than the Arial widths vl-convert lays the chart out with
DEJAVU = [
    Path(d) / "DejaVuSans.ttf"
    for d in ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/share/fonts/TTF")
]


def _drawn_texts(svg: str, regular: Path) -> tuple[float, list[tuple[str, float, float]]]:
    """The SVG's width and, per horizontal text, (text, left, right) as DejaVu Sans draws it."""
    from xml.etree import ElementTree

    from PIL import ImageFont

    root = ElementTree.fromstring(svg)
    fonts: dict[tuple[int, bool], Any] = {}
    out: list[tuple[str, float, float]] = []

    def walk(el: ElementTree.Element, x: float, y: float, rotated: bool) -> None:
        moved = re.search(r"translate\(([-\d.e]+),\s*([-\d.e]+)\)", el.get("transform") or "")
        if moved:
            x, y = x + float(moved.group(1)), y + float(moved.group(2))
        rotated = rotated or "rotate" in (el.get("transform") or "")
        if el.tag.endswith("}text") and (el.text or "").strip() and not rotated:
            key = (
                round(float(el.get("font-size", "11px").removesuffix("px"))),
                el.get("font-weight") == "bold",
            )
            if key not in fonts:
                bold = regular.with_name("DejaVuSans-Bold.ttf")
                fonts[key] = ImageFont.truetype(str(bold if key[1] and bold.exists() else regular), key[0])
            w = fonts[key].getlength(el.text)
            anchor = el.get("text-anchor", "start")
            left = x - w if anchor == "end" else x - w / 2 if anchor == "middle" else x
            out.append((el.text or "", left, left + w))
        for child in el:
            walk(child, x, y, rotated)

    walk(root, 0.0, 0.0, False)
    return float(root.get("width", "0")), out


@pytest.mark.parametrize("name", list(CHARTS))
def test_no_label_is_cut_in_a_wider_browser_font(name: str, tables: dict[str, pa.Table]) -> None:
    """'llreduce in sync', 'ank 0 (worker)': a y-axis label grows leftwards from the axis, a legend
    to the right edge; drawn in DejaVu Sans they must still lie inside the chart, and none is cut
    short with an ellipsis."""
    font = next((p for p in DEJAVU if p.exists()), None)
    if font is None:
        pytest.skip("DejaVu Sans is not installed here")
    width, drawn = _drawn_texts(to_svg(CHARTS[name].build(tables)), font)
    assert drawn
    cut = [(t, round(left), round(right)) for t, left, right in drawn if left < 0 or right > width]
    assert not cut, f"outside 0..{width}: {cut}"
    assert not [t for t, _, _ in drawn if "…" in t]
