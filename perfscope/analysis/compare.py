"""Two runs compared: did the candidate get slower than the base, by how much beyond the runs' own
noise, and where (phase, rank, collective, op type), with what changed in their set-up listed first.

The step-time ratio is candidate over base of the steady step time T (DESIGN: elapsed wall clock of
the steady window / its steps). Its confidence interval comes from the steps themselves. Steps are
autocorrelated (a slow patch of the host, a periodic checkpoint, a loader that falls behind for
several steps), so resampling single steps would understate the noise: a moving-block bootstrap
(Künsch 1989) resamples blocks of consecutive steps of length ceil(n^(1/3)) (at least a recorded
period of slow steps), each run on its own, and takes the percentiles of the ratio of the resampled
means. The per-step series is each steady step's share of the wall clock (the latest end on any rank
less the previous step's), whose mean is T exactly; without start times, the slowest rank's step time.
The random generator is seeded, so one pair of runs gives one answer.

Verdict: `no-change` when the interval holds 1 or lies inside ±`threshold` (the practical threshold,
default 2%); else `slower` (the interval above 1) or `faster` (below).

The culprit is the rank whose own work changed: its step less the time it waited in exposed
communication (DESIGN: a rank that now waits for a slower peer is its victim, never the cause).
Everything is computed from per-run aggregates (one scan of each run's steps, comm and spans), so the
cost is linear in the rows of the two runs; the bootstrap is O(n + B·n/L) in the n steady steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import PerfscopeError, shown
from ..store.reader import Store
from .runs import rank_breakdown, run_summary
from .selection import Selection, sql_literal
from .steady import PHASE_LABELS, PHASES, run_stats_table, step_agg_table
from .sync import collectives

#: the interval's confidence level and the bootstrap's resamples
CONFIDENCE = 0.95
RESAMPLES = 2000
#: the practical threshold: a ratio within ±2% of 1 is no change worth acting on
DEFAULT_THRESHOLD = 0.02
#: the generator's seed (reproducible intervals)
SEED = 0
#: fewer steady steps than this in either run: no interval
MIN_STEPS = 5
#: the phases of the additive breakdown, as `by_phase` names them
BY_PHASE = (*PHASES, "imbalance")
#: a rank's own work: its phases less the exposed communication it waited in
OWN_PHASES = ("data", "forward", "backward", "optimizer", "other")
#: spans that are phases or the step itself, not op types
_NOT_OPS = (*PHASES, "sync", "step")
#: an op type counts as more frequent / slower when its count per step / mean time moved this much
OP_CHANGE = 0.10

#: `runs` columns that identify a run rather than set it up
_RUN_IDENTITY = {"run_id", "started_ns", "ended_ns", "hostname", "experiment", "tags", "source"}
#: `ranks` columns that identify a process rather than set it up
_RANK_IDENTITY = {
    "run_id", "rank", "local_rank", "node_rank", "hostname", "pid", "clock_offset_ns", "started_ns",
    "clock_error_ns", "device_index", "dp_rank", "pp_stage", "tp_rank", "cp_rank", "role",
}  # fmt: skip


@dataclass(frozen=True)
class Side:
    """One side of a comparison: an open store and the run in it."""

    store: Store
    run_id: str
    label: str  # "base" / "candidate"


@dataclass
class Comparison:
    base: Side
    candidate: Side
    threshold: float
    verdict: str
    step_ratio: float | None
    ci: tuple[float, float] | None
    throughput_ratio: float | None
    throughput_ci: tuple[float, float] | None
    base_step_ns: float | None
    candidate_step_ns: float | None
    base_steps: int
    candidate_steps: int
    block_len: int
    by_phase: list[dict[str, Any]]
    by_rank: list[dict[str, Any]]
    culprit: dict[str, Any] | None
    by_collective: list[dict[str, Any]]
    by_op_type: list[dict[str, Any]]
    setup_changes: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    #: each run's steady steps as the interval resampled them (ns): "base", "candidate"
    series: dict[str, np.ndarray] = field(default_factory=dict)

    def slower_beyond(self, pct: float) -> bool:
        """Whether the candidate is slower by more than `pct` percent with confidence: the interval's
        lower end above 1 + pct/100."""
        return self.ci is not None and self.ci[0] > 1.0 + pct / 100.0

    def steps_table(self) -> pa.Table:
        """Both runs' steady steps for the distribution chart: side, step_ms."""
        sides = [(k, v) for k, v in self.series.items()]
        return pa.table(
            {
                "side": [k for k, v in sides for _ in range(len(v))],
                "step_ms": np.concatenate([v / 1e6 for _, v in sides]) if sides else np.empty(0),
            }
        )

    def phase_table(self) -> pa.Table:
        return pa.Table.from_pylist(self.by_phase)

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "step_ratio": self.step_ratio,
            "ci": list(self.ci) if self.ci else None,
            "confidence": CONFIDENCE,
            "threshold": self.threshold,
            "method": (
                f"moving-block bootstrap of the steady steps (blocks of {self.block_len} consecutive steps: "
                f"steps are autocorrelated), {RESAMPLES} resamples, seed {SEED}"
            ),
            "throughput_ratio": self.throughput_ratio,
            "throughput_ci": list(self.throughput_ci) if self.throughput_ci else None,
            "base": {
                "run_id": self.base.run_id,
                "store": str(self.base.store.root),
                "step_ns": self.base_step_ns,
                "steady_steps": self.base_steps,
            },
            "candidate": {
                "run_id": self.candidate.run_id,
                "store": str(self.candidate.store.root),
                "step_ns": self.candidate_step_ns,
                "steady_steps": self.candidate_steps,
            },
            "setup_changes": self.setup_changes,
            "by_phase": self.by_phase,
            "by_rank": self.by_rank,
            "culprit": self.culprit,
            "by_collective": self.by_collective,
            "by_op_type": self.by_op_type,
            "notes": self.notes,
        }


def pick_run(store: Store, run_id: str | None, label: str, option: str) -> Side:
    """The run `run_id` of `store`, or its only run; a PerfscopeError (exit 2) that says what to pass
    when the store holds none, several, or not that one."""
    ids = [
        str(r) for r in store.query("SELECT DISTINCT run_id FROM runs ORDER BY run_id").column(0).to_pylist()
    ]
    if run_id is not None:
        if run_id not in ids:
            held = ", ".join(ids[:5]) + (" ..." if len(ids) > 5 else "") if ids else "no runs"
            raise PerfscopeError(f"{label}: no run {shown(run_id)} in {store.root} (it holds {held})")
        return Side(store, run_id, label)
    if not ids:
        raise PerfscopeError(f"{label}: {store.root} holds no runs")
    if len(ids) > 1:
        raise PerfscopeError(
            f"{label}: {store.root} holds {len(ids)} runs ({', '.join(ids[:3])}"
            f"{' ...' if len(ids) > 3 else ''}); pick one with {option} ID"
        )
    return Side(store, ids[0], label)


def _summary(side: Side) -> dict[str, Any]:
    rows = run_summary(side.store, Selection(run_ids=(side.run_id,))).to_pylist()
    if not rows or not rows[0].get("steady_steps") or rows[0].get("step_ns") is None:
        raise PerfscopeError(
            f"{side.label}: run {shown(side.run_id)} in {side.store.root} has no steady steps"
        )
    return dict(rows[0])


def step_series(side: Side) -> np.ndarray:
    """Each steady step's share of the window's wall clock (ns): the latest end on any rank less the
    previous step's, the first step from its earliest start; their mean is the steady step time. A run
    whose elapsed time is not the wall clock (no start times, ranks' clocks disagree): the slowest
    rank's step time per step."""
    sel = Selection(run_ids=(side.run_id,))
    sa = step_agg_table(side.store, sel)
    stats = run_stats_table(side.store, sel)
    t = side.store.query(
        f"""
        SELECT CASE WHEN st.elapsed_source = 'wall_clock' AND a.end_max_ns IS NOT NULL
                    THEN a.end_max_ns - coalesce(lag(a.end_max_ns) OVER (ORDER BY a.step), a.start_min_ns)
                    ELSE a.step_max_ns END AS d
        FROM {sa} a JOIN {stats} st USING (run_id)
        WHERE a.run_id = {sql_literal(side.run_id)}
        ORDER BY a.step
        """
    )
    values = t.column(0).to_numpy(zero_copy_only=False).astype(np.float64)
    return values[np.isfinite(values)]


def block_length(n: int, period: int | None = None) -> int:
    """Blocks of ceil(n^(1/3)) consecutive steps (the moving-block bootstrap's usual order), at least a
    recorded period of slow steps, at most n."""
    if n <= 0:
        return 1
    return int(max(1, min(n, max(math.ceil(n ** (1 / 3)), period or 0))))


def resampled_means(x: np.ndarray, block: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of `resamples` moving-block bootstrap resamples of `x`: ceil(n/block) blocks of `block`
    consecutive values with uniformly drawn starts, from the block sums (O(n + resamples·n/block))."""
    n = len(x)
    cs = np.concatenate(([0.0], np.cumsum(x)))
    sums = cs[block:] - cs[: n - block + 1]  # sum of each block, by its start
    k = math.ceil(n / block)
    starts = rng.integers(0, len(sums), size=(resamples, k))
    return sums[starts].sum(axis=1) / (k * block)


def ratio_interval(
    base: np.ndarray,
    cand: np.ndarray,
    *,
    base_period: int | None = None,
    cand_period: int | None = None,
    seed: int = SEED,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
) -> tuple[tuple[float, float], int]:
    """The `confidence` interval of mean(cand)/mean(base) by a moving-block bootstrap of each series
    (independent runs), and the longer of the two block lengths."""  # fmt: skip
    rng = np.random.default_rng(seed)
    lb = block_length(len(base), base_period)
    lc = block_length(len(cand), cand_period)
    mb = resampled_means(base, lb, resamples, rng)
    mc = resampled_means(cand, lc, resamples, rng)
    ratios = mc / mb
    ratios = ratios[np.isfinite(ratios)]
    a = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [a, 1 - a])
    return (float(lo), float(hi)), max(lb, lc)


def verdict_of(ci: tuple[float, float] | None, threshold: float) -> str:
    if ci is None:
        return "no-change"
    lo, hi = ci
    if lo <= 1.0 <= hi or (lo >= 1.0 - threshold and hi <= 1.0 + threshold):
        return "no-change"
    return "slower" if lo > 1.0 else "faster"


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _by_phase(bs: dict[str, Any], cs: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in BY_PHASE:
        b, c = _num(bs.get(f"{p}_ns")), _num(cs.get(f"{p}_ns"))
        if b is None and c is None:
            continue
        b, c = b or 0.0, c or 0.0
        out.append({"phase": p, "label": PHASE_LABELS[p], "base_ns": b, "candidate_ns": c, "delta_ns": c - b})
    return out


def _own(r: dict[str, Any]) -> float | None:
    step = _num(r.get("step_ns"))
    if step is None:
        return None
    return step - (_num(r.get("sync_exposed_ns")) or 0.0)


def _by_rank(base: Side, cand: Side, threshold: float, base_step: float) -> tuple[list[dict[str, Any]], Any]:
    rb = {
        int(r["rank"]): r for r in rank_breakdown(base.store, Selection(run_ids=(base.run_id,))).to_pylist()
    }
    rc = {
        int(r["rank"]): r for r in rank_breakdown(cand.store, Selection(run_ids=(cand.run_id,))).to_pylist()
    }
    rows: list[dict[str, Any]] = []
    for rank in sorted(set(rb) | set(rc)):
        b, c = rb.get(rank, {}), rc.get(rank, {})
        phases = {
            p: _delta(_num(b.get(f"{p}_ns")), _num(c.get(f"{p}_ns"))) for p in (*OWN_PHASES, "sync_exposed")
        }
        own_phases = {p: d for p, d in phases.items() if p in OWN_PHASES and d is not None}
        top = max(own_phases, key=lambda p: abs(own_phases[p])) if own_phases else None
        rows.append({
            "rank": rank,
            "base_step_ns": _num(b.get("step_ns")),
            "candidate_step_ns": _num(c.get("step_ns")),
            "base_own_ns": _own(b) if b else None,
            "candidate_own_ns": _own(c) if c else None,
            "delta_own_ns": _delta(_own(b) if b else None, _own(c) if c else None),
            "delta_wait_ns": phases["sync_exposed"],
            "delta_by_phase_ns": phases,
            "phase": top,
            "culprit": False,
        })  # fmt: skip
    changed = [r for r in rows if r["delta_own_ns"] is not None]
    if not changed:
        return rows, None
    biggest = max(abs(r["delta_own_ns"]) for r in changed)
    if biggest < threshold * base_step:
        return rows, None
    named = [r for r in changed if abs(r["delta_own_ns"]) >= 0.5 * biggest]
    if len(named) == len(rows) and len(rows) > 1:
        return rows, {"ranks": [r["rank"] for r in named], "every_rank": True, "phase": _common_phase(named)}
    for r in named:
        r["culprit"] = True
    worst = max(named, key=lambda r: abs(r["delta_own_ns"]))
    return rows, {
        "ranks": [r["rank"] for r in named],
        "every_rank": False,
        "rank": worst["rank"],
        "phase": worst["phase"],
        "delta_own_ns": worst["delta_own_ns"],
        "victims": [r["rank"] for r in rows if not r["culprit"]],
    }


def _common_phase(rows: list[dict[str, Any]]) -> str | None:
    phases = {r["phase"] for r in rows}
    return phases.pop() if len(phases) == 1 else None


def _by_collective(base: Side, cand: Side, bsteps: int, csteps: int) -> list[dict[str, Any]]:
    def table(side: Side, steps: int) -> dict[tuple[Any, ...], dict[str, Any]]:
        out = {}
        for r in collectives(side.store, Selection(run_ids=(side.run_id,))).to_pylist():
            key = (r["op"], r["group_kind"], int(r["bytes"] or 0))
            out[key] = {
                "per_step": (r["instances"] or 0) / max(steps, 1),
                "transfer_ns": _num(r["transfer_ns"]),
                "busbw_gb_per_s": _num(r["busbw_gb_per_s"]),
            }
        return out

    b, c = table(base, bsteps), table(cand, csteps)
    rows: list[dict[str, Any]] = []
    for key in sorted(set(b) | set(c), key=lambda k: (str(k[0]), str(k[1]), k[2])):
        x, y = b.get(key), c.get(key)
        bt = x["transfer_ns"] * x["per_step"] if x and x["transfer_ns"] is not None else 0.0
        ct = y["transfer_ns"] * y["per_step"] if y and y["transfer_ns"] is not None else 0.0
        rows.append({
            "op": key[0], "group_kind": key[1], "bytes": key[2],
            "change": "added" if x is None else "removed" if y is None else "changed",
            "base_per_step": x["per_step"] if x else 0.0, "candidate_per_step": y["per_step"] if y else 0.0,
            "base_transfer_ns": x["transfer_ns"] if x else None,
            "candidate_transfer_ns": y["transfer_ns"] if y else None,
            "base_busbw_gb_per_s": x["busbw_gb_per_s"] if x else None,
            "candidate_busbw_gb_per_s": y["busbw_gb_per_s"] if y else None,
            "base_ns_per_step": bt, "candidate_ns_per_step": ct, "delta_ns_per_step": ct - bt,
        })  # fmt: skip
    rows.sort(key=lambda r: -abs(r["delta_ns_per_step"]))
    return rows


def _op_types(side: Side, steps: int) -> dict[str, dict[str, float]]:
    """Per span name that is not a phase (an op type of an imported trace: a kernel, an NVTX range, a
    Megatron op): calls and time per steady step, and mean time per call."""
    sel = Selection(run_ids=(side.run_id,))
    from .steady import thresholds_table

    thr = thresholds_table(side.store, sel)
    names = ", ".join(sql_literal(n) for n in _NOT_OPS)
    t = side.store.query(
        f"""
        SELECT s.name, count(*) AS calls, sum(s.dur_ns)::DOUBLE AS total_ns
        FROM spans s JOIN {thr} t ON s.run_id = t.run_id AND s.step >= t.first_steady_step
        WHERE s.run_id = {sql_literal(side.run_id)} AND s.name NOT IN ({names}) AND s.dur_ns >= 0
        GROUP BY s.name
        """
    ).to_pylist()
    per = max(steps, 1)
    return {
        str(r["name"]): {
            "calls_per_step": r["calls"] / per,
            "ns_per_step": (r["total_ns"] or 0.0) / per,
            "mean_ns": (r["total_ns"] or 0.0) / max(r["calls"], 1),
        }
        for r in t
    }


def _by_op_type(
    base: Side, cand: Side, bsteps: int, csteps: int, bworld: int, cworld: int
) -> list[dict[str, Any]]:
    # spans are per rank: per step of one rank, the mean over ranks
    b = _op_types(base, bsteps * max(bworld, 1))
    c = _op_types(cand, csteps * max(cworld, 1))
    rows: list[dict[str, Any]] = []
    for name in set(b) | set(c):
        x, y = b.get(name), c.get(name)
        if x is None:
            change = "added"
        elif y is None:
            change = "removed"
        elif y["calls_per_step"] > (1 + OP_CHANGE) * x["calls_per_step"]:
            change = "more frequent"
        elif y["calls_per_step"] < (1 - OP_CHANGE) * x["calls_per_step"]:
            change = "less frequent"
        elif y["mean_ns"] > (1 + OP_CHANGE) * x["mean_ns"]:
            change = "slower"
        elif y["mean_ns"] < (1 - OP_CHANGE) * x["mean_ns"]:
            change = "faster"
        else:
            change = "unchanged"
        bt = x["ns_per_step"] if x else 0.0
        ct = y["ns_per_step"] if y else 0.0
        rows.append({
            "op_type": name, "change": change,
            "base_calls_per_step": x["calls_per_step"] if x else 0.0,
            "candidate_calls_per_step": y["calls_per_step"] if y else 0.0,
            "base_mean_ns": x["mean_ns"] if x else None, "candidate_mean_ns": y["mean_ns"] if y else None,
            "base_ns_per_step": bt, "candidate_ns_per_step": ct, "delta_ns_per_step": ct - bt,
        })  # fmt: skip
    rows.sort(key=lambda r: (r["change"] == "unchanged", -abs(r["delta_ns_per_step"]), r["op_type"]))
    return rows


def _settings(store: Store, table: str, run_id: str, identity: set[str]) -> dict[str, str]:
    """The set-up a run recorded in `table`: per column, its value (per rank when ranks differ)."""
    t = store.query(f"SELECT * FROM {table} WHERE run_id = ?", [run_id])
    out: dict[str, str] = {}
    for name in t.column_names:
        if name in identity:
            continue
        values = t.column(name).to_pylist()
        if table == "ranks":
            ranks = t.column("rank").to_pylist()
            distinct = sorted({_text(v) for v in values})
            if distinct == [""]:
                continue
            if len(distinct) == 1:
                out[name] = distinct[0]
            else:
                out[name] = ", ".join(
                    f"rank {r}: {_text(v)}" for r, v in sorted(zip(ranks, values, strict=True))
                )
        else:
            v = _text(values[0]) if values else ""
            if v != "":
                out[name] = v
    return out


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _setup_changes(base: Side, cand: Side) -> list[dict[str, Any]]:
    out = []
    for table, identity in (("runs", _RUN_IDENTITY), ("ranks", _RANK_IDENTITY)):
        b = _settings(base.store, table, base.run_id, identity)
        c = _settings(cand.store, table, cand.run_id, identity)
        for name in sorted(set(b) | set(c)):
            if b.get(name) != c.get(name):
                out.append({"table": table, "setting": name, "base": b.get(name), "candidate": c.get(name)})
    return out


def compare(base: Side, cand: Side, *, threshold: float = DEFAULT_THRESHOLD, seed: int = SEED) -> Comparison:
    """The comparison of `cand` against `base` (see the module's doc)."""
    if not (0 <= threshold < 1):
        raise PerfscopeError(f"the practical threshold must be a fraction in [0, 1), not {shown(threshold)}")
    bs, cs = _summary(base), _summary(cand)
    bT, cT = _num(bs["step_ns"]), _num(cs["step_ns"])
    notes: list[str] = []
    xb, xc = step_series(base), step_series(cand)
    ratio = cT / bT if bT and cT is not None else None
    ci: tuple[float, float] | None = None
    block = 1
    if len(xb) >= MIN_STEPS and len(xc) >= MIN_STEPS and ratio is not None:
        (lo, hi), block = ratio_interval(
            xb,
            xc,
            base_period=_int(bs.get("step_period")),
            cand_period=_int(cs.get("step_period")),
            seed=seed,
        )
        # centred on the runs' own ratio where the series' means are not exactly T (gapped step numbers)
        scale = ratio / (float(xc.mean()) / float(xb.mean()))
        ci = (lo * scale, hi * scale)
    else:
        notes.append(
            f"fewer than {MIN_STEPS} steady steps in a run: no interval, no verdict beyond no-change"
        )
    xr_b, xr_c = _num(bs.get("throughput_samples_per_s")), _num(cs.get("throughput_samples_per_s"))
    tput = xr_c / xr_b if xr_b and xr_c is not None else None
    tput_ci = None
    if tput is not None and ci is not None and ratio:
        # samples per step may differ; throughput = samples per step / step time
        k = tput * ratio
        tput_ci = (k / ci[1], k / ci[0])
    by_rank, culprit = _by_rank(base, cand, threshold, bT or 0.0)
    bsteps, csteps = int(bs["steady_steps"]), int(cs["steady_steps"])
    return Comparison(
        base=base,
        candidate=cand,
        threshold=threshold,
        verdict=verdict_of(ci, threshold),
        step_ratio=ratio,
        ci=ci,
        throughput_ratio=tput,
        throughput_ci=tput_ci,
        base_step_ns=bT,
        candidate_step_ns=cT,
        base_steps=bsteps,
        candidate_steps=csteps,
        block_len=block,
        by_phase=_by_phase(bs, cs),
        by_rank=by_rank,
        culprit=culprit,
        by_collective=_by_collective(base, cand, bsteps, csteps),
        by_op_type=_by_op_type(
            base, cand, bsteps, csteps, int(bs.get("ranks_seen") or 1), int(cs.get("ranks_seen") or 1)
        ),
        setup_changes=_setup_changes(base, cand),
        notes=notes,
        series={"base": xb, "candidate": xc},
    )


def _int(v: Any) -> int | None:
    f = _num(v)
    return int(f) if f is not None and f > 0 else None
