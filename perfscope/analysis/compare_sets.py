"""Two sets of runs compared world size by world size: did a change make scaling worse?

A set is an experiment (the `runs` table's `experiment`) or a scaling group (groups.py's group id,
'experiment/cluster/backend/model/mode:batch') of one store. The base's and the candidate's runs are
paired by world size; where one side holds several runs of one world size, the latest (by
`started_ns`, then run id) stands for it and a note says so. Each pair is compared as two runs are
(compare.py: a verdict beyond the runs' own noise), beside each side's scaling efficiency at that
world size (scaling.py: throughput against the run's group's smallest world size).

The set's verdict: `slower` when any world size is slower with confidence; else `faster` when any is
faster; else `no-change`. The world size that decides is the largest slower one, else the largest
faster one, else the largest world size compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PerfscopeError, shown
from ..store.reader import Store
from .compare import DEFAULT_THRESHOLD, Comparison, Side, compare
from .groups import groups_table
from .scaling import scaling_table
from .selection import Selection, sql_literal
from .steady import runs_table

#: what a set is picked by: a column of the runs table, or the scaling group
KINDS = ("experiment", "group")
#: values a message lists of what the store holds
HELD_SHOWN = 5


@dataclass(frozen=True)
class RunSet:
    """One side of a set comparison: an open store, what picked the runs, and the runs by world size
    (run_id, world_size, started_ns), every run of the set."""

    store: Store
    label: str  # "BASE" / "CANDIDATE"
    kind: str  # "experiment" / "group"
    name: str
    runs: tuple[dict[str, Any], ...]

    @property
    def what(self) -> str:
        return f"{self.kind} {shown(self.name, 80)}"


def _members(store: Store, kind: str) -> str:
    """SQL of every run of `store` with its world size, start and the value of `kind` as `name`."""
    sel = Selection()
    runs = runs_table(store, sel)
    if kind == "experiment":
        return f"SELECT run_id, world_size, started_ns, experiment AS name FROM {runs}"
    groups = groups_table(store, sel)
    return (
        f"SELECT r.run_id, r.world_size, r.started_ns, g.group_id AS name "
        f"FROM {runs} r JOIN {groups} g USING (run_id)"
    )


def pick_set(store: Store, kind: str, name: str, label: str) -> RunSet:
    """The runs of experiment / scaling group `name` in `store`; a PerfscopeError (exit 2) listing
    what the store holds when it has none of that name."""
    if kind not in KINDS:
        raise ValueError(f"a set is picked by one of {KINDS}, not {kind!r}")
    members = _members(store, kind)
    rows = store.query(
        f"SELECT run_id, world_size, started_ns FROM ({members}) "
        f"WHERE name = {sql_literal(name)} ORDER BY world_size, started_ns, run_id"
    ).to_pylist()
    if not rows:
        held = [
            str(v)
            for v in store.query(f"SELECT DISTINCT name FROM ({members}) ORDER BY name").column(0).to_pylist()
        ]
        listed = ", ".join(shown(v, 80) for v in held[:HELD_SHOWN]) + (
            " ..." if len(held) > HELD_SHOWN else ""
        )
        raise PerfscopeError(
            f"{label}: no {kind} {shown(name)} in {store.root} "
            f"(it holds {f'{kind}s {listed}' if held else f'no {kind}s'})"
        )
    return RunSet(store, label, kind, name, tuple(rows))


def _by_world_size(s: RunSet, notes: list[str]) -> dict[int, str]:
    """world size -> the run that stands for it: the latest by start (then run id); a note for every
    world size of several runs, and for runs of no known world size (left out)."""
    out: dict[int, str] = {}
    several: dict[int, list[str]] = {}
    unknown = []
    for r in sorted(s.runs, key=lambda r: (r["started_ns"] is not None, r["started_ns"] or 0, r["run_id"])):
        if r["world_size"] is None:
            unknown.append(str(r["run_id"]))
            continue
        n = int(r["world_size"])
        if n in out:
            several.setdefault(n, [out[n]]).append(str(r["run_id"]))
        out[n] = str(r["run_id"])
    for n, ids in sorted(several.items()):
        notes.append(
            f"{s.label} has {len(ids)} runs at world size {n} ({', '.join(shown(i) for i in ids)}): "
            f"the latest, {shown(ids[-1])}, is compared"
        )
    if unknown:
        notes.append(f"{s.label}: run(s) {', '.join(shown(i) for i in unknown)} of no world size left out")
    return out


def _efficiency(store: Store, run_ids: list[str]) -> dict[str, float | None]:
    """Each run's scaling efficiency in its scaling group (scaling.py), None without steady steps."""
    if not run_ids:
        return {}
    ids = ", ".join(sql_literal(i) for i in run_ids)
    rows = store.query(
        f"SELECT run_id, efficiency FROM {scaling_table(store, Selection())} WHERE run_id IN ({ids})"
    ).to_pylist()
    return {str(r["run_id"]): r["efficiency"] for r in rows}


@dataclass
class SetComparison:
    base: RunSet
    candidate: RunSet
    threshold: float
    verdict: str
    decided_by: int
    by_world_size: list[dict[str, Any]]
    comparisons: dict[int, Comparison]
    only_in_base: list[int]
    only_in_candidate: list[int]
    notes: list[str] = field(default_factory=list)

    def slower_beyond(self, pct: float) -> list[int]:
        """The world sizes slower by more than `pct` percent with confidence, largest first."""
        return sorted((n for n, c in self.comparisons.items() if c.slower_beyond(pct)), reverse=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "decided_by": self.decided_by,
            "threshold": self.threshold,
            "base": {"store": str(self.base.store.root), self.base.kind: self.base.name},
            "candidate": {"store": str(self.candidate.store.root), self.candidate.kind: self.candidate.name},
            "by_world_size": self.by_world_size,
            "only_in_base": self.only_in_base,
            "only_in_candidate": self.only_in_candidate,
            "notes": self.notes,
            "comparisons": {str(n): c.as_dict() for n, c in sorted(self.comparisons.items())},
        }


def set_verdict(verdicts: dict[int, str]) -> tuple[str, int]:
    """The verdict of a set from its world sizes' and the world size that decides it (see the module's
    doc); `verdicts` must not be empty."""
    for v in ("slower", "faster"):
        hit = [n for n, x in verdicts.items() if x == v]
        if hit:
            return v, max(hit)
    return "no-change", max(verdicts)


def compare_sets(base: RunSet, cand: RunSet, *, threshold: float = DEFAULT_THRESHOLD) -> SetComparison:
    """`cand` against `base`, world size by world size (see the module's doc)."""
    notes: list[str] = []
    b, c = _by_world_size(base, notes), _by_world_size(cand, notes)
    both = sorted(set(b) & set(c))
    if not both:
        sizes = [", ".join(map(str, sorted(x))) or "none" for x in (b, c)]
        raise PerfscopeError(
            f"BASE's {base.what} and CANDIDATE's {cand.what} share no world size "
            f"(BASE: {sizes[0]}; CANDIDATE: {sizes[1]})"
        )
    if base.store is cand.store and all(b[n] == c[n] for n in both) and set(b) == set(c):
        raise PerfscopeError(
            f"BASE's {base.what} and CANDIDATE's {cand.what} are the same runs: pick two different sets"
        )
    eff_b = _efficiency(base.store, [b[n] for n in both])
    eff_c = _efficiency(cand.store, [c[n] for n in both])
    comparisons: dict[int, Comparison] = {}
    rows: list[dict[str, Any]] = []
    for n in both:
        cmp = compare(
            Side(base.store, b[n], "base"), Side(cand.store, c[n], "candidate"), threshold=threshold
        )
        comparisons[n] = cmp
        rows.append({
            "world_size": n,
            "base_run_id": b[n],
            "candidate_run_id": c[n],
            "verdict": cmp.verdict,
            "step_ratio": cmp.step_ratio,
            "ci": list(cmp.ci) if cmp.ci else None,
            "base_efficiency": eff_b.get(b[n]),
            "candidate_efficiency": eff_c.get(c[n]),
        })  # fmt: skip
    verdict, decided_by = set_verdict({n: x.verdict for n, x in comparisons.items()})
    return SetComparison(
        base=base,
        candidate=cand,
        threshold=threshold,
        verdict=verdict,
        decided_by=decided_by,
        by_world_size=rows,
        comparisons=comparisons,
        only_in_base=sorted(set(b) - set(c)),
        only_in_candidate=sorted(set(c) - set(b)),
        notes=notes,
    )
