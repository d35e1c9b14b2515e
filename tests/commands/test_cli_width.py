"""CLI output fits the terminal (COLUMNS or the terminal's width), --json does not change with it, and
counts read as words ('1 run', '2 runs'; a run's rewritten row counted once)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from storegen import make_run

from perfscope import sample_traces
from perfscope.cli import main
from perfscope.terminal import format_rows, terminal_width
from perfscope.words import counted, plural

BUNDLED = sample_traces.bundled()
needs_bundled = pytest.mark.skipif(
    not {"demo-cpu", "seed-study"} <= set(BUNDLED),
    reason="the bundled sample traces are not in this checkout",
)


def _too_wide(text: str, width: int) -> list[str]:
    """Lines longer than `width`, leaving out one that is a single word that cannot break (a path)."""
    return [line for line in text.splitlines() if len(line) > width and len(line.split()) > 1]


def _same(a: Any, b: Any) -> bool:
    """Equal JSON, floats within 1e-9 (DuckDB's parallel sums differ in the last bits run to run)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _out(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("width") / "store"
    for n in (1, 2, 4):
        make_run(root, f"a-rather-long-run-name-so-that-tables-are-wide-n{n}", world_size=n, experiment="w")
    return root


def test_counts_read_as_words() -> None:
    assert [counted(n, "run") for n in (0, 1, 2)] == ["0 runs", "1 run", "2 runs"]
    assert counted(12_000, "row") == "12,000 rows"
    assert counted(3, "world size") == "3 world sizes"
    assert plural("analysis", 2) == "analyses" and plural("category", 2) == "categories"
    assert plural("is", 1) == "is" and plural("is", 3) == "are"
    assert counted(4, "micro-batch") == "4 micro-batches" and plural("pass", 2) == "passes"


def test_terminal_width_follows_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "93")
    assert terminal_width() == 93
    monkeypatch.setenv("COLUMNS", "5")  # nonsense is taken as the narrowest width we fit
    assert terminal_width() == 40
    monkeypatch.delenv("COLUMNS")
    assert terminal_width() is None  # pytest captures stdout: a pipe, nothing to fit


def test_a_wide_table_is_cut_and_split_into_panels_that_keep_every_value() -> None:
    header = ["run", *[f"column {i}" for i in range(8)]]
    rows = [[f"sim-experiment-cluster-backend-n{n:03d}-b75-s2022", *range(n, n + 8)] for n in (1, 12)]
    whole = format_rows(header, rows)
    assert len(whole.splitlines()) == 4 and max(map(len, whole.splitlines())) > 80
    fitted = format_rows(header, rows, width=80)
    assert not _too_wide(fitted, 80)
    panels = fitted.split("\n\n")
    assert len(panels) >= 2
    for panel in panels:  # every panel names its rows, cut in the middle so both ends show
        lines = panel.splitlines()
        assert lines[0].startswith("run ")
        assert "…" in lines[2] and lines[2].split()[0].endswith("n001-b75-s2022")
    for name in header[1:]:
        assert sum(name in p.splitlines()[0] for p in panels) == 1
    assert "19" in fitted.splitlines()[-1]  # the last value of the last row is still there


@pytest.mark.parametrize("columns", [80, 200])
def test_analyze_info_and_sql_fit_the_terminal(
    columns: int, small: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    for argv in (
        ["analyze", str(small)],
        ["info", str(small)],
        ["sql", str(small), "SELECT r.*, 'x' AS a_long_column_name_here FROM runs r"],
    ):
        out = _out(argv, capsys)
        assert not _too_wide(out, columns), (argv, _too_wide(out, columns))
    assert "a-rather-long" in out and "-wide-n4" in out  # a run id is cut in the middle, never away


@needs_bundled
@pytest.mark.parametrize("columns", [80, 200])
def test_the_seed_study_fits_80_and_200_columns_and_json_does_not_change(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(BUNDLED["seed-study"])
    monkeypatch.setenv("COLUMNS", str(columns))
    out = _out(["analyze", store], capsys)
    assert not _too_wide(out, columns), _too_wide(out, columns)
    assert "selection: (everything)" in out
    if columns == 200:  # wide enough for the runs table whole: one panel, nothing cut
        runs = out.split("\n\n")[1]
        assert "…" not in runs and "samples/s" in runs.splitlines()[1]
    as_json = json.loads(_out(["analyze", store, "--json"], capsys))
    monkeypatch.delenv("COLUMNS")
    assert _same(json.loads(_out(["analyze", store, "--json"], capsys)), as_json)


@needs_bundled
def test_info_counts_each_run_once(capsys: pytest.CaptureFixture[str]) -> None:
    store = str(BUNDLED["demo-cpu"])  # each run's row is written at its start and again at its end
    info = json.loads(_out(["info", store, "--json"], capsys))
    assert info["rows"]["runs"] == len(info["runs"]) == 6
    out = _out(["info", store], capsys)
    assert "rows: runs 6," in out
