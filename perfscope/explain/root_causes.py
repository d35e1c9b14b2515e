"""Root causes, not symptoms: the rules' findings merged so that each cause is said once.

Two passes over the rules' findings:

1. On one group, findings that read the same evidence as one cause seen several ways (a rule
   family in `FAMILIES`) become ONE finding: the first rule of the family that fired is the root
   cause, the others its `symptoms`. The root claims its own share of the lost time only; the
   symptoms keep their numbers, and their shares overlap the root's rather than add to it.
2. The same rule on several groups becomes ONE finding: the one that explains most leads, the
   others are kept in `also_in`, and the title and text name the groups.
"""

from __future__ import annotations

from dataclasses import replace

from ..analysis.groups import group_label_map
from .finding import SEVERITIES, Evidence, Finding, impact, rank_findings

#: Rules that are one cause seen several ways, root cause first: exposed sync (communication-bound)
#: shows up as sync that does not overlap compute, as per-message latency and as a knee where the
#: ranks start talking across nodes (except when the knee is measured at equal N: see
#: `_placement_evidence`).
FAMILIES: tuple[tuple[str, ...], ...] = (
    ("communication-bound", "overlap-failure", "latency-bound", "node-boundary-knee"),
)


#: On one run, a rule that names how its communication is organised (parameter averaging every k
#: steps, sharded data parallelism, a pipeline, a parameter server) is the root cause of the run's
#: wait on communication, which is then its symptom.
#: The what-if replay, when it names a cause (a long stage, a slow worker, data imbalance), explains
#: the run's waits too: the ranks that wait on the long stage (its pipeline bubble) are its symptom,
#: not a cause of their own, and so is the straggler finding on the rank the replay names.
#: A run with more ranks than its host has cores waits in its collectives for peers the scheduler has
#: taken off a core: that wait is the oversubscription's, not the link's.
RUN_ROOTS: dict[str, tuple[str, ...]] = {
    "what-if": ("communication-share", "straggler", "pipeline-bubble"),
    "pipeline-bubble": ("communication-share",),
    "parameter-server": ("communication-share",),
    "periodic-sync": ("communication-share",),
    "sharded-exposed": ("communication-share",),
    "oversubscription": ("communication-share",),
}


def root_causes(findings: list[Finding]) -> list[Finding]:
    """One finding per cause per group, then one per rule across groups; ranked."""
    merged = merge_symptoms(merge_run_symptoms(findings))
    return rank_findings(collapse_repeats(rank_findings(mark_overlaps(merged))))


def merge_run_symptoms(findings: list[Finding]) -> list[Finding]:
    """A one-run finding that a RUN_ROOTS finding on its run covers becomes that finding's symptom
    (the first such root by RUN_ROOTS order)."""
    order = list(RUN_ROOTS)
    roots: dict[tuple[str, str], Finding] = {}
    for f in sorted((f for f in findings if f.rule in RUN_ROOTS), key=lambda f: order.index(f.rule)):
        for run in f.evidence.run_ids:
            for symptom in RUN_ROOTS[f.rule]:
                roots.setdefault((run, symptom), f)
    attached: dict[int, list[Finding]] = {}
    out: list[Finding] = []
    for f in findings:
        root = roots.get((f.evidence.run_ids[0], f.rule)) if len(f.evidence.run_ids) == 1 else None
        if root is None or not _covers(root, f):
            out.append(f)
        else:
            attached.setdefault(id(root), []).append(f)
    return [replace(f, symptoms=f.symptoms + tuple(attached[id(f)])) if id(f) in attached else f for f in out]


#: the share of a run's wait that a what-if cause must account for to take the wait as its symptom
WHAT_IF_COVERS = 0.5


def _covers(root: Finding, symptom: Finding) -> bool:
    """A what-if cause (a slow worker costing 10% of a step, say) explains a run's wait only when it
    accounts for at least half of it: a 40% wait on a big allreduce beside it is the allreduce's own,
    and both findings stand, each ranked by what it explains. The structural roots (a pipeline, a
    parameter server, periodic or sharded sync) explain the wait by what they are."""
    if root.rule != "what-if":
        return True
    if symptom.rule == "pipeline-bubble":  # the stages wait for the long stage: the bubble is its symptom
        return root.id.endswith(":stage-imbalance")
    if not impact(symptom):
        return True
    return impact(root) >= WHAT_IF_COVERS * impact(symptom)


def mark_overlaps(findings: list[Finding]) -> list[Finding]:
    """Root causes on one group whose shares add up past the group's lost time say that they overlap."""
    total: dict[str, float] = {}
    for f in findings:
        if f.group_id is not None and f.explained_loss:
            total[f.group_id] = total.get(f.group_id, 0.0) + f.explained_loss
    out = []
    for f in findings:
        others = [
            g.title
            for g in findings
            if g is not f and g.group_id == f.group_id and g.explained_loss and f.explained_loss
        ]
        if f.group_id is not None and total.get(f.group_id, 0.0) > 1.0 + 1e-9 and others:
            f = replace(
                f,
                text=f"{f.text} On this group its share overlaps that of {'; '.join(others)}: "
                "the shares add up to more than the lost time, so part of it has both causes.",
                numbers={**f.numbers, "shares_overlap": 1},
            )
        out.append(f)
    return out


def merge_symptoms(findings: list[Finding]) -> list[Finding]:
    """On each group, every rule family's findings become its root cause with the rest as symptoms."""
    family_of = {r: fam for fam in FAMILIES for r in fam}
    members: dict[tuple[str, tuple[str, ...]], list[Finding]] = {}
    out: list[Finding] = []
    for f in findings:
        fam = family_of.get(f.rule)
        if fam is None or f.group_id is None:
            out.append(f)
        else:
            members.setdefault((f.group_id, fam), []).append(f)
    for (_, fam), found in members.items():
        found.sort(key=lambda f: (not _placement_evidence(f), fam.index(f.rule), -(f.explained_loss or 0.0)))
        root, symptoms = found[0], found[1:]
        if symptoms:
            root = replace(
                root,
                severity=min((f.severity for f in found), key=SEVERITIES.index),
                symptoms=root.symptoms + tuple(symptoms),  # each keeps its own evidence
            )
        out.append(root)
    return out


def _placement_evidence(f: Finding) -> bool:
    """A knee measured at equal N, on one node and across nodes: the same job, the same work per rank,
    only the placement differs. Its cause is the node boundary itself, and the exposed sync that grew
    with it (communication-bound and the rest of the family) is its symptom."""
    return f.rule == "node-boundary-knee" and bool(f.numbers.get("same_world_size"))


def collapse_repeats(ranked: list[Finding]) -> list[Finding]:
    """The same rule on several groups: the first (most explaining) leads and names the others."""
    by_rule: dict[str, list[Finding]] = {}
    for f in ranked:
        by_rule.setdefault(f.rule, []).append(f)
    out = []
    for found in by_rule.values():
        lead, others = found[0], found[1:]
        if others:
            labels = short_labels([where(f) for f in found])
            named = ", ".join(
                labels[where(f)] + (f" ({f.explained_loss:.0%})" if f.explained_loss is not None else "")
                for f in found
            )
            lead = replace(
                lead,
                title=_with_count(lead.title, len(found)),
                text=f"{lead.text} Seen in {len(found)} places: {named}.",
                severity=min((f.severity for f in found), key=SEVERITIES.index),
                evidence=_union_evidence(found),
                recommendation=_advice_by_place(found, labels),
                also_in=lead.also_in + tuple(others),
            )
        out.append(lead)
    return out


def where(f: Finding) -> str:
    """The group a finding is about, or the scope in its id for findings across groups."""
    return f.group_id or f.id.split(":", 1)[-1]


def short_labels(places: list[str]) -> dict[str, str]:
    """'exp/cluster/backend/model/mode:b' ids -> the '/'-parts that tell them apart (an unknown part
    in words, as the report and the dashboard name it, never '-')."""
    return group_label_map(places, sep="/")


def _advice_by_place(found: list[Finding], labels: dict[str, str]) -> str:
    """One recommendation when the places share it; otherwise each, naming the places it is for
    (a Horovod-over-MPI group is not told what fits an NCCL one)."""
    places: dict[str, list[str]] = {}
    for f in found:
        places.setdefault(f.recommendation, []).append(labels[where(f)])
    if len(places) == 1:
        return found[0].recommendation
    return " ".join(f"For {', '.join(p)}: {rec}" for rec, p in places.items())


def _with_count(title: str, n: int) -> str:
    """'X [simulated runs]' -> 'X, in n places [simulated runs]': the source marker stays last."""
    base, sep, marker = title.rpartition(" [")
    if not sep or not marker.endswith("runs]"):
        base, marker = title, ""
    return f"{base}, in {n} places" + (f" [{marker}" if marker else "")


def _union_evidence(found: list[Finding]) -> Evidence:
    runs = sorted({r for f in found for r in f.evidence.run_ids})
    analyses = tuple(dict.fromkeys(a for f in found for a in f.evidence.analyses))
    return Evidence(tuple(runs), analyses)
