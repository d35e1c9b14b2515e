"""Store text is text (issue 25): names from a store that hold Markdown (an image URL, a Streamlit colour
directive, LaTeX, bold, a backtick) are shown literally by the dashboard in a real browser, which fetches
nothing they name, and the Markdown report escapes them too."""

from __future__ import annotations

import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from storegen import DEFAULT_PHASES, MS, make_run
from test_dashboard_browser import dashboard_server, free_port, settle

from perfscope.report.text import literal, literal_gfm


class _Counter(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def trap() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on 127.0.0.1 that counts the requests it gets."""
    hits: ClassVar[list[str]] = []
    handler = type("Counter", (_Counter,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


def payload(port: int, tag: str) -> str:
    return (
        f"{tag}![i](http://127.0.0.1:{port}/{tag}.png) :red[spoof{tag}] "
        f"$\\href{{http://127.0.0.1:{port}/{tag}-tex}}{{x}}$ **bold{tag}**"
    )


def hostile_study(root: Path, port: int) -> dict[str, str]:
    """Runs at N = 1, 2, 4, 8 whose exposed sync grows (a communication-bound finding that quotes the
    group), every name a payload, runs.model with a backtick that would close a code span."""
    names = {
        "experiment": payload(port, "exp"),
        "cluster": payload(port, "clu"),
        "backend": payload(port, "bac"),
        "device_model": payload(port, "dev"),
    }
    for n in (1, 2, 4, 8):
        make_run(
            root,
            f"run{n}",
            world_size=n,
            model=f"m`![i](http://127.0.0.1:{port}/model.png)`",
            phases={**DEFAULT_PHASES, "sync_exposed": 8 * MS * (n - 1)},
            tags={"note": payload(port, "tag")},
            **names,
        )
    # first in the runs' order (by experiment): Compare's default pair is this run and run1
    make_run(root, "other", experiment="aaa", model="plain`", world_size=1)
    return names


def test_literal_escapes_every_markdown_start() -> None:
    text = "a![i](http://h/x.png) :red[x] $\\href{u}{v}$ **b** `c` <b>&amp; #h\nnext"
    out = literal(text)
    assert "\n" not in out
    # every punctuation character is escaped, so none starts anything; unescaping gives the text back
    assert re.sub(r"\\(.)", r"\1", out) == text.replace("\n", " ")
    assert re.fullmatch(r"(?:\\[!-/:-@\[-`{-~]|[^!-/:-@\[-`{-~])*", out)
    gfm = literal_gfm("1.25 ms ![i](u) $x$ ~~s~~ <b> a|b")
    assert gfm.startswith("1.25 ms ")  # numbers stay readable in a file
    assert "![" not in gfm and "\\$x\\$" in gfm and "\\~\\~" in gfm and "\\<b\\>" in gfm and "a\\|b" in gfm


def _shown(page: Any) -> str:
    return str(page.inner_text("body"))


def test_store_names_are_shown_literally_and_fetch_nothing(
    tmp_path: Path, trap: tuple[int, list[str]]
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    port, hits = trap
    names = hostile_study(tmp_path / "store", port)
    with dashboard_server(tmp_path / "store", tmp_path / "server.log") as (url, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})
            seen: dict[str, str] = {}
            page.goto(url)
            settle(page)
            seen["overview"] = _shown(page)
            page.goto(f"{url}/run?run=run8")
            settle(page)
            seen["run"] = _shown(page)
            page.goto(f"{url}/compare")
            settle(page)
            seen["compare"] = _shown(page)
            page.goto(f"{url}/scaling")
            settle(page)
            seen["scaling"] = _shown(page)
            page.wait_for_timeout(1000)  # an image the page asked for has arrived by now
            spoofed = page.evaluate(
                "() => [...document.querySelectorAll('[data-testid=stMarkdownContainer] strong')]"
                ".map(e => e.textContent).filter(t => t.startsWith('bold'))"
            )
        finally:
            browser.close()
    assert hits == [], f"the dashboard made the browser fetch {hits}"
    assert spoofed == []
    overview = seen["overview"]
    # the findings and their captions quote the group (its label shows "/" as " · "): literally
    assert "Communication-bound" in overview, overview[:3000]
    for tag in ("exp", "clu", "bac"):
        assert (
            f":red[spoof{tag}] $\\href{{http: · 127.0.0.1:{port} · {tag}-tex}}{{x}}$ **bold{tag}**"
            in overview
        )
    assert names["cluster"] in seen["run"] and names["device_model"] in seen["run"], seen["run"][:3000]
    compare = seen["compare"]
    assert "A and B differ in" in compare
    assert f"m`![i](http://127.0.0.1:{port}/model.png)`" in compare, compare[:3000]


def test_markdown_report_escapes_store_names(tmp_path: Path) -> None:
    from perfscope.analysis import Selection
    from perfscope.report import render_report
    from perfscope.store.open import open_store

    hostile_study(tmp_path / "store", 9999)
    with open_store(tmp_path / "store") as store:
        import io
        import zipfile

        text = (
            zipfile.ZipFile(io.BytesIO(render_report(store, Selection(), fmt="md")))
            .read("report.md")
            .decode()
        )
    assert "127.0.0.1:9999" in text  # the names are in it
    # no image of the names' URLs and no math: each `!`, `[` and `$` from a name is escaped
    assert not re.search(r"(?<!\\)!\\?\[i", text.replace("\\!\\[", "")), "an image from a store name"
    assert "\\!\\[i\\](http://127.0.0.1:9999/" in text
    assert not re.search(r"(?<!\\)\$\\*href", text)
