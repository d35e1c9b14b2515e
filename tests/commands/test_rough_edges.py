"""Issue 16's rough edges of the CLI, the report and the dashboard: bare `perfscope`, `analyse`, a verb's
own usage on its errors, one exit status per refused query, `--run` everywhere, every flag in the README,
`help(perfscope.profile)`, figure captions that follow their data's source, the reference the product
cites, and the dashboard's store switch."""

from __future__ import annotations

import argparse
import inspect
import io
import itertools
import json
import pydoc
import re
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from storegen import make_run
from streamlit.testing.v1 import AppTest

import perfscope
from perfscope import sample_traces
from perfscope.analysis import Selection
from perfscope.cli import VERBS, _parser, main
from perfscope.report import collect, render_report
from perfscope.report.model import REFERENCE, ChartBlock, Num, Ref, Section, TableBlock, device_unit
from perfscope.store.open import open_store
from perfscope.store.user_sql import REFUSED_EXIT

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = sample_traces.bundled()
needs_bundled = pytest.mark.skipif(
    not {"demo-cpu", "seed-study"} <= set(BUNDLED),
    reason="the bundled sample traces are not in this checkout",
)


def mixed_store(root: Path) -> Path:
    """The bundled CPU store (measured) and seed study (simulated) copied into one folder."""
    for name in ("demo-cpu", "seed-study"):
        shutil.copytree(BUNDLED[name], root, dirs_exist_ok=True)
    return root


# ---- CLI ----------------------------------------------------------------------------------------


def test_bare_perfscope_prints_help_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: perfscope") and err == ""
    for verb in VERBS:
        assert verb in out


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small") / "store"
    for n in (1, 2):
        make_run(root, f"run-n{n}", world_size=n, experiment="small")
    return root


def test_analyse_is_analyze(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyse", str(small), "--json"]) == 0
    british = json.loads(capsys.readouterr().out)
    assert main(["analyze", str(small), "--json"]) == 0
    american = json.loads(capsys.readouterr().out)
    assert british["format"] == "perfscope-analyze"
    assert [r["run_id"] for r in british["runs"]] == [r["run_id"] for r in american["runs"]]


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "STORE", "--foo"],
        ["analyse", "STORE", "--foo"],
        ["info", "STORE", "extra"],
        ["report", "STORE", "--nope", "1"],
    ],
)
def test_a_verbs_error_points_to_that_verbs_usage(
    argv: list[str], small: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(small) if a == "STORE" else a for a in argv]
    verb = {"analyse": "analyze"}.get(argv[0], argv[0])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"perfscope {verb}: error: unrecognized arguments: ")
    assert err.endswith(f"(usage: perfscope {verb} --help)\n")


def test_every_refused_query_exits_with_one_status(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused = [
        "DROP VIEW steps",
        "COPY steps TO '/tmp/perfscope-refused.csv'",
        "ATTACH '/tmp/perfscope-refused.db'",
        "SET threads = 1",
        "SELECT 1; SELECT 2",
        "EXPLAIN ANALYZE SELECT 1",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"SELECT * FROM read_parquet('{small}/steps/*/*.parquet')",  # a glob lists folders: refused
        "SELECT * FROM read_text('/etc/hostname')",
    ]
    for query in refused:
        assert main(["sql", str(small), query]) == REFUSED_EXIT, query
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err, (query, err)
    # a query that is allowed but fails while it runs is a different thing, with its own status
    assert main(["sql", str(small), "SELECT * FROM no_such_table"]) == 1
    assert REFUSED_EXIT != 1


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {verb: sub.choices[verb] for verb in VERBS}


def test_one_flag_name_per_concept_run_is_repeatable_everywhere() -> None:
    parsers = _verb_parsers()
    for verb in ("analyze", "report"):
        args = parsers[verb].parse_args(["STORE", "--run", "a", "--run", "b"])
        assert tuple(getattr(args, "run", None) or args.runs) == ("a", "b"), verb
    # the old report spelling still works, hidden from the help
    assert parsers["report"].parse_args(["S", "--runs", "a", "b", "--run", "c"]).runs == ["a", "b", "c"]
    assert "--runs" not in parsers["report"].format_help()
    for verb, p in parsers.items():
        flags = {o for a in p._actions for o in a.option_strings}
        assert "--runs" not in flags or verb == "report", verb


def _flags(p: argparse.ArgumentParser) -> list[Sequence[str]]:
    """Each shown option's spellings (-o, --output)."""
    return [
        a.option_strings
        for a in p._actions
        if a.option_strings and a.help != argparse.SUPPRESS and "--help" not in a.option_strings
    ]


def test_every_flag_of_every_verb_is_in_the_readme() -> None:
    """Each flag is named on its verb's row of the README's command table."""
    lines = (ROOT / "README.md").read_text().splitlines()
    missing = []
    for verb, p in _verb_parsers().items():
        rows = "\n".join(line for line in lines if line.startswith(f"| `perfscope {verb}"))
        assert rows, f"the README's command table has no row for {verb}"
        missing += [
            f"{verb} {'/'.join(spellings)}"
            for spellings in _flags(p)
            if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", rows) for o in spellings)
        ]
    assert missing == [], f"flags missing from README.md's command table: {missing}"


def test_help_of_profile_shows_the_real_signature_and_docstring() -> None:
    from perfscope.collectors import profile

    assert perfscope.profile is profile
    params = inspect.signature(perfscope.profile).parameters
    assert {"store", "experiment", "batch_size", "count_flops"} <= set(params)
    text = pydoc.render_doc(perfscope.profile, renderer=pydoc.plaintext)  # type: ignore[attr-defined]
    assert "Record this rank's training" in text and "see perfscope.collectors.profile" not in text


# ---- report -------------------------------------------------------------------------------------


def _captions(root: Path) -> tuple[list[ChartBlock], str]:
    with open_store(root) as store:
        report = collect(store, Selection()).report
        html = render_report(store, Selection(), fmt="html").decode()
    return report.charts(), html


def _figcaptions(html: str) -> list[str]:
    return re.findall(r"<figcaption>(.*?)</figcaption>", html, re.S)


@needs_bundled
def test_captions_of_a_simulated_report_never_say_measured() -> None:
    charts, html = _captions(BUNDLED["seed-study"])
    assert charts
    for c in charts:
        assert "measured" not in c.caption, (c.name, c.caption)
        assert c.caption.startswith("simulated"), (c.name, c.caption)
    for cap in _figcaptions(html):
        assert "— measured" not in cap and "measured and" not in cap, cap


@needs_bundled
def test_captions_of_a_measured_report_say_measured() -> None:
    charts, html = _captions(BUNDLED["demo-cpu"])
    assert charts
    for c in charts:
        assert c.caption.startswith("measured"), (c.name, c.caption)
    assert all("simulated" not in cap for cap in _figcaptions(html))


@needs_bundled
def test_captions_of_a_mixed_report_say_which(tmp_path: Path) -> None:
    charts, _ = _captions(mixed_store(tmp_path / "mixed"))
    by_name = {c.name: c.caption for c in charts}
    assert by_name["speedup"].startswith("measured and simulated"), by_name
    assert by_name["efficiency"].startswith("measured and simulated"), by_name
    # the stragglers figures show one run, and say that run's source only
    assert by_name["last_rank"] in ("measured", "simulated"), by_name


def test_prediction_section_draws_no_figure_without_predictions(small: Path) -> None:
    with open_store(small) as store:
        collected = collect(store, Selection())
    # two world sizes: no model predicts beyond them
    assert not [r for r in collected.tables["scaling_prediction"].to_pylist() if r["kind"] == "prediction"]
    section = next(s for s in collected.report.sections if s.id == "prediction")
    assert [b for b in section.blocks if isinstance(b, ChartBlock)] == []
    words = ["".join(map(str, b)) for b in section.blocks if isinstance(b, list)]
    assert any("No group has a model" in w for w in words)


@needs_bundled
def test_prediction_section_draws_the_predictions_when_there_are_some() -> None:
    with open_store(BUNDLED["demo-cpu"]) as store:
        section = next(s for s in collect(store, Selection()).report.sections if s.id == "prediction")
    charts = [b for b in section.blocks if isinstance(b, ChartBlock)]
    assert [c.name for c in charts] == ["speedup", "efficiency"]
    assert all(c.caption == "measured, with the model's predictions" for c in charts)


@needs_bundled
def test_report_and_dashboard_cite_the_reference_in_the_repository() -> None:
    assert (ROOT / "docs" / "analysis.md").is_file()
    assert "docs/analysis.md" in REFERENCE
    with open_store(BUNDLED["demo-cpu"]) as store:
        html = render_report(store, Selection(), fmt="html").decode()
        md = render_report(store, Selection(), fmt="md")
    assert "docs/analysis.md" in html and "DESIGN.md" not in html
    assert b"DESIGN.md" not in md
    for path in (ROOT / "dashboard").glob("*.py"):
        code = path.read_text()
        # user-facing strings only: docstrings and comments may name the design notes
        shown = re.findall(r'(?:st\.\w+|placeholder=|help=)\(?\s*f?"([^"]*)"', code)
        assert not [s for s in shown if "DESIGN" in s], path


# ---- dashboard: switching store -----------------------------------------------------------------


def _app(store: str) -> None:
    from perfscope.dashboard.app import main

    main(store=store)


def _store_shown(at: AppTest) -> str:
    return str(at.sidebar.code[0].value)


def test_the_dashboard_switches_to_another_store(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_ROOT", "/")  # perfscope dashboard --root /
    other = tmp_path / "other"
    make_run(other, "other-n4", world_size=4, experiment="other")
    at = AppTest.from_function(_app, args=(str(small),), default_timeout=120).run()
    assert not at.exception
    assert _store_shown(at) == str(small.resolve())
    at.sidebar.text_input(key="store_switch").input(str(other)).run()
    assert not at.exception and not at.sidebar.error
    assert _store_shown(at) == str(other.resolve())
    assert [m.value for m in at.metric if m.label == "Runs"] == ["1"]


@pytest.mark.parametrize(
    "typed, words",
    [
        ("/no/such/store", "does not exist"),
        ("README.md", "is not a folder"),
        ("bad\x00name", "not a usable path"),
        ("x" * 5000, "not a usable path"),
    ],
)
def test_a_bad_store_path_is_one_line_and_keeps_the_store(
    small: Path, typed: str, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_ROOT", "/")  # perfscope dashboard --root /
    typed = str(ROOT / typed) if typed == "README.md" else typed
    at = AppTest.from_function(_app, args=(str(small),), default_timeout=120).run()
    at.sidebar.text_input(key="store_switch").input(typed).run()
    assert not at.exception
    errors = [e.value for e in at.sidebar.error]
    assert len(errors) == 1 and words in errors[0] and "\n" not in errors[0], errors
    assert _store_shown(at) == str(small.resolve())  # the shown store stays


def test_an_empty_folder_is_refused_with_the_stores_words(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_ROOT", "/")  # perfscope dashboard --root /
    (tmp_path / "empty").mkdir()
    at = AppTest.from_function(_app, args=(str(small),), default_timeout=120).run()
    at.sidebar.text_input(key="store_switch").input(str(tmp_path / "empty")).run()
    errors = [e.value for e in at.sidebar.error]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert _store_shown(at) == str(small.resolve())


# ---- dashboard in a real browser: every page by its own URL, offline ------------------------------

#: url path and query of every page and tab a user can land on
URLS = (
    "",
    "overview",
    "scaling",
    "scaling?scaling_tab=Sync",
    "scaling?scaling_tab=Phases",
    "scaling?scaling_tab=Utilisation",
    "scaling?scaling_tab=Groups",
    "scaling?scaling_tab=Model",
    "run",
    "run?run_tab=Phases",
    "run?run_tab=Stragglers",
    "run?run_tab=Telemetry",
    "batch",
    "compare",
    "sql",
)
SCREENSHOTS = ROOT / "artifacts" / "dashboard-pages"

#: every chart placeholder on the page has drawn its canvas or svg
_CHARTS_DRAWN = """() => [...document.querySelectorAll('.vega-embed')]
    .every(e => e.querySelector('canvas, svg') !== null)"""


#: charts (by position on the page) that must show the legend of their series: speedup, efficiency and
#: per-GPU speedup (the first charts a user sees), sync time, the batch sweep
LEGENDS: dict[str, tuple[str, tuple[int, ...]]] = {
    "scaling": ("group", (0, 1, 2)),
    "scaling?scaling_tab=Sync": ("group", (0,)),
    "batch": ("setup", (0,)),
}
#: per chart, the titles of its legends
_LEGENDS = """() => [...document.querySelectorAll('.vega-embed')].map(e =>
    [...e.querySelectorAll('g.role-legend-title')].map(t => t.textContent))"""


@pytest.fixture(scope="module")
def page_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not {"demo-cpu", "seed-study"} <= set(BUNDLED):
        pytest.skip("no bundled sample traces in this checkout")
    return {
        "cpu": BUNDLED["demo-cpu"],
        "simulated": BUNDLED["seed-study"],
        "mixed": mixed_store(tmp_path_factory.mktemp("mixed") / "store"),
    }


@pytest.mark.browser
@pytest.mark.parametrize("kind", ["cpu", "simulated", "mixed"])
def test_every_page_opens_by_its_url_and_nothing_leaves_the_machine(
    kind: str, page_stores: dict[str, Path], tmp_path: Path
) -> None:
    from browser import CHROMIUM, CHROMIUM_ARGS
    from test_dashboard_browser import _screenshot, dashboard_server, settle

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    left: list[str] = []
    problems: list[str] = []
    with (
        dashboard_server(page_stores[kind], tmp_path / "server.log") as (url, _),
        sync_api.sync_playwright() as p,
    ):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1920, "height": 1080})

            def route(r: object) -> None:
                request_url = r.request.url  # type: ignore[attr-defined]
                if request_url.startswith(url + "/") or request_url == url:
                    r.continue_()  # type: ignore[attr-defined]
                else:
                    left.append(request_url)
                    r.abort()  # type: ignore[attr-defined]

            context.route("**/*", route)
            page = context.new_page()
            for where in URLS:
                page.goto(f"{url}/{where}")
                settle(page)
                page.wait_for_function(_CHARTS_DRAWN, timeout=60_000)
                body = page.inner_text("body")
                if "Page not found" in body:
                    problems.append(f"{where or '/'}: Page not found")
                if page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]').count():
                    problems.append(f"{where or '/'}: an error box: {body[:300]!r}")
                path = page.evaluate("() => window.location.pathname")
                expected = "/" + (where.split("?")[0] or "overview")
                if path != expected:
                    problems.append(f"{where or '/'}: opened {path}, not {expected}")
                if where in LEGENDS:
                    legends = page.evaluate(_LEGENDS)
                    title, charts = LEGENDS[where]
                    if len(legends) <= max(charts) or any(title not in legends[i] for i in charts):
                        problems.append(f"{where}: a chart without its {title!r} legend: {legends}")
                name = (where or "root").replace("?", "-").replace("=", "-").replace("_tab", "")
                _screenshot(page, SCREENSHOTS / f"{kind}-{name}.png")
        finally:
            browser.close()
    assert problems == []
    assert left == [], f"requests that left 127.0.0.1: {sorted(set(left))}"


def test_per_gpu_value_labels_do_not_overlap() -> None:
    from perfscope.charts.scaling import HEIGHT, LABEL_HEIGHT_PX, _spread

    values = [0.51, 0.58, 0.53, 0.52, 0.74, 0.55]
    spread = _spread([{"series": str(v), "v": v} for v in values], "v")
    ys = [r["label_y"] for r in spread]
    gap = 1.0 * LABEL_HEIGHT_PX / HEIGHT
    assert sorted(r["v"] for r in spread) == sorted(values)
    assert all(a - b >= gap - 1e-9 for a, b in itertools.pairwise(ys))
    assert ys[0] == pytest.approx(0.74)  # the largest stays at its value; a lone label never moves
    assert _spread([{"v": 0.3}], "v")[0]["label_y"] == pytest.approx(0.3)


# ---- a CPU store speaks of ranks, cores and host CPU, never of GPUs --------------------------------


def _text(part: str | Num | Ref) -> str:
    return part.text() if isinstance(part, Num) else part if isinstance(part, str) else part.text


def _words(section: Section) -> list[str]:
    """What a reader sees of a section but its charts' insides: heading, paragraphs, table captions
    and headers, figure titles and captions."""
    out = [section.heading]
    for b in section.blocks:
        if isinstance(b, list):
            out.append("".join(_text(p) for p in b))
        elif isinstance(b, TableBlock):
            out += [b.caption, *(c.header for c in b.columns)]
        elif isinstance(b, ChartBlock):
            out += [b.title, b.caption]
    return out


@needs_bundled
def test_a_cpu_report_speaks_of_ranks_and_host_cpu_not_gpus() -> None:
    with open_store(BUNDLED["demo-cpu"]) as store:
        report = collect(store, Selection()).report
    # the findings are the explainer's words (issue 16's explainer part), the definitions are generic
    sections = [s for s in report.sections if s.id not in ("findings",)]
    gpu = [(s.id, w) for s in sections for w in _words(s) if "GPU" in w]
    assert gpu == [], gpu
    shown = {s.id: _words(s) for s in sections}
    assert "Per-rank speedup" in shown["speedup"]
    assert shown["utilisation"][0] == "Host CPU and load"
    assert "job's CPU (100% = 1 core)" in shown["utilisation"]
    with open_store(BUNDLED["seed-study"]) as store:
        gpu_report = collect(store, Selection()).report
    assert any("Per-GPU speedup" in w for s in gpu_report.sections for w in _words(s))


def test_device_unit() -> None:
    assert device_unit(["cpu", "CPU "]) == "rank"
    assert device_unit(["cpu", "NVIDIA A100-SXM4-40GB"]) == "GPU"
    assert device_unit([]) == "GPU"
    assert device_unit([None]) == "GPU"


@needs_bundled
def test_the_dashboard_of_a_cpu_store_speaks_of_ranks() -> None:
    def app(store: str, page: str) -> None:
        from perfscope.dashboard.app import main

        main(store=store, page=page)

    store = str(BUNDLED["demo-cpu"])
    at = AppTest.from_function(app, args=(store, "overview"), default_timeout=120).run()
    assert not at.exception
    headers = [c for df in at.dataframe for c in df.value.columns]
    assert "per-rank speedup S(N)/N" in headers and not [h for h in headers if "GPU" in h]
    at = AppTest.from_function(app, args=(store, "scaling"), default_timeout=120)
    at.query_params["scaling_tab"] = "Utilisation"
    at.run()
    assert not at.exception and not at.error
    headers = [c for df in at.dataframe for c in df.value.columns]
    assert {"logical CPUs", "job's CPU (%)", "load (1 min)"} <= set(headers)
    assert not at.get("vega_lite_chart")  # no empty GPU charts


@needs_bundled
def test_a_mixed_report_names_each_groups_own_unit(tmp_path: Path) -> None:
    """CPU groups lose rank time, GPU groups GPU time, in one report of both."""
    with open_store(mixed_store(tmp_path / "mixed")) as store:
        packed = render_report(store, Selection(), fmt="md")  # a ZIP of report.md and its figures
    with zipfile.ZipFile(io.BytesIO(packed)) as z:
        md = z.read(next(n for n in z.namelist() if n.endswith(".md"))).decode()
    lost = re.findall(r"^(.*?): at N = \d+, \*\*[^*]+\*\* of (\w+) time is lost per step", md, re.M)
    units = {("demo-cpu" in group, unit) for group, unit in lost}
    assert units == {(True, "rank"), (False, "GPU")}, lost
