"""Issue 22: no analysis prints a negative duration. Phases recorded overlapping (their sum past the
step, as a hand-placed timer or an imported trace can give) once made `other` negative in the run
summary, the scaling table and the per-rank breakdown; it is the rest of the step, at least zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from storegen import MS, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.cli import main
from perfscope.store.open import open_store

#: phases adding up to 34 ms of a 28 ms step
OVERLAPPING = {"data": 1 * MS, "forward": 10 * MS, "backward": 20 * MS, "sync_exposed": 2 * MS,
               "optimizer": 1 * MS, "other": -6 * MS}  # fmt: skip


def _durations(x: object, where: str = "") -> list[tuple[str, float]]:
    """Every number under a key that names a duration (`..._ns`), but differences (lost time)."""
    if isinstance(x, dict):
        return [d for k, v in x.items() for d in _durations(v, f"{where}.{k}")]
    if isinstance(x, list):
        return [d for i, v in enumerate(x) for d in _durations(v, f"{where}[{i}]")]
    key = where.rsplit(".", 1)[-1]
    if isinstance(x, int | float) and not isinstance(x, bool) and key.endswith("_ns") and "lost" not in key:
        return [(where, float(x))]
    return []


def test_overlapping_phases_never_make_a_negative_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "s"
    for n in (1, 2, 4):
        make_run(root, f"n{n}", world_size=n, steps=40, phases=OVERLAPPING)
    capsys.readouterr()
    assert main(["analyze", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    found = _durations(out)
    assert any(w.endswith(".other_ns") for w, _ in found)  # the check looks where it went wrong
    assert [d for d in found if d[1] < 0] == []
    with open_store(root) as store:
        for name in ("run_summary", "rank_breakdown"):
            rows = run_analysis(name, store, Selection()).to_pylist()
            assert rows and all(r["other_ns"] is not None and r["other_ns"] >= 0 for r in rows), name
