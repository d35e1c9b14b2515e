"""The one registry of analyses: name -> function, title, and the DESIGN.md definition it implements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from ..store.reader import Store
from .cache import memo
from .selection import Selection

AnalysisFn = Callable[[Store, Selection], pa.Table]

META_ANALYSIS = b"perfscope.analysis"
META_DEFINITION = b"perfscope.definition"
META_TITLE = b"perfscope.title"

#: The definitions of DESIGN.md, by key; every analysis names the one(s) its numbers follow.
DEFINITIONS: dict[str, str] = {
    "steady-state": "Steady state: drop warm-up steps (default: first 10 or first 5%, whichever is "
    "larger); statistics are medians with spread (p10/p90, coefficient of variation).",
    "step-time": "Step time T of a run = the steady window's elapsed wall-clock time (latest end of "
    "its last step on any rank − earliest start of its first step on any rank) / its steps; the "
    "median and p10/p90 of the slowest rank's step time per step describe spread, and a periodic or "
    "bimodal step-time distribution is named.",
    "throughput": "Throughput X = global samples over the steady window / its elapsed wall-clock time "
    "(samples per second); a periodic slow step counts in full, never samples / median step.",
    "speedup": "Speedup S(N) = X(N)/X(N0), N0 the smallest world size in the same group (experiment, "
    "cluster, backend, per-rank batch or global batch, model). Efficiency E(N) = S(N)·N0/N. Per-GPU "
    "speedup S(N)/N.",
    "scaling-mode": "Strong vs weak scaling: global batch fixed across N is strong scaling; per-rank "
    "batch fixed is weak scaling. Mixed groups are flagged, not compared.",
    "lost-time": "Lost time: N·T(N) − N0·T(N0)·G(N)/G(N0) (G = global samples per step; for strong "
    "scaling G(N)=G(N0) and this is N·T(N) − N0·T(N0)), split by phase.",
    "busbw": "Allreduce bus bandwidth (nccl-tests): algbw = bytes/t; busbw = algbw·2(n−1)/n.",
    "alpha-beta": "Ring allreduce cost: T = 2(p−1)·α + 2·(p−1)/p·n·β, fitted separately within a node "
    "and across nodes.",
    "utilisation": "GPU utilisation is nvmlDeviceGetUtilizationRates().gpu: the kernel-active time "
    "share (some kernel ran during the last 1/6-1 s), not an efficiency.",
    "energy": "Energy per sample: energy_mj counter deltas over the steady window, summed over the "
    "run's GPUs, divided by the samples of that window.",
    "pop": "POP efficiencies from per-rank useful = compute time: LB = mean(useful)/max(useful); "
    "CommE = max(useful)/T; PE = LB·CommE; computation scaling = Σuseful(N0)/Σuseful(N).",
    "wait-at-collective": "Wait at collective: for each collective instance, w_i = max_j(enter_j) − "
    "enter_i. A rank that is last most of the time is a straggler.",
    "scaling-model": "Scaling models: performance-model normal form c0 + c1·p^i·log2(p)^j (Extra-P "
    "search space) and the alpha-beta model, with SMAPE and adjusted R²; no trusted extrapolation "
    "from fewer than 4-5 points.",
    "mfu": "MFU = achieved FLOP/s per device / peak FLOP/s of that device; only when FLOPs per step "
    "are known.",
    "batch-sweep": "Batch-size sweep: steady-state step time, samples/s and epoch time "
    "(dataset_samples / global batch · T) against batch size; time-to-metric from the user metrics.",
    "time-to-target": "Time to target: wall time until a metric, smoothed over 10 steps, first reaches "
    "the target: the user's (--target loss=0.5, or profile(target='loss=0.5')), else the best value "
    "75% of the runs that did not diverge reached. A run diverged when a value is NaN/inf or its "
    "metric moves away from its best for the last third of the run. Runs whose tags differ (the "
    "learning-rate rule, say) are variants, compared side by side, never pooled as repeats. Only "
    "loss-like and accuracy-like metrics are judged (or one the user names): grad_norm, learning_rate, "
    "epoch, *_runtime, *_per_second and such bookkeeping are not.",
    "data-quality": "Data quality: missing ranks, phases or baselines, too few steps or points, high "
    "variance, superlinear speedup, throttling.",
    "placement": "Placement: ranks per host against the host's logical CPUs and GPUs.",
    "threads": "Threads and cores per rank: torch intra-op threads and the cores a rank may use "
    "(affinity); runs of one group compare like with like only when both are the same at every world "
    "size and ranks × threads per host do not exceed its logical CPUs.",
    "contention": "Contention: other processes' CPU on a host during the steady window = system CPU "
    "(sys_cpu_pct · cpu_count) minus the job's ranks' (proc_cpu_pct, collector threads included); above "
    "0.2 of a core per rank, timing findings are uncertain. A host whose system CPU is ≥ 90% had no "
    "idle core.",
    "raw": "Recorded values, aggregated only to fit a chart (no derived definition).",
    "memory": "Memory over the run: a rank's resident memory (its process's RSS, sampled by the poller) "
    "and its CUDA allocator peak per step, over the steady steps; creep = a least-squares slope "
    "against the step with R² ≥ 0.8 that adds ≥ 16 MiB over the window, with the step at "
    "which it would use up the device's or the host's memory left at the end; imbalance = the most "
    "a rank peaks ≥ 1.25× the ranks' median and ≥ 256 MiB above it; headroom = a device peak "
    "reserved ≥ 90% of its memory.",
    "settings": "The job's settings as recorded: the DataLoader given to prof.steps, the host's CPUs and "
    "threads, the model's parameter dtypes and autocast, torch.compile, DDP's bucketing knobs and the "
    "NCCL/OpenMP/MKL variables; NULL where a run did not record one (never a default assumed).",
    "comm-patterns": "Communication beyond DDP: every torch.distributed call is a comm row with its "
    "total (issue to completion) and exposed time (what the caller waited); exposed time in a phase "
    "is charged to communication, not to that phase's compute. Point-to-point transfers never enter "
    "the ring model or busbw.",
    "pipeline": "Pipeline (p stages, m micro-batches): measured bubble fraction = a stage's wait in "
    "point-to-point / its step time; ideal GPipe bubble (p−1)/(m+p−1). A stage waiting for its "
    "neighbour is a victim: the slowest stage (most compute) is named.",
    "pserver": "Parameter server: per worker push and pull time per step, the server's busy share "
    "(1 − its wait to receive / its active time), worker skew = max / median worker step time.",
    "periodic-sync": "Periodic synchronisation every k steps: the sync step's exposed cost, its "
    "amortised share cost/k over the mean step, and the k that keeps it under 10%.",
    "what-if": "What-if: each step's dependency graph (each rank's ops in recorded order; a recv cannot "
    "end before its send starts; a collective ends on every member no earlier than its last member "
    "enters) is replayed with the recorded times (replay error = mean |replayed − recorded| / recorded "
    "step time) and with ideal ones: each op's time is the typical (lower median) time of the same op "
    "at its data-parallel peers (same stage, same step, same position), averaged over the pipeline "
    "stages that run it (a balanced pipeline). Slowdown S = mean actual / mean ideal step time; S_x = "
    "the same with only x's ops (a worker: one dp rank at one stage; a stage; an op type) as recorded; "
    "x's share of the excess is (S_x − 1)/(S − 1). Cause: stage-imbalance (one stage's share ≥ 1/2, "
    "every other's ≤ 0.1, its compute longer at every dp rank), slow-worker (one worker's share ≥ 1/2 "
    "and the largest in most steps, its dp peers' under half of it), data-imbalance (the same op "
    "differs across dp ranks by > 5% and no dp rank is the slowest in over 60% of steps and stages), "
    "none (S < 1.03).",
}


@dataclass(frozen=True)
class Analysis:
    name: str
    title: str
    definition: tuple[str, ...]  # keys of DEFINITIONS
    fn: AnalysisFn
    doc: str

    def definition_text(self) -> str:
        return " ".join(DEFINITIONS[k] for k in self.definition)


ANALYSES: dict[str, Analysis] = {}


def analysis(name: str, title: str, *definition: str) -> Callable[[AnalysisFn], AnalysisFn]:
    """Register `fn(store, sel) -> pa.Table` under `name`; the table gets the metadata on return."""
    for key in definition:
        if key not in DEFINITIONS:
            raise KeyError(f"analysis {name}: unknown definition {key!r}")

    def wrap(fn: AnalysisFn) -> AnalysisFn:
        if name in ANALYSES:
            raise KeyError(f"analysis {name!r} registered twice")
        ANALYSES[name] = Analysis(name, title, definition, fn, (fn.__doc__ or "").strip())
        return fn

    return wrap


def run_analysis(name: str, store: Store, sel: Selection | None = None) -> pa.Table:
    """Run one registered analysis; the result carries its name, title and definition as metadata."""
    try:
        a = ANALYSES[name]
    except KeyError:
        raise KeyError(f"unknown analysis {name!r}; analyses are {', '.join(ANALYSES)}") from None
    sel = sel or Selection()

    def compute() -> pa.Table:
        table = a.fn(store, sel)
        meta = dict(table.schema.metadata or {})
        meta.update(
            {
                META_ANALYSIS: a.name.encode(),
                META_TITLE: a.title.encode(),
                META_DEFINITION: a.definition_text().encode(),
            }
        )
        return table.replace_schema_metadata(meta)

    # Tables are immutable and the cache is dropped when the store re-lists: safe to share.
    return memo(store, ("analysis", name, sel), compute)


def run_all(store: Store, sel: Selection | None = None) -> dict[str, pa.Table]:
    return {name: run_analysis(name, store, sel) for name in ANALYSES}
