"""Downloads on a team server (issue 25): the SQL page's CSV of a larger result is the result (the
download's rerun used to interrupt it on the shared connection: a file holding only 'perfscope: query
failed: INTERRUPT Error: Interrupted!'), and a report that cannot be made says so in the page."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from storegen import make_run
from test_dashboard_browser import dashboard_server, settle
from test_dashboard_sessions import _query

#: 3.2 M rows, past the 10,000 the page shows, sorted before the first row comes: the page's rerun
#: and the download each run it for seconds, so the two overlap
BIG = (
    "SELECT s.run_id, s.step, s.rank, r.range AS k FROM steps s, range(8000) r "
    "ORDER BY k DESC, s.step, s.rank"
)


@pytest.mark.browser
def test_csv_download_of_a_larger_result_is_the_result(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    make_run(tmp_path / "store", "r1", world_size=4, steps=100)  # 400 step rows
    with dashboard_server(tmp_path / "store", tmp_path / "server.log") as (url, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000}, accept_downloads=True)
            page.goto(f"{url}/sql")
            settle(page)
            assert "the first 10,000 are shown" in _query(page, BIG)
            with page.expect_download(timeout=300_000) as got:
                page.get_by_role("button", name="Download up to 1,000,000 rows (CSV)").click()
            saved = tmp_path / "result.csv"
            got.value.save_as(saved)
            page.wait_for_timeout(500)
            settle(page)
            assert page.locator('[data-testid="stException"]').count() == 0
            # the page's own result stands: nothing stopped its query either
            assert page.locator('[data-testid="stMain"] [data-testid="stAlertContentError"]').count() == 0
        finally:
            browser.close()
    with open(saved, newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == ["run_id", "step", "rank", "k"], saved.read_text()[:300]
        first = next(reader)
        n = 1 + sum(1 for _ in reader)
    assert first == ["r1", "0", "0", "7999"]
    assert n == 1_000_000  # the download's row bound (DOWNLOAD_ROWS); the result has 3.2 M


def _app(store: str) -> None:
    from perfscope.dashboard.app import main

    main(store=store)


def test_a_report_whose_store_went_away_says_so(tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    store = tmp_path / "store"
    make_run(store, "r1", world_size=2)
    make_run(store, "r2", world_size=4)
    at = AppTest.from_function(_app, args=(str(store),), default_timeout=120).run()
    assert not at.exception and not at.error
    shutil.rmtree(store)  # the store disappears between the page and the report
    at.sidebar.button(key="make_report").click().run()
    assert not at.exception, [e.message for e in at.exception]
    errors = [e.value for e in at.sidebar.error]
    assert len(errors) == 1 and errors[0].startswith("The report could not be made:"), errors
    assert "\n" not in errors[0]
    assert at.sidebar.get("download_button") == []  # no file that is not the report
