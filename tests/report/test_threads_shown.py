"""Threads and cores per rank, and host CPU for CPU runs, where a user looks: the report's runs table
and host CPU section, the dashboard run page's Telemetry tab; a figure's caption names only the runs
it draws (a GPU chart beside CPU runs draws no CPU run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from storegen import Gpu, Host, make_run
from test_dashboard_app import clean, open_page

from perfscope.analysis import Selection
from perfscope.report import collect
from perfscope.report.model import ChartBlock, TableBlock
from perfscope.report.text import literal
from perfscope.store.open import open_store

CPU = {"device": False, "device_model": "cpu", "backend": "gloo", "host": Host(), "experiment": "cpu"}


@pytest.fixture(scope="module")
def threads_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CPU study whose N=1 run had 2 torch threads and its N=2 ranks 1 each, on 2 cores; and a
    simulated GPU run of another experiment beside it."""
    root = tmp_path_factory.mktemp("threads") / "store"
    make_run(root, "cpu-n1", world_size=1, torch_threads=2, affinity_cores=2, **CPU)  # type: ignore[arg-type]
    make_run(root, "cpu-n2", world_size=2, torch_threads=1, affinity_cores=2, **CPU)  # type: ignore[arg-type]
    make_run(root, "gpu-n1", world_size=1, experiment="gpu", gpu=Gpu(), host=Host(), source="simulated")
    make_run(root, "gpu-n2", world_size=2, experiment="gpu", gpu=Gpu(), host=Host(), source="simulated")
    return root


def _blocks(store_root: Path) -> dict[str, list[object]]:
    with open_store(store_root) as store:
        report = collect(store, Selection()).report
    return {s.id: [b for b in s.blocks] for s in report.sections}


def test_the_report_runs_table_shows_threads_and_cores(threads_store: Path) -> None:
    blocks = _blocks(threads_store)
    runs = next(b for b in blocks["setup"] if isinstance(b, TableBlock) and b.caption == "Runs")
    titles = [c.header for c in runs.columns]
    assert {"threads/rank", "OMP", "MKL", "cores/rank"} <= set(titles)
    by_run = {r["run_id"]: r for r in runs.rows}
    assert by_run["cpu-n1"]["threads_per_rank"] == 2 and by_run["cpu-n2"]["threads_per_rank"] == 1
    assert by_run["cpu-n1"]["cores_per_rank_allowed"] == 2
    assert any(isinstance(b, list) and "OMP_NUM_THREADS" in b[0] for b in blocks["setup"])


def test_cpu_runs_beside_gpu_runs_get_their_host_cpu_and_gpu_figures_name_only_what_they_draw(
    threads_store: Path,
) -> None:
    blocks = _blocks(threads_store)["utilisation"]
    host = [b for b in blocks if isinstance(b, TableBlock) and b.caption == "Host CPU per run"]
    assert host and {r["run_id"] for r in host[0].rows} == {"cpu-n1", "cpu-n2"}
    figures = [b for b in blocks if isinstance(b, ChartBlock)]
    assert figures and all(f.caption.startswith("simulated") for f in figures), [f.caption for f in figures]


def test_a_store_without_threads_shows_no_empty_threads_columns(tmp_path: Path) -> None:
    for n in (1, 2):  # written as a perfscope that recorded no threads would have
        make_run(tmp_path / "old", f"old-n{n}", world_size=n, **CPU)  # type: ignore[arg-type]
    setup = _blocks(tmp_path / "old")["setup"]
    runs = next(b for b in setup if isinstance(b, TableBlock) and b.caption == "Runs")
    assert "threads/rank" not in [c.header for c in runs.columns]


def test_the_run_page_shows_threads_and_cores(threads_store: Path) -> None:
    at = clean(open_page(threads_store, "run", run="cpu-n1", run_tab="Telemetry"))
    tables = [df.value for df in at.dataframe if "torch threads / rank" in df.value.columns]
    assert tables and list(tables[0]["torch threads / rank"]) == [2]
    assert list(tables[0]["cores / rank (affinity)"]) == [2]
    at = clean(open_page(threads_store, "run", run="gpu-n1", run_tab="Telemetry"))
    assert any("not recorded" in c.value for c in at.caption)


def test_the_scaling_page_shows_cpu_runs_host_cpu_beside_gpu_charts(threads_store: Path) -> None:
    at = clean(open_page(threads_store, "scaling", scaling_tab="Utilisation"))
    host = [df.value for df in at.dataframe if "host CPU busy (%)" in df.value.columns]
    assert host and len(host[0]) == 2  # the two CPU runs; the GPU runs are in the charts
    assert len(list(at.get("vega_lite_chart"))) >= 2


def test_compare_names_a_difference_in_threads(threads_store: Path) -> None:
    at = open_page(threads_store, "compare")
    at.selectbox(key="compare_a").select("cpu-n1")
    at.selectbox(key="compare_b").select("cpu-n2").run()
    differ = " ".join(m.value for m in clean(at).markdown if "differ in" in m.value)
    assert literal("threads_per_rank: 2 → 1") in differ, differ  # shown literally (issue 25)
