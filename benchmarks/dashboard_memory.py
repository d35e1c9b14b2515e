"""The dashboard server's memory with several browser sessions running heavy queries at once (issue 25).

    .venv/bin/python benchmarks/dashboard_memory.py                 # 1, 3 and 6 sessions
    .venv/bin/python benchmarks/dashboard_memory.py --sessions 1 8

Starts `perfscope dashboard` on a copy of the bundled demo-cpu store (a real server on 127.0.0.1),
opens N browser sessions (one Chromium context each, as N users would) on the SQL page, submits the
same query in all of them at once, waits until every page has drawn its answer, and samples the
resident memory of the server's process tree (psutil, every 50 ms) throughout. Prints, per query and
N, the server's peak RSS above its idle RSS, and what each page said (rows shown, or the bound that
stopped it). The queries are the issue's: wide rows (each row 10 KB, a GB in all), and a list that
DuckDB must build in memory. A fresh server per query, so one query's cached memory does not count
for the next.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "dashboard"))  # tests/rooms.py

from browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from test_dashboard_browser import dashboard_server, settle  # noqa: E402
from test_dashboard_sessions import _query  # noqa: E402

from perfscope.store.user_sql import DEFAULT_MEMORY_LIMIT, FETCH_MAX_BYTES, RUNNING_QUERIES  # noqa: E402

DEMO = HERE.parent / "sample_traces" / "demo-cpu"
QUERIES = {
    "wide rows (10 KB x 100k)": "SELECT repeat('x', 10000) AS s FROM range(100000)",
    "a 2e9-element list": "SELECT max(len(s)) AS n FROM (SELECT list(range) AS s FROM range(2000000000))",
}


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


class Peak:
    """The largest RSS of a process tree, sampled on a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.proc))
            time.sleep(0.05)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _outcome(text: str) -> str:
    """A page's answer in a few words: the rows it showed or the bound that stopped it."""
    if m := re.search(r"the first ([\d,]+) rows are shown: (its rows passed \d+ MB)", text):
        return f"{m.group(1)} rows shown ({m.group(2)})"
    if m := re.search(r"more than ([\d,]+) rows", text):
        return f"{m.group(1)} rows shown"
    if m := re.search(r"^[\d,]+ rows?", text):
        return m.group(0)
    for key in ("already running", "time limit", "memory", "Out of Memory"):
        if key.lower() in text.lower():
            said = {"memory": "DuckDB's memory limit", "already running": "refused: 2 already running"}
            return said.get(key, key)
    return text[:60] or "(nothing)"


def measure(sql: str, sessions: int, work: Path, sync_api: Any) -> dict[str, Any]:
    root = work / "store"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(DEMO, root)
    with dashboard_server(root, work / "server.log") as (url, server), sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            size = {"width": 1400, "height": 900}
            pages = [browser.new_context(viewport=size).new_page() for _ in range(sessions)]
            for page in pages:
                page.goto(f"{url}/sql")
                settle(page)
            time.sleep(1.0)
            idle = tree_rss(psutil.Process(server.pid))
            t0 = time.perf_counter()
            with Peak(server.pid) as peak:
                for page in pages:  # all submitted before any is awaited
                    _query(page, sql, wait=False)
                answers = []
                for page in pages:
                    page.wait_for_timeout(300)
                    answers.append(_outcome(_query_text(page)))
                time.sleep(1.0)
            after = tree_rss(psutil.Process(server.pid))
        finally:
            browser.close()
    return {
        "idle": idle,
        "peak": peak.peak,
        "after": after,
        "wall": time.perf_counter() - t0,
        "answers": Counter(answers),
    }


def _query_text(page: Any) -> str:
    settle(page, timeout_s=300)
    main = page.locator('[data-testid="stMain"]')
    errors = main.locator('[data-testid="stAlertContentError"], [data-testid="stAlertContentWarning"]')
    captions = main.locator('[data-testid="stCaptionContainer"]').all_inner_texts()
    text = " ".join([*errors.all_inner_texts(), *captions])
    return str(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 3, 6])
    args = ap.parse_args()
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} is not installed")
    from playwright import sync_api

    gb = 2**30
    print(
        f"bound: {RUNNING_QUERIES} queries at once x (DuckDB {DEFAULT_MEMORY_LIMIT} + "
        f"{FETCH_MAX_BYTES / 2**20:.0f} MB fetched) per server; load {psutil.getloadavg()[0]:.1f}"
    )
    print("| query | sessions | idle RSS | peak RSS | peak above idle | after | wall | pages said |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="dash-mem-") as tmp:
        for name, sql in QUERIES.items():
            for n in args.sessions:
                r = measure(sql, n, Path(tmp), sync_api)
                said = ", ".join(f"{c}x {a}" for a, c in sorted(r["answers"].items()))
                print(
                    f"| {name} | {n} | {r['idle'] / gb:.2f} GB | {r['peak'] / gb:.2f} GB | "
                    f"{(r['peak'] - r['idle']) / gb:.2f} GB | {r['after'] / gb:.2f} GB | "
                    f"{r['wall']:.0f} s | {said} |",
                    flush=True,
                )
    print(f"load after: {psutil.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
