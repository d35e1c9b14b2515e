"""`perfscope dashboard` served for real, every page loaded in headless Chromium, screenshots saved."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from storegen import make_run

from perfscope.simulate import write_study
from perfscope.simulate.presets import parse_config, seed_study_config

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "dashboard"

RUN = "sim-seed-scaling-hpdlf-horovod-nccl-n006-b75-s2022"
#: screenshot name, how to get there (open a URL, click a page in the navigation, click a tab), where,
#: and how many charts the page then draws. Clicks keep the loaded app: a URL reloads all of it.
STEPS: list[tuple[str, str, str, int]] = [
    ("overview", "url", "", 0),
    ("scaling", "page", "Scaling", 3),
    ("scaling-sync", "tab", "Sync", 2),
    ("scaling-phases", "tab", "Phases", 2),
    ("scaling-utilisation", "tab", "Utilisation", 2),
    ("batch", "page", "Batch size", 2),
    ("compare", "page", "Compare", 1),
    ("sql", "page", "SQL", 0),
    ("run", "url", f"run?run={RUN}", 1),
    ("run-stragglers", "tab", "Stragglers", 2),
    ("run-telemetry", "tab", "Telemetry", 2),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"perfscope dashboard exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


@contextmanager
def dashboard_server(
    store: Path, log: Path, host: str = "127.0.0.1", *, token: bool = False, extra: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`perfscope dashboard STORE` on a free port; yields its URL and process once it answers, and
    always ends it (the CLI and the Streamlit server it started) afterwards. Without an access token
    unless `token` (the access tests read it from the log: `printed_token`)."""
    port = free_port()
    extra = (*extra, *([] if host == "127.0.0.1" else ["--host", host]), *([] if token else ["--no-token"]))
    with open(log, "wb") as out:
        # its own session, so the CLI and the Streamlit server it started end together
        proc = subprocess.Popen(
            [sys.executable, "-m", "perfscope", "dashboard", str(store), "--port", str(port), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://{host}:{port}"
        _wait_healthy(url, proc)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test may have ended it already
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_STATE = """() => [
    document.querySelector('.stApp')?.getAttribute('data-test-script-state') ?? 'loading',
    document.querySelectorAll('[data-stale="true"], [data-testid="stSkeleton"]').length,
    document.querySelectorAll('h1').length,
    document.querySelectorAll('.vega-embed canvas, .vega-embed svg').length,
    document.querySelectorAll('[data-testid]').length,
]"""


def settle(page: Any, charts: int = 0, timeout_s: float = 120, quiet_s: float = 0.5) -> None:
    """Wait until the page is drawn: its script has finished, nothing stale or a placeholder, a title,
    `charts` charts, and no change for `quiet_s` (a click's rerun starts a moment after the click)."""
    deadline = time.monotonic() + timeout_s
    last: list[Any] = []
    since = time.monotonic()
    while time.monotonic() < deadline:
        state = page.evaluate(_STATE)
        if state != last:
            last, since = state, time.monotonic()
        elif (
            state[0] == "notRunning"
            and state[1] == 0
            and state[2] > 0
            and state[3] >= charts
            and time.monotonic() - since >= quiet_s
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"page not drawn within {timeout_s} s: {last}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path_factory.mktemp("browser")
    write_study(root / "store", parse_config(seed_study_config()))
    with dashboard_server(root / "store", root / "server.log") as (url, _):
        yield url, root / "server.log"


def test_cli_prints_the_local_address(server: tuple[str, Path]) -> None:
    url, log = server
    text = log.read_text()
    assert f"perfscope dashboard: {url}" in text
    assert "warning" not in text.replace("warning: --no-token", "")  # bound to 127.0.0.1: no other


def test_every_page_renders_without_errors(server: tuple[str, Path]) -> None:
    from playwright.sync_api import sync_playwright

    url, log = server
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})
            for name, how, where, charts in STEPS:
                if how == "url":
                    page.goto(f"{url}/{where}")
                else:
                    page.get_by_role("link" if how == "page" else "tab", name=where, exact=True).first.click()
                settle(page, charts)
                body = page.inner_text("body")
                assert page.locator('[data-testid="stException"]').count() == 0, name
                assert page.locator('[data-testid="stAlertContentError"]').count() == 0, (name, body[:2000])
                assert "Traceback" not in body, name
                drawn = page.locator(".vega-embed canvas, .vega-embed svg")
                assert drawn.count() >= charts, name
                for i in range(drawn.count()):
                    box = drawn.nth(i).bounding_box()
                    assert box is not None and box["width"] > 50 and box["height"] > 50, (name, i, box)
                _screenshot(page, ARTIFACTS / f"{name}.png")
        finally:
            browser.close()
    assert not re.search(r"Traceback|Uncaught app exception", log.read_text()), log.read_text()[-3000:]


def _screenshot(page: Any, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its main block, so grow the viewport to fit it first."""
    height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    page.set_viewport_size({"width": 1920, "height": max(1080, min(int(height) + 40, 8000))})
    page.wait_for_timeout(500)
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size({"width": 1920, "height": 1080})


def test_live_mode_shows_a_run_written_while_the_page_is_open(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    store = tmp_path / "store"
    make_run(store, "first", world_size=1, experiment="live")
    with dashboard_server(store, tmp_path / "server.log") as (url, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})
            page.goto(url)
            settle(page)
            runs = page.locator('[data-testid="stMetricValue"]').first
            assert runs.inner_text() == "1"
            page.get_by_text("Live: follow a store a job is writing").click()
            settle(page)
            make_run(store, "second", world_size=2, experiment="live")  # the job writes on
            # no click, no reload: the page's own timer (every 5 s by default) picks it up
            page.wait_for_function(
                "() => document.querySelector('[data-testid=\"stMetricValue\"]')?.innerText === '2'",
                timeout=30_000,
            )
        finally:
            browser.close()


# What a newcomer saw on the dashboard (issue 34): each in the browser, at a laptop's window.
LAPTOP = {"width": 1280, "height": 800}


@contextmanager
def _page(viewport: dict[str, int] = LAPTOP) -> Iterator[Any]:
    """One headless Chromium page, closed afterwards (one browser at a time)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport=viewport)
        finally:
            browser.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A dashboard started on store A (run a1, 2 ranks) whose sidebar can open B (run b1, 4 ranks)
    and C (runs of 1, 2 and 4 ranks), the three under its --root."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path_factory.mktemp("stores")
    make_run(root / "A", "a1", world_size=2)
    make_run(root / "B", "b1", world_size=4)
    for run_id, n in (("c1", 1), ("c2", 2), ("c4", 4)):
        make_run(root / "C", run_id, world_size=n)
    with dashboard_server(root / "A", root / "server.log", extra=("--root", str(root))) as (url, _):
        yield url


def _open_store(page: Any, name: str, charts: int = 0) -> None:
    """Type a store's name into the sidebar's "Open another store" and wait for the page."""
    box = page.get_by_role("textbox", name="Open another store")
    box.fill(name)
    box.press("Enter")
    settle(page, charts)


def _metric(page: Any, label: str) -> str:
    """The value of the metric whose label is `label` exactly."""
    found = page.locator('[data-testid="stMetric"]').filter(
        has=page.get_by_test_id("stMetricLabel").get_by_text(label, exact=True)
    )
    assert found.count() == 1, (label, page.locator('[data-testid="stMetricLabel"]').all_inner_texts())
    return str(found.get_by_test_id("stMetricValue").inner_text()).strip()


def test_run_selector_shows_the_new_stores_run_after_a_switch(stores: str) -> None:
    with _page() as page:
        page.goto(f"{stores}/run?run=a1")
        settle(page, 1)
        run = page.get_by_role("combobox", name="Run")
        assert run.input_value() == "a1" and _metric(page, "World size") == "2"
        _open_store(page, "B", 1)
        # the selector names the run the page draws: the new store's, not the id it had before
        assert run.input_value() == "b1"
        assert _metric(page, "World size") == "4"  # b1's, not a1's
        assert "a1" not in page.url
        assert "a1" not in page.inner_text('[data-testid="stMain"]')


def test_overview_lists_the_world_sizes(stores: str) -> None:
    with _page() as page:
        page.goto(stores)
        settle(page)
        # one size: said as the size, not as a count of sizes ("World sizes 2")
        assert _metric(page, "World size") == "N = 2"
        assert "World sizes" not in page.inner_text('[data-testid="stMain"]')
        _open_store(page, "C")
        assert _metric(page, "World sizes") == "1, 2, 4"


#: where the legend and the 1/n label of "Last rank to enter the collective" are drawn, and their
#: bounding boxes in the page: [left, top, right, bottom], or null when missing
_LEGEND_AND_LABEL = """() => {
    const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    for (const svg of document.querySelectorAll('.vega-embed svg')) {
        const label = Array.from(svg.querySelectorAll('text'))
            .find((t) => t.textContent.startsWith('even spread 1/n'));
        if (label) {
            const legend = svg.querySelector('.role-legend');
            return [label.textContent, box(label), legend ? box(legend) : null];
        }
    }
    return null;
}"""


def test_stragglers_legend_leaves_the_even_spread_label_clear(stores: str) -> None:
    with _page() as page:
        page.goto(f"{stores}/run?run=a1&run_tab=Stragglers")  # 2 ranks: 1/n = 50%, high in the plot
        settle(page, 2)
        found = page.evaluate(_LEGEND_AND_LABEL)
        assert found is not None, "no 1/n label drawn"
        text, label, legend = found
        assert text == "even spread 1/n = 50%" and legend is not None, found
        apart = (
            label[2] <= legend[0] or legend[2] <= label[0] or label[3] <= legend[1] or legend[3] <= label[1]
        )
        assert apart, f"the legend {legend} covers the label {label}"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A dashboard on one imported pipeline job (2 dp ranks × 3 stages) whose stage 1 is 1.8 times
    as long: its what-if cause is stage-imbalance."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    pytest.importorskip("playwright.sync_api")
    import pyarrow.parquet as pq
    from test_what_if import _cli, synthetic

    root = tmp_path_factory.mktemp("pipeline")
    pq.write_table(synthetic(2, 3, slow={(0, 1): 1.8, (1, 1): 1.8}), root / "ops.parquet")
    res = _cli("import", "op-table", root / "ops.parquet", "--dp", 2, "--pp", 3, "--store", root / "store")
    assert res.returncode == 0, res.stderr
    with dashboard_server(root / "store", root / "server.log") as (url, _):
        yield url


#: every element that holds `cause` in its own text: whether its text's box ends inside each
#: ancestor that clips (a cell or a metric that cuts the words off with "…")
_CUT_OFF = """(cause) => {
    const out = [];
    const main = document.querySelector('[data-testid="stMain"]');
    const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        if (!node.textContent.includes(cause)) continue;
        const range = document.createRange();
        range.selectNodeContents(node);
        const text = range.getBoundingClientRect();
        let cut = false;
        for (let e = node.parentElement; e; e = e.parentElement) {
            const style = getComputedStyle(e);
            if (style.overflowX === 'visible' && style.textOverflow !== 'ellipsis') continue;
            const r = e.getBoundingClientRect();
            if (text.right > r.right + 1 || text.left < r.left - 1) cut = true;
        }
        out.push([node.textContent, cut]);
    }
    return out;
}"""


def test_what_if_cause_is_readable_in_full(pipeline: str) -> None:
    with _page() as page:
        page.goto(f"{pipeline}/run?run_tab=What-if")
        settle(page, 5)
        shown = page.evaluate(_CUT_OFF, "stage-imbalance")
        assert shown, "the cause is not on the page"
        assert not [text for text, cut in shown if cut], shown
        assert "Cause: stage-imbalance." in page.inner_text('[data-testid="stMain"]')


#: each chart's overflow: [its width drawn, the width it has, its right edge, the page's right edge]
_CHART_FIT = """() => {
    const main = document.querySelector('[data-testid="stMainBlockContainer"]').getBoundingClientRect();
    return Array.from(document.querySelectorAll('.vega-embed')).map((e) => {
        const drawn = e.querySelector('svg, canvas').getBoundingClientRect();
        const room = e.parentElement;
        return [Math.max(e.scrollWidth, room.scrollWidth), room.clientWidth, drawn.right, main.right];
    });
}"""


@pytest.mark.parametrize(("tab", "charts"), [("What-if", 5), ("Timeline", 1), ("Steps", 1)])
def test_timeline_charts_fit_the_page(pipeline: str, tab: str, charts: int) -> None:
    with _page() as page:
        page.goto(f"{pipeline}/run?run_tab={tab}")
        settle(page, charts)
        fits = page.evaluate(_CHART_FIT)
        assert len(fits) >= charts, fits
        for i, (width, room, right, page_right) in enumerate(fits):
            assert width <= room + 1 and right <= page_right + 1, (tab, i, fits)
        main = page.get_by_test_id("stMain")
        assert main.evaluate("e => e.scrollWidth <= e.clientWidth"), tab  # nothing scrolls sideways
