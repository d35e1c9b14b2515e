"""The dashboard pages under AppTest: numbers equal the analyses', widgets work, bad stores read well."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest
from storegen import MS, Comm, Gpu, Host, make_run
from streamlit.testing.v1 import AppTest

from perfscope.analysis import Selection, run_analysis
from perfscope.charts.rows import group_labels
from perfscope.dashboard.links import PLACES, Place
from perfscope.explain import explain
from perfscope.report.model import format_value
from perfscope.report.text import literal
from perfscope.simulate import write_study
from perfscope.simulate.presets import parse_config, seed_study_config
from perfscope.store.open import open_store

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


def _app(store: str, page: str) -> None:
    # AppTest runs this function's body as the script: it imports what it needs itself.
    from perfscope.dashboard.app import main

    main(store=store, page=page)


def open_page(store: Path, page: str = "overview", **params: str) -> AppTest:
    at = AppTest.from_function(_app, args=(str(store), page), default_timeout=120)
    for k, v in params.items():
        at.query_params[k] = v
    return at.run()


def clean(at: AppTest) -> AppTest:
    """No exception and no error box: every page must draw without either on a good store."""
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, f"no metric {label!r}; have {[m.label for m in at.metric]}"
    return str(found[0])


def charts(at: AppTest) -> list[Any]:
    return list(at.get("vega_lite_chart"))


def column(at: AppTest, title: str, *also: str) -> list[Any]:
    """The values of column `title` in the first shown table that also has the columns `also`."""
    for df in at.dataframe:
        if all(t in df.value.columns for t in (title, *also)):
            return list(df.value[title])
    raise AssertionError(f"no table with columns {(title, *also)!r}")


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("seed") / "store"
    write_study(root, parse_config(seed_study_config()))
    return root


def _measured(root: Path) -> Path:
    """Two GPU runs (N = 1, 2) of one experiment with collectives, and a CPU-only run."""
    comm = Comm(bucket_bytes=[4_000_000], transfer_ns=lambda b: 2 * MS, delay_ns=lambda r, s: MS * (r == 1))
    for n in (1, 2):
        make_run(
            root,
            f"gpu-n{n}",
            world_size=n,
            experiment="gpu",
            comm=comm if n > 1 else None,
            gpu=Gpu(),
            host=Host(),
        )
    make_run(
        root,
        "cpu-n2",
        world_size=2,
        experiment="cpu",
        device=False,
        device_model="cpu",
        backend="gloo",
        host=Host(),
    )
    return root


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _measured(tmp_path_factory.mktemp("measured") / "store")


def test_every_column_a_page_shows_is_in_its_analysis(seed: Path) -> None:
    from perfscope.dashboard import batch, overview, run, scaling

    shown = {
        "run_summary": overview.RUN_COLUMNS,
        "quality": overview.QUALITY_COLUMNS,
        "scaling": {**overview.GLANCE_COLUMNS, **scaling.SCALING_COLUMNS, **scaling.LARGEST_COLUMNS},
        "allreduce_fit": scaling.FIT_COLUMNS,
        "utilisation": scaling.HOST_CPU_COLUMNS,
        "pop": scaling.POP_COLUMNS,
        "scaling_model": scaling.MODEL_COLUMNS,
        "scaling_prediction": scaling.PREDICTION_COLUMNS,
        "rank_breakdown": run.RANK_COLUMNS,
        "stragglers": run.STRAGGLER_COLUMNS,
        "placement": run.PLACEMENT_COLUMNS,
        "memory": run.MEMORY_COLUMNS,
        "batch_sweep": batch.SWEEP_COLUMNS,
        "time_to_metric": batch.TARGET_COLUMNS,
    }
    with open_store(seed) as store:
        for name, columns in shown.items():
            missing = set(columns) - set(run_analysis(name, store, Selection()).column_names)
            assert not missing, (name, missing)


def test_overview_numbers_and_findings_equal_the_analyses(seed: Path) -> None:
    at = clean(open_page(seed))
    with open_store(seed) as store:
        summary = run_analysis("run_summary", store, Selection())
        scaling = run_analysis("scaling", store, Selection()).to_pylist()
        findings = explain(store, Selection())
    assert metric(at, "Runs") == str(summary.num_rows)
    simulated = summary.column("source").to_pylist().count("simulated")
    assert metric(at, "Measured / simulated") == f"{summary.num_rows - simulated} / {simulated}"
    assert any("Simulated data" in i.value for i in at.info)
    # the per-GPU speedup of each group at its largest N: the seed study's headline figures
    largest: dict[str, dict[str, Any]] = {}
    for r in scaling:
        if r["group_id"] not in largest or r["world_size"] > largest[r["group_id"]]["world_size"]:
            largest[r["group_id"]] = r
    # groups by the names the charts give them, never their raw ids ('exp/-/gloo/...')
    named = {v: k for k, v in group_labels(largest, scaling).items()}
    groups = [named[g] for g in column(at, "scaling group")]
    shown = dict(zip(groups, column(at, "per-GPU speedup S(N)/N"), strict=True))
    assert groups and set(groups) <= set(largest)
    for g, v in shown.items():
        assert v == pytest.approx(largest[g]["per_gpu_speedup"])
    # findings in the explainer's order, each with a link to the chart behind it
    titles = [e.label for e in at.expander if e.label.startswith("**")]
    # (their words are store text, escaped for Markdown: report/text.py)
    assert titles == [f"**{i}. {literal(f.title)}**" for i, f in enumerate(findings, 1)]
    # the first three are open, each with its links; a closed one draws its body when opened
    shown = len(at.get("page_link"))
    assert shown >= 3
    at.session_state[f"finding:{findings[-1].id}"] = True
    links = clean(at.run()).get("page_link")
    assert len(links) > shown
    assert {link.proto.page for link in links} <= {"scaling", "run", "batch", "overview"}


def test_finding_links_open_their_page_and_tab_cleanly(seed: Path) -> None:
    at = clean(open_page(seed))
    targets = {(link.proto.page, link.proto.query_string) for link in at.get("page_link")}
    by_place: dict[tuple[str, str], str] = {}
    for page, query in sorted(targets):
        params = dict(parse_qsl(query))
        by_place.setdefault((page, params.get("scaling_tab") or params.get("run_tab") or ""), query)
    assert len(by_place) >= 3
    for (page, tab), query in by_place.items():
        params = dict(parse_qsl(query))
        target = clean(open_page(seed, page, **params))
        assert target.title[0].value.lower().startswith(page[:3]), (page, [t.value for t in target.title])
        if "run" in params:
            assert target.selectbox(key="run").value == params["run"]
        if tab:  # the linked tab is the one drawn (the others stay empty until opened)
            drawn = [t.label for t in target.tabs if t.children]
            assert drawn == [tab], (page, query)


@pytest.mark.parametrize(
    "place", sorted({p for p in PLACES.values() if p.tab}, key=lambda p: (p.page, p.tab or "")), ids=str
)
def test_every_place_a_finding_can_link_to_exists(seed: Path, place: Place) -> None:
    params = place.params(run_id="sim-seed-scaling-gpu2-horovod-nccl-n004-b75-s2022")
    at = clean(open_page(seed, place.page, **params))
    assert [t.label for t in at.tabs if t.children] == [place.tab]


def test_selection_in_the_sidebar_changes_the_numbers(seed: Path) -> None:
    at = clean(open_page(seed))
    everything = int(metric(at, "Runs"))
    at.sidebar.multiselect(key="sel_clusters").set_value(["gpu2"]).run()
    clean(at)
    with open_store(seed) as store:
        gpu2 = run_analysis("run_summary", store, Selection(clusters=("gpu2",)))
        scaling = run_analysis("scaling", store, Selection(clusters=("gpu2",))).to_pylist()
    assert int(metric(at, "Runs")) == gpu2.num_rows < everything
    named = {v: k for k, v in group_labels((r["group_id"] for r in scaling), scaling).items()}
    assert all("/gpu2/" in named[g] for g in column(at, "scaling group"))
    at.sidebar.radio(key="sel_source").set_value("measured").run()
    assert any("No runs match" in i.value for i in clean(at).info)


def test_scaling_page_shows_the_scaling_analysis(seed: Path) -> None:
    at = clean(open_page(seed, "scaling"))
    with open_store(seed) as store:
        scaling = run_analysis("scaling", store, Selection()).to_pylist()
    largest: dict[str, dict[str, Any]] = {}
    for r in scaling:
        if r["group_id"] not in largest or r["world_size"] > largest[r["group_id"]]["world_size"]:
            largest[r["group_id"]] = r
    picker = at.multiselect(key="scaling_groups")
    assert sorted(picker.value) == sorted(g for g in largest if g.startswith("seed-scaling/"))
    # the table "at the largest world size" lists the groups by their short labels, in id order
    assert column(at, "S(N)/N") == pytest.approx(
        [largest[g]["per_gpu_speedup"] for g in sorted(picker.value)]
    )
    assert len(charts(at)) == 3  # speedup, efficiency, per-GPU speedup
    first = sorted(picker.value)[0]
    picker.set_value([first]).run()
    clean(at)
    assert column(at, "S(N)/N") == pytest.approx([largest[first]["per_gpu_speedup"]])
    assert len(column(at, "S(N)", "step (ms)")) == len([r for r in scaling if r["group_id"] == first])


@pytest.mark.parametrize("tab", ["Sync", "Phases", "Utilisation", "Groups", "Model"])
def test_scaling_tabs_draw(seed: Path, tab: str) -> None:
    at = clean(open_page(seed, "scaling", scaling_tab=tab))
    assert charts(at) or at.dataframe


def test_run_page_numbers_follow_the_picked_run(seed: Path) -> None:
    with open_store(seed) as store:
        summary = {r["run_id"]: r for r in run_analysis("run_summary", store, Selection()).to_pylist()}
    run_id = "sim-seed-scaling-gpu2-horovod-nccl-n008-b75-s2022"
    at = clean(open_page(seed, "run", run=run_id))
    assert metric(at, "Step time") == format_value("step_ns", summary[run_id]["step_ns"])
    assert metric(at, "World size") == "8"
    other = "sim-seed-scaling-alpha-horovod-mpi-n002-b75-s2022"
    at.selectbox(key="run").set_value(other).run()
    assert metric(clean(at), "Step time") == format_value("step_ns", summary[other]["step_ns"])


@pytest.mark.parametrize("tab", ["Steps", "Phases", "Stragglers", "Communication", "Telemetry", "What-if"])
def test_run_tabs_draw(seed: Path, tab: str) -> None:
    at = clean(open_page(seed, "run", run="sim-seed-scaling-hpdlf-horovod-nccl-n006-b75-s2022", run_tab=tab))
    assert charts(at)


def test_run_without_gpus_says_so(measured: Path) -> None:
    at = clean(open_page(measured, "run", run="cpu-n2", run_tab="Telemetry"))
    assert any("No GPU telemetry" in i.value for i in at.info)
    assert len(charts(at)) == 1  # the host timeline


def test_stragglers_of_a_measured_run(measured: Path) -> None:
    at = clean(open_page(measured, "run", run="gpu-n2", run_tab="Stragglers"))
    with open_store(measured) as store:
        strag = run_analysis("stragglers", store, Selection(run_ids=("gpu-n2",))).to_pylist()
    shares = column(at, "last to enter")
    assert shares == pytest.approx([100 * r["last_share"] for r in strag])


def test_batch_page_equals_the_sweep(seed: Path) -> None:
    at = clean(open_page(seed, "batch"))
    with open_store(seed) as store:
        sweep = run_analysis("batch_sweep", store, Selection()).to_pylist()
    assert column(at, "× smallest batch") == pytest.approx([r["throughput_vs_smallest"] for r in sweep])
    assert len(charts(at)) == 2


def test_batch_page_without_a_sweep(measured: Path) -> None:
    at = clean(open_page(measured, "batch"))
    assert any("No batch-size sweep" in i.value for i in at.info)


def test_batch_page_reads_a_quote_in_a_tag_key(tmp_path: Path) -> None:
    """A run tagged {'x"y': '1'} beside two others: the page showed "JSON path error" (issue 33)."""
    root = tmp_path / "store"
    for rid, tags in (("a", {"lr": "1"}), ("b", {"lr": "2"}), ("odd", {'x"y': "1"})):
        make_run(root, rid, steps=12, metrics={"loss": lambda step: 2.0 / (1 + step)}, tags=tags)
    at = clean(open_page(root, "batch"))
    assert len(column(at, "reached")) == 3  # one row per run in the time-to-target table


def test_compare_runs_side_by_side(seed: Path) -> None:
    a = "sim-seed-scaling-hpdlf-horovod-nccl-n012-b75-s2022"
    b = "sim-seed-scaling-hpdlf-horovod-mpi-n012-b75-s2022"
    at = clean(open_page(seed, "compare"))
    at.selectbox(key="compare_a").set_value(a)
    at.selectbox(key="compare_b").set_value(b).run()
    clean(at)
    with open_store(seed) as store:
        summary = {r["run_id"]: r for r in run_analysis("run_summary", store, Selection()).to_pylist()}
    table = next(df.value for df in at.dataframe if "B against A" in df.value.columns)
    row = table[table["quantity"] == "step time (elapsed mean)"].iloc[0]
    assert row["A"] == f"{summary[a]['step_ns'] / 1e6:.3f}"
    assert row["B"] == f"{summary[b]['step_ns'] / 1e6:.3f}"
    assert any("backend" in m.value for m in at.markdown)  # what differs between the two is named
    at.radio(key="compare_mode").set_value("Two groups").run()
    clean(at)
    assert charts(at)
    assert any(df.value.columns[0] == "efficiency E(N)" for df in at.dataframe)


def test_sql_runs_a_select_and_refuses_writes_and_outside_files(seed: Path) -> None:
    at = clean(open_page(seed, "sql"))
    assert at.dataframe  # the example query ran on arrival
    at.text_area(key="sql_text").input("SELECT count(*) AS n FROM runs")
    at.button[0].click().run()
    clean(at)
    with open_store(seed) as store:
        assert at.dataframe[0].value["n"][0] == store.query("SELECT count(*) AS n FROM runs")["n"][0].as_py()
    at.text_area(key="sql_text").input("DELETE FROM runs")
    at.button[0].click().run()
    assert any("only reading queries" in e.value for e in at.error)
    at.text_area(key="sql_text").input("SELECT * FROM read_csv('/etc/passwd')")
    at.button[0].click().run()
    assert not at.exception and at.error and not at.dataframe


def test_sql_page_shows_wide_rows_up_to_its_byte_bound(seed: Path) -> None:
    """10,000 rows of 10 KB would be 100 MB in the server and the browser per session: the page stops at
    its byte bound, says so, and points at the download."""
    from perfscope.dashboard.sql import SHOWN_BYTES

    at = clean(open_page(seed, "sql"))
    at.text_area(key="sql_text").input("SELECT repeat('x', 10000) AS s FROM range(10000)")
    at.button[0].click().run()
    clean(at)
    shown = at.dataframe[0].value
    assert 0 < len(shown) < 10000 and len(shown) * 10000 < SHOWN_BYTES + 2048 * 10100
    said = [c.value for c in at.caption]
    assert any(f"passed {SHOWN_BYTES >> 20} MB" in c and "download the rest" in c for c in said), said


def test_missing_path_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    for page in ("overview", "scaling", "sql"):
        at = open_page(tmp_path / "nowhere", page)
        assert not at.exception
        assert any("does not exist" in e.value for e in at.error)


def test_empty_and_foreign_folders(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    at = open_page(empty)
    assert not at.exception and any("no perfscope data" in e.value for e in at.error)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    at = open_page(foreign, "run")
    assert not at.exception and any("not a perfscope store" in e.value for e in at.error)


def test_corrupt_segment_is_skipped_and_named(tmp_path: Path, measured: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(measured, root)
    victim = sorted((root / "steps").rglob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    at = clean(open_page(root))
    assert any("skipped" in w.value for w in at.warning)
    assert any(str(victim) in str(v) for df in at.dataframe for v in df.value.get("file", []))


def test_live_mode_picks_up_a_run_written_meanwhile(tmp_path: Path) -> None:
    root = tmp_path / "live"
    make_run(root, "first", world_size=1, experiment="live")
    at = clean(open_page(root))
    assert metric(at, "Runs") == "1"
    make_run(root, "second", world_size=2, experiment="live")
    at.sidebar.toggle(key="live").set_value(True).run()
    assert metric(clean(at), "Runs") == "2"
    make_run(root, "third", world_size=4, experiment="live")
    at.sidebar.toggle(key="live").set_value(False).run()
    at.sidebar.button(key="reload_store").click().run()  # shown when live mode is off
    assert metric(clean(at), "Runs") == "3"


def test_app_file_reads_the_store_from_the_environment(
    measured: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_STORE", str(measured))
    at = clean(AppTest.from_file(str(APP), default_timeout=120).run())
    assert metric(at, "Runs") == "3"
    assert str(measured) in at.sidebar.code[0].value


def test_warmup_override_changes_the_steady_steps(measured: Path) -> None:
    at = clean(open_page(measured, "run", run="gpu-n1"))
    before = metric(at, "Steady steps")
    at.sidebar.number_input(key="sel_warmup").set_value(0).run()
    after = metric(clean(at), "Steady steps")
    assert before != after and after.startswith("40 /")


def test_report_download_gives_the_html_report(measured: Path) -> None:
    from perfscope.dashboard.app import report_renderer

    at = clean(open_page(measured))
    at.sidebar.button(key="make_report").click().run()
    assert [b.proto.label for b in clean(at).sidebar.get("download_button")] == ["Download report (HTML)"]
    with open_store(measured) as store:
        html = report_renderer(store, Selection(experiments=("gpu",)))()
    assert html.startswith(b"<!DOCTYPE html") and b"gpu-n2" in html
