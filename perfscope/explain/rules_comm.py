"""Rules about gradient synchronisation: communication-bound, slow network, latency-bound, no overlap,
and which backend wins where (DESIGN rules 1, 2, 3, 8, 9); and one run that waits on communication
for much of its step (a single world size cannot be communication-bound in the scaling sense, but
its wait is still the first thing to say about it)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from statistics import median
from typing import Any

from ..analysis.sync import alpha_beta_fits, fit_points
from ..words import counted
from .context import Context, Row, baseline, largest, lost_share
from .finding import Finding
from .hardware import Setup, fewer_hops, setup_of, transport_check
from .rulebook import cause_severity, cost_numbers, make_finding, rule
from .rules_patterns import COMM_WAIT_SHARE, alone, measure_next, pattern_runs, ranks_waiting, waits_on
from .words import batch_per, dur, gbps, listing, num, pct, times

LOW_EFFICIENCY = 0.8
SYNC_GROWTH = 0.02  # exposed-sync share must grow by at least 2 points from N0 to the largest N
#: Fitted or measured bus bandwidth under this, with NCCL on GPUs and large messages, looks like TCP.
SLOW_NCCL_GB_PER_S = 3.0
LARGE_MESSAGE_BYTES = 1 << 20
UNDER_DELIVERY = 2.0  # measured transfer time this many times the fit's prediction
#: achieved busbw under this share of the cluster's nccl-tests busbw at the same size is under-delivery
REFERENCE_SHARE = 0.5
LATENCY_SHARE = 0.5
SMALL_MESSAGE_BYTES = 256 << 10
MANY_COLLECTIVES = 10
OVERLAP_EXPOSED = 0.9
SIGNIFICANT_SYNC = 0.10
BACKEND_TIE = 0.03
_EXPECTED_LINK = {
    "inter-node": "InfiniBand/RoCE: 10-50 GB/s",
    "intra-node": "NVLink: 100+ GB/s, PCIe: 10-25 GB/s",
}


def ddp_knobs(ctx: Context, run_id: str) -> str:
    """DDP's recorded settings of a run in words, with what find_unused_parameters=True costs
    (DESIGN.md: advice names the setting and its recorded value). Empty when none was recorded."""
    s = ctx.by_run("run_settings").get(run_id) or {}
    said = [
        f"{name}={s[key]:g}" if isinstance(s[key], float) else f"{name}={s[key]}"
        for key, name in (
            ("ddp_bucket_cap_mb", "bucket_cap_mb"),
            ("ddp_gradient_as_bucket_view", "gradient_as_bucket_view"),
            ("ddp_find_unused_parameters", "find_unused_parameters"),
            ("ddp_static_graph", "static_graph"),
        )
        if s.get(key) is not None
    ]
    if not said:
        return ""
    text = f"DDP ran with {', '.join(said)}. "
    if s.get("ddp_find_unused_parameters") is True and s.get("ddp_static_graph") is not True:
        text += (
            "find_unused_parameters=True walks the autograd graph after every forward and holds back "
            "the buckets of parameters without a gradient: set it to False when every parameter gets "
            "one (or static_graph=True when the set never changes). "
        )
    return text


@rule("communication-bound", 1, "Communication-bound: exposed gradient sync eats the efficiency")
def communication_bound(ctx: Context) -> list[Finding]:
    out = []
    for gid, rows in ctx.scaling_groups().items():
        top, base = largest(rows), baseline(rows)
        eff = top["efficiency"]
        share = lost_share(top, "sync_exposed")
        if eff is None or eff >= LOW_EFFICIENCY or share is None or share <= 0.5:
            continue
        s0, s1 = base["sync_share"] or 0.0, top["sync_share"] or 0.0
        if s1 < s0 + SYNC_GROWTH:
            continue
        shares = [r["sync_share"] or 0.0 for r in rows]
        hw = setup_of(ctx, [r["run_id"] for r in rows])
        monotone = all(b >= a - 0.01 for a, b in itertools.pairwise(shares))
        # the steps' exposed sync holds the tensor-parallel calls' exposed time too: name that part
        tp = (ctx.by_run("sync").get(top["run_id"]) or {}).get("tp_comm_exposed_ns") or 0.0
        what = "Exposed communication" if tp > 0 else "Exposed gradient sync"
        text = (
            f"In {gid}, efficiency at N={top['world_size']} is {num(eff)} (speedup "
            f"{num(top['speedup'])} of an ideal {num(top['ideal_speedup'], 0)}). {what} grows "
            f"from {dur(base['sync_exposed_ns'])} per step at N={base['world_size']} to "
            f"{dur(top['sync_exposed_ns'])} at N={top['world_size']} ({pct(s0)} → {pct(s1)} of the step) and "
            f"accounts for {pct(share)} of the {dur(top['lost_ns'])} of {hw.time} lost per step."
        )
        if tp > 0:
            text += (
                f" Of the {dur(top['sync_exposed_ns'])} at N={top['world_size']}, {dur(tp)} is "
                "tensor-parallel communication (all-reduces on tensor-parallel groups, part of the "
                "layers' compute path), not gradient sync: fewer tensor-parallel ranks or sequence "
                "parallelism shrink it, DDP settings do not."
            )
        out.append(
            make_finding(
                ctx,
                "communication-bound",
                gid,
                severity=cause_severity(share),
                category="cause",
                title=f"Communication-bound at N={top['world_size']}: sync explains {pct(share)} of the loss",
                text=text,
                run_ids=[r["run_id"] for r in rows],
                analyses=("scaling", "lost_time", "sync"),
                recommendation=ddp_knobs(ctx, top["run_id"])
                + (
                    "Hide or shrink the allreduce: let DDP overlap it with backward (smaller bucket_cap_mb "
                    "so the first bucket starts early, static_graph=True), send bf16/fp16 gradients (a "
                    "compression comm hook), synchronise less often (gradient accumulation with no_sync()), "
                    f"or give each {hw.unit} more work per step (a larger batch per {hw.unit}) so the same "
                    "sync is a smaller share. Check the bus bandwidth against the link (network rule)."
                ),
                confidence=0.85 if monotone and len(rows) >= 3 else 0.65,
                explained_loss=share,
                numbers={
                    "world_size": top["world_size"],
                    "efficiency": eff,
                    "sync_share_baseline": s0,
                    "sync_share": s1,
                    "sync_exposed_ns": top["sync_exposed_ns"],
                    "lost_ns": top["lost_ns"],
                    "lost_sync_exposed_ns": top["lost_sync_exposed_ns"],
                    "tp_comm_exposed_ns": tp or None,
                },
                group_id=gid,
            )
        )
    return out


#: ranks whose waits differ by more than this share of the step wait for each other, not only for
#: the transfer
WAIT_SPREAD = 0.10


@rule("communication-share", None, "One run waits on communication for much of its step")
def communication_share(ctx: Context) -> list[Finding]:
    """A run with no other world size of its job beside it (no scaling series), that is neither a
    pipeline nor a parameter server (their rules say more), whose ranks wait on communication for
    COMM_WAIT_SHARE of their step or more: which op, with whom, and what to record next."""
    out = []
    skip = pattern_runs(ctx)
    runs, sync = ctx.by_run("run_summary"), ctx.by_run("sync")
    by_run: dict[str, list[Row]] = defaultdict(list)
    for r in ctx.rows("comm_by_role"):
        if r["step_ns"] and r["world_size"] and r["world_size"] > 1:
            by_run[r["run_id"]].append(r)
    for run_id, ranks in by_run.items():
        if run_id in skip or not alone(ctx, run_id):
            continue
        shares = {r["rank"]: _waited(r) / r["step_ns"] for r in ranks}
        mean_share = sum(shares.values()) / len(shares)
        step = (runs.get(run_id) or {}).get("step_ns") or _mean(r["step_ns"] for r in ranks)
        waited = _mean(_waited(r) for r in ranks)
        if mean_share < COMM_WAIT_SHARE:
            continue
        # what free communication would save: each step's wait of the rank that waited least (the
        # transfer itself); the rest of the others' wait is for a slower rank, which stays
        transfer = ranks[0].get("transfer_wait_ns")
        transfer = min(waited, float(transfer)) if transfer is not None else min(map(_waited, ranks))
        share = transfer / step
        n = int(ranks[0]["world_size"])
        most = max(ranks, key=lambda r: shares[r["rank"]])
        least = min(ranks, key=lambda r: shares[r["rank"]])
        ops = listing(dict.fromkeys(waits_on(r, n) for r in ranks))
        per_step = (sync.get(run_id) or {}).get("bytes_per_step")
        moved = f" ({per_step / 2**20:.1f} MiB per step)" if per_step else ""
        roles = sorted({str(r["role"]) for r in ranks})
        text = (
            f"In run {run_id} (N={n}, {listing(counted_roles(ranks))}), the ranks wait on communication "
            f"for {pct(mean_share)} of each step on average, {dur(waited)} of the run's {dur(step)} step: "
            f"{ops}{moved}. The transfer itself (each step, the wait of the rank that waited least) takes "
            f"{dur(transfer)} per step, {pct(share)} of the step: what free communication would save"
        )
        text += (
            "."
            if transfer >= COMM_WAIT_SHARE * step
            else "; the rest is waiting for a slower rank to "
            "arrive, a straggler or contention (their findings), not the link."
        )
        detail = ranks_waiting(ranks)
        if detail:
            text += f" Per rank: {detail}."
        if shares[most["rank"]] - shares[least["rank"]] > WAIT_SPREAD:
            text += (
                f" Rank {most['rank']} waits {pct(shares[most['rank']])} of its step, rank {least['rank']} "
                f"{pct(shares[least['rank']])}: the rank that waits least waits for the transfer itself, "
                "the others also for a slower rank to join it."
            )
        hw = setup_of(ctx, [run_id])
        collective = all(r["wait_peer"] is None for r in ranks)
        advice = (
            "Hide or shrink the communication: let DDP overlap the allreduce with backward (bucket_cap_mb, "
            "static_graph=True), send bf16/fp16 gradients (a compression comm hook), synchronise less "
            f"often (gradient accumulation with no_sync()), or give each {hw.unit} more work per step "
            "(a larger batch) so the same sync is a smaller share."
            if collective
            else "Overlap the transfers with compute (isend/irecv started early and waited for late), send "
            "fewer or smaller tensors, or give each rank more work per transfer."
        )
        sizes = sorted({1, n // 2, 2 * n} - {0, n})  # N=1 and N=4 beside N=2; N=1, 4, 16 beside 8
        nxt = measure_next(ctx, run_id, sizes, f"the same batch per {hw.unit}")
        out.append(
            make_finding(
                ctx,
                "communication-share",
                run_id,
                severity="alarm" if share >= 0.5 else "warning" if share >= COMM_WAIT_SHARE else "info",
                category="cause",
                title=f"Run {run_id} waits on communication for {pct(share)} of its step ({ops})",
                text=text,
                run_ids=[run_id],
                analyses=("comm_by_role", "comm_ops", "sync"),
                recommendation=(ddp_knobs(ctx, run_id) if collective else "") + advice + nxt,
                confidence=0.7 if run_id in runs else 0.6,
                explained_loss=share,
                numbers={
                    "comm_share": share,
                    "world_size": n,
                    "wait_op": most["wait_op"],
                    "wait_peer": most["wait_peer"],
                    "most_waiting_rank": most["rank"],
                    "most_waiting_share": shares[most["rank"]],
                    "least_waiting_rank": least["rank"],
                    "least_waiting_share": shares[least["rank"]],
                    "roles": ",".join(roles),
                    "measure_world_sizes": ",".join(map(str, sizes)) if nxt else None,
                    "mean_wait_share": mean_share,
                    # its cost: the transfer's wait (the least waiting rank's, per step), against the
                    # run's step time
                    **cost_numbers(transfer, step),
                },
            )
        )
    return out


def counted_roles(ranks: list[Row]) -> list[str]:
    """'2 workers', '1 server' ... for the ranks' roles."""
    by_role: dict[str, int] = defaultdict(int)
    for r in ranks:
        by_role[str(r["role"]).split(":", 1)[0]] += 1
    return [counted(k, role) for role, k in sorted(by_role.items())]


def _waited(r: Row) -> float:
    """A rank's exposed communication per step: point-to-point and collective wait (comm_by_role)."""
    return float((r["p2p_wait_ns"] or 0.0) + (r["collective_wait_ns"] or 0.0))


def _mean(values: Any) -> float:
    vals = [float(v) for v in values]
    return sum(vals) / len(vals) if vals else 0.0


def _is_gpu(run: Row | None) -> bool:
    model = str((run or {}).get("device_model") or "").lower()
    return bool(model) and model != "cpu"


@rule("network-under-delivering", 2, "Network under-delivering: bus bandwidth far below expectation")
def network_under_delivering(ctx: Context) -> list[Finding]:
    out = []
    runs = ctx.by_run("run_summary")
    scaling = ctx.by_run("scaling")
    sync_rows = ctx.by_run("sync")
    references = ctx.by_run("reference_busbw")
    out += _below_reference(ctx, references, scaling)
    fits = alpha_beta_fits(ctx.store, ctx.sel)
    for (cluster, backend, scope), (fit, pts) in fits.items():
        by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in pts:
            by_run[str(p["run_id"])].append(p)
        # (a) one run much slower than the fit of the others predicts (leave that run out)
        if len(by_run) >= 3:
            for rid, own in by_run.items():
                others = [p for r, ps in by_run.items() if r != rid for p in ps]
                f = fit_points(others)
                if f is None:
                    continue
                predicted = [(p["t"], f.predict_s(p["p"], p["n"], p["k"])) for p in own]
                ratios = [t / pred for t, pred in predicted if pred > 0]
                if not ratios or median(ratios) < UNDER_DELIVERY:
                    continue
                ratio = median(ratios)
                srow = sync_rows.get(rid, {})
                sc = scaling.get(rid, {})
                loss = lost_share(sc, "sync_exposed") if sc else None
                explained = loss * (1 - 1 / ratio) if loss is not None else None
                out.append(
                    make_finding(
                        ctx,
                        "network-under-delivering",
                        f"{rid}",
                        severity=cause_severity(explained),
                        category="cause",
                        title=f"Run {rid}: collectives {times(ratio)} slower than the same setup elsewhere",
                        text=(
                            f"On {cluster} with {backend} ({scope}), the allreduces of run {rid} "
                            f"(N={srow.get('world_size')}) take {times(ratio)} the time the "
                            "alpha-beta fit of "
                            f"the other runs predicts for the same message sizes; its bus bandwidth is "
                            f"{gbps(srow.get('busbw_gb_per_s'))}. Something in this run's network "
                            "path differs: "
                            "a fallback to TCP, the wrong network interface, a congested link or a "
                            + ("bad node." if setup_of(ctx, [rid]).multi_node else "busy host.")
                        ),
                        run_ids=[rid],
                        analyses=("sync", "collectives", "allreduce_fit"),
                        recommendation=_compare_transport(setup_of(ctx, [rid])),
                        confidence=0.7,
                        explained_loss=explained,
                        numbers={"slowdown": ratio, "busbw_gb_per_s": srow.get("busbw_gb_per_s")},
                        group_id=sc.get("group_id") if sc else None,
                    )
                )
        # (b) NCCL on GPUs with a bandwidth no GPU interconnect should have; runs with an nccl-tests
        # reference were compared with it instead of this fixed floor
        run_ids = sorted(r for r in by_run if r not in references)
        if "nccl" not in backend.lower() or not any(_is_gpu(runs.get(r)) for r in run_ids):
            continue
        pts = [p for p in pts if str(p["run_id"]) in run_ids]
        large = [p for p in pts if p["n"] >= LARGE_MESSAGE_BYTES]
        busbw = [
            sync_rows[r]["busbw_gb_per_s"]
            for r in run_ids
            if r in sync_rows and sync_rows[r]["busbw_gb_per_s"] is not None
        ]
        bw = fit.bandwidth_gb_per_s if fit is not None and len(pts) >= 3 else None
        measured = max(busbw) if busbw else None
        slow = (bw is not None and bw < SLOW_NCCL_GB_PER_S) or (
            bw is None and measured is not None and measured < SLOW_NCCL_GB_PER_S
        )
        if not large or not slow:
            continue
        where = "across nodes" if scope == "inter-node" else "inside a node"
        out.append(
            make_finding(
                ctx,
                "network-under-delivering",
                f"{cluster}/{backend}/{scope}",
                severity="warning",
                category="cause",
                title=(
                    f"{backend} on {cluster} reaches only {gbps(bw if bw is not None else measured)} {where}"
                ),
                text=(
                    f"With NCCL on GPUs and messages of 1 MB or more, the allreduce {where} on {cluster} "
                    f"delivers {gbps(measured)} bus bandwidth at best"
                    + (f" (alpha-beta fit: {gbps(bw)})" if bw is not None else "")
                    + ". GPU interconnects deliver far more "
                    f"({_EXPECTED_LINK[scope]}); "
                    "this looks like a fallback to TCP sockets"
                    + (
                        " or a missing GPUDirect RDMA path."
                        if scope == "inter-node"
                        else " or peer-to-peer being disabled."
                    )
                ),
                run_ids=run_ids,
                analyses=("sync", "allreduce_fit"),
                recommendation=(
                    "Check NCCL_DEBUG=INFO for 'NET/Socket' (no InfiniBand plugin or NCCL_IB_DISABLE=1), "
                    "NCCL_SOCKET_IFNAME, NCCL_P2P_DISABLE, and whether GPUDirect RDMA (nvidia-peermem) is "
                    "loaded; compare with nccl-tests on the same nodes."
                ),
                confidence=0.5,
                numbers={"busbw_gb_per_s": measured, "fit_bandwidth_gb_per_s": bw},
            )
        )
    return out


def _compare_transport(hw: Setup) -> str:
    """Advice for one run whose collectives are slower than the same setup's elsewhere."""
    bench = "; run nccl-tests all_reduce_perf on the same nodes to compare." if hw.uses("nccl") else "."
    check = transport_check(hw)
    return check[0].upper() + check[1:] + bench


def _below_reference(ctx: Context, references: dict[str, Row], scaling: dict[str, Row]) -> list[Finding]:
    """(c) NCCL runs whose busbw falls far below the cluster's own nccl-tests busbw at that size."""
    out = []
    for rid, ref in references.items():
        share = ref["delivered_share"]
        if share is None or share >= REFERENCE_SHARE:
            continue
        sc = scaling.get(rid, {})
        loss = lost_share(sc, "sync_exposed") if sc else None
        explained = loss * (1 - share) if loss is not None else None
        size = f"{ref['message_bytes'] / 2**20:.1f} MiB"
        out.append(
            make_finding(
                ctx,
                "network-under-delivering",
                f"{rid}/reference",
                severity=cause_severity(explained),
                category="cause",
                title=(
                    f"Run {rid}: allreduce reaches {pct(share)} of the cluster's nccl-tests bus bandwidth"
                ),
                text=(
                    f"At N={ref['world_size']} on {ref['cluster'] or 'this cluster'}, the allreduces of run "
                    f"{rid} ({size} per message) reach {gbps(ref['busbw_gb_per_s'])} bus bandwidth, while "
                    f"nccl-tests measured {gbps(ref['ref_busbw_gb_per_s'])} for that size on "
                    f"{ref['ref_ranks']} ranks ({ref['ref_file']}). The job's collectives get much less of "
                    "the network than the hardware gave the benchmark: a different transport (TCP instead "
                    "of InfiniBand), other NCCL settings, contention with the job's own compute or "
                    "copies, or nodes other than the benchmark's."
                ),
                run_ids=[rid],
                analyses=("reference_busbw", "sync"),
                recommendation=(
                    "Compare the job's NCCL_DEBUG=INFO transport lines with the benchmark's, run the job "
                    "with the same NCCL_* variables as nccl-tests, and check that communication is not "
                    "starved by compute on the same stream (overlap) or by CPU-side launch delays."
                ),
                confidence=0.75,
                explained_loss=explained,
                numbers={
                    "busbw_gb_per_s": ref["busbw_gb_per_s"],
                    "ref_busbw_gb_per_s": ref["ref_busbw_gb_per_s"],
                    "delivered_share": share,
                    "message_bytes": ref["message_bytes"],
                },
                group_id=ref["group_id"],
            )
        )
    return out


def _recorded_sizes(ctx: Context, run_id: str) -> str:
    """The run's recorded collective sizes in words, from their distribution ('' without comm rows)."""
    ops = [o for o in ctx.rows("comm_ops") if o["run_id"] == run_id and o["kind"] == "collective"]
    if not ops:
        return ""
    lo, hi = min(o["bytes_min"] for o in ops), max(o["bytes_max"] for o in ops)
    if lo == hi:
        return f"of {_size(lo)} each"
    main = max(ops, key=lambda o: o["calls"])
    return f"of {_size(lo)} to {_size(hi)} (median {_size(main['bytes_median'])} for {main['op']})"


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


@rule("latency-bound", 3, "Latency-bound: many small collectives")
def latency_bound(ctx: Context) -> list[Finding]:
    out = []
    fits = alpha_beta_fits(ctx.store, ctx.sel)
    sync_rows = ctx.by_run("sync")
    victims = pattern_runs(ctx)  # pipelines and parameter servers: point-to-point, not allreduces
    for gid, rows in ctx.scaling_groups().items():
        top = largest(rows)
        s = sync_rows.get(top["run_id"])
        if not s or top["world_size"] < 2 or not s["comm_count"] or not s["bytes_per_step"]:
            continue
        if top["run_id"] in victims:
            continue
        if (top["sync_share"] or 0) < 0.05:
            continue
        k, nbytes, p = float(s["comm_count"]), float(s["bytes_per_step"]), float(top["world_size"])
        fit = fits.get((top["cluster"], top["backend"], s["scope"]), (None, []))[0]
        avg_msg = nbytes / k
        if fit is not None and fit.alpha_s > 0 and not fit.alpha_refused:
            lat = fit.latency_share(p, nbytes, k)
            confidence = 0.75
            basis = (
                f"the alpha-beta fit (α = {dur(fit.alpha_s * 1e9)} per ring step) puts "
                f"{pct(lat)} of the allreduce time in per-message latency"
            )
        elif avg_msg < SMALL_MESSAGE_BYTES and k >= MANY_COLLECTIVES:
            lat, confidence = None, 0.4
            basis = "no alpha-beta fit is available, but the messages are small"
        else:
            continue
        if lat is not None and lat <= LATENCY_SHARE:
            continue
        share = lost_share(top, "sync_exposed")
        explained = share * lat if share is not None and lat is not None else None
        sizes = _recorded_sizes(ctx, top["run_id"]) or f"averaging {avg_msg / 1024:.0f} KiB"
        out.append(
            make_finding(
                ctx,
                "latency-bound",
                gid,
                severity=cause_severity(explained),
                category="cause",
                title=(
                    f"Latency-bound sync at N={top['world_size']}: {k:.0f} "
                    f"collective{'s' if round(k) != 1 else ''} of {avg_msg / 1024:.0f} KiB per step"
                ),
                text=(
                    f"In {gid} at N={top['world_size']}, each step issues {k:.0f} "
                    f"collective{'s' if round(k) != 1 else ''} {sizes} "
                    f"({nbytes / 2**20:.1f} MiB in all); {basis}. Each "
                    "ring allreduce "
                    f"pays 2(p−1) = {2 * (p - 1):.0f} latency hops whatever its size, so many small "
                    "ones cost "
                    "more than their bytes."
                ),
                run_ids=[top["run_id"]],
                analyses=("sync", "allreduce_fit", "collectives"),
                recommendation=(
                    "Fuse gradients into fewer, larger messages: raise DDP's bucket_cap_mb (default 25 MB), "
                    "Horovod's HOROVOD_FUSION_THRESHOLD, or flatten parameters before a manual allreduce; "
                    "synchronise every k steps with gradient accumulation."
                    if k > 2
                    else fewer_hops(setup_of(ctx, [top["run_id"]]))
                ),
                confidence=confidence,
                explained_loss=explained,
                numbers={"collectives_per_step": k, "avg_message_bytes": avg_msg, "latency_share": lat},
                group_id=gid,
            )
        )
    return out


@rule("overlap-failure", 8, "Overlap failure: the allreduce does not overlap with backward")
def overlap_failure(ctx: Context) -> list[Finding]:
    out = []
    sync_rows = ctx.by_run("sync")
    summary = ctx.by_run("run_summary")
    for gid, rows in ctx.scaling_groups().items():
        bad = []
        for r in rows:
            s = sync_rows.get(r["run_id"])
            if not s or r["world_size"] < 2 or not s["comm_total_ns"] or not s["sync_exposed_ns"]:
                continue
            if (r["sync_share"] or 0) >= SIGNIFICANT_SYNC and s["sync_exposed_ns"] >= OVERLAP_EXPOSED * s[
                "comm_total_ns"
            ]:
                bad.append((r, s))
        if not bad:
            continue
        r, s = max(bad, key=lambda x: x[0]["world_size"])
        backward = summary[r["run_id"]]["backward_ns"] or 0.0
        hideable = min(s["sync_exposed_ns"], backward) * r["world_size"]
        explained = hideable / r["lost_ns"] if r["lost_ns"] and r["lost_ns"] > 0 else None
        out.append(
            make_finding(
                ctx,
                "overlap-failure",
                gid,
                severity=cause_severity(explained),
                category="cause",
                title=(
                    f"No overlap: {pct(min(1.0, s['sync_exposed_ns'] / s['comm_total_ns']))} of "
                    "the allreduce time is exposed"
                ),
                text=(
                    f"In {gid} at N={r['world_size']}, the collectives take "
                    f"{dur(s['comm_total_ns'])} per step and "
                    f"the step waits {dur(s['sync_exposed_ns'])} for them: almost none of the communication "
                    f"overlaps with the {dur(backward)} backward pass, although it could hide up to "
                    f"{dur(min(s['sync_exposed_ns'], backward))} per step."
                ),
                run_ids=[x[0]["run_id"] for x in bad],
                analyses=("sync", "run_summary"),
                recommendation=ddp_knobs(ctx, r["run_id"])
                + (
                    "Let communication start during backward: with DDP, keep gradients in buckets that fill "
                    "early (lower bucket_cap_mb), avoid find_unused_parameters=True and work between "
                    "backward() and the optimizer that forces a wait; with a hand-written "
                    "allreduce, launch it "
                    "per bucket from a gradient hook (async_op=True) instead of after backward"
                    + (
                        "; with Horovod tune HOROVOD_CYCLE_TIME and the fusion threshold."
                        if setup_of(ctx, [x[0]["run_id"] for x in bad]).uses("horovod")
                        else "."
                    )
                ),
                confidence=0.75,
                explained_loss=explained,
                numbers={
                    "exposed_ns": s["sync_exposed_ns"],
                    "comm_total_ns": s["comm_total_ns"],
                    "overlap_share": s["overlap_share"],
                },
                group_id=gid,
            )
        )
    return out


@rule("backend-comparison", 9, "Backend comparison: which collective backend wins where")
def backend_comparison(ctx: Context) -> list[Finding]:
    out = []
    keyed: dict[tuple[object, ...], list[Row]] = defaultdict(list)
    for r in ctx.rows("backend_compare"):
        keyed[(r["experiment"], r["cluster"], r["model"], r["batch_size_per_rank"])].append(r)
    for (exp, cluster, model, batch), rows in keyed.items():
        per_n: dict[int, list[Row]] = defaultdict(list)
        for r in rows:
            if r["world_size"] > 1:
                per_n[r["world_size"]].append(r)
        if not per_n:
            continue
        parts, numbers = [], {}
        wins: dict[str, list[str]] = {"inside one node": [], "across nodes": []}
        for n, rs in sorted(per_n.items()):
            rs.sort(key=lambda r: r["step_ns"])
            best, runner = rs[0], rs[1]
            gap = runner["step_ns"] / best["step_ns"] - 1
            where = "inside one node" if (best["nodes"] or 1) <= 1 else "across nodes"
            numbers[f"N{n}_best"] = best["backend"]
            numbers[f"N{n}_gap"] = gap
            if gap < BACKEND_TIE:
                wins[where].append(f"N={n}: a tie ({pct(gap)})")
            else:
                wins[where].append(f"N={n}: {best['backend']} by {pct(gap)}")
        for where, items in wins.items():
            if items:
                parts.append(f"{where}, {listing(items)}")
        backends = sorted({r["backend"] for r in rows})
        text = (
            f"For {exp} on {cluster} (model {model}, {batch_per(batch)}), "
            f"{' vs '.join(backends)} at the same world size — step time, faster backend and its lead: "
            + "; ".join(parts)
            + "."
        )
        out.append(
            make_finding(
                ctx,
                "backend-comparison",
                f"{exp}/{cluster}/{model}/b{batch}",
                severity="info",
                category="comparison",
                title=f"{' vs '.join(backends)} on {cluster}: "
                + "; ".join(f"{w}: " + _winner(items) for w, items in wins.items() if items),
                text=text,
                run_ids=[r["run_id"] for r in rows],
                analyses=("backend_compare", "sync"),
                recommendation=_backend_advice(setup_of(ctx, [r["run_id"] for r in rows])),
                confidence=0.8,
                numbers=numbers,
            )
        )
    return out


def _backend_advice(hw: Setup) -> str:
    """Which backend tends to win where, for the backends compared and the hardware they ran on."""
    if hw.gpu and hw.uses("nccl") and hw.uses("mpi"):
        tip = "Inside a node MPI's shared-memory reduction can beat NCCL for small models; " + (
            "across nodes NCCL's ring over InfiniBand with GPUDirect usually wins. "
            if hw.multi_node
            else "NCCL's NVLink/PCIe paths usually win for large gradients. "
        )
    elif not hw.gpu:
        tip = "On CPUs an MPI library's shared-memory reduction usually beats gloo's TCP on one host" + (
            "; across hosts compare them on the same network. " if hw.multi_node else ". "
        )
    else:
        tip = ""
    return (
        "Use the faster backend for each placement. "
        + tip
        + "With small gradients the difference is small, because the sync is short."
    )


def _winner(items: list[str]) -> str:

    names = {i.split(": ", 1)[1].split(" by ")[0] for i in items if " by " in i}
    if not names:
        return "no meaningful difference"
    return "/".join(sorted(names)) + " faster"
