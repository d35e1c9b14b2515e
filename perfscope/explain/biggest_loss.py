"""The phase that lost the most time always has a finding: one of the rules' or, where none of them
covers it (each rule has its own threshold), one that names the phase and says why no rule fired.

Read after the rules ran (explain() calls `uncovered_losses`), on each scaling series that lost a
share of its efficiency worth explaining at its largest world size.
"""

from __future__ import annotations

from .context import Context, Row, largest
from .finding import Finding
from .hardware import setup_of
from .rulebook import cause_severity, make_finding
from .words import dur, num, pct

#: A series whose efficiency at its largest world size is below this lost time worth explaining.
WORTH_EXPLAINING = 0.9
#: A phase must hold at least this share of the lost time to be "the phase that lost the most".
LEADING_SHARE = 0.2
#: Confounds say why for every phase: the measurement does not compare like with like.
_CONFOUNDS = {"threads", "oversubscription", "contention"}
#: Rules whose findings account for each phase's lost time.
COVERED_BY: dict[str, set[str]] = {
    "sync_exposed": {
        "communication-bound",
        "overlap-failure",
        "latency-bound",
        "node-boundary-knee",
        "network-under-delivering",
        "straggler",
        "pipeline-bubble",
        "sharded-exposed",
        "periodic-sync",
        "parameter-server",
        "communication-share",
    },
    "data": {"input-bound"},
    "forward": {"small-per-gpu-work", "straggler"},
    "backward": {"small-per-gpu-work", "straggler"},
    "optimizer": {"small-per-gpu-work", "straggler"},
    "imbalance": {"straggler"},
    "other": set(),
}
PHASE_WORDS = {
    "sync_exposed": "exposed gradient sync",
    "data": "data loading",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "the optimizer step",
    "imbalance": "imbalance between ranks",
    "other": "time outside the recorded phases",
}


def uncovered_losses(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """One finding per series whose leading lost phase no finding on that series accounts for."""
    fired: dict[str, set[str]] = {}
    for f in findings:
        fired.setdefault(f.group_id or "", set()).add(f.rule)
    everywhere = {f.rule for f in findings if f.group_id is None} & _CONFOUNDS
    out = []
    for gid, rows in ctx.scaling_groups().items():
        top = largest(rows)
        eff, lost = top["efficiency"], top["lost_ns"]
        if eff is None or eff >= WORTH_EXPLAINING or not lost or lost <= 0:
            continue
        phase, part = max(
            ((p, top.get(f"lost_{p}_ns") or 0.0) for p in COVERED_BY), key=lambda x: x[1], default=("", 0.0)
        )
        share = part / lost
        rules = fired.get(gid, set()) | everywhere
        if share < LEADING_SHARE or rules & (COVERED_BY[phase] | _CONFOUNDS):
            continue
        out.append(_finding(ctx, gid, rows, top, phase, part, share))
    return out


def _finding(
    ctx: Context, gid: str, rows: list[Row], top: Row, phase: str, part: float, share: float
) -> Finding:
    hw = setup_of(ctx, [r["run_id"] for r in rows])
    what = PHASE_WORDS[phase]
    return make_finding(
        ctx,
        "biggest-loss",
        gid,
        severity=cause_severity(share),
        category="cause",
        title=f"Most lost time at N={top['world_size']} is {what}: {pct(share)} of the loss",
        text=(
            f"In {gid}, efficiency at N={top['world_size']} is {num(top['efficiency'])} and "
            f"{what} accounts for {dur(part)} of the {dur(top['lost_ns'])} of {hw.time} lost per step "
            f"({pct(share)}), more than any other phase. {_why_no_rule(phase, top, share)}"
        ),
        run_ids=[r["run_id"] for r in rows],
        analyses=("scaling", "lost_time"),
        recommendation=_advice(phase, hw.unit),
        confidence=0.6,
        explained_loss=share,
        numbers={"phase": phase, "lost_phase_ns": part, "lost_ns": top["lost_ns"], "share_of_lost": share},
        group_id=gid,
    )


def _why_no_rule(phase: str, top: Row, share: float) -> str:
    if phase == "sync_exposed":
        return (
            "No communication finding fired: the communication-bound rule needs efficiency under 0.80 "
            f"and exposed sync over half of the lost time (here {num(top['efficiency'])} and "
            f"{pct(share)}), and the sync share of the step must grow with N; it is still the phase to "
            "work on first."
        )
    if phase == "data":
        return (
            "The input-bound rule did not fire (it needs data loading over 15% of the step, or a share "
            "that grows with N and explains over a quarter of the loss); it is still the phase to work on."
        )
    if phase == "other":
        return (
            "perfscope cannot say what it is: the step spends it outside forward, backward, the optimizer, "
            "data loading and the sync. Wrap more of the loop in prof.phase(...) to name it."
        )
    return (
        "The compute cost per sample grows with N, but not past the per-rank-work rule's threshold "
        "(computation scaling under 0.90); it is still the phase to work on first."
    )


def _advice(phase: str, unit: str) -> str:
    if phase == "sync_exposed":
        return (
            "Hide or shrink the allreduce (overlap it with backward, fewer larger buckets, lower-precision "
            f"gradients), or give each {unit} more work per step so the same sync is a smaller share."
        )
    if phase == "data":
        return "Feed the ranks faster: more DataLoader workers, persistent workers and prefetching."
    if phase == "other":
        return "Record the rest of the step as phases (prof.phase) and look at what it does."
    return (
        f"Look at why the same samples cost more compute per {unit} at larger N: threads and cores per "
        "rank, memory bandwidth shared by the ranks on a host, and the batch per rank."
    )
