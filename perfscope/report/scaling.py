"""The scaling story's sections: at a glance, the setup, speedup and efficiency, where the lost
time went, and the predicted scaling."""

from __future__ import annotations

from typing import Any

from ..words import counted, plural
from .context import Context, curve_groups, known_joined, largest_world_size, span, with_group
from .model import Num, Ref, Section, table_block, table_columns


def overview(ctx: Context) -> Section:
    s = Section("overview", "At a glance", definitions=("speedup",))
    runs = ctx.rows("run_summary", ("experiment", "source"))
    scaling = with_group(ctx, ctx.rows("scaling"))
    sim = sum(1 for r in runs if r["source"] == "simulated")
    s.blocks.append(
        [
            counted(len(runs), "run")
            + (f" of {names}" if (names := known_joined(r["experiment"] for r in runs)) else "")
            + (f"; {sim} of them simulated (not measured)." if sim else ", all measured.")
        ]
    )
    last = largest_world_size(scaling)
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
                "world_sizes": known_joined(r["world_size"] for r in rs),
                "batch_sizes_per_rank": known_joined(r["batch_size_per_rank"] for r in rs) or None,
                "runs": len(rs),
                "source": known_joined(r["source"] for r in rs),
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
                f"Steady state: the first {known_joined(warm)} steps of each run are warm-up and dropped; "
                f"{span(steady)} steady steps remain per run. Step time is the steady window's wall "
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
    scaling = with_group(ctx, ctx.rows("scaling"))
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
    curve_rows = [r for rs in curve_groups(scaling).values() for r in rs]
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
    scaling = with_group(ctx, ctx.rows("scaling"))
    s.blocks.append(
        [
            "Each bar splits a run's steady-state step into its phases. Lost time is the "
            f"{ctx.unit} time (ranks × step time) per step beyond perfect scaling, split by phase: the phase "
            "that grows is the one that ate the efficiency."
        ]
    )
    for r in largest_world_size(scaling):
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
    last = largest_world_size(scaling)
    s.blocks.append(
        table_block(
            "scaling",
            f"Lost {ctx.unit} time per step at the largest N, by phase",
            table_columns(("group", "group"), ("world_size", "N"), ("lost_ns", "lost"), *_PHASE_LOSS),
            last,
        )
    )
    pop = with_group(ctx, ctx.rows("pop"))
    pop_last = largest_world_size(pop)
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


def prediction(ctx: Context) -> Section:
    s = Section("prediction", "Predicted scaling", definitions=("scaling-model", "alpha-beta"))
    models = with_group(ctx, [r for r in ctx.rows("scaling_model") if not r.get("mixed")])
    s.blocks.append(
        [
            "The step time of each group is fitted with the Extra-P normal form c0 + c1·p^i·log2(p)^j "
            "and extrapolated; dashed lines and hollow diamonds are predictions, not measurements. A "
            "model from fewer than 5 world sizes is not trusted."
        ]
    )
    preds = with_group(ctx, [r for r in ctx.rows("scaling_prediction") if r["kind"] == "prediction"])
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
