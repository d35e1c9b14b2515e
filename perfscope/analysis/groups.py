"""Scaling groups: which runs are compared with which, strong vs weak inferred from batch sizes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..store.reader import Store
from ..words import joined, known
from .cache import memo, temp_table
from .selection import Selection, sql_literal
from .steady import runs_table

GROUP_COLUMNS = (
    "group_id",
    "experiment",
    "cluster",
    "backend",
    "model",
    "scaling_mode",
    "mixed",
    "mode_note",
)


@dataclass(frozen=True)
class Membership:
    run_id: str
    group_id: str
    scaling_mode: str  # 'weak' | 'strong' | 'single'
    mixed: bool
    mode_note: str


def _label(v: object) -> str:
    return "-" if v in (None, "") else str(v)


def common_tokens(keys: Sequence[Sequence[str]]) -> set[int]:
    """Positions where every key has the same token."""
    if not keys:
        return set()
    width = min(len(k) for k in keys)
    return {i for i in range(width) if len({k[i] for k in keys}) == 1}


#: a group id's fields before its 'mode:batch' (assign_groups), as an unknown one reads in words
_GROUP_FIELDS = ("no experiment", "no cluster", "no backend", "no model")


def _group_part(i: int, token: str, differs: bool) -> str:
    """One field of a group id as a label shows it: an unknown value ('-', 'b-') is left out, or said
    in words where it is what tells the group from another."""
    if ":" in token and i >= len(_GROUP_FIELDS):  # 'weak:b75', 'strong:g600', 'single:b-'
        mode, _, batch = token.partition(":")
        if known(batch[1:]):
            return token
        return f"{mode}, no batch size" if differs else mode
    if known(token):
        return token
    return _GROUP_FIELDS[i] if differs and i < len(_GROUP_FIELDS) else ""


def group_label_map(group_ids: Iterable[str], sep: str = " · ") -> dict[str, str]:
    """group_id ('experiment/cluster/backend/model/mode:batch') -> the parts that tell groups apart
    (every known part when nothing does), joined by `sep`; an unknown part never shows as '-'."""
    ids = sorted({g for g in group_ids if g})
    keys = [g.split("/") for g in ids]
    same = common_tokens(keys) if len(keys) > 1 else set()
    out = {}
    for g, k in zip(ids, keys, strict=True):
        shown = [i for i in range(len(k)) if i not in same] or list(range(len(k)))
        apart = len(keys) > 1 and bool(set(range(len(k))) - same)
        out[g] = joined((_group_part(i, k[i], apart and i not in same) for i in shown), sep) or g
    return out


def group_name(group_id: str) -> str:
    """A group's full name in words, for a sentence about it alone: every known part of its id."""
    return group_label_map([group_id]).get(group_id, group_id)


def assign_groups(rows: list[dict[str, object]]) -> list[Membership]:
    """rows: run_id, experiment, cluster, backend, model, world_size, batch_size_per_rank,
    global_batch_size, scaling_mode_declared. Pure so it can be tested on its own."""
    fam_of = {}
    by_bpr: dict[tuple[object, ...], set[object]] = defaultdict(set)
    by_gbs: dict[tuple[object, ...], set[object]] = defaultdict(set)
    fam_sizes: dict[tuple[object, ...], set[object]] = defaultdict(set)
    for r in rows:
        fam = (r["experiment"], r["cluster"], r["backend"], r["model"])
        fam_of[r["run_id"]] = fam
        gbs = r["global_batch_size"] or _mul(r["batch_size_per_rank"], r["world_size"])
        r["_gbs"] = gbs
        by_bpr[(*fam, r["batch_size_per_rank"])].add(r["world_size"])
        by_gbs[(*fam, gbs)].add(r["world_size"])
        fam_sizes[fam].add(r["world_size"])
    keyed: dict[str, tuple[str, str]] = {}
    contradicted: dict[str, str] = {}
    for r in rows:
        fam = fam_of[r["run_id"]]
        declared = str(r["scaling_mode_declared"] or "")
        weak_multi = len(by_bpr[(*fam, r["batch_size_per_rank"])]) >= 2
        strong_multi = len(by_gbs[(*fam, r["_gbs"])]) >= 2
        inferred = "weak" if weak_multi else "strong" if strong_multi else ""
        mode = declared if declared in ("weak", "strong") else inferred or "weak"
        if (
            declared in ("weak", "strong")
            and inferred
            and declared != inferred
            and not (weak_multi if declared == "weak" else strong_multi)
        ):
            # The batches contradict the label: compare as the batches say, and flag it.
            mode = inferred
            contradicted[str(r["run_id"])] = (
                f"run {r['run_id']} declares {declared} scaling but keeps the "
                f"{'per-rank' if inferred == 'weak' else 'global'} batch fixed across world sizes"
            )
        if mode == "strong":
            keyed[str(r["run_id"])] = ("strong", f"g{_label(r['_gbs'])}")
        else:
            keyed[str(r["run_id"])] = ("weak", f"b{_label(r['batch_size_per_rank'])}")
    members: dict[str, list[dict[str, object]]] = defaultdict(list)
    for r in rows:
        mode, batch = keyed[str(r["run_id"])]
        fam = fam_of[r["run_id"]]
        gid = "/".join(_label(x) for x in fam) + f"/{mode}:{batch}"
        members[gid].append(r)
    out = []
    for gid, rs in members.items():
        sizes = {r["world_size"] for r in rs}
        mode = keyed[str(rs[0]["run_id"])][0] if len(sizes) > 1 else "single"
        modes = {str(r["scaling_mode_declared"]) for r in rs if r["scaling_mode_declared"]}
        notes = [contradicted[str(r["run_id"])] for r in rs if str(r["run_id"]) in contradicted]
        if len(modes) > 1:
            notes.insert(0, f"runs declare different scaling modes ({', '.join(sorted(modes))})")
        note = "; ".join(notes)
        gid_mode = (
            gid if mode != "single" else gid.replace("/weak:", "/single:").replace("/strong:", "/single:")
        )
        for r in rs:
            out.append(Membership(str(r["run_id"]), gid_mode, mode, bool(note), note))
    return sorted(out, key=lambda m: (m.group_id, m.run_id))


def _mul(a: object, b: object) -> object:
    return a * b if isinstance(a, int) and isinstance(b, int) else None


def groups_table(store: Store, sel: Selection) -> str:
    """Temp table run_id -> group columns for the selected runs."""

    def members() -> list[Membership]:
        runs = runs_table(store, sel)
        rows = store.query(
            f"SELECT run_id, experiment, cluster, backend, model, world_size, batch_size_per_rank, "
            f"global_batch_size, scaling_mode_declared FROM {runs}"
        ).to_pylist()
        return assign_groups(rows)

    ms = memo(store, ("memberships", sel), members)
    if not ms:
        values = "SELECT NULL::VARCHAR AS run_id, NULL::VARCHAR AS group_id, NULL::VARCHAR AS scaling_mode, "
        values += "NULL::BOOLEAN AS mixed, NULL::VARCHAR AS mode_note WHERE false"
    else:
        tuples = ", ".join(
            f"({sql_literal(m.run_id)}, {sql_literal(m.group_id)}, {sql_literal(m.scaling_mode)}, "
            f"{'true' if m.mixed else 'false'}, {sql_literal(m.mode_note)})"
            for m in ms
        )
        values = f"SELECT * FROM (VALUES {tuples}) v(run_id, group_id, scaling_mode, mixed, mode_note)"
    return temp_table(store, ("groups", sel), values)
