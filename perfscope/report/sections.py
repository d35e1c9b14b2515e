"""The story a report tells, section by section, built from analysis tables and findings only: setup,
speedup and efficiency, lost time, sync, backends, utilisation, stragglers, batch size, prediction,
findings, data quality."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ..analysis.selection import SOURCES
from ..charts import CHARTS
from ..charts.rows import group_labels, natural_key, rows
from ..explain.finding import Finding as ExplainFinding
from ..explain.rules_compute import LOW_LOAD_BALANCE, STRAGGLER_WAIT_SHARE
from ..words import counted, joined, known, plural
from .model import (
    ChartBlock,
    Finding,
    FindingsBlock,
    Num,
    Ref,
    Section,
    TableBlock,
    device_unit,
    format_value,
    table_block,
    table_columns,
)
from .what_if import what_if

#: Tables longer than this fold away in HTML (they stay complete in Markdown and --tables).

Tables = Mapping[str, pa.Table]


@dataclass
class Context:
    tables: Tables
    findings: list[Finding]
    labels: dict[str, str]  # group_id -> short label
    unit: str = "GPU"  # what one rank runs on, in words: "rank" when every run was on CPU
    #: every rule firing behind the findings, with the rank of the finding that says it (a symptom
    #: is said by its root cause's finding): the sections read these, never judge on their own
    fired: list[tuple[int, ExplainFinding]] = field(default_factory=list)

    def rows(self, name: str, columns: Iterable[str] | None = None) -> list[dict[str, Any]]:
        return rows(self.tables.get(name), list(columns) if columns is not None else None)

    def unit_of(self, run_id: Any) -> str:
        """What one rank of this run runs on, in words (a mixed store has CPU and GPU runs)."""
        models = [
            r["device_model"]
            for r in self.rows("run_summary", ["run_id", "device_model"])
            if r["run_id"] == run_id
        ]
        return device_unit(models) if models else self.unit

    def chart(
        self,
        name: str,
        caption: str = "",
        *,
        without: tuple[str, ...] = (),
        title: str | None = None,
        drawn: str | None = None,
        **options: Any,
    ) -> ChartBlock:
        """Chart `name` from the report's tables, leaving out the analyses in `without`; `drawn`: the
        column the chart plots, so that only rows with a value there say where the figure comes from
        (CPU runs have no GPU utilisation: a chart of it beside them draws simulated GPUs only)."""
        spec = CHARTS[name]
        tables = {k: v for k, v in self.tables.items() if k not in without}
        chart = spec.build(tables, **options)
        used = tuple(a for a in spec.analyses if a not in without)
        origin = source_words(self.sources_of(used, options.get("run_id"), drawn=drawn))
        words = ", ".join(c for c in (origin, caption) if c)
        return ChartBlock(name, title or spec.title, chart, used, words)

    def sources_of(
        self, analyses: Iterable[str], run_id: str | None = None, *, drawn: str | None = None
    ) -> set[str]:
        """Where the runs behind these analyses' rows come from (measured, simulated), read from a row's
        own source, else from its run or group; only `run_id`'s rows when one is given."""
        by_run = {r["run_id"]: r["source"] for r in self.rows("run_summary", ("run_id", "source"))}
        by_group: dict[str, set[str]] = {}
        for r in self.rows("scaling", ("group_id", "source")):
            by_group.setdefault(r["group_id"], set()).add(r["source"])
        out: set[str] = set()
        for name in analyses:
            if name == "scaling_prediction":  # a model's output, named by the caption itself
                continue
            for r in self.rows(name, ("source", "run_id", "group_id", drawn or "source")):
                if run_id is not None and r["run_id"] not in (None, run_id):
                    continue
                if drawn is not None and r[drawn] is None:
                    continue
                if r["source"] in SOURCES:
                    out.add(r["source"])
                elif r["run_id"] in by_run:
                    out.add(by_run[r["run_id"]])
                else:
                    out |= by_group.get(r["group_id"], set())
        return out & set(SOURCES)

    def label(self, group_id: str | None) -> str:
        return self.labels.get(group_id or "", group_id or "")


def source_words(sources: set[str]) -> str:
    """A figure's origin in words: never "measured" for a figure of simulated runs only."""
    if sources == {"measured"}:
        return "measured"
    if sources == {"simulated"}:
        return "simulated"
    if sources:
        return "measured and simulated runs (simulated ones hollow)"
    return ""


def _with_group(ctx: Context, values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in values:
        r["group"] = ctx.label(r.get("group_id"))
    return values


def _curve_groups(values: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by scaling group, only groups with two or more world sizes and not mixed, N ascending."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in values:
        if not r.get("mixed"):
            by.setdefault(r["group_id"], []).append(r)
    return {
        g: sorted(rs, key=lambda r: r["world_size"])
        for g, rs in sorted(by.items())
        if len({r["world_size"] for r in rs}) >= 2
    }


def _largest(values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The row at the largest world size of each group."""
    return [rs[-1] for rs in _curve_groups(values).values()]


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _joined(items: Iterable[Any]) -> str:
    """The distinct known values, in natural order; an unknown one (None, '', '-') is left out."""
    names: list[str] = sorted({str(i) for i in items if known(i)}, key=natural_key)
    return joined(names, ", ")


# ---- sections -----------------------------------------------------------------------------------


def overview(ctx: Context) -> Section:
    s = Section("overview", "At a glance", definitions=("speedup",))
    runs = ctx.rows("run_summary", ("experiment", "source"))
    scaling = _with_group(ctx, ctx.rows("scaling"))
    sim = sum(1 for r in runs if r["source"] == "simulated")
    s.blocks.append(
        [
            counted(len(runs), "run")
            + (f" of {names}" if (names := _joined(r["experiment"] for r in runs)) else "")
            + (f"; {sim} of them simulated (not measured)." if sim else ", all measured.")
        ]
    )
    last = _largest(scaling)
    speedups = [r for r in last if r["per_gpu_speedup"] is not None]
    if last and not speedups:
        s.blocks.append(
            [
                f"Per-{ctx.unit} speedup is unknown: throughput needs the samples of each step, and these "
                "runs recorded none (give the batch size: profile(batch_size=...) or perfscope run "
                "--batch-size)."
            ]
        )
    if speedups:
        best = max(speedups, key=lambda r: r["per_gpu_speedup"])
        worst = min(speedups, key=lambda r: r["per_gpu_speedup"])
        if best is worst:
            s.blocks.append(
                [
                    f"Per-{ctx.unit} speedup at N = {best['world_size']} is ",
                    Num(best["per_gpu_speedup"], "scaling", "per_gpu_speedup", best["run_id"]),
                    f" ({best['group']}).",
                ]
            )
        else:
            s.blocks.append(
                [
                    f"Per-{ctx.unit} speedup at the largest world size ranges from ",
                    Num(worst["per_gpu_speedup"], "scaling", "per_gpu_speedup", worst["run_id"]),
                    f" ({worst['group']}, N = {worst['world_size']}) to ",
                    Num(best["per_gpu_speedup"], "scaling", "per_gpu_speedup", best["run_id"]),
                    f" ({best['group']}, N = {best['world_size']}).",
                ]
            )
    if last:
        s.blocks.append(
            table_block(
                "scaling",
                "Scaling at the largest world size of each group",
                table_columns(
                    ("group", "group"),
                    ("baseline_world_size", "N0"),
                    ("world_size", "N"),
                    ("source", "source"),
                    ("speedup", "speedup S"),
                    ("ideal_speedup", "ideal N/N0"),
                    ("per_gpu_speedup", "S/N"),
                    ("efficiency", "efficiency E"),
                ),
                last,
            )
        )
    else:
        s.blocks.append(["No scaling group in this selection has two or more world sizes."])
    top = [f for f in ctx.findings if f.severity != "info"][:3]
    if top:
        s.blocks.append(["Main findings (ranked by the share of the lost efficiency they explain):"])
        for f in top:
            where = f"{ctx.label(f.group_id)}: " if f.group_id else ""
            s.blocks.append([f"{f.rank}. ", Ref(where + f.title, f"finding-{f.rank}")])
    return s


#: the threads analysis's columns shown in the runs table: what a rank computed with, as recorded
THREAD_COLUMNS = [
    ("threads_per_rank", "threads/rank"),
    ("omp_num_threads", "OMP"),
    ("mkl_num_threads", "MKL"),
    ("cores_per_rank_allowed", "cores/rank"),
]
THREAD_NOTE = (
    "threads/rank: torch's intra-op threads in each rank; OMP and MKL: OMP_NUM_THREADS and "
    "MKL_NUM_THREADS as the job set them (– when unset); cores/rank: the cores a rank may use (its "
    "CPU affinity, at most the host's logical CPUs)."
)


def setup(ctx: Context) -> Section:
    s = Section("setup", "Setup", definitions=("steady-state", "step-time", "throughput"))
    runs = ctx.rows("run_summary")
    setups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        key = (r["experiment"], r["cluster"], r["backend"], r["model"], r["device_model"])
        setups.setdefault(key, []).append(r)
    rows_ = []
    for (exp, cluster, backend, model, device), rs in sorted(setups.items(), key=lambda kv: str(kv[0])):
        rows_.append(
            {
                "experiment": exp,
                "cluster": cluster,
                "backend": backend,
                "model": model,
                "device_model": device,
                # a CPU setup beside GPU ones has no GPUs per node: '–', not its ranks per node
                "gpus_per_node": (max((r["gpus_per_node"] or 0) for r in rs) or None)
                if ctx.unit == "rank" or str(device).lower() != "cpu"
                else None,
                "world_sizes": _joined(r["world_size"] for r in rs),
                "batch_sizes_per_rank": _joined(r["batch_size_per_rank"] for r in rs) or None,
                "runs": len(rs),
                "source": _joined(r["source"] for r in rs),
            }
        )
    s.blocks.append(
        [
            "What was run: each line is one setup (experiment, cluster or partition, backend, model, "
            "device), with the world sizes and per-rank batch sizes it was run at."
        ]
    )
    s.blocks.append(
        table_block(
            "run_summary",
            "Setups",
            table_columns(
                ("experiment", "experiment"),
                ("cluster", "cluster"),
                ("backend", "backend"),
                ("model", "model"),
                ("device_model", "device"),
                ("gpus_per_node", f"{ctx.unit}s/node"),
                ("world_sizes", "world sizes N"),
                ("batch_sizes_per_rank", "batch/rank"),
                ("runs", "runs"),
                ("source", "source"),
            ),
            rows_,
            key="experiment",
        )
    )
    sim = [r for r in runs if r["source"] == "simulated"]
    if sim:
        s.blocks.append(
            [
                f"{len(sim)} of {counted(len(runs), 'run')} {plural('is', len(sim))} simulated (from a model "
                "of the hardware, such as "
                "perfscope simulate writes), not measured. Charts draw them as hollow triangles and "
                "tables say 'simulated'; read their numbers as what the model predicts."
            ]
        )
    warm = sorted({r["warmup_steps"] for r in runs if r["warmup_steps"] is not None})
    steady = [r["steady_steps"] for r in runs if r["steady_steps"] is not None]
    if warm and steady:
        s.blocks.append(
            [
                f"Steady state: the first {_joined(warm)} steps of each run are warm-up and dropped; "
                f"{_span(steady)} steady steps remain per run. Step time is the steady window's wall "
                "clock (latest end on any rank minus earliest start on any rank) over its steps, so "
                "throughput counts slow steps and ranks' misaligned steps are not counted twice."
            ]
        )
    versions = [
        c for c in ("torch_version", "cuda_version", "nccl_version", "driver_version") if c in runs[0]
    ]
    cols = [
        ("run_id", "run"),
        ("source", "source"),
        ("cluster", "cluster"),
        ("backend", "backend"),
        ("world_size", "N"),
        ("nodes", "nodes"),
        ("batch_size_per_rank", "batch/rank"),
        ("global_batch_size", "global batch"),
        ("steady_steps", "steady steps"),
        ("step_ns", "step time T"),
        ("step_cv", "step CV"),
        ("throughput_samples_per_s", "throughput X"),
    ]
    threads = {r["run_id"]: r for r in ctx.rows("threads")}
    if any(t["threads_per_rank"] is not None for t in threads.values()):  # older stores recorded none
        runs = [{**r, **{k: threads.get(r["run_id"], {}).get(k) for k, _ in THREAD_COLUMNS}} for r in runs]
        at = cols.index(("batch_size_per_rank", "batch/rank")) + 1  # beside the work per rank, in view
        cols[at:at] = THREAD_COLUMNS
    cols += [(c, c.replace("_version", "")) for c in versions]
    s.blocks.append(table_block("run_summary", "Runs", table_columns(*cols), runs))
    if THREAD_COLUMNS[0] in cols:
        s.blocks.append([THREAD_NOTE])
    over = [r for r in ctx.rows("placement") if r["oversubscribed_cpu"] or r["oversubscribed_gpu"]]
    if over:
        cpu_only = ctx.unit == "rank"
        devices = "CPUs" if cpu_only else "CPUs or GPUs"
        s.blocks.append([f"Some hosts ran more ranks than they have {devices}:"])
        placement = [("run_id", "run"), ("hostname", "host"), ("ranks_on_host", "ranks")]
        placement.append(("cpu_count", "CPUs"))
        s.blocks.append(
            table_block(
                "placement",
                "Oversubscribed hosts",
                table_columns(*placement, *([] if cpu_only else [("gpus_on_host", "GPUs")])),
                over,
            )
        )
    return s


def speedup(ctx: Context) -> Section:
    s = Section("speedup", "Speedup and efficiency", definitions=("speedup", "scaling-mode", "throughput"))
    scaling = _with_group(ctx, ctx.rows("scaling"))
    s.blocks.append(
        [
            "Speedup compares throughput with the smallest world size N0 of the same group (same "
            "experiment, cluster, backend, model and batch). Efficiency is the speedup over the ideal; "
            f"per-{ctx.unit} speedup is S(N)/N."
        ]
    )
    mixed = [r for r in scaling if r["mixed"]]
    if mixed:
        s.blocks.append(
            [
                f"{counted(len(mixed), 'run')} {plural('is', len(mixed))} in groups that mix strong and "
                "weak scaling; they are not compared: "
                + "; ".join(sorted({r["mode_note"] for r in mixed if r["mode_note"]}))
            ]
        )
    s.blocks.append(ctx.chart("speedup", without=("scaling_prediction",)))
    s.blocks.append(ctx.chart("efficiency", without=("scaling_prediction",)))
    s.blocks.append(ctx.chart("per_gpu_speedup", title=f"Per-{ctx.unit} speedup", unit=ctx.unit))
    curve_rows = [r for rs in _curve_groups(scaling).values() for r in rs]
    s.blocks.append(
        table_block(
            "scaling",
            "Scaling per group",
            table_columns(
                ("group", "group"),
                ("world_size", "N"),
                ("nodes", "nodes"),
                ("source", "source"),
                ("step_ns", "step time T"),
                ("throughput_samples_per_s", "throughput X"),
                ("speedup", "speedup S"),
                ("efficiency", "efficiency E"),
                ("per_gpu_speedup", "S/N"),
            ),
            curve_rows,
        )
    )
    return s


_PHASE_LOSS = (
    ("lost_data_ns", "data"),
    ("lost_forward_ns", "forward"),
    ("lost_backward_ns", "backward"),
    ("lost_sync_exposed_ns", "exposed sync"),
    ("lost_optimizer_ns", "optimizer"),
    ("lost_other_ns", "other"),
    ("lost_imbalance_ns", "imbalance"),
)


def lost_time(ctx: Context) -> Section:
    s = Section("lost-time", "Where the lost time went", definitions=("lost-time", "pop"))
    scaling = _with_group(ctx, ctx.rows("scaling"))
    s.blocks.append(
        [
            "Each bar splits a run's steady-state step into its phases. Lost time is the "
            f"{ctx.unit} time (ranks × step time) per step beyond perfect scaling, split by phase: the phase "
            "that grows is the one that ate the efficiency."
        ]
    )
    for r in _largest(scaling):
        if (r["lost_note"] or "").startswith("superlinear"):  # not a fact about N: about the baseline
            s.blocks.append(
                [
                    f"{r['group']}: at N = {r['world_size']} the step costs less "
                    f"{ctx.unit_of(r['run_id'])} time per sample than at the baseline (superlinear), "
                    "so no lost time is shown: the baseline run is likely contaminated (warm-up, "
                    "contention, another configuration) or the per-rank work now fits in cache."
                ]
            )
            continue
        if not r["lost_ns"]:
            continue
        worst = max(_PHASE_LOSS, key=lambda p: r[p[0]] or 0)
        s.blocks.append(
            [
                f"{r['group']}: at N = {r['world_size']}, ",
                Num(r["lost_ns"], "scaling", "lost_ns", r["run_id"]),
                f" of {ctx.unit_of(r['run_id'])} time is lost per step; the largest part is {worst[1]} (",
                Num(r[worst[0]], "scaling", worst[0], r["run_id"]),
                ").",
            ]
        )
    s.blocks.append(ctx.chart("phase_breakdown"))
    s.blocks.append(ctx.chart("lost_time", unit=ctx.unit))
    last = _largest(scaling)
    s.blocks.append(
        table_block(
            "scaling",
            f"Lost {ctx.unit} time per step at the largest N, by phase",
            table_columns(("group", "group"), ("world_size", "N"), ("lost_ns", "lost"), *_PHASE_LOSS),
            last,
        )
    )
    pop = _with_group(ctx, ctx.rows("pop"))
    pop_last = _largest(pop)
    if pop_last:
        s.blocks.append(
            [
                "POP efficiencies at the largest N (useful = forward + backward + optimizer): values "
                "under 0.8 are worth a look."
            ]
        )
        s.blocks.append(
            table_block(
                "pop",
                "POP efficiencies at the largest N",
                table_columns(
                    ("group", "group"),
                    ("world_size", "N"),
                    ("load_balance", "load balance"),
                    ("comm_efficiency", "comm. efficiency"),
                    ("parallel_efficiency", "parallel eff."),
                    ("computation_scaling", "computation scaling"),
                    ("global_efficiency", "global eff."),
                ),
                pop_last,
            )
        )
    return s


def _where(fit: dict[str, Any]) -> str:
    """' (cluster · backend)' of a fit, the unknown parts left out."""
    where = joined((fit["cluster"], fit["backend"]))
    return f" ({where})" if where else ""


def sync(ctx: Context) -> Section:
    s = Section("sync", "Gradient synchronisation", definitions=("busbw", "alpha-beta"))
    values = _with_group(ctx, ctx.rows("sync"))
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
    curve = [r for rs in _curve_groups(values).values() for r in rs if r["world_size"] > 1]
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


def utilisation(ctx: Context) -> Section:
    if ctx.unit == "rank":
        return host_cpu(ctx)
    s = Section("utilisation", "Utilisation and energy", definitions=("utilisation", "energy", "mfu"))
    s.blocks.append(
        [
            "GPU utilisation here is NVML's kernel-active time share: the share of time some kernel ran. "
            "It is not an efficiency: a GPU can be 100% 'utilised' by one tiny kernel at a time."
        ]
    )
    s.blocks.append(ctx.chart("utilisation", drawn="util_gpu_pct"))
    s.blocks.append(ctx.chart("energy", drawn="energy_per_sample_j"))
    values = _with_group(ctx, ctx.rows("utilisation"))
    curve = [r for rs in _curve_groups(values).values() for r in rs] or values
    s.blocks.append(
        table_block(
            "utilisation",
            "Utilisation and energy per run",
            table_columns(
                ("group", "group"),
                ("world_size", "N"),
                ("gpus", "GPUs"),
                ("util_gpu_pct", "kernel-active share"),
                ("util_mem_pct", "memory busy"),
                ("power_w", "power/GPU"),
                ("sm_clock_mhz", "SM clock"),
                ("throttle_share", "throttled"),
                ("energy_per_sample_j", "energy/sample"),
                ("host_proc_cpu_pct", "process CPU"),
            ),
            curve,
        )
    )
    on_cpu = [r for r in values if r["util_gpu_pct"] is None and r["host_sys_cpu_pct"] is not None]
    if on_cpu:  # a store of CPU and GPU runs: the CPU runs' hosts, where their GPU figures would be
        s.blocks.append(
            [
                "Runs on CPU have no GPU figures; what their hosts' CPUs did over the steady window "
                "(the job's processes, 100% = one core; the whole host; its 1-minute load):"
            ]
        )
        s.blocks.append(_host_cpu_table(on_cpu))
    mfu = [r for r in ctx.rows("mfu") if r["mfu"] is not None]
    if mfu:
        s.blocks.append(
            table_block(
                "mfu",
                "Model FLOP/s utilisation (MFU)",
                table_columns(
                    ("run_id", "run"),
                    ("world_size", "N"),
                    ("device_model", "device"),
                    ("achieved_flops_per_s", "achieved/GPU"),
                    ("device_peak_flops", "peak"),
                    ("mfu", "MFU"),
                ),
                mfu,
            )
        )
    return s


def host_cpu(ctx: Context) -> Section:
    """Where a GPU job shows GPU utilisation, a CPU job shows what its hosts' CPUs did."""
    s = Section("utilisation", "Host CPU and load", definitions=("utilisation",))
    s.blocks.append(
        [
            "Every run here ran on CPU; instead of device utilisation and energy, what the hosts' "
            "CPUs did over the steady window: the job's processes (100% is one core busy), the whole "
            "host, and its 1-minute load average against its logical CPUs. Ranks whose threads together "
            "want more cores than the host has slow each other down: compare the load with the CPUs."
        ]
    )
    values = _with_group(ctx, ctx.rows("utilisation"))
    s.blocks.append(_host_cpu_table([r for rs in _curve_groups(values).values() for r in rs] or values))
    return s


def _host_cpu_table(values: list[dict[str, Any]]) -> TableBlock:
    return table_block(
        "utilisation",
        "Host CPU per run",
        table_columns(
            ("group", "group"),
            ("world_size", "N"),
            ("host_cpu_count", "logical CPUs"),
            ("host_proc_cpu_pct", "job's CPU (100% = 1 core)"),
            ("host_sys_cpu_pct", "host CPU busy"),
            ("host_load1", "load (1 min)"),
        ),
        values,
    )


def stragglers(ctx: Context) -> Section:
    """What the straggler rule found (the explainer's own finding, linked), the per-rank waits of the
    runs it names, and the charts of its run: the section never says less or other than the finding."""
    s = Section("stragglers", "Stragglers", definitions=("wait-at-collective", "pop"))
    waits = ctx.rows("stragglers")
    said = [(rank, f) for rank, f in ctx.fired if f.rule == "straggler"]
    s.blocks.append(
        [
            "At every collective the early ranks wait for the last one. A rank that is last far more "
            "often than 1/n of the time holds the others back; so does one that computes more than the "
            "others (a load balance, mean/max useful compute per rank, under "
            f"{LOW_LOAD_BALANCE})."
        ]
    )
    run_id: str | None = None
    if said:
        sizes = {r["run_id"]: r["world_size"] or 0 for r in ctx.rows("run_summary", ("run_id", "world_size"))}
        for rank, f in said:
            s.blocks.append([Ref(f.title, f"finding-{rank}"), f". {f.text}"])
        named = {run for _, f in said for run in f.evidence.run_ids}
        # the run the first finding speaks of: its largest world size, as the rule chooses
        run_id = max(said[0][1].evidence.run_ids, key=lambda r: (sizes.get(r, 0), r), default=None)
        s.blocks.append(
            table_block(
                "stragglers",
                "Wait at collective per rank, in the runs the findings name",
                table_columns(
                    ("run_id", "run"),
                    ("world_size", "N"),
                    ("rank", "rank"),
                    ("hostname", "host"),
                    ("last_share", "last in"),
                    ("is_straggler", "last most often"),
                    ("others_wait_per_step_ns", "others wait/step"),
                    ("others_wait_share", "others wait share"),
                    ("wait_source", "from"),
                ),
                [r for r in waits if r["run_id"] in named],
            )
        )
    else:
        s.blocks.append(
            [
                "No rank holds the others back in this selection: every run's load balance is at least "
                f"{LOW_LOAD_BALANCE}, and no rank is last in most collectives with the others waiting "
                f"{format_value('others_wait_share', STRAGGLER_WAIT_SHARE)} of the step or more for it."
            ]
        )
        for r in (r for r in waits if r["is_straggler"]):
            run_id = run_id or r["run_id"]
            s.blocks.append(
                [
                    f"Rank {r['rank']} of run {r['run_id']} is last in "
                    f"{format_value('last_share', r['last_share'])} of the collectives, but the others wait "
                    f"only {format_value('others_wait_share', r['others_wait_share'] or 0.0)} of the step "
                    "for it: too little to slow the run."
                ]
            )
    s.blocks.append(ctx.chart("last_rank", run_id=run_id))
    s.blocks.append(ctx.chart("wait_heatmap", run_id=run_id))
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


def batch(ctx: Context) -> Section | None:
    sweep = ctx.rows("batch_sweep")
    curves = ctx.tables.get("metric_curves")
    if not sweep and (curves is None or curves.num_rows == 0):
        return None
    s = Section("batch", "Batch-size effects", definitions=("batch-sweep", "throughput"))
    s.blocks.append(
        [
            "A larger batch raises samples per second, but it can need more samples to reach the same "
            "quality: time-to-target decides (scale the learning rate linearly or with √k, with warm-up, "
            "or use LARS/LAMB)."
        ]
    )
    if sweep:
        s.blocks.append(ctx.chart("batch_sweep"))
    else:
        s.blocks.append(["No batch-size sweep: one batch size per experiment and world size."])
    if curves is not None and curves.num_rows:
        s.blocks.append(ctx.chart("metric_curves"))
    if sweep:
        s.blocks.append(
            table_block(
                "batch_sweep",
                "Batch-size sweep",
                table_columns(
                    ("experiment", "experiment"),
                    ("cluster", "cluster"),
                    ("world_size", "N"),
                    ("global_batch_size", "global batch"),
                    ("step_ns", "step time T"),
                    ("per_sample_ns", "time/sample"),
                    ("throughput_samples_per_s", "throughput X"),
                    ("epoch_s", "epoch"),
                    ("throughput_vs_smallest", "X / smallest batch"),
                ),
                sorted(
                    sweep,
                    key=lambda r: (
                        str(r["experiment"]),
                        str(r["cluster"]),
                        r["world_size"],
                        r["global_batch_size"] or 0,
                    ),
                ),
            )
        )
    ttm = ctx.rows("time_to_metric")
    if ttm:
        s.blocks.append(
            table_block(
                "time_to_metric",
                "Time to a metric target",
                table_columns(
                    ("experiment", "experiment"),
                    ("variant", "variant"),
                    ("metric", "metric"),
                    ("target", "target"),
                    ("target_source", "target from"),
                    ("world_size", "N"),
                    ("global_batch_size", "global batch"),
                    ("reached", "reached"),
                    ("diverged", "diverged"),
                    ("time_to_target_s", "time to target"),
                    ("steps_to_target", "steps"),
                    ("final_value", "final value"),
                ),
                sorted(
                    ttm,
                    key=lambda r: (
                        str(r["experiment"]),
                        str(r["variant"]),
                        r["metric"],
                        r["global_batch_size"] or 0,
                    ),
                ),
            )
        )
    return s


def prediction(ctx: Context) -> Section:
    s = Section("prediction", "Predicted scaling", definitions=("scaling-model", "alpha-beta"))
    models = _with_group(ctx, [r for r in ctx.rows("scaling_model") if not r.get("mixed")])
    s.blocks.append(
        [
            "The step time of each group is fitted with the Extra-P normal form c0 + c1·p^i·log2(p)^j "
            "and extrapolated; dashed lines and hollow diamonds are predictions, not measurements. A "
            "model from fewer than 5 world sizes is not trusted."
        ]
    )
    preds = _with_group(ctx, [r for r in ctx.rows("scaling_prediction") if r["kind"] == "prediction"])
    if preds:
        s.blocks.append(ctx.chart("speedup", caption="with the model's predictions"))
        s.blocks.append(ctx.chart("efficiency", caption="with the model's predictions"))
    else:
        # the same figures without predictions would repeat the speedup section's
        s.blocks.append(["No group has a model that predicts a world size beyond its measured ones."])
    s.blocks.append(
        table_block(
            "scaling_model",
            "Scaling model per group",
            table_columns(
                ("group", "group"),
                ("points", "points"),
                ("formula", "step time model (ns)"),
                ("smape_pct", "SMAPE"),
                ("loo_smape_pct", "leave-one-out SMAPE"),
                ("r2_adj", "adj. R²"),
                ("trusted", "trusted"),
                ("note", "why not trusted"),
            ),
            models,
            key="group_id",
        )
    )
    if preds:
        s.blocks.append(
            table_block(
                "scaling_prediction",
                "Predicted step time and efficiency",
                table_columns(
                    ("group", "group"),
                    ("world_size", "N"),
                    ("model_step_ns", "step time"),
                    ("model_speedup", "speedup"),
                    ("model_efficiency", "efficiency"),
                    ("predicted_allreduce_ns", "allreduce (α-β)"),
                    ("trusted", "trusted"),
                ),
                preds,
                key="group_id",
            )
        )
    return s


def findings(ctx: Context) -> Section:
    s = Section("findings", "Findings and recommendations")
    if ctx.findings:
        s.blocks.append(
            [
                "Ranked by the share of the lost efficiency each explains, then by severity and "
                "confidence. Each names its evidence: the runs and the analyses behind its numbers."
            ]
        )
        s.blocks.append(FindingsBlock(ctx.findings))
    else:
        s.blocks.append(["No rule fired: nothing in this selection needs explaining."])
    return s


def quality(ctx: Context) -> Section | None:
    values = ctx.rows("quality")
    if not values:
        return None
    s = Section("quality", "Data quality", definitions=("data-quality",))
    s.blocks.append(["What may make the numbers above less certain:"])
    s.blocks.append(
        table_block(
            "quality",
            "Data quality and confounds",
            table_columns(
                ("severity", "severity"),
                ("kind", "kind"),
                ("run_id", "run"),
                ("message", "what"),
            ),
            values,
        )
    )
    return s


#: The sections in reading order; a builder returning None leaves its section out (no such data).
SECTIONS: tuple[Callable[[Context], Section | None], ...] = (
    overview,
    setup,
    speedup,
    lost_time,
    sync,
    backends,
    utilisation,
    stragglers,
    communication,
    what_if,
    batch,
    prediction,
    findings,
    quality,
)

#: Every analysis the sections read (the report runs exactly these; --tables exports them).
ANALYSES_USED: tuple[str, ...] = (
    "run_summary",
    "scaling",
    "placement",
    "threads",
    "phase_breakdown",
    "lost_time",
    "pop",
    "sync",
    "allreduce_fit",
    "reference_busbw",
    "backend_compare",
    "utilisation",
    "mfu",
    "stragglers",
    "collective_wait",
    "comm_ops",
    "comm_by_role",
    "what_if",
    "batch_sweep",
    "metric_curves",
    "time_to_metric",
    "scaling_model",
    "scaling_prediction",
    "quality",
)


def build_sections(ctx: Context) -> list[Section]:
    out = []
    for fn in SECTIONS:
        section = fn(ctx)
        if section is not None:
            out.append(section)
    return out


def context(tables: Tables, findings: list[Finding], found: Iterable[ExplainFinding] = ()) -> Context:
    """The sections' context; `found`: the explainer's findings, in the order of `findings`."""
    group_ids = set()
    for name in ("scaling", "sync", "utilisation", "pop", "scaling_model", "scaling_prediction"):
        group_ids |= {r["group_id"] for r in rows(tables.get(name), ["group_id"]) if r["group_id"]}
    labels = group_labels(group_ids, rows(tables.get("scaling"), ["group_id", "world_size", "mixed"]))
    unit = device_unit(r["device_model"] for r in rows(tables.get("run_summary"), ["device_model"]))
    fired = [(rank, f) for rank, top in enumerate(found, start=1) for f in top.flatten()]
    return Context(tables, findings, labels, unit, fired)
