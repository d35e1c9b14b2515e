"""Data quality and confounds: missing ranks, phases and baselines, mixed modes, variance, throttling."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa

from ..store.reader import Store
from ..store.rollups import rank_sums_sql
from ..store.warmup import MIN_STEADY_STEPS
from ..words import joined, ordinal
from .fitting import MIN_POINTS
from .groups import group_name
from .registry import analysis, run_analysis
from .scaling import scaling_table
from .selection import Selection, sql_literal
from .steady import PHASES, run_stats_table, runs_table, thresholds_table

HIGH_CV = 0.25
#: share of slow steps (steady.SLOW_STEP_RATIO × median) that makes two kinds of step: bimodal
BIMODAL_SHARE = (0.05, 0.5)
SUPERLINEAR_EFFICIENCY = 1.1
THROTTLE_SHARE = 0.2
CLOCK_DROP = 0.9

QUALITY_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("source", pa.string()),
        ("group_id", pa.string()),
        ("kind", pa.string()),
        ("severity", pa.string()),
        ("message", pa.string()),
        ("value", pa.float64()),
    ]
)


def _row(
    kind: str,
    severity: str,
    message: str,
    run_id: str | None = None,
    group_id: str | None = None,
    value: float | None = None,
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "group_id": group_id,
        "kind": kind,
        "severity": severity,
        "message": message,
        "value": value,
    }


@analysis("quality", "Data quality and confounds", "data-quality")
def quality(store: Store, sel: Selection) -> pa.Table:
    """One row per problem found; an empty table means nothing to warn about."""
    rows: list[dict[str, Any]] = []
    rows += _orphans(store, sel)
    rows += _identity_and_durations(store, sel)
    stats = store.query(f"SELECT * FROM {run_stats_table(store, sel)} ORDER BY run_id").to_pylist()
    for r in stats:
        rows += _run_checks(r)
    scaling = store.query(
        f"SELECT * FROM {scaling_table(store, sel)} ORDER BY group_id, world_size"
    ).to_pylist()
    rows += _group_checks(stats, scaling)
    rows += _throttling(run_analysis("utilisation", store, sel).to_pylist(), scaling)
    sources = {r["run_id"]: r["source"] for r in stats}
    for row in rows:
        row["source"] = sources.get(row["run_id"])
    return pa.Table.from_pylist(rows, schema=QUALITY_SCHEMA)


def _orphans(store: Store, sel: Selection) -> list[dict[str, Any]]:
    if sel.experiments or sel.clusters or sel.backends or sel.source:
        return []  # a run without metadata cannot match these filters; say nothing about it
    known = store.query("SELECT run_id FROM runs").column("run_id").to_pylist()
    # A literal list (not a subquery) lets DuckDB prune whole partitions: only orphans' files are read.
    not_known = f"WHERE run_id NOT IN ({', '.join(sql_literal(k) for k in known)})" if known else ""
    ids = (
        store.query(f"SELECT DISTINCT run_id FROM steps {not_known} ORDER BY 1").column("run_id").to_pylist()
    )
    if sel.run_ids:
        ids = [i for i in ids if i in sel.run_ids]
    return [
        _row(
            "runs_without_metadata",
            "warning",
            f"run {i} has steps but no runs row (rank 0 never wrote its metadata, or it was lost); "
            "it is left out of every comparison.",
            run_id=i,
        )
        for i in ids
    ]


def _identity_and_durations(store: Store, sel: Selection) -> list[dict[str, Any]]:
    """Runs whose id two recordings share (their rows are mixed: every number of it is wrong), and
    step rows with a NULL or negative duration (left out of the statistics)."""
    runs = runs_table(store, sel)
    recordings = "count(DISTINCT (rank, pid, started_ns))"
    shared = store.query(
        f"""
        SELECT run_id, {recordings} AS recordings, count(DISTINCT rank) AS ranks
        FROM ranks WHERE run_id IN (SELECT run_id FROM {runs}) GROUP BY run_id
        HAVING {recordings} > count(DISTINCT rank) ORDER BY run_id
        """
    ).to_pylist()
    out = [
        _row(
            "shared_run_id",
            "warning",
            f"run {r['run_id']}: {r['recordings']} rank recordings for {r['ranks']} rank(s): two runs "
            "were recorded under this one id and their rows are mixed, so its numbers are wrong; "
            "record again with a distinct run id.",
            r["run_id"],
            value=r["recordings"],
        )
        for r in shared
    ]
    # step rows with a NULL or negative time, per run, from the rollups where they cover the run
    sums = rank_sums_sql(store, thresholds_table(store, sel), ("null_steps", "negative"), steady=False)
    bad = store.query(
        f"""
        SELECT run_id, sum(null_steps)::BIGINT AS null_steps, sum(negative)::BIGINT AS negative
        FROM ({sums}) GROUP BY run_id HAVING sum(null_steps) > 0 OR sum(negative) > 0 ORDER BY run_id
        """
    ).to_pylist()
    out += [
        _row(
            "impossible_durations",
            "warning",
            f"run {r['run_id']}: {r['negative']} step rows with a negative duration and "
            f"{r['null_steps']} without a step time (a clock or collector fault); they are left "
            "out of the statistics.",
            r["run_id"],
            value=r["negative"] + r["null_steps"],
        )
        for r in bad
    ]
    return out


def _run_checks(r: dict[str, Any]) -> list[dict[str, Any]]:
    rid = r["run_id"]
    out = []
    if not r["n_steps"]:
        return [_row("run_without_steps", "warning", f"run {rid} has metadata but no recorded steps.", rid)]
    ws, seen = r["world_size"], r["ranks_seen"] or 0
    if ws and seen < ws - (r.get("servers") or 0):  # a parameter server records no steps
        out.append(
            _row(
                "missing_ranks",
                "warning",
                f"run {rid}: steps of {seen} of its {ws} ranks are in the store; "
                "rank-level results (load balance, stragglers) cover only those.",
                rid,
                value=seen,
            )
        )
    if r["incomplete_steps"]:
        out.append(
            _row(
                "missing_ranks",
                "warning",
                f"run {rid}: {r['incomplete_steps']} steady steps lack some ranks' rows "
                "(ranks recorded different numbers of steps: one stopped early, ran extra steps, "
                "or lost its last segment).",
                rid,
                value=r["incomplete_steps"],
            )
        )
    missing = [
        p
        for p in PHASES
        if p != "other" and r[f"{p}_mean"] is None and not (p == "sync_exposed" and (ws or 1) <= 1)
    ]
    if missing:
        out.append(
            _row(
                "missing_phases",
                "warning",
                f"run {rid} recorded no {', '.join(missing)} phase; that time is counted as "
                "'other', so the phase breakdown cannot say where it went.",
                rid,
                value=len(missing),
            )
        )
    if r["warmup_fallback"] or (r["steady_steps"] or 0) < MIN_STEADY_STEPS:
        out.append(
            _row(
                "few_steady_steps",
                "warning",
                f"run {rid} has only {r['n_steps']} steps, so {r['steady_steps']} steady steps "
                "remain after the warm-up; its medians are rough.",
                rid,
                value=r["steady_steps"],
            )
        )
    if r["step_cv"] is not None and r["step_cv"] > HIGH_CV:
        out.append(
            _row(
                "high_variance",
                "warning",
                f"run {rid}: step time varies a lot (coefficient of variation {r['step_cv']:.2f}); "
                "its speedup is uncertain (noisy neighbours, I/O, a shared node?).",
                rid,
                value=r["step_cv"],
            )
        )
    out += _step_shape(r)
    return out


def _step_shape(r: dict[str, Any]) -> list[dict[str, Any]]:
    """A periodic or bimodal step-time distribution, named: its median is one kind of step only."""
    share, ratio, period = r.get("slow_step_share"), r.get("slow_step_ratio"), r.get("step_period")
    if not share or ratio is None or not (period or BIMODAL_SHARE[0] <= share <= BIMODAL_SHARE[1]):
        return []
    rid = r["run_id"]
    what = f"every {ordinal(int(period))} step takes" if period else f"{share:.0%} of steady steps take"
    return [
        _row(
            "periodic_steps" if period else "bimodal_steps",
            "info",
            f"run {rid}: {what} {ratio:.1f}× the median step (a periodic sync, checkpoint or "
            "evaluation?); throughput counts them in full (samples over elapsed time), the median "
            "describes only the common step.",
            rid,
            value=float(period or share),
        )
    ]


def _group_checks(stats: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in scaling:
        by_group[s["group_id"]].append(s)
    fam_sizes: dict[tuple[Any, ...], set[int]] = defaultdict(set)
    fam_modes: dict[tuple[Any, ...], set[str]] = defaultdict(set)
    for s in scaling:
        fam = (s["experiment"], s["cluster"], s["backend"], s["model"])
        fam_sizes[fam].add(s["world_size"])
        if s["scaling_mode"] != "single":
            fam_modes[fam].add(s["scaling_mode"])
    for gid, rows in by_group.items():
        first = rows[0]
        fam = (first["experiment"], first["cluster"], first["backend"], first["model"])
        if first["mixed"]:
            out.append(
                _row(
                    "mixed_scaling_mode",
                    "warning",
                    f"group {group_name(gid)}: {first['mode_note']}; its runs are not compared as one "
                    "scaling series.",
                    group_id=gid,
                )
            )
        sources = {r["source"] for r in rows}
        if len(sources) > 1:
            out.append(
                _row(
                    "mixed_sources",
                    "warning",
                    f"group {group_name(gid)} mixes measured and simulated runs; speedups across "
                    "them compare a model with a measurement.",
                    group_id=gid,
                )
            )
        n0 = first["baseline_world_size"]
        if first["scaling_mode"] == "single" and n0 > min(fam_sizes[fam]):
            for r in rows:
                out.append(
                    _row(
                        "no_baseline",
                        "warning",
                        f"run {r['run_id']} (N={r['world_size']}) has no run at a smaller world size "
                        "with the same per-rank or global batch, so its speedup has no baseline.",
                        r["run_id"],
                        gid,
                    )
                )
        sizes = sorted({r["world_size"] for r in rows})
        if 1 < len(sizes) < MIN_POINTS:
            out.append(
                _row(
                    "too_few_points",
                    "info",
                    f"group {group_name(gid)} has {len(sizes)} world sizes "
                    f"({', '.join(map(str, sizes))}); "
                    f"scaling models need {MIN_POINTS}-5 to be trusted for predictions.",
                    group_id=gid,
                    value=len(sizes),
                )
            )
        for r in rows:
            if r["world_size"] > n0 and (r["efficiency"] or 0) > SUPERLINEAR_EFFICIENCY:
                out.append(
                    _row(
                        "superlinear",
                        "warning",
                        f"run {r['run_id']}: efficiency {r['efficiency']:.2f} at N={r['world_size']} is "
                        "superlinear: more aggregate cache/memory, a slow baseline, or less work per "
                        "step than the baseline; check before reading it as a gain.",
                        r["run_id"],
                        gid,
                        r["efficiency"],
                    )
                )
    for fam, modes in fam_modes.items():
        if len(modes) > 1:
            where = joined(fam[1:3], ", ")  # cluster and backend, the unknown ones left out
            out.append(
                _row(
                    "mixed_scaling_mode",
                    "info",
                    f"experiment {fam[0]}{f' ({where})' if where else ''} holds both weak and strong scaling "
                    "series; they are compared separately.",
                    value=None,
                )
            )
    return out


def _throttling(util: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for u in util:
        if u["throttle_share"] is not None or u["sm_clock_mhz"] is not None:
            by_group[u["group_id"]].append(u)
    for gid, rows in by_group.items():
        rows.sort(key=lambda u: u["world_size"])
        lo, hi = rows[0], rows[-1]
        if lo is hi:
            continue
        share_hi = hi["throttle_share"] or 0.0
        share_lo = lo["throttle_share"] or 0.0
        clock_drop = (
            hi["sm_clock_mhz"] / lo["sm_clock_mhz"] if hi["sm_clock_mhz"] and lo["sm_clock_mhz"] else 1.0
        )
        if (share_hi > THROTTLE_SHARE and share_hi > share_lo + 0.1) or clock_drop < CLOCK_DROP:
            out.append(
                _row(
                    "throttling",
                    "warning",
                    f"group {group_name(gid)}: at N={hi['world_size']} the GPUs were clock-throttled in "
                    f"{share_hi:.0%} of samples (vs {share_lo:.0%} at N={lo['world_size']}) and ran at "
                    f"{clock_drop:.0%} of the SM clock; part of the lost efficiency is power or "
                    "thermal, not scaling.",
                    hi["run_id"],
                    gid,
                    share_hi,
                )
            )
    return out
