"""What rules read: the analyses of one store and selection, as small lists of rows, computed once."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..analysis import Selection, run_analysis
from ..store.reader import Store

Row = dict[str, Any]


class Context:
    def __init__(self, store: Store, sel: Selection) -> None:
        self.store = store
        self.sel = sel
        self._tables: dict[str, list[Row]] = {}

    def rows(self, analysis: str) -> list[Row]:
        if analysis not in self._tables:
            self._tables[analysis] = run_analysis(analysis, self.store, self.sel).to_pylist()
        return self._tables[analysis]

    def by_run(self, analysis: str) -> dict[str, Row]:
        return {r["run_id"]: r for r in self.rows(analysis)}

    def scaling_groups(self) -> dict[str, list[Row]]:
        """group_id -> its scaling rows sorted by world size; only real series (several N, not mixed)."""
        out: dict[str, list[Row]] = defaultdict(list)
        for r in self.rows("scaling"):
            if r["scaling_mode"] != "single" and not r["mixed"]:
                out[r["group_id"]].append(r)
        for rows in out.values():
            rows.sort(key=lambda r: (r["world_size"], r["run_id"]))
        return dict(out)

    def source_of(self, run_ids: list[str] | tuple[str, ...]) -> str:
        runs = self.by_run("run_summary")
        sources = {runs[r]["source"] for r in run_ids if r in runs}
        return "simulated" if sources == {"simulated"} else "mixed" if len(sources) > 1 else "measured"


def largest(rows: list[Row]) -> Row:
    """The row at the largest world size (the first run there)."""
    top = max(r["world_size"] for r in rows)
    return next(r for r in rows if r["world_size"] == top)


def baseline(rows: list[Row]) -> Row:
    n0 = min(r["world_size"] for r in rows)
    return next(r for r in rows if r["world_size"] == n0)


def node_boundary(rows: list[Row]) -> tuple[Row, Row] | None:
    """(one-node run, multi-node run) of a series that crosses a node boundary: at equal N when the
    series ran one N both on one node and across nodes (a placement comparison, the cleanest
    evidence), else the largest one-node run and the smallest multi-node run."""
    inside = [r for r in rows if (r["nodes"] or 1) <= 1]
    outside = [r for r in rows if (r["nodes"] or 1) > 1]
    if not inside or not outside:
        return None
    both = sorted({r["world_size"] for r in inside} & {r["world_size"] for r in outside})
    if both:
        n = both[0]
        return (
            next(r for r in inside if r["world_size"] == n),
            min((r for r in outside if r["world_size"] == n), key=lambda r: r["nodes"]),
        )
    n_in = max(r["world_size"] for r in inside)
    n_out = min(r["world_size"] for r in outside)
    return (
        next(r for r in inside if r["world_size"] == n_in),
        next(r for r in outside if r["world_size"] == n_out),
    )


def lost_share(row: Row, *phases: str) -> float | None:
    """Share of a run's lost time that these phases account for (None when nothing was lost)."""
    lost = row.get("lost_ns")
    if lost is None or lost <= 0:
        return None
    part = sum(row.get(f"lost_{p}_ns") or 0.0 for p in phases)
    return max(0.0, min(1.0, part / lost))
