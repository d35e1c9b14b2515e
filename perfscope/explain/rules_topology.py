"""Rules about where ranks run: the node-boundary knee, the utilisation jump that is a measurement
effect, and why one cluster scales better than another (DESIGN rules 4 and 10, and a comparison)."""

from __future__ import annotations

from collections import defaultdict

from ..analysis.groups import group_name
from ..analysis.sync import alpha_beta_fits
from .context import Context, Row, largest, node_boundary
from .finding import Finding
from .hardware import cheaper_network_hop, setup_of
from .rulebook import cause_severity, make_finding, rule
from .words import dur, gbps, num, pct, times

KNEE_DROP = 0.15  # relative efficiency drop at the first multi-node world size
UTIL_JUMP_POINTS = 15.0
NO_SPEEDUP_CHANGE = 0.05
CLUSTER_GAP = 0.05


@rule("node-boundary-knee", 4, "Node-boundary knee: efficiency drops when the job leaves one node")
def node_boundary_knee(ctx: Context) -> list[Finding]:
    out = []
    fits = alpha_beta_fits(ctx.store, ctx.sel)
    sync = ctx.by_run("sync")
    for gid, rows in ctx.scaling_groups().items():
        pair = node_boundary(rows)
        if pair is None:
            continue
        inside, outside = pair
        e_in, e_out = inside["efficiency"], outside["efficiency"]
        if not e_in or e_out is None:
            continue
        drop = (e_in - e_out) / e_in
        if drop <= KNEE_DROP:
            continue
        same_n = inside["world_size"] == outside["world_size"]
        where_in = f"N={inside['world_size']} on one node"
        where_out = f"N={outside['world_size']} on {outside['nodes']} nodes"
        numbers: dict[str, float | int | str | None] = {
            "world_size_inside": inside["world_size"],
            "world_size_outside": outside["world_size"],
            "nodes_outside": outside["nodes"],
            "same_world_size": int(same_n),
            "efficiency_inside": e_in,
            "efficiency_outside": e_out,
            "relative_drop": drop,
        }
        # what the collectives measured across the boundary and within a node (bytes unknown: none)
        bw_in = (sync.get(inside["run_id"]) or {}).get("busbw_gb_per_s")
        bw_out = (sync.get(outside["run_id"]) or {}).get("busbw_gb_per_s")
        measured = ""
        if bw_out:
            numbers["busbw_inter_gb_per_s"] = bw_out
            measured = f" Across nodes the gradient allreduce moved {gbps(bw_out)} of bus bandwidth"
            if bw_in:
                numbers["busbw_intra_gb_per_s"] = bw_in
                measured += f", against {gbps(bw_in)} within one node ({times(bw_in / bw_out)} more)"
            measured += ": that is what the link between the nodes carries for this job."
        cost = ""
        t_in, t_out = inside["step_ns"], outside["step_ns"]
        if same_n and t_in and t_out and t_out > t_in:
            numbers["step_share_of_boundary"] = 1 - t_in / t_out
            cost = (
                f" At the same N the step takes {dur(t_out)} across nodes against {dur(t_in)} on one node: "
                f"the boundary costs {pct(1 - t_in / t_out)} of each step."
            )
        intra = fits.get((inside["cluster"], inside["backend"], "intra-node"), (None, []))[0]
        inter = fits.get((inside["cluster"], inside["backend"], "inter-node"), (None, []))[0]
        fit_text = ""
        # the fits say why only where both are fits of measured sizes (traces without bytes give none)
        if (
            intra is not None
            and inter is not None
            and not (intra.alpha_refused or inter.alpha_refused)
            and intra.bandwidth_gb_per_s is not None
            and inter.bandwidth_gb_per_s is not None
        ):
            fit_text = (
                f" The alpha-beta fits say the same: within a node α = {dur(intra.alpha_s * 1e9)} and "
                f"{gbps(intra.bandwidth_gb_per_s)}, across nodes α = {dur(inter.alpha_s * 1e9)} and "
                f"{gbps(inter.bandwidth_gb_per_s)}."
            )
            numbers |= {
                "alpha_intra_s": intra.alpha_s,
                "alpha_inter_s": inter.alpha_s,
                "bandwidth_intra_gb_per_s": intra.bandwidth_gb_per_s,
                "bandwidth_inter_gb_per_s": inter.bandwidth_gb_per_s,
            }
        e_out_loss = 1 - e_out
        explained = (1 - (1 - e_in) / e_out_loss) if e_out_loss > 0 else None
        if same_n:
            title = (
                f"The node boundary: {where_out} runs at efficiency {num(e_out)}, "
                f"{where_in} at {num(e_in)}"
                + (f" (inter-node bus bandwidth {gbps(bw_out)})" if bw_out else "")
            )
            lead = (
                f"In {group_name(gid)}, the same job at the same N is {pct(drop)} less efficient once its "
                f"ranks are placed on {outside['nodes']} nodes instead of one: exposed sync goes from "
                f"{dur(inside['sync_exposed_ns'])} to {dur(outside['sync_exposed_ns'])} per step once "
                "gradients cross the network, while the work per rank is the same."
            )
        else:
            title = (
                f"Knee at the node boundary: efficiency {num(e_in)} → {num(e_out)} "
                f"from N={inside['world_size']} to N={outside['world_size']}"
            )
            lead = (
                f"In {group_name(gid)}, efficiency falls by {pct(drop)} (from {num(e_in)} at {where_in} "
                f"to {num(e_out)} at {where_out}): exposed sync goes from {dur(inside['sync_exposed_ns'])} "
                f"to {dur(outside['sync_exposed_ns'])} per step once gradients cross the network."
            )
        out.append(
            make_finding(
                ctx,
                "node-boundary-knee",
                gid,
                severity=cause_severity(explained),
                category="cause",
                title=title,
                text=lead + cost + measured + fit_text,
                run_ids=[inside["run_id"], outside["run_id"]],
                analyses=("scaling", "sync", "allreduce_fit"),
                recommendation=cheaper_network_hop(setup_of(ctx, [inside["run_id"], outside["run_id"]])),
                confidence=0.9 if same_n else 0.8,
                explained_loss=explained,
                numbers=numbers,
                group_id=gid,
            )
        )
    return out


@rule("utilisation-jump", 10, "Utilisation jump at a node boundary without a speedup change")
def utilisation_jump(ctx: Context) -> list[Finding]:
    out = []
    util = ctx.by_run("utilisation")
    jumps: dict[str, float] = {}
    found = []
    for gid, rows in ctx.scaling_groups().items():
        pair = node_boundary(rows)
        if pair is None:
            continue
        inside, outside = pair
        u_in = (util.get(inside["run_id"]) or {}).get("util_gpu_pct")
        u_out = (util.get(outside["run_id"]) or {}).get("util_gpu_pct")
        if u_in is None or u_out is None:
            continue
        jumps[gid] = u_out - u_in
        e_in, e_out = inside["efficiency"], outside["efficiency"]
        if (
            u_out - u_in >= UTIL_JUMP_POINTS
            and e_in is not None
            and e_out is not None
            and e_out <= e_in + NO_SPEEDUP_CHANGE
        ):
            found.append((gid, inside, outside, u_in, u_out))
    for gid, inside, outside, u_in, u_out in found:
        nccl = "nccl" in str(inside["backend"]).lower()
        # A sibling group on the same cluster with another backend and no jump supports the reading.
        siblings = [
            (g, j)
            for g, j in jumps.items()
            if g != gid and g.split("/")[:2] == gid.split("/")[:2] and j < UTIL_JUMP_POINTS / 2
        ]
        why = (
            "With NCCL, the allreduce is a GPU kernel that spins while it waits for data from the other "
            "node, and nvmlDeviceGetUtilizationRates counts every period in which any kernel is resident as "
            "busy. Waiting on the network therefore shows up as 'utilisation'."
            if nccl
            else "nvmlDeviceGetUtilizationRates counts every period in which any kernel is "
            "resident as busy, so a "
            "kernel that waits (a collective, a spin loop) raises it without doing work."
        )
        sib = ""
        if siblings:
            g, j = siblings[0]
            sib = (
                f" The same study with {g.split('/')[2]} ({g}) shows no such jump ({j:+.0f} points), "
                "as expected when the reduction does not busy-wait on the GPU."
            )
        out.append(
            make_finding(
                ctx,
                "utilisation-jump",
                gid,
                severity="info",
                category="measurement",
                title=(
                    f"GPU utilisation jumps {u_out - u_in:+.0f} points at the first extra node: a "
                    "measurement effect"
                ),
                text=(
                    f"In {gid}, the GPUs' kernel-active time share rises from {u_in:.0f}% at "
                    f"N={inside['world_size']} "
                    f"to {u_out:.0f}% at N={outside['world_size']} ({outside['nodes']} nodes), but "
                    "efficiency does not "
                    f"improve ({num(inside['efficiency'])} → {num(outside['efficiency'])}). {why} "
                    "The jump is not "
                    f"a gain in useful work.{sib}"
                ),
                run_ids=[inside["run_id"], outside["run_id"]],
                analyses=("utilisation", "scaling"),
                recommendation=(
                    "Do not read GPU utilisation as efficiency. Judge the GPUs by the phase "
                    "breakdown (compute "
                    "vs exposed sync), by SM activity (DCGM/GPM sm_active, on Hopper also tensor "
                    "activity), or "
                    "by an Nsight Systems timeline where the NCCL kernels are visible."
                ),
                confidence=0.75 if nccl else 0.5,
                numbers={
                    "util_inside_pct": u_in,
                    "util_outside_pct": u_out,
                    "efficiency_inside": inside["efficiency"],
                    "efficiency_outside": outside["efficiency"],
                },
                group_id=gid,
            )
        )
    return out


@rule("cluster-comparison", None, "Why one cluster scales better than another")
def cluster_comparison(ctx: Context) -> list[Finding]:
    out = []
    families: dict[tuple[object, ...], list[tuple[str, list[Row]]]] = defaultdict(list)
    for gid, rows in ctx.scaling_groups().items():
        r = rows[0]
        key = (
            r["experiment"],
            r["backend"],
            r["model"],
            r["scaling_mode"],
            r["batch_size_per_rank"] if r["scaling_mode"] == "weak" else r["global_batch_size"],
        )
        families[key].append((gid, rows))
    for fam_key, groups in families.items():
        if len({rows[0]["cluster"] for _, rows in groups}) < 2:
            continue
        common = set.intersection(*({r["world_size"] for r in rows} for _, rows in groups))
        common.discard(min(common, default=0))
        n = max(common) if common else None
        at: list[tuple[str, Row, Row]] = []
        for gid, rows in groups:
            row = next((r for r in rows if r["world_size"] == n), None) if n else largest(rows)
            base = min(rows, key=lambda r: r["world_size"])
            if row is not None:
                at.append((gid, row, base))
        if len(at) < 2:
            continue
        at.sort(key=lambda x: -(x[1]["per_gpu_speedup"] or 0))
        best, worst = at[0], at[-1]
        if (best[1]["efficiency"] or 0) - (worst[1]["efficiency"] or 0) <= CLUSTER_GAP:
            continue
        b_row, b_base = best[1], best[2]
        w_row, w_base = worst[1], worst[2]
        compute_ratio = b_base["step_ns"] / w_base["step_ns"]
        hw = setup_of(ctx, [x[1]["run_id"] for x in at])
        faster = w_row["throughput_samples_per_s"] / b_row["throughput_samples_per_s"]
        text = (
            f"At N={b_row['world_size']}, {b_row['cluster']} reaches a per-{hw.unit} speedup of "
            f"{num(b_row['per_gpu_speedup'])} and {w_row['cluster']} {num(w_row['per_gpu_speedup'])}. "
            f"The exposed sync per step is {dur(b_row['sync_exposed_ns'])} on {b_row['cluster']} and "
            f"{dur(w_row['sync_exposed_ns'])} on {w_row['cluster']}, but one step of compute at "
            f"N={b_base['world_size']} takes {dur(b_base['step_ns'])} on {b_row['cluster']} against "
            f"{dur(w_base['step_ns'])} on {w_row['cluster']} ({times(compute_ratio)}), so the sync is a "
            f"smaller share of the step ({pct(b_row['sync_share'])} vs {pct(w_row['sync_share'])}). "
            f"Slower per-{hw.unit} compute makes the same synchronisation cheaper in relative terms: "
            f"{b_row['cluster']} scales better, yet {w_row['cluster']} still delivers "
            f"{times(faster)} its samples per second."
        )
        out.append(
            make_finding(
                ctx,
                "cluster-comparison",
                "/".join(str(k) for k in fam_key),
                severity="info",
                category="comparison",
                title=(
                    f"{b_row['cluster']} scales better than {w_row['cluster']} because its {hw.units} "
                    "compute slower, not because it syncs faster"
                )
                if compute_ratio > 1
                else f"{b_row['cluster']} scales better than {w_row['cluster']}: its sync is cheaper",
                text=text,
                run_ids=[x[1]["run_id"] for x in at] + [x[2]["run_id"] for x in at],
                analyses=("scaling", "sync", "run_summary"),
                recommendation=(
                    "Compare clusters by time to solution (samples/s, time to accuracy), not by efficiency "
                    f"alone. On the fast-{hw.unit} cluster, raise the work per step (batch, model size) so "
                    "compute again dominates the fixed cost of the sync."
                ),
                confidence=0.7,
                numbers={
                    "world_size": b_row["world_size"],
                    f"per_gpu_speedup_{b_row['cluster']}": b_row["per_gpu_speedup"],
                    f"per_gpu_speedup_{w_row['cluster']}": w_row["per_gpu_speedup"],
                    "baseline_step_ratio": compute_ratio,
                    "throughput_ratio": faster,
                },
            )
        )
    return out
