"""One story in the report and the dashboard: every section says what the findings say, the charts
draw what the analyses measured, and no placeholder (None, -, an empty field) reaches a user."""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run
from test_charts import _datasets
from test_dashboard_app import clean, open_page

from perfscope.analysis import Selection, run_analysis
from perfscope.charts import CHARTS
from perfscope.charts.rows import group_label_map
from perfscope.cli import main
from perfscope.explain import explain
from perfscope.report import collect
from perfscope.report.model import ChartBlock, Ref, Section, TableBlock
from perfscope.report.text import literal
from perfscope.store.open import open_store


def _plain_ddp(root: Path, run_id: str = "ddp-n2", **kw: Any) -> None:
    """A plain 2-rank DDP run on CPU: its buckets' comm rows carry no exposed time (DDP overlaps
    them with backward); the step's exposed sync is in `steps.sync_exposed_ns`, 40 of 73 ms."""
    spec: dict[str, Any] = dict(
        world_size=2,
        experiment="default",
        backend="gloo",
        model="Sequential",
        device=False,
        device_model="cpu",
        phases={
            "data": 1 * MS,
            "forward": 10 * MS,
            "backward": 20 * MS,
            "sync_exposed": 40 * MS,
            "optimizer": 1 * MS,
            "other": 1 * MS,
        },
        comm=Comm([2**24, 2**22], lambda nb: 30 * MS),
    )
    spec.update(kw)
    make_run(root, run_id, **spec)


# ---- 2: the roles chart shows the exposed sync the analysis measured -------------------------------


def test_plain_ddp_collective_wait_is_the_exposed_sync(tmp_path: Path) -> None:
    _plain_ddp(tmp_path)
    with open_store(tmp_path) as store:
        roles = run_analysis("comm_by_role", store, Selection()).to_pylist()
        ranks = {r["rank"]: r for r in run_analysis("rank_breakdown", store, Selection()).to_pylist()}
    assert len(roles) == 2
    for r in roles:
        exposed = ranks[r["rank"]]["sync_exposed_ns"]
        assert exposed == pytest.approx(40 * MS, rel=1e-6)
        assert r["collective_wait_ns"] == pytest.approx(exposed, rel=1e-6)
        assert r["p2p_wait_ns"] == pytest.approx(0.0, abs=1.0)
    chart = CHARTS["comm_roles"].build({"comm_by_role": run_analysis_table(tmp_path, "comm_by_role")})
    drawn = {(d["rank"], d["part"]): d["ms"] for d in _datasets(chart)}
    for rank in (0, 1):
        label = next(k for k in drawn if k[0].startswith(f"rank {rank} ") and k[1] == "collective wait")
        assert drawn[label] == pytest.approx(40.0, rel=1e-6)


def run_analysis_table(root: Path, name: str) -> Any:
    with open_store(root) as store:
        return run_analysis(name, store, Selection())


# ---- 1: the Stragglers section says what the straggler finding says --------------------------------


def _unbalanced(root: Path) -> None:
    """Rank 1 spends 10 ms in its optimizer against rank 0's 1 ms: after the collective, so neither
    enters it last more often (a load balance of 35.5/40 = 0.89, no rank last)."""
    _plain_ddp(
        root,
        "lb-n2",
        phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS},
        phase_fn=lambda rank, step: {"optimizer": (1 if rank == 0 else 10) * MS},
        comm=Comm([2**24], lambda nb: 2 * MS),
    )


def _words(section: Section) -> str:
    """A section's running text (paragraphs; links by their text)."""
    out = []
    for b in section.blocks:
        if isinstance(b, list):
            out.append(
                "".join(p if isinstance(p, str) else p.text if isinstance(p, Ref) else p.text() for p in b)
            )
    return "\n".join(out)


def _section(root: Path, sid: str) -> tuple[Section, Any]:
    with open_store(root) as store:
        got = collect(store)
    return next(s for s in got.report.sections if s.id == sid), got


def test_stragglers_section_says_the_load_balance_finding(tmp_path: Path) -> None:
    _unbalanced(tmp_path)
    with open_store(tmp_path) as store:
        flagged = [r for r in run_analysis("stragglers", store, Selection()).to_pylist() if r["is_straggler"]]
        tops = explain(store, Selection())
        found = [f for top in tops for f in top.flatten() if f.rule == "straggler"]
    assert not flagged  # no rank is last most of the time ...
    # ... yet the rule fires on balance, and names the rank whose own work is longer, with its phase
    assert len(found) == 1 and "load balance" in found[0].text and "rank 1" in found[0].title
    section, _ = _section(tmp_path, "stragglers")
    text = _words(section)
    assert found[0].title in text and found[0].text in text
    assert "No rank" not in text
    # the link goes to the finding that says it: itself, or the cause it is a symptom of (here the
    # what-if's slow worker, rank 1 in its optimizer)
    rank = 1 + next(k for k, top in enumerate(tops) if found[0] in top.flatten())
    refs = [p for b in section.blocks if isinstance(b, list) for p in b if isinstance(p, Ref)]
    assert [r.anchor for r in refs] == [f"finding-{rank}"]
    tables = [b for b in section.blocks if isinstance(b, TableBlock)]
    assert {r["run_id"] for t in tables for r in t.rows} == {"lb-n2"}


def test_stragglers_section_without_a_finding_says_none(tmp_path: Path) -> None:
    _plain_ddp(tmp_path)  # both ranks alike
    with open_store(tmp_path) as store:
        assert not [f for top in explain(store, Selection()) for f in top.flatten() if f.rule == "straggler"]
    section, _ = _section(tmp_path, "stragglers")
    text = _words(section)
    assert "No rank holds the others back" in text
    assert "Straggler in run" not in text


def test_dashboard_stragglers_tab_says_the_finding(tmp_path: Path) -> None:
    _unbalanced(tmp_path)
    at = clean(open_page(tmp_path, "run", run="lb-n2", run_tab="Stragglers"))
    with open_store(tmp_path) as store:
        found = [f for top in explain(store, Selection()) for f in top.flatten() if f.rule == "straggler"]
    # store text is shown literally (escaped for Markdown: issue 25)
    assert [w.value for w in at.warning] == [f"**{literal(found[0].title)}.** {literal(found[0].text)}"]
    assert not any("No straggler finding" in c.value for c in at.caption)


# ---- 3: an unknown value is left out or said in words, never printed as None, '-' or a gap ----------

#: what a placeholder looks like in running text, a table cell aside ('–' is a table's empty cell)
PLACEHOLDERS = (
    re.compile(r"\bNone\b"),
    re.compile(r"(^|·)\s*-\s*(·|$)", re.M),  # a '-' field between separators
    re.compile(r"·\s*·|·\s*$|^\s*·", re.M),  # an empty field between separators
    re.compile(r"\b(weak|strong|single):[bg]-"),  # a group's unknown batch
    re.compile(r"/-/"),  # a raw group id with an unknown field
    re.compile(r"\*\*–\*\*"),  # a number in a sentence that has no value
    re.compile(r"\bb(None|-)\b"),
)


def _unknowns(root: Path) -> None:
    """Zero-code recording as it often is: no cluster, no batch size, experiment 'default'."""
    for n in (1, 2):
        _plain_ddp(
            root,
            f"nobatch-n{n}",
            world_size=n,
            cluster="",
            batch_size_per_rank=None,
            comm=Comm([2**24], lambda nb: 2 * MS) if n > 1 else None,
        )


def _placeholders(text: str) -> list[str]:
    return [m.group(0) for p in PLACEHOLDERS for line in text.splitlines() for m in p.finditer(line)]


def test_report_prints_no_placeholder(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _unknowns(store)
    out = tmp_path / "r.md"
    assert main(["report", str(store), "-o", str(out), "--format", "md"]) == 0
    text = out.read_text()
    # running text, table cells and headings; a table's empty cell is '–', never 'None' or '-'
    assert not _placeholders(text), sorted(set(_placeholders(text)))
    assert "default · gloo · Sequential · weak" in text  # the group, by its known parts
    assert "speedup is unknown" in text  # no samples: said in words, not as a dash
    with open_store(store) as s:
        quality = run_analysis("quality", s, Selection()).column("message").to_pylist()
    assert quality and not _placeholders("\n".join(quality))


def test_two_groups_apart_by_an_unknown_value_say_it_in_words() -> None:
    labels = group_label_map(["e/-/gloo/m/weak:b-", "e/c1/gloo/m/weak:b32"])
    assert labels == {
        "e/-/gloo/m/weak:b-": "no cluster · weak, no batch size",
        "e/c1/gloo/m/weak:b32": "c1 · weak:b32",
    }
    assert group_label_map(["default/-/gloo/Sequential/single:b-"]) == {
        "default/-/gloo/Sequential/single:b-": "default · gloo · Sequential · single"
    }


def test_dashboard_run_caption_prints_no_placeholder(tmp_path: Path) -> None:
    _unknowns(tmp_path)
    at = clean(open_page(tmp_path, "run", run="nobatch-n2"))
    captions = [c.value for c in at.caption]
    line = next(c for c in captions if c.startswith("2 ranks on 1 node"))
    assert line == "2 ranks on 1 node · gloo · cpu · batch size not recorded · experiment default"
    overview = clean(open_page(tmp_path, "overview"))
    # the tables' text cells (a missing value is drawn as the table's empty-cell mark) and captions
    cells = [v for df in overview.dataframe for v in df.value.to_numpy().ravel() if isinstance(v, str)]
    assert cells and "" not in cells
    shown = "\n".join(cells + [c.value for c in overview.caption])
    assert not _placeholders(shown), sorted(set(_placeholders(shown)))
    assert "default · gloo · Sequential · weak" in cells  # the glance table names the group


# ---- 7: `perfscope sql --format csv` quotes a field only where it must -------------------------------

CSV_QUERY = (
    "SELECT run_id, experiment, cluster, 'a,b' AS comma, 'say \"hi\"' AS quote, "
    "'two' || chr(10) || 'lines' AS lines, NULL AS nothing, world_size FROM runs ORDER BY run_id"
)


def test_sql_csv_quotes_like_duckdb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    _unknowns(store)  # cluster '' (an empty string, not NULL)
    assert main(["sql", str(store), CSV_QUERY, "--format", "csv"]) == 0
    got = capsys.readouterr().out
    # DuckDB's own CSV of the same rows is the reference (psql and Python's csv quote the same way)
    with open_store(store) as s:
        rows = s.query(CSV_QUERY).to_pylist()
    ref = tmp_path / "duck.csv"
    con = duckdb.connect()
    con.register("t", pa.Table.from_pylist(rows))
    con.execute(f"COPY (SELECT * FROM t) TO '{ref}' (FORMAT csv, HEADER)")
    con.close()
    assert got == ref.read_text()
    assert got.splitlines()[0] == "run_id,experiment,cluster,comma,quote,lines,nothing,world_size"
    assert got.splitlines()[1].startswith('nobatch-n1,default,"","a,b","say ""hi""","two')
    assert next(csv.DictReader(io.StringIO(got)))["lines"] == "two\nlines"


# ---- 8: no DuckDB "extra copy" warning on the user's console or in a recorded job's stderr ------------

#: Arrow output of a DB-API result (con.execute(...)); DuckDB 2 warns "Arrow output on a DB-API result
#: makes an extra copy of the rows" for each, where a relation's (con.sql(...)) does not
DBAPI_ARROW = {"to_arrow_table", "to_arrow_reader", "fetch_arrow_table", "fetch_record_batch", "arrow"}
SOURCES = [
    p
    for top in ("perfscope", "collectors", "dashboard")
    for p in sorted((Path(__file__).resolve().parents[2] / top).rglob("*.py"))
]


def test_no_arrow_output_of_a_dbapi_result() -> None:
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in DBAPI_ARROW
                and isinstance(node.func.value, ast.Call)
                and isinstance(node.func.value.func, ast.Attribute)
                and node.func.value.func.attr == "execute"
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert SOURCES and not found


def test_cli_stderr_is_clean(tmp_path: Path) -> None:
    """`perfscope sql`, `report --tables csv` and `compact` with every warning an error: nothing on
    stderr (with DuckDB 2 the DB-API Arrow calls printed a warning there)."""
    store = tmp_path / "store"
    _unknowns(store)
    cli = [sys.executable, "-W", "error", "-m", "perfscope"]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    for args in (
        ["sql", str(store), "SELECT run_id, started_ns, 'x' AS s FROM runs", "--format", "csv"],
        ["sql", str(store), "SELECT * FROM steps LIMIT 3", "--format", "json"],
        ["compact", str(store)],
    ):
        done = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=240)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)


# ---- 5: "Communication by op" shows the run the findings are about, and says so ------------------------


def test_communication_section_shows_the_findings_run(tmp_path: Path) -> None:
    _plain_ddp(tmp_path, "a-calm-n2", experiment="a", phases={**DEFAULT_PHASES, "sync_exposed": 1 * MS})
    # experiment b: rank 3 of 4 computes 12 ms more and enters every collective last
    _plain_ddp(
        tmp_path,
        "b-slow-n4",
        experiment="b",
        world_size=4,
        phases={**DEFAULT_PHASES, "sync_exposed": 1 * MS},
        phase_fn=lambda rank, step: {"forward": (22 if rank == 3 else 10) * MS},
        comm=Comm([2**24], lambda nb: 2 * MS),
    )
    section, got = _section(tmp_path, "communication")
    first = got.report.findings[0]
    assert "b-slow-n4" in first.run_ids and "a-calm-n2" not in first.run_ids
    figures = [b for b in section.blocks if isinstance(b, ChartBlock)]
    assert [f.name for f in figures] == ["comm_ops", "comm_roles"]
    for f in figures:
        assert f"run b-slow-n4, the run finding {first.rank} is about (N = 4)" in f.caption
        spec = json.dumps(f.chart.to_dict())
        assert "b-slow-n4" in spec and "a-calm-n2" not in spec


def test_dashboard_compare_says_an_unrecorded_setting_in_words(tmp_path: Path) -> None:
    _unknowns(tmp_path)
    _plain_ddp(tmp_path, "batch32-n2", cluster="", batch_size_per_rank=32)
    at = clean(open_page(tmp_path, "compare"))
    at.selectbox(key="compare_a").set_value("nobatch-n2")
    at.selectbox(key="compare_b").set_value("batch32-n2")
    at = clean(at.run())
    said = [m.value for m in at.markdown if m.value.startswith("**A and B differ in**")]
    assert said and literal("batch_size_per_rank: not recorded → 32") in said[0]
    assert not _placeholders(said[0])
