"""Memory over the run (the `memory` analysis): a rank whose memory creeps up step after step, ranks
that peak far apart, and a device close to its limit. Memory is no timing verdict: these findings are
`measurement`s, never weakened by CPU contention."""

from __future__ import annotations

from collections import defaultdict
from statistics import median

from ..words import counted
from .context import Context, Row
from .finding import Finding
from .rulebook import make_finding, rule
from .words import listing, num

MIB = 2**20
#: a creep: the fit explains this much of the variance ...
CREEP_R2 = 0.8
#: ... and adds at least this much over the steady window (a flat process wobbles by well under 1 MiB)
CREEP_MIN_RISE_BYTES = 16 * MIB
#: fewer steady samples than this fit no trend
CREEP_MIN_SAMPLES = 6
#: imbalance: the most a rank peaks against the ranks' median peak, by ratio and by bytes
IMBALANCE_RATIO = 1.25
IMBALANCE_MIN_BYTES = 256 * MIB
#: headroom: a device's peak reserved at or above this share of its memory
HEADROOM_SHARE = 0.9

_WHAT = {"host": "resident memory (RSS)", "device": "CUDA memory (the allocator's peak per step)"}
_ADVICE = {
    "host": "Something keeps a reference every step: losses or outputs kept as tensors (log "
    "loss.item(), not loss), a list or cache that only grows, a profiler or hook that records "
    "without end. Compare two tracemalloc snapshots a few hundred steps apart (or memray) to find "
    "the line that allocates; DataLoader workers reading Python lists of the dataset copy them on "
    "read (keep them in numpy arrays).",
    "device": "Tensors outlive their step: a loss summed without .item() or .detach() keeps every "
    "step's graph, outputs appended to a list keep their activations. "
    "torch.cuda.memory._record_memory_history() and a snapshot (memory_viz) name the allocating "
    "stack; torch.cuda.memory_summary() tells fragmentation (reserved far above allocated) from "
    "live tensors.",
}


def _mib(b: float | None) -> str:
    return "?" if b is None else f"{b / MIB:,.1f} MiB" if abs(b) < 10 * 2**30 else f"{b / 2**30:,.1f} GiB"


def creeping(r: Row) -> bool:
    slope, r2 = r["slope_bytes_per_step"], r["r2"]
    if slope is None or slope <= 0 or r2 is None or r["samples"] < CREEP_MIN_SAMPLES:
        return False
    rise = slope * (r["last_step"] - r["first_step"])
    return r2 >= CREEP_R2 and rise >= CREEP_MIN_RISE_BYTES


def _by_run_kind(ctx: Context) -> dict[tuple[str, str], list[Row]]:
    out: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in ctx.rows("memory"):
        out[(r["run_id"], r["kind"])].append(r)
    return out


@rule("memory-creep", None, "Memory creeps up step after step")
def memory_creep(ctx: Context) -> list[Finding]:
    out = []
    for (run_id, kind), rows in _by_run_kind(ctx).items():
        rising = [r for r in rows if creeping(r)]
        if not rising:
            continue
        worst = max(rising, key=lambda r: r["slope_bytes_per_step"])
        slope = worst["slope_bytes_per_step"]
        soonest = min((r["exhaust_step"] for r in rising if r["exhaust_step"] is not None), default=None)
        limit = "the device's memory" if kind == "device" else "the host's available memory"
        text = (
            f"In run {run_id}, the {_WHAT[kind]} of {counted(len(rising), 'rank')} of {len(rows)} "
            f"({listing(str(r['rank']) for r in rising)}) rises steadily over the steady steps: rank "
            f"{worst['rank']} by {_mib(slope)} per step (R² {num(worst['r2'])}), "
            f"from {_mib(worst['first_bytes'])} "
            f"at step {worst['first_step']} to {_mib(worst['last_bytes'])} at step {worst['last_step']}."
        )
        if soonest is not None:
            text += f" At this rate {limit} runs out at about step {soonest:,}."
        out.append(
            make_finding(
                ctx,
                "memory-creep",
                f"{run_id}:{kind}",
                severity="alarm"
                if soonest is not None and soonest <= 10 * max(1, worst["last_step"])
                else "warning",
                category="measurement",
                title=f"Run {run_id}: {kind} memory creeps up by {_mib(slope)} per step",
                text=text,
                run_ids=[run_id],
                analyses=("memory",),
                recommendation=_ADVICE[kind],
                confidence=min(0.9, max(0.5, worst["r2"])),
                numbers={
                    "kind": kind,
                    "rank": worst["rank"],
                    "slope_bytes_per_step": slope,
                    "slope_mib_per_step": slope / MIB,
                    "r2": worst["r2"],
                    "ranks_creeping": len(rising),
                    "exhaust_step": soonest,
                },
            )
        )
    return out


@rule("memory-imbalance", None, "One rank needs much more memory than the others")
def memory_imbalance(ctx: Context) -> list[Finding]:
    out = []
    for (run_id, kind), rows in _by_run_kind(ctx).items():
        peaks = [r for r in rows if r["peak_bytes"] is not None]
        if len(peaks) < 2:
            continue
        mid = median(r["peak_bytes"] for r in peaks)
        top = max(peaks, key=lambda r: r["peak_bytes"])
        if top["peak_bytes"] < IMBALANCE_RATIO * mid or top["peak_bytes"] - mid < IMBALANCE_MIN_BYTES:
            continue
        out.append(
            make_finding(
                ctx,
                "memory-imbalance",
                f"{run_id}:{kind}",
                severity="warning",
                category="measurement",
                title=f"Run {run_id}: rank {top['rank']} peaks at {num(top['peak_bytes'] / mid)}× "
                f"the ranks' {kind} memory",
                text=(
                    f"In run {run_id}, rank {top['rank']}'s {_WHAT[kind]} peaks at "
                    f"{_mib(top['peak_bytes'])}, the "
                    f"ranks' median at {_mib(mid)}: the batch fits only as far as this rank allows."
                ),
                run_ids=[run_id],
                analyses=("memory",),
                recommendation="Give the ranks equal shares: the rank that holds more (rank 0 keeping "
                "logging, evaluation or checkpoint copies; an uneven pipeline stage or embedding shard; "
                "longer sequences in its batches) sets the batch and the memory everyone can use. Move "
                "the extra work off it, or balance the stages and the batches' lengths.",
                confidence=0.7,
                numbers={
                    "kind": kind,
                    "rank": top["rank"],
                    "peak_bytes": top["peak_bytes"],
                    "median_peak_bytes": mid,
                },
            )
        )
    return out


def _precision_words(ctx: Context, run_id: str) -> str:
    """The run's recorded parameter dtypes and autocast, when the activations could be halved."""
    s = ctx.by_run("run_settings").get(run_id) or {}
    dtypes, autocast = s.get("param_dtypes"), s.get("autocast")
    if autocast != "" or not dtypes or not str(dtypes).startswith("float32"):
        return ""  # autocast on, not recorded, or parameters already in 16 bits
    return (
        f"The model ran with {dtypes} parameters and no autocast: torch.autocast('cuda', "
        "dtype=torch.bfloat16) around the forward keeps most activations in half the bytes. "
    )


@rule("memory-headroom", None, "A device runs close to its memory limit")
def memory_headroom(ctx: Context) -> list[Finding]:
    out = []
    for (run_id, kind), rows in _by_run_kind(ctx).items():
        near = [
            r
            for r in rows
            if kind == "device"
            and r["limit_bytes"]
            and (r["peak_bytes"] or 0) >= HEADROOM_SHARE * r["limit_bytes"]
        ]
        if not near:
            continue
        top = max(near, key=lambda r: r["peak_bytes"] / r["limit_bytes"])
        share = top["peak_bytes"] / top["limit_bytes"]
        out.append(
            make_finding(
                ctx,
                "memory-headroom",
                run_id,
                severity="warning",
                category="measurement",
                title=f"Run {run_id}: rank {top['rank']} reserves {num(100 * share, 0)}% "
                "of its device's memory",
                text=(
                    f"In run {run_id}, the CUDA allocator of {counted(len(near), 'rank')} "
                    f"({listing(str(r['rank']) for r in near)}) reserved at its peak "
                    f"{_mib(top['peak_bytes'])} of {_mib(top['limit_bytes'])} ({num(100 * share, 0)}%): "
                    "a longer sequence, a larger batch or "
                    "fragmentation runs it out of memory, and near the limit the allocator frees and retries "
                    "(cudaFree/cudaMalloc), which stalls the step."
                ),
                run_ids=[run_id],
                analyses=("memory",),
                recommendation=_precision_words(ctx, run_id)
                + "Leave room: activation checkpointing, a smaller micro-batch with gradient "
                "accumulation, bf16 activations (autocast), sharded optimizer state (ZeRO/FSDP); "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation.",
                confidence=0.8,
                numbers={
                    "rank": top["rank"],
                    "peak_reserved_bytes": top["peak_bytes"],
                    "share_of_device": share,
                },
            )
        )
    return out
