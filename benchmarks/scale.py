"""Scale, side by side in one run: today's design (a commit, exported with `git archive`) and the
current tree, each measured in fresh subprocesses of the same .venv.

    .venv/bin/python benchmarks/scale.py                                    # full size, ~20 min
    .venv/bin/python benchmarks/scale.py --job-steps 600 --sim-ranks 256 --sim-steps 200   # quick

a. a real 4-rank gloo DDP job of 6,000 steps (a tiny model, one thread per rank): the files it
   leaves in its store, their size, its wall time;
b. `perfscope simulate` of a 4,096-rank, 1,000-step study (through StoreWriter): write time and
   peak RSS, files and size, `perfscope compact` time, and `perfscope info` and `perfscope analyze
   --json` time and peak RSS before and after compaction (the median step time analyze reports is
   printed too: compaction must not change it).

Every command is a fresh process (its import time included, the same for both designs); its peak
RSS comes from wait4. Stores live under a temporary folder and are deleted. The result is a
Markdown table on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: setuptools' package-dir of pyproject.toml: these packages live beside perfscope/ in the tree
PACKAGE_DIRS = {"collectors": "collectors", "dashboard": "dashboard", "sample_traces": "sample_traces"}

#: `perfscope ARGS` from the tree in argv[1]
CLI = r"""
import sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
import perfscope, perfscope.cli
assert perfscope.__file__.startswith(tree), perfscope.__file__
sys.exit(perfscope.cli.main(sys.argv[1:]))
"""

#: one rank of the gloo job: argv tree, store, steps; RANK, WORLD_SIZE, MASTER_* in the environment
RANK = r"""
import os, sys
tree, store, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
import torch, torch.distributed as dist, torch.nn as nn
import perfscope, perfscope.collectors
assert perfscope.collectors.__file__.startswith(tree), perfscope.collectors.__file__
torch.manual_seed(0)
torch.set_num_threads(1)
dist.init_process_group("gloo")
net = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
with perfscope.profile(store, experiment="scale-bench", batch_size=8, gpu_telemetry=False) as prof:
    prof.watch(net)
    for _ in prof.steps(range(steps)):
        with prof.phase("forward"):
            loss = nn.functional.cross_entropy(net(x), y)
        with prof.phase("backward"):
            loss.backward()
        with prof.phase("optimizer"):
            opt.step()
            opt.zero_grad()
dist.destroy_process_group()
"""


@dataclass
class Design:
    name: str
    tree: str  # a commit's exported tree, or the working tree
    rows: dict[str, str] = field(default_factory=dict)


@dataclass
class Ran:
    wall_s: float
    cpu_s: float  # user + system, of the process and the children it waited for
    peak_rss_bytes: int
    stdout: str

    def __str__(self) -> str:
        return f"{self.wall_s:.1f} s ({self.cpu_s:.1f} s CPU, {mb(self.peak_rss_bytes)})"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def export_commit(commit: str, dest: Path) -> Path:
    """The commit's tree as plain files (no worktree: the shared .git is left alone), laid out
    like the installed package so `perfscope.collectors` resolves inside it."""
    dest.mkdir(parents=True)
    archive = dest.with_suffix(".tar")
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    for package, folder in PACKAGE_DIRS.items():
        (dest / "perfscope" / package).symlink_to(dest / folder, target_is_directory=True)
    return dest


def run(argv: list[str]) -> Ran:
    """Run to the end: wall time, CPU time and peak RSS (wait4 on its own pid). Fails on a non-zero
    exit."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{argv[5:]} exited {proc.returncode}: {err.read().strip()[-2000:]}")
        cpu = usage.ru_utime + usage.ru_stime
        return Ran(wall, cpu, usage.ru_maxrss * 1024, out.read())


def perfscope(d: Design, *args: str) -> Ran:
    return run([sys.executable, "-c", CLI, d.tree, *args])


def files_and_size(root: Path) -> tuple[int, int, int]:
    """(data files, of which Parquet, bytes of all files): a file or folder named with a leading
    `.` or `_` (temporary files, the manifest, `_rollups/`) is not table data."""
    data = parquet = size = 0
    for dirpath, _, names in os.walk(root):
        hidden = any(part.startswith((".", "_")) for part in Path(dirpath).relative_to(root).parts)
        for name in names:
            size += os.lstat(os.path.join(dirpath, name)).st_size
            if not hidden and not name.startswith((".", "_")):
                data += 1
                parquet += name.endswith(".parquet")
    return data, parquet, size


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def record(d: Design, key: str, value: str) -> None:
    d.rows[key] = value
    log(f"{d.name}: {key} = {value}")


def gloo_job(d: Design, store: Path, ranks: int, steps: int) -> None:
    port = 29_000 + os.getpid() % 1000
    procs = []
    t0 = time.perf_counter()
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        argv = [sys.executable, "-c", RANK, d.tree, str(store), str(steps)]
        log_file = store.with_name(f"{store.name}-rank{r}.log")
        with log_file.open("w") as err:  # a file, not a pipe: a chatty rank never blocks
            procs.append(subprocess.Popen(argv, env=env, stdout=err, stderr=err))
    cpu_s = 0.0
    for r, p in enumerate(procs):
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu_s += usage.ru_utime + usage.ru_stime
        if p.returncode:
            text = store.with_name(f"{store.name}-rank{r}.log").read_text()
            raise RuntimeError(f"rank {r} exited {p.returncode}: {text.strip()[-2000:]}")
    wall = time.perf_counter() - t0
    data, parquet, size = files_and_size(store)
    i = perfscope(d, "info", str(store), "--json")
    rows = sum(r.get("step_rows") or 0 for r in json.loads(i.stdout)["runs"])
    record(
        d,
        f"a. {ranks}-rank gloo job, {steps:,} steps: wall (CPU of all ranks)",
        f"{wall:.1f} s ({cpu_s:.1f} s)",
    )
    record(d, "a. step rows in the store", f"{rows:,}")
    record(d, "a. `perfscope info --json` on it", str(i))
    record(d, "a. data files left (of which .parquet)", f"{data:,} ({parquet:,})")
    record(d, "a. store size", mb(size))


def study(d: Design, store: Path, ranks: int, steps: int) -> None:
    w = perfscope(d, "simulate", str(store), "--world-sizes", str(ranks), "--steps", str(steps))
    record(d, f"b. `perfscope simulate` {ranks:,} ranks x {steps:,} steps", str(w))
    for when in ("before", "after"):
        if when == "after":
            c = perfscope(d, "compact", str(store), "--grace", "0")
            record(d, "b. `perfscope compact --grace 0`", str(c))
        data, parquet, size = files_and_size(store)
        record(d, f"b. data files {when} compaction (.parquet)", f"{data:,} ({parquet:,})")
        record(d, f"b. store size {when} compaction", mb(size))
        i = perfscope(d, "info", str(store), "--json")
        record(d, f"b. `perfscope info --json`, {when} compaction", str(i))
        a = perfscope(d, "analyze", str(store), "--json")
        record(d, f"b. `perfscope analyze --json`, {when} compaction", str(a))
        median = json.loads(a.stdout)["runs"][0]["step_median_ns"]
        record(d, f"b. median step time analyze reports, {when}", f"{median / 1e6:.3f} ms")


def short(commit: str) -> str:
    argv = ["git", "-C", str(REPO), "rev-parse", "--short", commit]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default="fc72bec", help="commit of today's design (default fc72bec)")
    p.add_argument(
        "--new",
        default="HEAD",
        help="commit to compare with (default HEAD), or 'worktree' for the working tree as it is",
    )
    p.add_argument("--job-ranks", type=int, default=4)
    p.add_argument("--job-steps", type=int, default=6000)
    p.add_argument("--sim-ranks", type=int, default=4096)
    p.add_argument("--sim-steps", type=int, default=1000)
    p.add_argument("--skip", choices=["job", "study"], action="append", default=[])
    p.add_argument("--new-first", action="store_true", help="measure the new design first")
    p.add_argument("--min-free-mb", type=float, default=12_000, help="skip the study below this")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="perfscope-scale-"))
    try:
        old = Design(f"today ({short(args.old)})", str(export_commit(args.old, work / "old")))
        if args.new == "worktree":
            new = Design(f"working tree ({short('HEAD')} + changes)", str(REPO))
        else:
            new = Design(f"new ({short(args.new)})", str(export_commit(args.new, work / "new")))
        designs = [old, new]
        for d in reversed(designs) if args.new_first else designs:
            tag = "old" if d is old else "new"
            if "job" not in args.skip:
                gloo_job(d, work / f"job-{tag}", args.job_ranks, args.job_steps)
                shutil.rmtree(work / f"job-{tag}")
            if "study" not in args.skip:
                if available_mb() < args.min_free_mb:
                    record(d, "b. study", f"skipped: {available_mb():,.0f} MB available")
                else:
                    study(d, work / f"study-{tag}", args.sim_ranks, args.sim_steps)
                shutil.rmtree(work / f"study-{tag}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(
        f"perfscope scale benchmark: {' vs '.join(d.name for d in designs)}; {os.cpu_count()} cores; "
        f"load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} at the end\n"
    )
    print(f"| figure | {' | '.join(d.name for d in designs)} |")
    print(f"|---|{'---|' * len(designs)}")
    for key in dict.fromkeys(k for d in designs for k in d.rows):
        print(f"| {key} | {' | '.join(d.rows.get(key, '') for d in designs)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
