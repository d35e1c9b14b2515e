"""One story in the report and the dashboard: every section says what the findings say, the charts
draw what the analyses measured, and no placeholder (None, -, an empty field) reaches a user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run
from test_charts import _datasets
from test_dashboard_app import clean, open_page

from perfscope.analysis import Selection, run_analysis
from perfscope.charts import CHARTS
from perfscope.explain import explain
from perfscope.report import collect
from perfscope.report.model import Ref, Section, TableBlock
from perfscope.store import open_store


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
        found = [f for top in explain(store, Selection()) for f in top.flatten() if f.rule == "straggler"]
    assert not flagged  # no rank is last most of the time ...
    assert len(found) == 1 and "load balance" in found[0].title  # ... yet the rule fires on balance
    section, got = _section(tmp_path, "stragglers")
    text = _words(section)
    assert found[0].title in text and found[0].text in text
    assert "No rank" not in text
    # the link goes to the finding that says it
    rank = next(f.rank for f in got.report.findings if f.title == found[0].title)
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
    assert [w.value for w in at.warning] == [f"**{found[0].title}.** {found[0].text}"]
    assert not any("No straggler finding" in c.value for c in at.caption)
