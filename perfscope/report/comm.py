"""The communication sections: gradient synchronisation (with the allreduce's alpha-beta fit),
backends compared, and communication by op and role."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..words import joined
from .context import Context, curve_groups, with_group
from .model import Num, Section, table_block, table_columns


def _where(fit: dict[str, Any]) -> str:
    """' (cluster · backend)' of a fit, the unknown parts left out."""
    where = joined((fit["cluster"], fit["backend"]))
    return f" ({where})" if where else ""


def sync(ctx: Context) -> Section:
    s = Section("sync", "Gradient synchronisation", definitions=("busbw", "alpha-beta"))
    values = with_group(ctx, ctx.rows("sync"))
    s.blocks.append(
        [
            "Exposed sync is the part of the step spent waiting for gradients; total is the duration of "
            "every collective, part of which overlaps with backward. Bus bandwidth follows nccl-tests, "
            "and the ring-allreduce model T = 2(p−1)·α + 2(p−1)/p·n·β is fitted separately inside a "
            "node and across nodes."
        ]
    )
    s.blocks.append(ctx.chart("sync_time"))
    s.blocks.append(ctx.chart("busbw"))
    fit = ctx.rows("allreduce_fit")
    for f in fit:
        f["fit_key"] = f"{f['cluster']}/{f['backend']}/{f['scope']}"
    for scope, where in (("intra-node", "Inside one node"), ("inter-node", "Across nodes")):
        fitted = [
            f for f in fit if f["scope"] == scope and f["bandwidth_gb_per_s"] and not f["too_few_points"]
        ]
        if not fitted:
            continue
        lo = min(fitted, key=lambda f: f["bandwidth_gb_per_s"])
        hi = max(fitted, key=lambda f: f["bandwidth_gb_per_s"])
        para: list[Any] = [f"{where} the fitted allreduce bandwidth 1/β is "]
        if lo is hi:
            para += [Num(lo["bandwidth_gb_per_s"], "allreduce_fit", "bandwidth_gb_per_s", lo["fit_key"])]
            para += [f"{_where(lo)}, latency α "]
            para += [Num(lo["alpha_s"], "allreduce_fit", "alpha_s", lo["fit_key"]), "."]
        else:
            para += [
                Num(lo["bandwidth_gb_per_s"], "allreduce_fit", "bandwidth_gb_per_s", lo["fit_key"]),
                f"{_where(lo)} to ",
                Num(hi["bandwidth_gb_per_s"], "allreduce_fit", "bandwidth_gb_per_s", hi["fit_key"]),
                f"{_where(hi)}.",
            ]
        s.blocks.append(para)
    s.blocks.append(
        table_block(
            "allreduce_fit",
            "Alpha-beta fit of the ring allreduce",
            table_columns(
                ("cluster", "cluster"),
                ("backend", "backend"),
                ("scope", "scope"),
                ("alpha_s", "α (latency)"),
                ("bandwidth_gb_per_s", "1/β (bandwidth)"),
                ("points", "points"),
                ("world_sizes", "world sizes"),
                ("smape_pct", "SMAPE"),
                ("r2_adj", "adj. R²"),
                ("too_few_points", "too few points"),
            ),
            fit,
            key="fit_key",
        )
    )
    curve = [r for rs in curve_groups(values).values() for r in rs if r["world_size"] > 1]
    # tensor-parallel collectives (on the layout's tp groups) are not gradient sync: their own columns
    tp = (
        [("tp_comm_exposed_ns", "exposed TP comm"), ("tp_comm_total_ns", "total TP comm"),
         ("tp_comm_count", "TP collectives/step")]
        if any(r.get("tp_comm_count") for r in curve) else []
    )  # fmt: skip
    s.blocks.append(
        table_block(
            "sync",
            "Synchronisation per run",
            table_columns(
                ("group", "group"),
                ("world_size", "N"),
                ("scope", "scope"),
                ("sync_exposed_ns", "exposed sync"),
                ("comm_total_ns", "total comm"),
                ("overlap_share", "overlap"),
                ("comm_count", "collectives/step"),
                ("bytes_per_step", "bytes/step"),
                ("busbw_gb_per_s", "busbw"),
                ("bw_source", "from"),
                *tp,
            ),
            curve,
        )
    )
    return s


def backends(ctx: Context) -> Section | None:
    values = ctx.rows("backend_compare")
    if len({r["backend"] for r in values}) < 2:
        return None
    s = Section("backends", "Backends compared", definitions=("step-time", "throughput"))
    s.blocks.append(
        [
            "The same setup with different communication backends at the same world size; in the chart "
            "1.0 is the faster one."
        ]
    )
    for f in ctx.findings:
        if f.id.startswith("backend-comparison"):
            s.blocks.append([f.title])
    s.blocks.append(ctx.chart("backend_compare"))
    s.blocks.append(
        table_block(
            "backend_compare",
            "Backends side by side",
            table_columns(
                ("cluster", "cluster"),
                ("world_size", "N"),
                ("nodes", "nodes"),
                ("backend", "backend"),
                ("step_ns", "step time T"),
                ("sync_exposed_ns", "exposed sync"),
                ("ratio_to_best", "T / best"),
                ("best_backend", "best"),
            ),
            values,
        )
    )
    return s


def communication(ctx: Context) -> Section | None:
    """Communication beyond DDP: by op type and phase, and per rank and role (pipelines, servers)."""
    ops = ctx.rows("comm_ops")
    if not ops:
        return None
    s = Section(
        "communication", "Communication by op and role", definitions=("comm-patterns", "pipeline", "pserver")
    )
    run_id, why = _story_run(ctx, {r["run_id"] for r in ops})
    s.blocks.append(
        [
            "Every torch.distributed call made inside the profile is recorded: its total time (issue to "
            "completion) and the time the rank waited for it. A wait in forward or backward is "
            "communication, not compute; a pipeline stage's wait in send/recv is its bubble, and a "
            "worker's push and pull wait on a parameter server."
        ]
    )
    caption = f"run {run_id}, {why}"
    s.blocks.append(ctx.chart("comm_ops", caption, run_id=run_id))
    s.blocks.append(ctx.chart("comm_roles", caption, run_id=run_id))
    tp = [r for r in ctx.rows("sync") if r.get("tp_comm_count")]
    if tp:
        s.blocks.append(
            [
                "Tensor-parallel communication (collectives on the recorded layout's tensor-parallel groups, "
                "part of the layers' forward and backward) is its own figure, never gradient sync: the "
                "gradient sync columns count the data-parallel collectives alone."
            ]
        )
        s.blocks.append(
            table_block(
                "sync",
                "Tensor-parallel communication beside gradient sync, per step",
                table_columns(
                    ("run_id", "run"),
                    ("world_size", "N"),
                    ("sync_exposed_ns", "exposed sync"),
                    ("comm_total_ns", "total comm"),
                    ("comm_count", "collectives/step"),
                    ("tp_comm_exposed_ns", "exposed TP comm"),
                    ("tp_comm_total_ns", "total TP comm"),
                    ("tp_comm_count", "TP collectives/step"),
                ),
                tp,
            )
        )
    return s


def _story_run(ctx: Context, candidates: set[str]) -> tuple[str, str]:
    """Which of `candidates` a one-run figure shows, and why in words: the run the highest-ranked
    finding names (its largest world size), else the largest world size of the group the findings
    are about, else of all candidates."""
    sizes = {r["run_id"]: r["world_size"] or 0 for r in ctx.rows("run_summary", ("run_id", "world_size"))}
    groups = {r["run_id"]: r["group_id"] for r in ctx.rows("scaling", ("run_id", "group_id"))}

    def largest(runs: Iterable[str]) -> str | None:
        return max(sorted(runs), key=lambda r: sizes.get(r, 0), default=None)

    def at(run: str) -> str:
        return f" (N = {sizes[run]})" if sizes.get(run) else ""

    for f in ctx.findings:
        named = largest(r for r in f.run_ids if r in candidates)
        if named is not None:
            return named, f"the run finding {f.rank} is about{at(named)}"
    for f in ctx.findings:
        in_group = largest(r for r in candidates if f.group_id and groups.get(r) == f.group_id)
        if in_group is not None:
            return (
                in_group,
                f"the largest world size of {ctx.label(f.group_id)}, which finding {f.rank} is about",
            )
    chosen = largest(candidates)
    assert chosen is not None
    return chosen, f"the largest world size among the runs with communication{at(chosen)}"
