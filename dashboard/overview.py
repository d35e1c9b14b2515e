"""Overview page: the runs in the store, the ranked findings with links to their charts, data quality."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import streamlit as st

from perfscope.charts.rows import multi_point_groups, rows
from perfscope.report.text import literal as md
from perfscope.words import counted, plural

from . import links
from .state import Context
from .widgets import (
    EMPTY_CELL,
    Col,
    definition_note,
    device_unit_of,
    for_unit,
    no_runs,
    pct,
    relabel,
    show_table,
    simulated_notice,
)

SEVERITY_ICONS = {"alarm": ":material/error:", "warning": ":material/warning:", "info": ":material/info:"}
SEVERITY_COLOURS = {"alarm": "red", "warning": "orange", "info": "blue"}

RUN_COLUMNS = {
    "run_id": Col("run"),
    "source": Col("source", help="measured by perfscope.profile or simulated by perfscope simulate"),
    "experiment": Col("experiment"),
    "cluster": Col("cluster"),
    "backend": Col("backend"),
    "world_size": Col("N", fmt="%d", help="world size: ranks (GPUs or processes)"),
    "nodes": Col("nodes", fmt="%d"),
    "batch_size_per_rank": Col("batch/rank", fmt="%d"),
    "step_ns": Col("step (ms)", 1e-6, "%.3f", "steady window's elapsed time per step (slowest rank)"),
    "step_cv": Col("step CV", fmt="%.3f", help="coefficient of variation of the step time (stdev/mean)"),
    "throughput_samples_per_s": Col("samples/s", fmt="%,.0f", help="X = global samples / step time"),
    "steady_steps": Col("steady steps", fmt="%d"),
    "device_model": Col("device"),
}

GLANCE_COLUMNS = {
    "group_id": Col("scaling group"),
    "source": Col("source"),
    "baseline_world_size": Col("N0", fmt="%d", help="smallest world size of the group: the baseline"),
    "world_size": Col("largest N", fmt="%d"),
    "speedup": Col("speedup S(N)", fmt="%.2f"),
    "efficiency": Col("efficiency E(N)", 100.0, "%.0f%%"),
    "per_gpu_speedup": Col("per-GPU speedup S(N)/N", fmt="%.2f", help="what the seed study quotes"),
}

QUALITY_COLUMNS = {
    "severity": Col("severity"),
    "kind": Col("kind"),
    "message": Col("what"),
    "run_id": Col("run"),
    "group_id": Col("group"),
}


def render(ctx: Context) -> None:
    st.title("Overview")
    summary = ctx.table("run_summary")
    if summary.num_rows == 0:
        no_runs()
        return
    _headline(summary)
    simulated_notice(summary)

    st.header("Scaling at a glance", anchor="glance")
    _glance(ctx.table("scaling"), device_unit_of(summary), ctx.group_labels())

    st.header("Findings", anchor="findings")
    st.caption("Ranked by the share of lost efficiency each explains, then severity and confidence.")
    findings = ctx.findings()
    if findings is not None:
        if not findings:
            st.success("No finding: nothing in this selection looks wrong to the explainer's rules.")
        for i, f in enumerate(findings, 1):
            _finding(ctx, i, f)

    st.header("Runs", anchor="runs")
    show_table(summary, RUN_COLUMNS)
    definition_note("run_summary")

    st.header("Data quality", anchor="quality")
    _quality(ctx)


def _headline(summary: pa.Table) -> None:
    vals = rows(summary, ("experiment", "source", "world_size", "cluster", "backend"))
    sim = sum(1 for r in vals if r["source"] == "simulated")
    sizes = sorted({r["world_size"] for r in vals if r["world_size"] is not None})
    cols = st.columns(5)
    cols[0].metric("Runs", len(vals), help="runs in the selection")
    cols[1].metric("Measured / simulated", f"{len(vals) - sim} / {sim}")
    cols[2].metric("Experiments", len({r["experiment"] for r in vals}))
    cols[3].metric(*world_sizes(sizes))
    cols[4].metric(
        "Clusters × backends", f"{len({r['cluster'] for r in vals})} × {len({r['backend'] for r in vals})}"
    )


#: world sizes the overview lists one by one; more are said as their range (all of them in its help)
LISTED_SIZES = 3


def world_sizes(sizes: list[int]) -> tuple[str, str, str]:
    """The overview's world-size metric (label, value, help): the sizes themselves, never a count to
    misread (issue 34: "World sizes 2" read as two sizes). One size is "World size N = 2"; a few are
    listed, "1, 2, 4"; more are their range, "1–12", with every size in the help."""
    listed = ", ".join(map(str, sizes))
    if not sizes:
        return "World size", "–", "no run in the selection records its world size"
    if len(sizes) == 1:
        return "World size", f"N = {sizes[0]}", "ranks; every run in the selection has this world size"
    shown = listed if len(sizes) <= LISTED_SIZES else f"{sizes[0]}–{sizes[-1]}"
    return "World sizes", shown, f"ranks; the runs in the selection have {len(sizes)} sizes: {listed}"


#: Findings shown open; the rest are listed by title, one click away.
OPEN_FINDINGS = 3


def _finding(ctx: Context, rank: int, f: Any) -> None:
    icon = SEVERITY_ICONS.get(f.severity, ":material/info:")
    box = st.expander(
        f"**{rank}. {md(f.title)}**",
        expanded=rank <= OPEN_FINDINGS,
        icon=icon,
        key=f"finding:{f.id}",
        on_change="rerun",
    )
    with box:
        if not box.open:
            return  # a closed finding draws only its title: a study can have dozens
        st.badge(f.severity, icon=icon, color=SEVERITY_COLOURS.get(f.severity, "gray"))  # type: ignore[arg-type]
        st.markdown(md(f.text))
        if f.symptoms:
            st.markdown(
                "**Symptoms of this cause** (their shares overlap its share):\n"
                + "".join(f"\n- *{md(s.title)}.* {md(s.text)}" for s in f.symptoms)
            )
        if f.also_in:
            st.markdown("**The same on other groups:**\n" + "".join(f"\n- {md(a.title)}" for a in f.also_in))
        if f.recommendation:
            st.markdown(f"**What to do:** {md(f.recommendation)}")
        facts = [f"confidence {f.confidence_label} ({f.confidence:.2f})"]
        if f.explained_loss is not None:
            facts.append(f"explains {pct(f.explained_loss)} of the group's lost time")
        facts.append(f"rule: {f.rule} ({f.category})")
        if f.group_id:
            facts.append(f"group: {ctx.group_labels().get(f.group_id, f.group_id)}")
        st.caption(" · ".join(md(fact) for fact in facts))
        evidence_runs = list(f.evidence.run_ids)
        shown = ", ".join(evidence_runs[:4]) + (
            f" and {len(evidence_runs) - 4} more" if len(evidence_runs) > 4 else ""
        )
        if shown:
            st.caption(f"evidence runs: {md(shown)}")
        found = links.links_for(f.evidence.analyses, evidence_runs, f.group_id)
        if found:
            cols = st.columns(len(found))
            for col, link in zip(cols, found, strict=True):
                page = ctx.pages.get(link.place.page)
                if page is not None:
                    col.page_link(
                        page, label=link.place.label, icon=":material/insert_chart:", query_params=link.params
                    )
        definition_note(*f.evidence.analyses, popover=True)


def _glance(scaling: pa.Table, unit: str, labels: dict[str, str]) -> None:
    """Each scaling group at its largest world size: the seed study's headline numbers."""
    vals = rows(scaling)
    keep = multi_point_groups([r for r in vals if not r.get("mixed")])
    last: dict[str, dict[str, Any]] = {}
    for r in vals:
        g = str(r.get("group_id"))
        if g in keep and (g not in last or r["world_size"] > last[g]["world_size"]):
            last[g] = r
    if not last:
        st.caption("No scaling group has runs at two or more world sizes in this selection.")
        return
    table = pa.Table.from_pylist([last[g] for g in sorted(last)])
    show_table(relabel(table, "group_id", labels), for_unit(GLANCE_COLUMNS, unit))
    definition_note("scaling")


def _quality(ctx: Context) -> None:
    skipped = ctx.store.skipped
    if skipped:
        st.warning(
            f"{counted(len(skipped), 'file')} in the store could not be read and "
            f"{plural('was', len(skipped))} skipped; the numbers above leave them out.",
            icon=":material/warning:",
        )
        st.dataframe(
            pa.table({"file": [s.path for s in skipped], "reason": [s.reason for s in skipped]}),
            hide_index=True,
            placeholder=EMPTY_CELL,
        )
    quality = ctx.table("quality")
    if quality.num_rows:
        show_table(relabel(quality, "group_id", ctx.group_labels()), QUALITY_COLUMNS)
        definition_note("quality")
    elif not skipped:
        st.success("No data-quality problem found in this selection.")
