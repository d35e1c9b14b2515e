"""The HTML report in headless Chromium with the network blocked: every chart draws, nothing leaves the
page, no script runs; screenshots go to artifacts/report/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from test_report_store import build_study

from perfscope import sample_traces
from perfscope.analysis import Selection
from perfscope.report import write_report
from perfscope.store.open import open_store

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "report"

#: Per chart figure: its name, whether it holds an <svg>, the svg's drawn size, how many marks it
#: draws, and the "no data" texts it shows.
FIGURES_JS = """() => [...document.querySelectorAll('figure.chart')].map(f => {
  const svg = f.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const marks = svg ? svg.querySelectorAll('g[class*="role-mark"] > *').length : 0;
  const texts = svg ? [...svg.querySelectorAll('text')].map(t => t.textContent) : [];
  // text the browser draws (in its own font) outside the chart's box is cut off: 'llreduce in sync'
  const clipped = svg ? [...svg.querySelectorAll('text')].filter(t => {
    const r = t.getBoundingClientRect();
    return r.width > 0 && (r.left < box.left - 0.5 || r.right > box.right + 0.5);
  }).map(t => t.textContent) : [];
  return {name: f.dataset.chart, svg: !!svg, width: box.width, height: box.height, marks,
          empty: texts.filter(t => t.startsWith('no ') || t.startsWith('fewer than')).length,
          clipped, truncated: texts.filter(t => t.includes('\u2026'))};
})"""

SECTIONS = ("overview", "speedup", "lost-time", "sync", "stragglers", "prediction", "findings")


def _stores(tmp: Path) -> dict[str, Path]:
    stores = {"study": build_study(tmp / "study")}
    bundled = sample_traces.bundled()
    if sample_traces.DEFAULT in bundled:
        stores["seed-study"] = bundled[sample_traces.DEFAULT]
    return stores


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("browser")
    (tmp / "study").mkdir()
    out = {}
    for name, root in _stores(tmp).items():
        with open_store(root) as store:
            out[name] = write_report(store, Selection(), tmp / f"{name}.html").report
    return out


def _open(browser: Any, path: Path) -> tuple[Any, list[str], list[str]]:
    """A page showing the file; every other request is recorded and aborted."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    left: list[str] = []
    errors: list[str] = []
    own = path.resolve().as_uri()

    def route(r: Any) -> None:
        if r.request.url == own:
            r.continue_()
        else:
            left.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(own, wait_until="load")
    return page, left, errors


@pytest.mark.parametrize("name", ["study", "seed-study"])
def test_every_chart_renders_offline(name: str, reports: dict[str, Path]) -> None:
    if name not in reports:
        pytest.skip("the bundled seed study is not generated in this checkout")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page, left, errors = _open(browser, reports[name])
            figures = page.evaluate(FIGURES_JS)
            scripts = page.evaluate("document.scripts.length")
            title = page.title()
            page.screenshot(path=str(ARTIFACTS / f"{name}-full.png"), full_page=True)
            for section in SECTIONS:
                page.locator(f"#{section}").screenshot(path=str(ARTIFACTS / f"{name}-{section}.png"))
        finally:
            browser.close()
    assert left == [], f"requests left the page: {left}"
    assert errors == []
    assert scripts == 0
    assert title.startswith("Scaling study")
    assert len(figures) == 23  # the charts, communication by op and by role and what-if's five included
    for f in figures:
        assert f["svg"], f
        assert f["width"] > 300 and f["height"] > 100, f
        # a line chart draws one path per series; a DDP-only store's op chart has one bar (allreduce), a
        # what-if heat map one cell per worker (the seed study's pipeline: two)
        few = ("comm_ops", "what_if_heatmap", "what_if_step_heatmap")
        assert f["marks"] >= (1 if f["name"] in few else 3), f
        assert f["empty"] == 0, f
        assert f["clipped"] == [] and f["truncated"] == [], f  # every label whole, in the browser's font
    assert {f["name"] for f in figures} >= {"speedup", "efficiency", "busbw", "wait_heatmap", "metric_curves"}


def test_a_page_that_asks_for_the_network_is_caught(tmp_path: Path) -> None:
    """The guard above is real: a page with an external image and script is seen and blocked."""
    from playwright.sync_api import sync_playwright

    page_file = tmp_path / "leaky.html"
    page_file.write_text(
        '<html><body><img src="https://example.com/x.png"><script src="http://example.org/a.js"></script>'
        "</body></html>"
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            _, left, _ = _open(browser, page_file)
        finally:
            browser.close()
    assert sorted(left) == ["http://example.org/a.js", "https://example.com/x.png"]


#: what a report's tables and charts must never show a reader
BROKEN_TEXT_JS = """() => {
  const cells = [...document.querySelectorAll('table.data td, table.data th')].map(c => c.textContent.trim());
  const heads = [...document.querySelectorAll('h2, h3')].filter(h => {
    let next = h.nextElementSibling;  // a heading with nothing under it before the next heading
    return !next || /^H[23]$/.test(next.tagName);
  }).map(h => h.textContent);
  const ids = [...document.querySelectorAll('section[id]')].map(s => s.id);
  return {none: cells.filter(t => ['None', 'nan', 'NaN', 'null', 'undefined'].includes(t)),
          emptyHeaders: [...document.querySelectorAll('table.data th')]
            .filter(th => !th.textContent.trim()).length,
          emptySections: heads, ids};
}"""


@pytest.mark.parametrize("kind", ["cpu", "mixed"])
def test_a_cpu_and_a_mixed_report_show_nothing_broken(kind: str, tmp_path: Path) -> None:
    """The bundled CPU store alone, and beside the simulated seed study in one folder: every section
    is screenshotted (artifacts/report/<kind>-<section>.png), no table shows None or an empty header,
    no heading stands over nothing, and a CPU-only report says nothing of GPU utilisation."""
    import shutil

    from playwright.sync_api import sync_playwright

    bundled = sample_traces.bundled()
    names = ["demo-cpu"] if kind == "cpu" else ["demo-cpu", "seed-study"]
    if not set(names) <= set(bundled):
        pytest.skip("the bundled sample traces are not in this checkout")
    root = tmp_path / kind
    for name in names:
        shutil.copytree(bundled[name], root, dirs_exist_ok=True)
    with open_store(root) as store:
        report = write_report(store, Selection(), tmp_path / f"{kind}.html").report
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page, left, errors = _open(browser, report)
            found = page.evaluate(BROKEN_TEXT_JS)
            figures = page.evaluate(FIGURES_JS)
            for section in found["ids"]:
                page.locator(f"section#{section}").screenshot(path=str(ARTIFACTS / f"{kind}-{section}.png"))
            text = page.inner_text("body")
            utilisation = page.inner_text("section#utilisation")
        finally:
            browser.close()
    assert left == [] and errors == []
    assert found["none"] == [] and found["emptyHeaders"] == 0
    assert found["emptySections"] == [], found["emptySections"]
    assert {"overview", "setup", "speedup", "utilisation", "findings"} <= set(found["ids"])
    assert all(f["svg"] and f["width"] > 300 for f in figures), figures
    if kind == "cpu":
        assert "Host CPU and load" in utilisation and "kernel-active" not in utilisation
        assert "GPUs / ranks" not in report.read_text(encoding="utf-8")  # the charts are inline SVG
    else:
        assert "simulated" in text and "measured" in text
