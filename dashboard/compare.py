"""Compare page: two runs or two scaling groups side by side, with the differences that matter highlighted."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pyarrow as pa
import streamlit as st

from perfscope.analysis.compare import Side, compare
from perfscope.charts.compare import (
    NOTABLE_CHANGE,
    VERDICT_COLOURS,
    Quantity,
    difference_table,
    phase_compare_chart,
    phase_waterfall_chart,
    scaling_compare_chart,
    step_distribution_chart,
)
from perfscope.charts.rows import group_label_map, rows
from perfscope.commands.compare import where_lines
from perfscope.errors import PerfscopeError
from perfscope.report.text import literal as md
from perfscope.words import known

from .state import Context
from .widgets import chart, definition_note, no_runs

RUN_QUANTITIES = (
    Quantity("step_ns", "step time (elapsed mean)", "ms", 1e-6, "lower"),
    Quantity("throughput_samples_per_s", "throughput", "samples/s", 1.0, "higher"),
    Quantity("data_ns", "data (loader wait)", "ms", 1e-6, "lower"),
    Quantity("forward_ns", "forward", "ms", 1e-6, "lower"),
    Quantity("backward_ns", "backward", "ms", 1e-6, "lower"),
    Quantity("sync_exposed_ns", "exposed sync", "ms", 1e-6, "lower"),
    Quantity("optimizer_ns", "optimizer", "ms", 1e-6, "lower"),
    Quantity("other_ns", "other", "ms", 1e-6, "lower"),
    Quantity("imbalance_ns", "imbalance (wait for slowest rank)", "ms", 1e-6, "lower"),
    Quantity("comm_total_ns", "collectives, total (overlapped or not)", "ms", 1e-6, "lower"),
    Quantity("step_cv", "step-time CV", "", 1.0, "lower"),
    Quantity("load_balance", "load balance (POP)", "", 1.0, "higher"),
    Quantity("comm_efficiency", "communication efficiency (POP)", "", 1.0, "higher"),
    Quantity("util_gpu_pct", "kernel-active share (NVML)", "%", 1.0, ""),
    Quantity("power_w", "GPU power (per run, mean)", "W", 1.0, ""),
    Quantity("energy_per_sample_j", "energy per sample", "mJ", 1e3, "lower"),
)
#: Run settings worth naming when two runs differ in them.
SETTINGS = (
    "source",
    "experiment",
    "cluster",
    "backend",
    "world_size",
    "nodes",
    "batch_size_per_rank",
    "global_batch_size",
    "device_model",
    "model",
    # threads and cores per rank (the threads analysis): N=1 under torchrun has all of a host's threads,
    # each rank of N=2 one, so two runs that differ here are not like with like
    "threads_per_rank",
    "omp_num_threads",
    "cores_per_rank_allowed",
)
GROUP_FIELDS = {
    "efficiency": "efficiency E(N)",
    "speedup": "speedup S(N)",
    "per_gpu_speedup": "per-GPU speedup S(N)/N",
    "throughput_samples_per_s": "throughput (samples/s)",
}


def render(ctx: Context) -> None:
    st.title("Compare")
    summary = ctx.table("run_summary")
    if summary.num_rows == 0:
        no_runs()
        return
    mode = st.radio("Compare", ["Two runs", "Two groups"], horizontal=True, key="compare_mode")
    if mode == "Two runs":
        _runs(ctx, summary)
    else:
        _groups(ctx)


TWIN_KEYS = ("experiment", "cluster", "world_size", "batch_size_per_rank")


def _default_pair(runs: list[dict[str, Any]]) -> tuple[int, int]:
    """Two runs worth comparing: the largest world size measured on two backends (the seed study's
    NCCL against MPI), else the first two runs."""
    seen: dict[tuple[Any, ...], int] = {}
    best: tuple[int, int] | None = None
    for i, r in enumerate(runs):
        key = tuple(r[k] for k in TWIN_KEYS)
        j = seen.setdefault(key, i)
        twin = j != i and runs[j]["backend"] != r["backend"]
        if twin and (best is None or (r["world_size"] or 0) > (runs[best[0]]["world_size"] or 0)):
            best = (j, i)
    return best or (0, min(1, len(runs) - 1))


def _said(value: Any) -> str:
    """A setting's value in words: one nobody recorded says so, never 'None'."""
    return str(value) if known(value) else "not recorded"


def _runs(ctx: Context, summary: pa.Table) -> None:
    runs = rows(summary)
    ids = [r["run_id"] for r in runs]
    a_default, b_default = _default_pair(runs)
    left, right = st.columns(2)
    a = left.selectbox("Run A", ids, index=a_default, key="compare_a")
    b = right.selectbox("Run B", ids, index=b_default, key="compare_b")
    merged = {r["run_id"]: dict(r) for r in runs}
    # POP and utilisation numbers of the same runs (whole-selection tables: the cached ones)
    for name in ("pop", "utilisation", "threads"):
        for r in rows(ctx.table(name)):
            if r.get("run_id") in merged:
                for k, v in r.items():
                    merged[r["run_id"]].setdefault(k, v)
    ra, rb = merged[a], merged[b]
    differs = [f"{k}: {_said(ra.get(k))} → {_said(rb.get(k))}" for k in SETTINGS if ra.get(k) != rb.get(k)]
    if a == b:
        st.info("Pick two different runs.", icon=":material/compare_arrows:")
    elif differs:
        st.markdown("**A and B differ in** " + "; ".join(md(d) for d in differs))
    if "simulated" in (ra.get("source"), rb.get("source")):
        st.caption("At least one of the two runs is simulated (perfscope simulate), not measured.")
    if a != b:
        _verdict(ctx, a, b)
    _difference(difference_table(ra, rb, RUN_QUANTITIES))
    chart(phase_compare_chart(ctx.table("phase_breakdown"), a, b))
    definition_note("run_summary", "phase_breakdown", "pop", "utilisation")


def _verdict(ctx: Context, a: str, b: str) -> None:
    """`perfscope compare`'s verdict on B against A: the interval, the culprit, set-up changes and the
    two charts (the same analysis as the command and the report's section)."""
    try:
        c = compare(Side(ctx.store, a, "A"), Side(ctx.store, b, "B"))
    except PerfscopeError as exc:
        st.warning(md(exc.message), icon=":material/warning:")
        return
    ci = "no interval" if c.ci is None else f"95% interval {c.ci[0]:.3f}–{c.ci[1]:.3f}"
    ratio = "n/a" if c.step_ratio is None else f"×{c.step_ratio:.3f}"
    st.markdown(f"**Verdict for B against A: {c.verdict}**: step time {ratio}, {ci}")
    for line in where_lines(c):
        st.markdown(md(line))
    if c.setup_changes:
        st.dataframe(pd.DataFrame(c.setup_changes), hide_index=True)
    st.caption(
        f"Interval: moving-block bootstrap of each run's steady steps (blocks of {c.block_len} steps, "
        f"as steps are autocorrelated), seeded; no change when it holds 1 or lies within ±{c.threshold:.0%}. "
        "`perfscope compare` prints the same, with tables by rank, collective and op type."
    )
    left, right = st.columns(2)
    with left:
        chart(step_distribution_chart(c.steps_table()))
    with right:
        chart(phase_waterfall_chart(c.phase_table()))


def _groups(ctx: Context) -> None:
    scaling = ctx.table("scaling")
    vals = rows(scaling, ("group_id", "world_size", "source", *GROUP_FIELDS))
    groups = sorted({r["group_id"] for r in vals if r["group_id"]})
    if len(groups) < 2:
        st.info("This selection has fewer than two scaling groups.", icon=":material/info:")
        return
    labels = group_label_map(groups)
    left, mid, right = st.columns([2, 2, 1])
    a = left.selectbox(
        "Group A", groups, index=0, format_func=lambda g: labels.get(g, g), key="compare_group_a"
    )
    b = mid.selectbox(
        "Group B", groups, index=1, format_func=lambda g: labels.get(g, g), key="compare_group_b"
    )
    field = right.selectbox(
        "Quantity", list(GROUP_FIELDS), format_func=GROUP_FIELDS.__getitem__, key="compare_group_field"
    )
    chart(scaling_compare_chart(scaling, a, b, field))
    at_a = {str(r["world_size"]): r[field] for r in vals if r["group_id"] == a}
    at_b = {str(r["world_size"]): r[field] for r in vals if r["group_id"] == b}
    sizes = sorted(set(at_a) | set(at_b), key=int)
    scale = 100.0 if field == "efficiency" else 1.0
    unit = "%" if field == "efficiency" else ""
    better = "higher"
    _difference(
        difference_table(at_a, at_b, [Quantity(n, f"N = {n}", unit, scale, better) for n in sizes]),
        first_column=GROUP_FIELDS[field],
    )
    definition_note("scaling")


def _shown(v: float | None, signed: bool = False) -> str:
    """A number for reading: thousands separated, small values with their significant digits."""
    if v is None or v != v:
        return "–"
    sign = "+" if signed and v > 0 else ""
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{sign}{v:,.0f}"
    return f"{sign}{v:.3f}" if abs(v) >= 1 else f"{sign}{v:.4f}"


def _difference(table: pa.Table, first_column: str = "quantity") -> None:
    """The A/B table with each row tinted by its verdict for B (green better, orange worse)."""
    vals = rows(table)
    df = pd.DataFrame(
        {
            first_column: [r["quantity"] for r in vals],
            "unit": [r["unit"] for r in vals],
            "A": [_shown(r["a"]) for r in vals],
            "B": [_shown(r["b"]) for r in vals],
            "B − A": [_shown(r["difference"], signed=True) for r in vals],
            "B / A − 1": ["–" if r["change"] is None else f"{r['change']:+.1%}" for r in vals],
            "B against A": [r["verdict"] or "–" for r in vals],
        }
    )
    tints = {k: v + "22" for k, v in VERDICT_COLOURS.items() if k in ("better", "worse")}

    def tint(row: Any) -> list[str]:
        colour = tints.get(row["B against A"])
        return [f"background-color: {colour}" if colour else "" for _ in row]

    # pandas only for the Styler: Streamlit tints table rows from a Styler and nothing else
    st.dataframe(df.style.apply(tint, axis=1), hide_index=True)
    st.caption(
        f"Rows tinted green where B is better and orange where B is worse by {NOTABLE_CHANGE:.0%} or more; "
        "'same' is within that; 'different' where neither direction is better (e.g. kernel-active share)."
    )
