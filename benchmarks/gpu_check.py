"""The GPU check: every CUDA path of perfscope, once, on one GPU, in at most 5 minutes.

    .venv/bin/python benchmarks/gpu_check.py [--json FILE] [--keep DIR]      (or: make gpu-check)

Checks, each with a plain verdict (pass, fail or skipped, and why) on stderr and a JSON summary on
stdout (and in FILE):

1. pytest-gpu: the test files marked `gpu` (`pytest -m gpu`).
2. kineto-vs-perfscope: a small CUDA training job (DDP over NCCL, world size 1) recorded by perfscope
   and by torch.profiler at once; the Kineto trace imported with `perfscope import kineto`; per
   steady step, GPU compute (forward + backward + optimizer) and NCCL time of the two agree within
   5% (NCCL, tiny on one rank, within 5% or 50 us).
3. cuda-events-vs-host: phase times from perfscope's CUDA events against the host's clock with a
   `torch.cuda.synchronize()` around each phase, within 5% (or 0.2 ms) per phase, median of steps.
4. nvml: the job's NVML samples are plausible: power > 0, utilisation within 0-100 (and above 0 at
   least once while the GPU trains), memory used at least `torch.cuda.memory_reserved()` of the job
   and at most the GPU's memory.
5. device-memory: the job's device_memory rows (the CUDA allocator's peaks per step): one per step
   after the first, peak allocated at least the model's parameters and gradients, at most the peak
   reserved, at most the device's memory (which equals torch's total_memory); no memory-creep
   finding on the flat job; and the runs row records the job's DDP bucket_cap_mb=25.
6. nvtx-nsys: the job run under Nsight Systems; the export (SQLite) holds perfscope's NVTX ranges
   (domain `perfscope`, its steps and phases); skipped, and said, when `nsys` is not installed.

Without a CUDA GPU it says "no CUDA GPU: every check skipped", prints the JSON and exits 0. It exits 1
when a check fails, or when a GPU is there but torch cannot use it (a CPU build of torch: the lock
installs one; install a CUDA build of torch into the environment first).

Written before perfscope had a GPU to run on (from torch's, NVML's and Nsight Systems' documented
interfaces): its first run on a GPU is also the check's own first run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: the whole check's budget (the brief: at most 5 minutes on one GPU)
BUDGET_S = 300.0
#: relative agreement asked of two clocks measuring the same GPU work
TOLERANCE = 0.05
#: absolute floors under which a difference is noise: a phase has launch and wake-up latencies of tens
#: of microseconds; NCCL on one rank moves nothing (an in-place all-reduce of one rank launches no
#: kernel), so there the two can only agree on "about nothing": within 50 us or 2% of the step
NCCL_FLOOR_NS = 50_000
NCCL_FLOOR_SHARE = 0.02
PHASE_FLOOR_NS = 200_000
#: steps of the training job; the first WARMUP and the last TAIL of each are not compared
STEPS = 60
WARMUP = 5
TAIL = 2

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"

# The training job: run in a fresh process (its own CUDA context), writes what only it can see
# (host timings, torch.cuda.memory_reserved) to OUT/job.json.
JOB = """
import json, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import perfscope

out = Path(sys.argv[1])
for store in ("store", "events-store", "nvtx-store"):
    (out / store).mkdir(exist_ok=True)
mode = sys.argv[2]  # "train" (both recorders, NVML, CUDA events vs host) or "nvtx" (under nsys)
torch.cuda.set_device(0)
torch.manual_seed(0)
result = {}

# GPU-bound steps of ~12 ms: the host runs ahead, so stream time between events is kernel time
dist.init_process_group("nccl", rank=0, world_size=1)
model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]).cuda()
ddp = DDP(model, device_ids=[0], bucket_cap_mb=25)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
batches = [torch.randn(BATCH, WIDTH, device="cuda") for _ in range(STEPS)]
torch.cuda.synchronize()


def train(prof, on_step=None):
    prof.watch(ddp)
    for x in prof.steps(batches):
        with prof.phase("forward"):
            loss = ddp(x).square().mean()
        with prof.phase("backward"):
            loss.backward()
        with prof.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step()


if mode == "nvtx":
    with perfscope.profile(out / "nvtx-store", batch_size=BATCH, poll_hz=0, experiment="nvtx") as prof:
        train(prof)
else:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as tprof:  # ProfilerStep#N is perfscope's step N
        with perfscope.profile(
            out / "store", batch_size=BATCH, timing="cuda", poll_hz=20, experiment="both"
        ) as prof:
            train(prof, tprof.step)
            result["memory_reserved"] = torch.cuda.memory_reserved()
            result["memory_total"] = torch.cuda.get_device_properties(0).total_memory
    tprof.export_chrome_trace(str(out / "kineto.json"))

    # CUDA events against the host's clock: a synchronize before and after each phase, so the host
    # sees the phase's GPU time plus launch and wake-up latency
    cycles = SLEEP_CYCLES
    host = {"forward": [], "backward": []}
    with perfscope.profile(out / "events-store", poll_hz=0, timing="cuda", experiment="events") as prof:
        for _ in prof.steps(range(PHASE_STEPS)):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            with prof.phase("forward"):
                torch.cuda._sleep(cycles)
                torch.cuda.synchronize()
            t1 = time.perf_counter_ns()
            with prof.phase("backward"):
                torch.cuda._sleep(2 * cycles)
                torch.cuda.synchronize()
            t2 = time.perf_counter_ns()
            host["forward"].append(t1 - t0)
            host["backward"].append(t2 - t1)
    result["host_ns"] = host
dist.destroy_process_group()
(out / "job.json").write_text(json.dumps(result))
"""

#: the job's sizes: 8 layers of 4096x4096 at batch 1024 is ~14 ms a step in fp32 on an H100
JOB_CONSTANTS = {
    "LAYERS": 8,
    "WIDTH": 4096,
    "BATCH": 1024,
    "STEPS": STEPS,
    "PHASE_STEPS": 12,
    "SLEEP_CYCLES": 10_000_000,  # torch.cuda._sleep spins: ~5 ms at ~2 GHz
}


def job_source() -> str:
    consts = "".join(f"{k} = {v!r}\n" for k, v in JOB_CONSTANTS.items())
    return consts + textwrap.dedent(JOB)


class Budget:
    """What is left of the check's time; each step gets at most that."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def check(name: str, verdict: str, detail: str, **figures: Any) -> dict[str, Any]:
    return {"name": name, "verdict": verdict, "detail": detail, "figures": figures}


def rel(a: float, b: float) -> float:
    """|a - b| relative to b (inf when b is 0 and a is not)."""
    if b == 0:
        return 0.0 if a == 0 else float("inf")
    return abs(a - b) / abs(b)


def agree(a: float, b: float, floor: float) -> bool:
    return abs(a - b) <= max(TOLERANCE * abs(b), floor)


def run_cmd(args: list[str], budget: Budget, cap_s: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    timeout = min(cap_s, budget.left())
    if timeout < 5:
        raise TimeoutError("the check's 5-minute budget is spent")
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, **kw)


def finite(value: Any) -> Any:
    """`value` with every non-finite float made None: the summary stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------- the checks


def pytest_gpu(budget: Budget) -> dict[str, Any]:
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace")
    )
    if not files:
        return check("pytest-gpu", FAIL, "no test file is marked gpu")
    out = run_cmd(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *files],
        budget,
        150,
        cwd=ROOT,
    )
    summary = tail(out.stdout, 1)
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    verdict = PASS if out.returncode == 0 else FAIL
    return check("pytest-gpu", verdict, f"{summary} (exit {out.returncode})", files=files, skipped=skips)


def train_job(work: Path, budget: Budget, env: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """Run the training job once; (its job.json, '') or (None, why it failed)."""
    script = work / "job.py"
    script.write_text(job_source())
    out = run_cmd([sys.executable, str(script), str(work), "train"], budget, 150, env=env)
    if out.returncode != 0 or not (work / "job.json").exists():
        return None, f"the training job failed (exit {out.returncode}): {tail(out.stderr)}"
    return json.loads((work / "job.json").read_text()), ""


def query(store: Path, sql: str) -> list[dict[str, Any]]:
    """The rows of one query over a store, read the way users read it."""
    import perfscope

    with perfscope.open_store(store) as s:
        rows: list[dict[str, Any]] = s.query(sql).to_pylist()
    return rows


def steps_of(store: Path) -> list[dict[str, Any]]:
    return query(
        store,
        "SELECT step, forward_ns, backward_ns, optimizer_ns, sync_exposed_ns, comm_total_ns, clock "
        "FROM steps ORDER BY step",
    )


def steady(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in rows if WARMUP <= r["step"] < STEPS - TAIL}


def compute_ns(r: dict[str, Any]) -> int:
    return sum(int(r[c] or 0) for c in ("forward_ns", "backward_ns", "optimizer_ns"))


def kineto_vs_perfscope(work: Path, budget: Budget) -> dict[str, Any]:
    name = "kineto-vs-perfscope"
    trace = work / "kineto.json"
    imported = work / "kineto-store"
    out = run_cmd(
        [sys.executable, "-m", "perfscope", "import", "kineto", str(trace), "--store", str(imported),
         "--experiment", "kineto", "--batch-size", str(JOB_CONSTANTS["BATCH"])],
        budget, 120, cwd=ROOT,
    )  # fmt: skip
    if out.returncode != 0:
        return check(
            name, FAIL, f"perfscope import kineto failed (exit {out.returncode}): {tail(out.stderr)}"
        )
    ours, theirs = steady(steps_of(work / "store")), steady(steps_of(imported))
    common = sorted(set(ours) & set(theirs))
    if len(common) < 10:
        return check(
            name,
            FAIL,
            f"only {len(common)} steady steps in both (perfscope {len(ours)}, kineto {len(theirs)})",
        )
    figures: dict[str, Any] = {
        "steps_compared": len(common),
        "clock": sorted({ours[s]["clock"] for s in common}),
    }
    failures = []
    step_ns = statistics.median(compute_ns(theirs[s]) for s in common)
    for what, get, floor in (
        ("compute", compute_ns, 0),
        ("nccl", lambda r: int(r["comm_total_ns"] or 0), max(NCCL_FLOOR_NS, NCCL_FLOOR_SHARE * step_ns)),
    ):
        a = [get(ours[s]) for s in common]
        b = [get(theirs[s]) for s in common]
        diffs = [rel(x, y) for x, y in zip(a, b, strict=True)]
        within = sum(agree(x, y, floor) for x, y in zip(a, b, strict=True))
        med_a, med_b = statistics.median(a), statistics.median(b)
        figures[what] = {
            "floor_ms": floor / 1e6,
            "perfscope_median_ms": med_a / 1e6,
            "kineto_median_ms": med_b / 1e6,
            "median_rel_diff": rel(med_a, med_b),
            "steps_within": within,
            "worst_rel_diff": max(diffs),
        }
        # every steady step within the tolerance but one in ten (a preempted launch, a clock tick)
        if not agree(med_a, med_b, floor) or within < 0.9 * len(common):
            failures.append(
                f"{what}: perfscope {med_a / 1e6:.3f} ms vs kineto {med_b / 1e6:.3f} ms a step, "
                f"{within}/{len(common)} steps within 5%"
            )
    c = figures["compute"]
    n = figures["nccl"]
    detail = (
        f"{len(common)} steps: compute {c['perfscope_median_ms']:.3f} vs {c['kineto_median_ms']:.3f} ms "
        f"({c['median_rel_diff']:.1%}), NCCL {n['perfscope_median_ms']:.3f} vs {n['kineto_median_ms']:.3f} ms"
    )
    if "cuda" not in figures["clock"]:
        failures.append(f"perfscope timed the steps by the {figures['clock']} clock, not CUDA events")
    return check(name, FAIL if failures else PASS, "; ".join(failures) or detail, **figures)


def events_vs_host(work: Path, job: dict[str, Any]) -> dict[str, Any]:
    name = "cuda-events-vs-host"
    steps = query(
        work / "events-store", "SELECT step, forward_ns, backward_ns, clock FROM steps ORDER BY step"
    )
    figures: dict[str, Any] = {"clock": sorted({r["clock"] for r in steps})}
    failures = []
    for phase in ("forward", "backward"):
        host = job["host_ns"][phase][1:]  # the first step carries the kernel's first launch
        dev = [r[f"{phase}_ns"] for r in steps][1:]
        if len(dev) != len(host) or not dev:
            failures.append(f"{phase}: {len(dev)} recorded steps for {len(host)} host timings")
            continue
        med_dev, med_host = statistics.median(dev), statistics.median(host)
        figures[phase] = {"events_median_ms": med_dev / 1e6, "host_median_ms": med_host / 1e6,
                          "rel_diff": rel(med_dev, med_host)}  # fmt: skip
        if not agree(med_dev, med_host, PHASE_FLOOR_NS):
            failures.append(f"{phase}: CUDA events {med_dev / 1e6:.3f} ms vs host {med_host / 1e6:.3f} ms")
    if figures["clock"] != ["cuda"]:
        failures.append(f"phases timed by {figures['clock']}, not CUDA events")
    if failures:
        return check(name, FAIL, "; ".join(failures), **figures)
    f, b = figures["forward"], figures["backward"]
    detail = (
        f"forward {f['events_median_ms']:.3f} vs {f['host_median_ms']:.3f} ms, "
        f"backward {b['events_median_ms']:.3f} vs {b['host_median_ms']:.3f} ms"
    )
    return check(name, PASS, detail, **figures)


def nvml(work: Path, job: dict[str, Any]) -> dict[str, Any]:
    name = "nvml"
    rows = query(
        work / "store",
        "SELECT util_gpu_pct, util_mem_pct, mem_used_bytes, mem_total_bytes, power_mw FROM gpu_samples",
    )
    if not rows:
        try:
            import pynvml  # noqa: F401
        except ImportError:
            return check(name, SKIPPED, "nvidia-ml-py (module pynvml) is not installed: no NVML samples")
        return check(name, FAIL, "no NVML samples recorded although pynvml is installed")
    power = [r["power_mw"] for r in rows if r["power_mw"] is not None]
    util = [r["util_gpu_pct"] for r in rows if r["util_gpu_pct"] is not None]
    util_mem = [r["util_mem_pct"] for r in rows if r["util_mem_pct"] is not None]
    used = [r["mem_used_bytes"] for r in rows if r["mem_used_bytes"] is not None]
    totals = [r["mem_total_bytes"] for r in rows if r["mem_total_bytes"] is not None]
    reserved, total = job["memory_reserved"], job["memory_total"]
    figures = {
        "samples": len(rows),
        "power_w": [min(power) / 1e3, max(power) / 1e3] if power else None,
        "util_gpu_pct": [min(util), max(util)] if util else None,
        "mem_used_max_bytes": max(used) if used else None,
        "memory_reserved_bytes": reserved,
        "memory_total_bytes": total,
    }
    failures = []
    if not power or min(power) <= 0:
        failures.append("power not above 0 W in every sample")
    if not util or not all(0 <= u <= 100 for u in util + util_mem):
        failures.append("utilisation missing or outside 0-100")
    elif max(util) == 0:
        failures.append("utilisation 0 in every sample while the GPU trained")
    if not used or max(used) < reserved:
        failures.append(f"memory used (max {max(used or [0]) / 2**20:.0f} MiB) below torch's reserved "
                        f"{reserved / 2**20:.0f} MiB")  # fmt: skip
    if used and max(used) > max(totals or [total]):
        failures.append("memory used above the GPU's memory")
    detail = (
        f"{len(rows)} samples: power {figures['power_w']} W, utilisation {figures['util_gpu_pct']} %, "
        f"used {max(used or [0]) / 2**20:.0f} MiB >= reserved {reserved / 2**20:.0f} MiB"
    )
    return check(name, FAIL if failures else PASS, "; ".join(failures) or detail, **figures)


def device_memory(work: Path, job: dict[str, Any]) -> dict[str, Any]:
    name = "device-memory"
    store = work / "store"
    rows = query(store, "SELECT * FROM device_memory ORDER BY step")
    runs = query(store, "SELECT ddp_bucket_cap_mb, ddp_find_unused_parameters, param_dtypes FROM runs")
    weights = 2 * JOB_CONSTANTS["LAYERS"] * JOB_CONSTANTS["WIDTH"] ** 2 * 4  # fp32 parameters + gradients
    total = job["memory_total"]
    figures: dict[str, Any] = {
        "rows": len(rows),
        "peak_allocated_max_bytes": max((r["peak_allocated_bytes"] for r in rows), default=None),
        "peak_reserved_max_bytes": max((r["peak_reserved_bytes"] for r in rows), default=None),
        "device_total_bytes": sorted({r["device_total_bytes"] for r in rows}),
        "runs": runs,
    }
    failures = []
    if len(rows) < STEPS - 1:
        failures.append(f"{len(rows)} rows for {STEPS} steps")
    if any(r["peak_allocated_bytes"] < weights for r in rows):
        failures.append(
            f"a step's peak allocated below the model's parameters and gradients ({weights} bytes)"
        )
    if any(r["peak_allocated_bytes"] > r["peak_reserved_bytes"] for r in rows):
        failures.append("a step's peak allocated above its peak reserved")
    if figures["device_total_bytes"] != [total]:
        failures.append(f"device total {figures['device_total_bytes']} is not torch's total_memory {total}")
    if not runs or runs[0]["ddp_bucket_cap_mb"] != 25.0 or runs[0]["ddp_find_unused_parameters"] is not False:
        failures.append(f"the runs row does not hold the job's DDP settings: {runs}")
    import perfscope
    from perfscope.explain import explain

    with perfscope.open_store(store) as s:
        creep = [g.title for f in explain(s) for g in f.flatten() if g.rule == "memory-creep"]
    if creep:
        failures.append(f"a memory-creep finding on a job that allocates the same every step: {creep}")
    allocated, reserved = (figures[k] or 0 for k in ("peak_allocated_max_bytes", "peak_reserved_max_bytes"))
    detail = (
        f"{len(rows)} steps, peak allocated up to {allocated / 2**20:.0f} MiB, "
        f"reserved up to {reserved / 2**20:.0f} MiB of {total / 2**20:.0f} MiB"
    )
    return check(name, FAIL if failures else PASS, "; ".join(failures) or detail, **figures)


def nvtx_names(export: Path) -> tuple[set[str], set[str]]:
    """(the domain names, the range names of domain perfscope) in an Nsight Systems SQLite export."""
    con = sqlite3.connect(f"file:{export}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "NVTX_EVENTS" not in tables:
            return set(), set()
        text = "coalesce(e.text, s.value)" if "StringIds" in tables else "e.text"
        join = "LEFT JOIN StringIds s ON s.id = e.textId" if "StringIds" in tables else ""
        # eventType 75 creates a domain (its text is the name); 59/70 push-pop, 60/71 start-end ranges;
        # domain ids are per process: the process id is bits 24-47 of globalTid
        domains = {
            (gtid, dom): name
            for dom, name, gtid in con.execute(
                "SELECT domainId, text, (globalTid >> 24) & 16777215 FROM NVTX_EVENTS WHERE eventType = 75"
            )
        }
        mine = {key for key, name in domains.items() if name == "perfscope"}
        names = {
            str(n)
            for n, gtid, dom in con.execute(
                f"SELECT {text}, (e.globalTid >> 24) & 16777215, e.domainId FROM NVTX_EVENTS e {join} "
                "WHERE e.eventType IN (59, 60, 70, 71)"
            )
            if (gtid, dom) in mine
        }
        return set(domains.values()), names
    finally:
        con.close()


def nvtx_nsys(work: Path, budget: Budget, env: dict[str, str]) -> dict[str, Any]:
    name = "nvtx-nsys"
    nsys = shutil.which("nsys")
    if nsys is None:
        return check(name, SKIPPED, "nsys (Nsight Systems) is not installed: NVTX ranges not checked")
    try:
        import nvtx  # noqa: F401
    except ImportError:
        return check(name, FAIL, "the nvtx package is not installed: perfscope emits no NVTX ranges")
    report = work / "nvtx"
    prof = run_cmd(
        [nsys, "profile", "-t", "cuda,nvtx", "--force-overwrite=true", "-o", str(report),
         sys.executable, str(work / "job.py"), str(work), "nvtx"],
        budget, 120, env=env,
    )  # fmt: skip
    rep = report.with_suffix(".nsys-rep")
    if prof.returncode != 0 or not rep.exists():
        return check(name, FAIL, f"nsys profile failed (exit {prof.returncode}): {tail(prof.stderr)}")
    export = report.with_suffix(".sqlite")
    exp = run_cmd(
        [nsys, "export", "--type=sqlite", "--force-overwrite=true", f"--output={export}", str(rep)],
        budget,
        90,
    )
    if exp.returncode != 0 or not export.exists():
        return check(name, FAIL, f"nsys export failed (exit {exp.returncode}): {tail(exp.stderr)}")
    domains, names = nvtx_names(export)
    wanted = {"step", "forward", "backward", "optimizer"}
    figures = {"domains": sorted(domains), "perfscope_ranges": sorted(names)}
    if "perfscope" not in domains:
        return check(
            name, FAIL, f"no NVTX domain 'perfscope' in the export (domains: {sorted(domains)})", **figures
        )
    missing = wanted - names
    if missing:
        return check(name, FAIL, f"ranges {sorted(missing)} missing from domain perfscope", **figures)
    return check(name, PASS, f"domain perfscope holds {sorted(names)}", **figures)


# ---------------------------------------------------------------- the run


def gpu_seen() -> str | None:
    """The first GPU's name when a driver sees one (whatever torch can do), else None; None too when
    CUDA_VISIBLE_DEVICES hides every GPU (empty or -1)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() < 1:
                return None
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CHECKS = ("pytest-gpu", "kineto-vs-perfscope", "cuda-events-vs-host", "nvml", "device-memory", "nvtx-nsys")


def all_skipped(reason: str) -> list[dict[str, Any]]:
    return [check(n, SKIPPED, reason) for n in CHECKS]


def run_checks(work: Path, budget: Budget) -> list[dict[str, Any]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # fmt: skip
    env.pop("PERFSCOPE_AUTO", None)
    results = []

    def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            results.append(fn())
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            results.append(check(name, FAIL, f"ran out of time: {exc}"))
        except Exception as exc:  # a check that breaks is a failed check, the others still run
            results.append(check(name, FAIL, f"{type(exc).__name__}: {exc}"))

    guarded("pytest-gpu", lambda: pytest_gpu(budget))
    job: dict[str, Any] | None = None
    why = ""
    try:
        job, why = train_job(work, budget, env)
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        why = f"the training job ran out of time: {exc}"
    if job is None:
        results += [
            check(n, FAIL, why)
            for n in ("kineto-vs-perfscope", "cuda-events-vs-host", "nvml", "device-memory")
        ]
    else:
        guarded("kineto-vs-perfscope", lambda: kineto_vs_perfscope(work, budget))
        guarded("cuda-events-vs-host", lambda: events_vs_host(work, job))
        guarded("nvml", lambda: nvml(work, job))
        guarded("device-memory", lambda: device_memory(work, job))
    env["MASTER_PORT"] = str(free_port())
    guarded("nvtx-nsys", lambda: nvtx_nsys(work, budget, env))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="also write the JSON summary to this file")
    p.add_argument("--keep", type=Path, help="keep the stores, traces and exports in this folder")
    args = p.parse_args(argv)
    started = time.monotonic()
    budget = Budget(BUDGET_S)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    torch: Any
    try:
        import torch
    except ImportError:
        torch = None
    cuda = bool(torch is not None and torch.cuda.is_available())
    summary["torch"] = getattr(torch, "__version__", None)
    summary["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        assert torch is not None
        summary["gpu"] = torch.cuda.get_device_name(0)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            results = run_checks(args.keep, budget)
        else:
            with tempfile.TemporaryDirectory(prefix="perfscope-gpu-check-") as tmp:
                results = run_checks(Path(tmp), budget)
        note = ""
    else:
        seen = gpu_seen()
        summary["gpu"] = seen
        if seen is None:
            note = "no CUDA GPU: every check skipped"
        else:
            build = "a CPU build" if summary["torch_cuda"] is None else "unable to use it"
            note = (
                f"a GPU is there ({seen}) but torch {summary['torch']} is {build}: every check skipped; "
                "install a CUDA build of torch (pip install torch --index-url "
                "https://download.pytorch.org/whl/cu126) and run again"
            )
        results = all_skipped(note)
    failed = [r for r in results if r["verdict"] == FAIL]
    if failed or (not cuda and summary["gpu"] is not None):
        overall = FAIL
    else:
        overall = PASS if any(r["verdict"] == PASS for r in results) else SKIPPED
    summary.update(verdict=overall, wall_s=round(time.monotonic() - started, 1), checks=results)
    if note:
        summary["note"] = note
        print(note, file=sys.stderr)
    for r in results:
        print(f"{r['verdict'].upper():8} {r['name']}: {r['detail']}", file=sys.stderr)
    print(f"gpu-check: {overall} in {summary['wall_s']} s", file=sys.stderr)
    text = json.dumps(finite(summary), indent=2, default=str, allow_nan=False)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 1 if overall == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
