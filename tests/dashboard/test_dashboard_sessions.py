"""Two browser sessions on one `perfscope dashboard` server (issue 10, items 1, 2 and 5): one runs every
write attempt, a query reading a valid segment as CSV, a 150 M-row query and a query that would run for
minutes; the other's numbers stay the same, and its query is answered while the slow one still runs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from test_dashboard_browser import dashboard_server, settle

pytestmark = pytest.mark.browser

DEMO = Path(__file__).resolve().parents[2] / "sample_traces" / "demo-cpu"

WRITES = [
    "EXPLAIN ANALYZE COPY (SELECT 1 AS a, 1 AS b) TO '{root}/spans' "
    "(FORMAT parquet, PARTITION_BY (b), OVERWRITE)",
    "EXPLAIN ANALYZE CREATE OR REPLACE VIEW steps AS SELECT 1 AS x",
    "CREATE OR REPLACE VIEW steps AS SELECT 1 AS x",
    "COPY steps TO '{root}/steps/x.parquet'",
    "ATTACH '{root}/x.db' AS x",
    "SET memory_limit = '100TB'",
]
#: a query that would run for minutes: the page's time limit stops it
SLOW = "SELECT sum(a * b) AS s FROM range(100000000000) t(a), range(1000) u(b)"


def _query(page: Any, sql: str, *, wait: bool = True) -> str:
    """Run `sql` on the SQL page; the text of the result's caption or error once drawn."""
    page.get_by_label("Query").fill(sql)
    page.get_by_role("button", name="Run query").click()
    if not wait:
        return ""
    page.wait_for_timeout(300)  # the rerun starts a moment after the click
    settle(page)
    main = page.locator('[data-testid="stMain"]')
    errors = main.locator('[data-testid="stAlertContentError"]')
    if errors.count():
        return str(errors.first.inner_text())
    captions = main.locator('[data-testid="stCaptionContainer"]').all_inner_texts()
    return next((c for c in captions if re.search(r"row", c)), "")


def _running(page: Any) -> bool:
    state = page.evaluate("() => document.querySelector('.stApp')?.getAttribute('data-test-script-state')")
    return state == "running"


def test_one_session_cannot_change_or_stall_another(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    root = tmp_path / "store"
    shutil.copytree(DEMO, root)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))
    segment = next(root.glob("steps/run_id=*/*.parquet"))
    with dashboard_server(root, tmp_path / "server.log") as (url, _), sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # two contexts: two browser sessions, as two users would have
            mine = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
            theirs = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
            for page in (mine, theirs):
                page.goto(f"{url}/sql")
                settle(page)
            counts = {t: _query(theirs, f"SELECT * FROM {t}") for t in ("steps", "spans", "runs")}
            assert counts["steps"] == "840 rows" and counts["spans"] == "3,360 rows", counts

            for sql in WRITES:
                assert "only reading queries" in _query(mine, sql.format(root=root)), sql
            assert re.search(
                "query failed|only the store's tables", _query(mine, f"SELECT * FROM read_csv('{segment}')")
            )
            assert "the first 10,000 are shown" in _query(mine, "SELECT * FROM range(150000000)")

            # a query that would run for minutes in one session; the other is answered meanwhile
            _query(mine, SLOW, wait=False)
            mine.wait_for_function(
                "() => document.querySelector('.stApp')?.getAttribute('data-test-script-state') === 'running'"
            )
            assert {t: _query(theirs, f"SELECT * FROM {t}") for t in counts} == counts
            assert _running(mine), "the slow query should still be running when the other session is answered"
            settle(mine, timeout_s=120)
            assert "time limit of 30 s" in mine.locator('[data-testid="stMain"]').inner_text()

            # a new session sees the same store too
            fresh = browser.new_context().new_page()
            fresh.goto(f"{url}/sql")
            settle(fresh)
            assert {t: _query(fresh, f"SELECT * FROM {t}") for t in counts} == counts
            for page in (mine, theirs, fresh):
                assert page.locator('[data-testid="stException"]').count() == 0
        finally:
            browser.close()
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet")) == files
    log = (tmp_path / "server.log").read_text()
    assert not re.search(r"Traceback|Uncaught app exception", log), log[-3000:]
