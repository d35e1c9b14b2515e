"""One story in the report and the dashboard: every section says what the findings say, the charts
draw what the analyses measured, and no placeholder (None, -, an empty field) reaches a user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from storegen import MS, Comm, make_run
from test_charts import _datasets

from perfscope.analysis import Selection, run_analysis
from perfscope.charts import CHARTS
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
