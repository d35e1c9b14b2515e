"""Rules about the work on each rank: stragglers, input-bound, per-GPU work too small
(DESIGN rules 5, 6, 7)."""

from __future__ import annotations

from collections import defaultdict

from ..words import counted
from .context import Context, Row, baseline, largest, lost_share
from .finding import Finding
from .hardware import setup_of
from .rulebook import cause_severity, cost_numbers, make_finding, rule
from .rules_patterns import pattern_runs
from .rules_placement import crowded_hosts
from .words import batch_per, dur, listing, num, pct, times

LOW_LOAD_BALANCE = 0.9
STRAGGLER_WAIT_SHARE = 0.02
DATA_SHARE = 0.15
DATA_GROWTH = 0.05
LOW_COMPUTATION_SCALING = 0.9
LOW_UTILISATION_PCT = 50.0
BATCH_GAIN = 1.4

TARGET_SOURCES = {
    "user": "your target",
    "tag": "the target the runs were tagged with",
    "default": "reached by most runs that did not diverge",
}

LR_CAVEATS = (
    "A larger batch changes the optimisation, not only the speed: scale the learning rate with the "
    "batch (linearly, Goyal et al., or by √k for k times the batch, Krizhevsky), warm it up over the "
    "first epochs, and beyond a few thousand samples per batch use a layer-wise optimiser (LARS, LAMB). "
    "Judge the result by time to the target accuracy, not samples per second: very large batches can "
    "generalise worse (Keskar et al.)."
)


@rule("straggler", 5, "Straggler: one rank makes the others wait")
def straggler(ctx: Context) -> list[Finding]:
    out = []
    pop = ctx.by_run("pop")
    runs = ctx.by_run("run_summary")
    strag: dict[str, list[Row]] = defaultdict(list)
    for s in ctx.rows("stragglers"):
        strag[s["run_id"]].append(s)
    ranks: dict[str, list[Row]] = defaultdict(list)
    for r in ctx.rows("rank_breakdown"):
        ranks[r["run_id"]].append(r)
    groups = ctx.scaling_groups()
    singles = [[r] for r in ctx.rows("scaling") if r["group_id"] not in groups]
    victims = pattern_runs(ctx)  # pipelines, parameter servers: their rules name who is slow
    for rows in [*groups.values(), *singles]:
        hits = []
        for r in rows:
            if r["world_size"] < 2 or r["run_id"] in victims:
                continue
            p = pop.get(r["run_id"], {})
            lb = p.get("load_balance")
            waits = strag.get(r["run_id"], [])
            last = max(waits, key=lambda s: s["last_share"] or 0, default=None)
            # the stragglers table's own number: the other ranks' mean wait per step for this rank
            wait_share = (last["others_wait_share"] or 0.0) if last else 0.0
            others_wait = (last["others_wait_per_step_ns"] or 0.0) * max(0, len(waits) - 1) if last else 0.0
            is_last = bool(last and last["is_straggler"] and wait_share >= STRAGGLER_WAIT_SHARE)
            if (lb is not None and lb < LOW_LOAD_BALANCE) or is_last:
                lost = r["lost_ns"] if r["lost_ns"] and r["lost_ns"] > 0 else None
                imb = r["world_size"] * ((p.get("useful_max_ns") or 0) - (p.get("useful_mean_ns") or 0))
                explained = max(imb, others_wait) / lost if lost else None
                hits.append((r, lb, last if is_last else None, wait_share, explained))
        if not hits:
            continue
        # the largest world size says most about scaling; its explained share is the one to rank by
        r, lb, last, wait_share, explained = max(hits, key=lambda h: (h[0]["world_size"], h[4] or 0))
        slowest = max(ranks.get(r["run_id"], []), key=lambda x: x["useful_ns"] or 0, default=None)
        culprit, phase, cost = own_excess(ranks.get(r["run_id"], []))
        step = (runs.get(r["run_id"]) or {}).get("step_ns") or r["step_ns"]
        parts = [f"In run {r['run_id']} (N={r['world_size']})"]
        if culprit is not None:
            parts.append(
                f"rank {culprit['rank']}{' on ' + culprit['hostname'] if culprit['hostname'] else ''} does "
                f"more of its own work than its peers: {dur(cost)} per step more in {phase} than their "
                f"median, {pct(cost / step if step else None)} of the {dur(step)} step, which the others "
                "then wait in the next collective"
            )
        if last is not None:
            parts.append(
                f"rank {last['rank']}{' on ' + last['hostname'] if last['hostname'] else ''} entered the "
                f"collective last in {pct(last['last_share'])} of {last['instances']} collectives, and the "
                f"other ranks waited {pct(wait_share)} of the step for it on average"
            )
        if lb is not None and lb < LOW_LOAD_BALANCE and slowest is not None:
            parts.append(
                f"load balance (mean/max useful compute per rank) is {num(lb)}: rank {slowest['rank']} "
                f"computes {dur(slowest['useful_ns'])} per step against "
                f"{dur(pop[r['run_id']]['useful_mean_ns'])} "
                "on average"
            )
        gid = r["group_id"]
        hw = setup_of(ctx, [r["run_id"]])
        share = cost / step if step and culprit is not None else None
        # the what-if replays the run step by step: where it names no slow worker, the rank's excess is
        # within the ranks' step-to-step spread (DESIGN.md: no cause), said but not a warning
        replayed = ctx.by_run("what_if").get(r["run_id"])
        noise = replayed is not None and replayed["cause"] != "slow-worker"
        if noise:
            parts.append(
                "but step by step the difference stays within the ranks' own step-to-step spread (the "
                "what-if replay names no slow worker), so it is noise, not a cause"
            )
        if culprit is not None:
            title = (
                f"Straggler in run {r['run_id']}: rank {culprit['rank']} is slower in {phase}, "
                f"{dur(cost)} per step ({pct(share)})"
            )
        elif last:
            title = (
                f"Straggler in run {r['run_id']}: rank {last['rank']} is last in {pct(last['last_share'])} "
                "of collectives"
            )
        else:
            title = f"Straggler in run {r['run_id']}: load balance {num(lb)}"
        out.append(
            make_finding(
                ctx,
                "straggler",
                gid if len(rows) > 1 else r["run_id"],
                severity="info" if noise else cause_severity(explained if explained is not None else share),
                category="cause",
                title=title,
                text=", ".join(parts[:1]) + " " + "; ".join(parts[1:]) + ".",
                run_ids=[h[0]["run_id"] for h in hits],
                analyses=("pop", "stragglers", "rank_breakdown", "collective_wait"),
                recommendation=(
                    "Find what is different about that rank: its host ("
                    + (
                        "a slower or throttled GPU, a busy CPU"
                        if hw.gpu
                        else "fewer cores allowed, a busy CPU"
                    )
                    + ", a noisy neighbour), its data (uneven shard sizes or sequence lengths: use a "
                    "DistributedSampler with equal shards, bucket by length), or extra work on it (logging, "
                    "checkpointing, evaluation only on rank 0)."
                ),
                confidence=0.8 if last is not None else 0.65,
                explained_loss=explained,
                numbers={
                    "load_balance": lb,
                    "last_rank": last["rank"] if last else None,
                    "last_share": last["last_share"] if last else None,
                    "wait_share": wait_share,
                    "rank": culprit["rank"] if culprit is not None else None,
                    "phase": phase,
                    **(cost_numbers(cost, step) if culprit is not None else {}),
                },
                group_id=gid,
            )
        )
    return out


#: the phases of a rank's own work, where a straggler's excess lives (data is the loader's: input-bound)
OWN_PHASES = ("forward", "backward", "optimizer")


def own_excess(ranks: list[Row]) -> tuple[Row | None, str | None, float]:
    """The culprit of a run (DESIGN.md: the rank whose own work is longer, never the one waiting in a
    collective for it): the rank whose forward, backward and optimizer exceed the median of the other
    ranks' most, the phase that holds most of it, and that excess (ns per step)."""
    if len(ranks) < 2:
        return None, None, 0.0

    def med(values: list[float]) -> float:
        v = sorted(values)
        return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2

    best: tuple[Row | None, str | None, float] = (None, None, 0.0)
    for r in ranks:
        others = [o for o in ranks if o is not r]
        by_phase = {p: (r[f"{p}_ns"] or 0.0) - med([o[f"{p}_ns"] or 0.0 for o in others]) for p in OWN_PHASES}
        excess = sum(by_phase.values())
        if excess > best[2]:
            best = (r, max(by_phase, key=lambda p: by_phase[p]), excess)
    return best


def _single_runs_by_family(ctx: Context, groups: dict[str, list[Row]]) -> list[list[Row]]:
    """Runs outside a scaling series (batch sweeps, lone runs), one list per experiment family."""
    fam: dict[tuple[object, ...], list[Row]] = defaultdict(list)
    for r in ctx.rows("scaling"):
        if r["group_id"] not in groups:
            fam[(r["experiment"], r["cluster"], r["backend"], r["model"])].append(r)
    return list(fam.values())


def worst_waiter(ctx: Context, run: Row) -> tuple[Row | None, float]:
    """The rank of a run that waits longest on its loader per step, and that wait (ns): the cost of
    the input wait (DESIGN.md, "The cost of a cause": the others wait for that rank in the next
    collective, so the mean over ranks understates it)."""
    ranks = [r for r in ctx.rows("rank_breakdown") if r["run_id"] == run["run_id"] and r["data_ns"]]
    worst = max(ranks, key=lambda r: r["data_ns"], default=None)
    if worst is None:
        return None, (run["data_share"] or 0.0) * (run["step_ns"] or 0.0)
    return worst, float(worst["data_ns"])


@rule("input-bound", 6, "Input-bound: the step waits on the data loader")
def input_bound(ctx: Context) -> list[Finding]:
    out = []
    groups = ctx.scaling_groups()
    for rows in [*groups.values(), *_single_runs_by_family(ctx, groups)]:
        series = rows[0]["group_id"] in groups
        waits = {r["run_id"]: worst_waiter(ctx, r) for r in rows}
        worst = max(rows, key=lambda r: waits[r["run_id"]][1] / r["step_ns"] if r["step_ns"] else 0.0)
        who, cost = waits[worst["run_id"]]
        cost_share = cost / worst["step_ns"] if worst["step_ns"] else 0.0
        top, base = largest(rows), baseline(rows)
        growth = (top["data_share"] or 0) - (base["data_share"] or 0)
        share = lost_share(top, "data")
        high = cost_share > DATA_SHARE
        growing = series and growth > DATA_GROWTH and share is not None and share > 0.25
        if not (high or growing):
            continue
        gid = (
            worst["group_id"]
            if series
            else f"{worst['experiment']}/{worst['cluster']}/{worst['backend']}/{worst['model']}"
        )
        where = f"run {worst['run_id']} ({batch_per(worst['batch_size_per_rank'])})" if not series else ""
        rank_words = (
            f"rank {who['rank']}{' on ' + who['hostname'] if who.get('hostname') else ''} waits on its data "
            f"loader {dur(cost)} per step, {pct(cost_share)} of the run's {dur(worst['step_ns'])} step "
            f"(the mean over the {worst['world_size']} ranks: {pct(worst['data_share'])}); the other ranks "
            "wait for it in the next collective"
            if who is not None and worst["world_size"] and worst["world_size"] > 1
            else f"waiting on the data loader takes {pct(cost_share)} of the step ({dur(cost)} per step)"
        )
        text = f"In {gid}{', ' + where if where else ''} at N={worst['world_size']}, {rank_words}"
        if series:
            text += (
                f"; its share goes from {pct(base['data_share'])} at N={base['world_size']} to "
                f"{pct(top['data_share'])} at N={top['world_size']} and explains {pct(share)} of "
                "the lost time"
            )
        hw = setup_of(ctx, [r["run_id"] for r in rows])
        knobs = loader_knobs(who)
        out.append(
            make_finding(
                ctx,
                "input-bound",
                gid,
                severity=cause_severity(max(share or 0.0, cost_share) if growing else cost_share),
                category="cause",
                title=(
                    f"Input-bound: the step waits {dur(cost)} on the data loader, {pct(cost_share)} of it"
                    + (f" (rank {who['rank']})" if who is not None and (worst["world_size"] or 1) > 1 else "")
                ),
                text=text + ".",
                run_ids=[r["run_id"] for r in rows],
                analyses=("scaling", "phase_breakdown"),
                recommendation=knobs
                + (
                    "Feed the GPUs faster: more DataLoader workers (num_workers), pin_memory=True with "
                    "non_blocking copies, persistent_workers and prefetch_factor, decode/augment on the GPU "
                    "(DALI), keep the dataset in RAM or GPU memory if it fits, and give each rank its own "
                    "CPU cores; on shared file systems stage the data to local disk first."
                    if hw.gpu
                    else "Feed the ranks faster: more DataLoader workers (num_workers), persistent_workers "
                    "and prefetch_factor, the dataset kept in RAM if it fits; on a CPU host the workers take "
                    "cores from the ranks, so count ranks × (threads + workers) against the cores; on "
                    "shared file systems stage the data to local disk first."
                ),
                confidence=0.8,
                explained_loss=share if growing else None,
                numbers={
                    "data_share": worst["data_share"],
                    "data_share_growth": growth,
                    "worst_rank": who["rank"] if who is not None else None,
                    "worst_rank_share": cost_share,
                    **cost_numbers(cost, worst["step_ns"]),
                },
                group_id=gid,
            )
        )
    return out


def loader_knobs(rank: Row | None) -> str:
    """The recorded DataLoader settings of the rank that waits most, in words, with the one to change
    first: "num_workers=0 on a 16-core host: ..." (DESIGN.md: advice names the setting and its
    recorded value). Empty when none was recorded."""
    if rank is None or rank.get("loader_workers") is None:
        return ""
    workers, cores = int(rank["loader_workers"]), rank.get("cpu_count")
    host = f" on a {cores}-core host" if cores else ""
    said = [f"num_workers={workers}{host}"]
    for key, name in (
        ("loader_prefetch_factor", "prefetch_factor"),
        ("loader_pin_memory", "pin_memory"),
        ("loader_persistent_workers", "persistent_workers"),
        ("loader_batch_size", "batch_size"),
    ):
        if rank.get(key) is not None:
            said.append(f"{name}={rank[key]}")
    if workers == 0:
        first = "the rank reads and collates every batch itself, in its own step: give it workers first"
    elif rank.get("loader_persistent_workers") is False:
        first = "its workers restart every epoch: persistent_workers=True, then more workers"
    else:
        first = f"{workers} workers do not keep up: more workers, or a larger prefetch_factor"
    return f"The loader ran with {', '.join(said)}; {first}. "


def _batch_headroom(ctx: Context, rows: list[Row]) -> tuple[str, dict[str, float], int | None]:
    """What a larger per-GPU batch buys at each world size, from a batch sweep at a small N.

    The extra time at N over the sweep's world size (sync, imbalance) is taken as independent of
    the batch, since the gradient bytes do not change with it: T(N, B) = T_s(B) + T(N, b) − T_s(b).
    """
    top = rows[0]
    b = top["batch_size_per_rank"]
    if top["scaling_mode"] != "weak" or b is None:
        return "", {}, None
    # The sweep may live in its own experiment; the same model on the same hardware is what counts.
    sweep = [
        s
        for s in ctx.rows("batch_sweep")
        if (s["cluster"], s["backend"], s["model"]) == (top["cluster"], top["backend"], top["model"])
    ]
    same_exp = [s for s in sweep if s["experiment"] == top["experiment"]]
    sweep = same_exp or sweep
    if not sweep:
        return "", {}, None
    ws = min(s["world_size"] for s in sweep)
    at = {s["batch_size_per_rank"]: s for s in sweep if s["world_size"] == ws}
    if b not in at:
        return "", {}, None
    t_b = at[b]["step_ns"]
    best_b = max(at, key=lambda k: k / at[k]["step_ns"])
    if best_b == b:
        return "", {}, None
    t_best = at[best_b]["step_ns"]
    gains, numbers = [], {}
    seen: set[int] = set()
    for r in rows:
        if r["world_size"] < ws or r["world_size"] in seen:
            continue
        seen.add(r["world_size"])
        t_new = t_best + (r["step_ns"] - t_b)
        gain = (best_b / t_new) / (b / r["step_ns"])
        eff_new = t_best / t_new if ws == 1 else None
        numbers[f"gain_N{r['world_size']}"] = gain
        gains.append(
            f"N={r['world_size']}: {times(gain)}"
            + (f" (efficiency {num(r['efficiency'])} → {num(eff_new)})" if eff_new is not None else "")
        )
    unit = setup_of(ctx, [r["run_id"] for r in rows]).unit
    top_n = max(rows, key=lambda r: r["world_size"])
    extra_top = top_n["step_ns"] - t_b
    per_batch = [
        f"{bb}: {times((bb / (at[bb]['step_ns'] + extra_top)) / (b / top_n['step_ns']))}"
        for bb in sorted(at)
        if bb > b
    ]
    text = (
        f" A batch sweep at N={ws} shows {best_b} samples per {unit} run at "
        f"{times((best_b / t_best) / (b / t_b))} the "
        f"samples/s of {b}. Since the gradients to synchronise do not grow with the batch, the same sync "
        f"is spread over more samples; estimated samples/s gain at batch {best_b}: {listing(gains, 10)}. "
        f"At N={top_n['world_size']}, by batch per {unit}: {listing(per_batch, 10)}."
    )
    return text, numbers, best_b


@rule("small-per-gpu-work", 7, "Per-GPU work too small")
def small_per_gpu_work(ctx: Context) -> list[Finding]:
    out = []
    pop = ctx.by_run("pop")
    util = ctx.by_run("utilisation")
    over = set(crowded_hosts(ctx))
    # other processes' CPU slows every rank's compute on its own: a computation scaling measured
    # on a contended run (or against a contended baseline) says more about the host than the job
    contended = {r["run_id"] for r in ctx.rows("contention") if r["contended"]}
    ttm = ctx.rows("time_to_metric")
    for gid, rows in ctx.scaling_groups().items():
        top, base = largest(rows), baseline(rows)
        reasons, numbers = [], {}
        cs = (pop.get(top["run_id"]) or {}).get("computation_scaling")
        if (
            cs is not None
            and cs < LOW_COMPUTATION_SCALING
            and top["run_id"] not in over
            and not {top["run_id"], base["run_id"]} & contended
        ):
            reasons.append(
                f"computation scaling is {num(cs)} at N={top['world_size']}: the same samples cost "
                f"{pct(1 / cs - 1)} more compute time per sample than at N={base['world_size']}"
            )
            numbers["computation_scaling"] = cs
        utils = [
            (util[r["run_id"]]["util_gpu_pct"], r["world_size"])
            for r in rows
            if r["run_id"] in util and util[r["run_id"]]["util_gpu_pct"] is not None
        ]
        if utils and min(utils)[0] < LOW_UTILISATION_PCT:
            low, at_n = min(utils)
            reasons.append(
                "the GPUs' kernel-active time share (nvmlDeviceGetUtilizationRates) is only "
                f"{low:.0f}% (N={at_n}): kernels are short and the GPU idles between them"
            )
            numbers["util_gpu_pct_min"] = low
        headroom, gains, best_b = _batch_headroom(ctx, rows)
        if gains and max(gains.values()) >= BATCH_GAIN:
            reasons.append(f"a larger batch would raise throughput (up to {times(max(gains.values()))})")
            numbers.update(gains)
            numbers["better_batch_size_per_rank"] = best_b
        if not reasons:
            continue
        b = top["batch_size_per_rank"]
        hw = setup_of(ctx, [r["run_id"] for r in rows])
        text = f"In {gid} ({batch_per(b, hw.unit)}), " + "; ".join(reasons) + "." + headroom
        ttm_runs = [
            t for t in ttm if t["experiment"] == top["experiment"] and t["reached"] and not t["diverged"]
        ]
        if ttm_runs:
            first = min(ttm_runs, key=lambda t: t["time_to_target_s"])
            variant = f", variant {first['variant']}" if first["variant"] else ""
            text += (
                f" Time to the {first['metric']} target ({num(first['target'], 4)}, "
                f"{TARGET_SOURCES[first['target_source']]}) is shortest at batch "
                f"{first['batch_size_per_rank']} per {hw.unit} and N={first['world_size']}{variant} "
                f"({dur(first['time_to_target_s'] * 1e9)})."
            )
        explained = (
            lost_share(top, "forward", "backward", "optimizer") if "computation_scaling" in numbers else None
        )
        out.append(
            make_finding(
                ctx,
                "small-per-gpu-work",
                gid,
                severity=cause_severity(explained) if explained is not None else "warning",
                category="cause",
                title=f"Per-{hw.unit} work too small" + (f" at batch {b}" if b is not None else ""),
                text=text,
                run_ids=[r["run_id"] for r in rows],
                analyses=("pop", "utilisation", "batch_sweep", "time_to_metric"),
                recommendation=(
                    f"Give each {hw.unit} more work per step: a larger batch per {hw.unit} (or gradient "
                    f"accumulation), a larger model per {hw.unit}, or fewer {hw.units} for this model size"
                    + ("" if hw.gpu else " (fewer ranks with more threads each)")
                    + ". "
                    + LR_CAVEATS
                ),
                confidence=0.7 if len(reasons) > 1 else 0.55,
                explained_loss=explained,
                numbers=numbers,
                group_id=gid,
            )
        )
    return out


@rule("diverged", None, "Training diverged")
def diverged(ctx: Context) -> list[Finding]:
    """Runs whose metric went NaN/inf or moved away from its best for the last third of the run:
    their time to target means nothing, and they are left out of the default target."""
    by_exp: dict[str, list[Row]] = defaultdict(list)
    for t in ctx.rows("time_to_metric"):
        if t["diverged"]:
            by_exp[t["experiment"]].append(t)
    out = []
    for exp, rows in by_exp.items():
        parts = [
            f"{r['run_id']} ({r['metric']} {r['diverged_reason']}: best {num(r['best_value'], 4)}, final "
            f"{num(r['final_value'], 4)}; "
            f"{batch_per(r['batch_size_per_rank'], setup_of(ctx, [r['run_id']]).unit)}, N={r['world_size']}"
            + (f", {r['variant']}" if r["variant"] else "")
            + ")"
            for r in rows
        ]
        out.append(
            make_finding(
                ctx,
                "diverged",
                exp,
                severity="warning",
                category="data-quality",
                title=f"{counted(len(rows), 'run')} of {exp} diverged",
                text=(
                    f"In {exp}, training diverged in {listing(parts)}. Their time to target is not "
                    "comparable, and they do not set the default target."
                ),
                run_ids=sorted({r["run_id"] for r in rows}),
                analyses=("time_to_metric", "metric_curves"),
                recommendation=(
                    "Lower the learning rate for the large batch (√k rather than linear scaling), warm "
                    "it up, or clip gradients; compare variants by time to a target they all reach."
                ),
                confidence=0.85,
                numbers={"diverged_runs": len({r["run_id"] for r in rows})},
            )
        )
    return out
