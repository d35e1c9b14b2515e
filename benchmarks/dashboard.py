"""Page load times of the dashboard in headless Chromium: the bundled sample traces and a 10M-row store.

    .venv/bin/python benchmarks/dashboard.py                      # sample traces and 1e7 step rows
    .venv/bin/python benchmarks/dashboard.py --rows 1e6 --keep --dir /tmp/bench
    .venv/bin/python benchmarks/dashboard.py --sample-only        # the sample traces alone

For each store it starts `perfscope dashboard STORE` (a real server on 127.0.0.1) and measures, in
Debian's headless Chromium: server start until it answers; server start until the Scaling page has
drawn its charts (the first visit computes the analyses); then every page reached through the
navigation, first visit (cold: analyses computed) and second visit (warm: Streamlit's caches); then
the Run page of the run with the most ranks, loaded by URL, and each of its tabs in turn.
A page counts as drawn when its script has finished, nothing on it is stale or a placeholder, its
charts are on screen and nothing changed for 0.5 s (that quiet time is part of every figure).
The large store comes from benchmarks/analysis.py's generator (steps only: no collectives, GPU or
host samples) and is deleted afterwards unless --keep is given. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "dashboard"))  # tests/rooms.py

from browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from test_dashboard_browser import dashboard_server, settle  # noqa: E402

from perfscope import sample_traces  # noqa: E402
from perfscope.analysis import Selection, run_analysis  # noqa: E402
from perfscope.store.open import open_store  # noqa: E402

#: navigation label, charts the page draws on these stores (at least)
PAGES = (("Overview", 0), ("Scaling", 3), ("Run", 1), ("Batch size", 0), ("Compare", 1), ("SQL", 0))
#: the Run page's tabs after the one it opens on (Steps), then Steps again, with the charts each draws
#: at least: the large store has no collectives, GPU or host samples, and the what-if needs a layout
RUN_TABS = (
    ("Phases", 1),
    ("Stragglers", 1),
    ("Communication", 1),
    ("Telemetry", 1),
    ("Timeline", 1),
    ("What-if", 0),
    ("Steps", 1),
)


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_analysis", HERE / "analysis.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _largest_run(store: Path) -> str:
    with open_store(store) as s:
        runs = run_analysis("run_summary", s, Selection()).to_pylist()
    return str(max(runs, key=lambda r: (r["world_size"], r["run_id"]))["run_id"])


def measure(store: Path, log: Path) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    with dashboard_server(store, log) as (url, _), sync_playwright() as p:
        out["server answers"] = time.perf_counter() - t0
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})
            page.goto(f"{url}/scaling")
            settle(page, 3, timeout_s=600)
            out["server start to Scaling charts drawn"] = time.perf_counter() - t0
            for visit in ("cold", "warm"):
                for label, charts in PAGES:
                    t = time.perf_counter()
                    page.get_by_role("link", name=label, exact=True).first.click()
                    settle(page, charts, timeout_s=600)
                    out[f"{label} ({visit})"] = time.perf_counter() - t
            # the heaviest page: the run with the most ranks, opened by URL (a full page load)
            t = time.perf_counter()
            page.goto(f"{url}/run?run={_largest_run(store)}")
            settle(page, 1, timeout_s=600)
            out["Run page of the largest run, by URL"] = time.perf_counter() - t
            for tab, charts in RUN_TABS:
                t = time.perf_counter()
                page.get_by_role("tab", name=tab, exact=True).click()
                settle(page, charts, timeout_s=600)
                out[f"  its {tab} tab"] = time.perf_counter() - t
        finally:
            browser.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=float, default=1e7, help="step rows of the large store (default 1e7)")
    p.add_argument("--dir", default="/tmp/perfscope-bench-dashboard", help="where the large store is written")
    p.add_argument("--keep", action="store_true", help="keep the generated store")
    p.add_argument("--sample-only", action="store_true", help="the sample traces alone, no large store")
    args = p.parse_args(argv)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    large = base / f"rows_{int(args.rows)}"
    columns: dict[str, dict[str, float]] = {}
    try:
        columns["sample traces (seed-study)"] = measure(sample_traces.path(), base / "sample.log")
        if not args.sample_only:
            if not (large / "runs").is_dir():
                t = time.perf_counter()
                rows = _generator().generate(large, int(args.rows))
                print(f"generated {rows:,} step rows in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            columns[f"{args.rows:.0e} step rows"] = measure(large, base / "large.log")
    finally:
        if not args.keep:
            shutil.rmtree(large, ignore_errors=True)
    names = list(columns)
    print(
        f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}, chromium {CHROMIUM} (headless, no GPU)\n"
    )
    print("| seconds | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for key in columns[names[0]]:
        print(f"| {key} | " + " | ".join(f"{columns[n].get(key, float('nan')):.1f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
