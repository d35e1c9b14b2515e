"""Opening a store of many small segments and summarising it (`perfscope info`): today's tree, with
and without its manifest, beside the design before the manifest (commit fc72bec) and the first
manifest's (commit 4f675ea: an entry and a Segment object per file), in one run.

    .venv/bin/python benchmarks/store_listing.py                        # 100,000 segments
    .venv/bin/python benchmarks/store_listing.py --segments 10000 --before-max 10000

The store: `--runs` runs of distinct one-row steps segments, the same files hard-linked into every
run's folder (copies in different partitions are distinct segments), and a runs row per run. Each
measurement is a fresh process that imports perfscope, opens the store and computes `perfscope
info`'s summary; its wall time, CPU time and peak RSS (imports included) are printed. "before" runs
the tree of fc72bec (`git archive`, in a temporary folder); "first manifest" the tree of 4f675ea
with the manifest it saves; "after, cold" today's tree on a store without a manifest (it reads every
footer and saves one); "after" today's tree with the manifest saved. The design before the manifest
takes about 2.5 ms and 85 KB per segment, and a cold open reads every footer, so both run only up to
`--before-max` segments; a manifest is built by each tree reading each distinct (hard-linked) file's
footer once, as the cold open would have saved it.

    .venv/bin/python benchmarks/store_listing.py --shape one-run       # one long run, 100,000 segments
    .venv/bin/python benchmarks/store_listing.py --shape one-run --store-dir /tmp/one --compact

`--shape one-run` measures the shape of issue 26 instead: one run of 4 ranks whose `--segments`
segments hold 10 steps of one rank each, written with plain pyarrow as another tool would
(build_one_run), and `--shape one-run-inflight` the same with one more segment holding a step that
started and never ended (no step_ns, so no range: the old info queried every file for it). Each
command is a fresh process (`python -m perfscope ...`, wall time and peak RSS from wait4): `info`
cold (no manifest: every footer read, the manifest saved), `info` warm (best of `--repeat`), and
`analyze --json` (on more than ANALYZE_MAX_SEGMENTS segments: the one line saying to compact first);
with `--compact`, `perfscope compact` on a hard-linked copy and `analyze --json` after it. The
building takes minutes (about 8 ms a segment on a loaded 2-core machine): `--store-dir` keeps the
store and reuses it.

    git worktree add --detach /tmp/before REV
    .venv/bin/python benchmarks/store_listing.py --shape one-run --before-tree /tmp/before --repeat 2

`--before-tree` measures `info` cold then warm, and `sql STORE "SELECT 1"` warm, by the perfscope of
that checkout and by this tree in turn, `--repeat` rounds, on the same store (each cold open starts
without a manifest).

    .venv/bin/python benchmarks/store_listing.py --shape one-run-recorded --store-dir /tmp/rec

`--shape one-run-recorded` is the same long run as perfscope's own recorder leaves it when the job
ends without closing (killed, or still running): four processes, one per rank, each a StoreWriter that
seals a steps segment of 10 steps at every flush (build_recorded). The one-run shapes also measure
`sql STORE "SELECT 1"` warm (best of `--repeat`) and `sql STORE "SELECT count(*) FROM steps"`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "fc72bec"
#: the first manifest: Python entries, and a Segment object per file at every open
FIRST_MANIFEST_COMMIT = "4f675ea"

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from perfscope.store import open_store
from perfscope.commands.info import summary
with open_store(sys.argv[1], warn=False) as store:
    opened = time.perf_counter()
    info = summary(store)
done = time.perf_counter()
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"open_s": opened - t0, "total_s": done - t0, "cpu_s": use.ru_utime + use.ru_stime,
                  "rss_mb": use.ru_maxrss / 1024,
                  "files": sum(info["files"].values()), "steps": info["rows"]["steps"]}))
"""


def build(root: Path, runs: int, per_run: int) -> None:
    from perfscope.store.segments import write_segment
    from perfscope.store.writer import rows_to_table

    steps_cols = ["rank", "step", "start_ns", "step_ns"]
    src = root.parent / "src"
    src.mkdir(parents=True)
    for i in range(per_run):
        values = dict(zip(steps_cols, (i % 8, i, 1_700_000_000_000_000_000 + i * 10**6, 10**6), strict=True))
        write_segment(src / f"s{i:06d}.parquet", rows_to_table("steps", [_row("steps", values)]))
    runs_row = {"experiment": "bench", "source": "measured", "world_size": 8, "backend": "gloo"}
    write_segment(src / "runs.parquet", rows_to_table("runs", [_row("runs", runs_row)]))
    for r in range(runs):
        steps = root / "steps" / f"run_id=r{r:04d}"
        steps.mkdir(parents=True)
        for i in range(per_run):
            os.link(src / f"s{i:06d}.parquet", steps / f"w-{i:06d}.parquet")
        (root / "runs" / f"run_id=r{r:04d}").mkdir(parents=True)
        os.link(src / "runs.parquet", root / "runs" / f"run_id=r{r:04d}" / "w-000000.parquet")


def build_one_run(root: Path, segments: int, ranks: int = 4, steps_per_segment: int = 10) -> None:
    """One long run as another tool writes it: `segments` steps segments of `steps_per_segment`
    steps of one rank each (ranks in turn), written with plain `pyarrow.parquet.write_table` in the
    store's schema (its metadata says table and version; default compression and statistics, no
    perfscope writer), and one runs row. Rank r starts each step r us after rank 0."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from perfscope.store.schema import TABLES

    schema = TABLES["steps"].arrow_schema
    part = root / "steps" / "run_id=long"
    part.mkdir(parents=True)
    step_ns, t0 = 10**7, 1_700_000_000_000_000_000
    for i in range(segments):
        rank = i % ranks
        step = np.arange(steps_per_segment, dtype=np.int64) + (i // ranks) * steps_per_segment
        n = len(step)
        columns = {
            "rank": pa.array(np.full(n, rank, np.int32)),
            "step": pa.array(step),
            "start_ns": pa.array(t0 + step * step_ns + rank * 1000),
            "step_ns": pa.array(np.full(n, step_ns - 5000, np.int64)),
            "forward_ns": pa.array(np.full(n, step_ns // 3, np.int64)),
            "backward_ns": pa.array(np.full(n, step_ns // 2, np.int64)),
            "samples": pa.array(np.full(n, 32, np.int32)),
        }
        arrays = [columns[f.name].cast(f.type) if f.name in columns else pa.nulls(n, f.type) for f in schema]
        pq.write_table(pa.Table.from_arrays(arrays, schema=schema), part / f"part-{i:06d}.parquet")
    runs_row = {"experiment": "long", "source": "measured", "world_size": ranks, "backend": "nccl"}
    (root / "runs" / "run_id=long").mkdir(parents=True)
    names = TABLES["runs"].column_names
    runs_table = [dict(zip(names, _row("runs", runs_row), strict=True))]
    runs = pa.Table.from_pylist(runs_table, schema=TABLES["runs"].arrow_schema)
    pq.write_table(runs, root / "runs" / "run_id=long" / "part-000000.parquet")


SEED = r"""
import os, sys
from pathlib import Path
from perfscope.store.manifest import Manifest
from perfscope.store.listing import Segment, _inspect_uncached

root = Path(sys.argv[1])
manifest = Manifest(str(root))
by_inode = {}
for table in ("steps", "runs"):
    for part in sorted((root / table).iterdir()):
        for entry in os.scandir(part):
            st = entry.stat()
            if st.st_ino not in by_inode:
                seg = _inspect_uncached(Path(entry.path), table)
                assert isinstance(seg, Segment), seg
                by_inode[st.st_ino] = seg
            manifest.note(entry.path, st.st_size, st.st_mtime_ns, by_inode[st.st_ino])
assert manifest.save()
"""


RECORDED = r"""
import os, sys
from pathlib import Path
from perfscope.store.schema import TABLES
from perfscope.store.writer import StoreWriter

root, segments, rank = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
names = [n for n in TABLES["steps"].column_names if n != "run_id"]
writer = StoreWriter(root, "long", writer_id=f"r{rank}", live_max_bytes=1, roll_interval_s=3600)
step_ns, t0 = 10**7, 1_700_000_000_000_000_000
for i in range(segments):
    for step in range(i * 10, i * 10 + 10):
        row = {"rank": rank, "step": step, "start_ns": t0 + step * step_ns + rank * 1000,
               "step_ns": step_ns - 5000, "forward_ns": step_ns // 3, "backward_ns": step_ns // 2,
               "samples": 32}
        writer.append("steps", tuple(row.get(n) for n in names))
    writer.flush()  # a segment sealed at every flush (live_max_bytes=1)
os._exit(0)  # the job ended without closing its writer: no merge at close
"""


def build_recorded(root: Path, segments: int, ranks: int = 4) -> None:
    """One long run as perfscope's recorder leaves it before `compact`: `ranks` processes, each a
    StoreWriter sealing `segments // ranks` steps segments of 10 steps, ended without close."""
    procs = [
        subprocess.Popen([sys.executable, "-c", RECORDED, str(root), str(segments // ranks), str(r)], cwd="/")
        for r in range(ranks)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("building the recorded store failed")
    runs_row = {"experiment": "long", "source": "measured", "world_size": ranks, "backend": "gloo"}
    import pyarrow as pa
    import pyarrow.parquet as pq

    from perfscope.store.schema import TABLES

    (root / "runs" / "run_id=long").mkdir(parents=True)
    names = TABLES["runs"].column_names
    runs = pa.Table.from_pylist(
        [dict(zip(names, _row("runs", runs_row), strict=True))], schema=TABLES["runs"].arrow_schema
    )
    pq.write_table(runs, root / "runs" / "run_id=long" / "part-000000.parquet")


def seed_manifest(root: Path, pythonpath: Path) -> None:
    """The manifest a first open by the tree at `pythonpath` saves, built reading each distinct
    (hard-linked) file's footer once."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    subprocess.run([sys.executable, "-c", SEED, str(root)], env=env, check=True, cwd="/")


def _row(table: str, values: Mapping[str, object]) -> tuple[object, ...]:
    from perfscope.store.schema import TABLES

    return tuple(values.get(c) for c in TABLES[table].column_names)


def measure(store: Path, pythonpath: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(store)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd="/",
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def old_tree(commit: str, dest: Path) -> Path:
    """perfscope as it was at `commit`, extracted under `dest`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "perfscope"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


COUNT = "SELECT count(*) FROM steps"


def command(*args: str, tree: Path = REPO) -> dict[str, Any]:
    """`python -m perfscope ARGS` of the perfscope in `tree`, in a fresh process: wall time, CPU time,
    peak RSS and exit status."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "perfscope", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd="/",
    )
    _, status, use = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = use.ru_utime + use.ru_stime
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "rss_mb": use.ru_maxrss / 1024,
        "rc": proc.returncode,
        "said": err[-300:],
    }


def one_run(args: argparse.Namespace) -> int:
    """The one-long-run shapes (see the module's docstring)."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.store_dir) if args.store_dir else Path(tmp)
        store = base / f"{args.shape}-{args.segments}" / "store"
        if not (store / "runs").is_dir():
            if args.shape == "one-run-recorded":
                build_recorded(store, args.segments)
            else:
                build_one_run(store, args.segments)
            if args.shape == "one-run-inflight":
                inflight(store)
        results: list[tuple[str, dict[str, Any]]] = []
        if args.before_tree:
            results += before_and_after(store, Path(args.before_tree), args.repeat)
        else:
            (store / ".perfscope-manifest").unlink(missing_ok=True)
            results.append(("info, cold (no manifest)", command("info", str(store))))
            warm = [command("info", str(store)) for _ in range(args.repeat)]
            results.append((f"info, warm (best of {args.repeat})", min(warm, key=lambda r: r["wall_s"])))
            warm = [command("sql", str(store), "SELECT 1") for _ in range(args.repeat)]
            results.append(
                (f'sql "SELECT 1", warm (best of {args.repeat})', min(warm, key=lambda r: r["wall_s"]))
            )
        results.append(('sql "SELECT count(*) FROM steps"', command("sql", str(store), COUNT)))
        results.append(("analyze --json", command("analyze", "--json", str(store))))
        if args.compact:
            copy = Path(tmp) / "compacted" / "store"
            copy.parent.mkdir(parents=True)
            subprocess.run(["cp", "-al", str(store), str(copy.parent)], check=True)
            results.append(("compact (a hard-linked copy)", command("compact", "--grace", "0", str(copy))))
            results.append(("analyze --json, compacted", command("analyze", "--json", str(copy))))
    print(f"load average before the run: {load_before:.1f}")
    print(f"| {args.shape}, {args.segments:,} segments | wall | CPU | peak RSS | exit |")
    print("|---|---|---|---|---|")
    for name, r in results:
        print(f"| {name} | {r['wall_s']:.2f} s | {r['cpu_s']:.2f} s | {r['rss_mb']:.0f} MB | {r['rc']} |")
    for name, r in results:
        if r["rc"]:
            print(f"{name} said: {r['said']}")
    print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    return 0


def before_and_after(store: Path, before: Path, repeat: int) -> list[tuple[str, dict[str, Any]]]:
    """`info` cold then warm, by the perfscope in `before` (a checkout of an older commit) and by
    this tree in turn, `repeat` rounds; each cold open starts without a manifest and saves one."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for k in range(repeat):
        for label, tree in (("before", before), ("after", REPO)):
            (store / ".perfscope-manifest").unlink(missing_ok=True)
            rows.append((f"{label}: info, cold (round {k + 1})", command("info", str(store), tree=tree)))
            rows.append((f"{label}: info, warm (round {k + 1})", command("info", str(store), tree=tree)))
            rows.append(
                (
                    f'{label}: sql "SELECT 1", warm (round {k + 1})',
                    command("sql", str(store), "SELECT 1", tree=tree),
                )
            )
    return rows


def inflight(root: Path) -> None:
    """One more segment: a step of rank 0 that started after the last and never ended (no step_ns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from perfscope.store.schema import TABLES

    schema = TABLES["steps"].arrow_schema
    values = {"rank": 0, "step": 10**9, "start_ns": 1_700_000_000_000_000_000 + 10**17}
    arrays = [pa.array([values.get(f.name)], f.type) for f in schema]
    pq.write_table(
        pa.Table.from_arrays(arrays, schema=schema), root / "steps" / "run_id=long" / "zz-inflight.parquet"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", type=int, default=100_000, help="steps segments in the store")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--before-max", type=int, default=10_000, help="largest store the old design opens")
    p.add_argument("--repeat", type=int, default=3, help="measurements of the store with its manifest")
    p.add_argument(
        "--today-only",
        action="store_true",
        help="only today's tree (the trees of fc72bec and 4f675ea read schema versions up to 2: "
        "today's writer writes 3, which they refuse)",
    )
    p.add_argument(
        "--shape",
        choices=["many-runs", "one-run", "one-run-inflight", "one-run-recorded"],
        default="many-runs",
    )
    p.add_argument("--store-dir", help="one-run shapes: build the store here, or reuse the one built there")
    p.add_argument(
        "--compact", action="store_true", help="one-run shapes: also compact a copy and analyze it"
    )
    p.add_argument(
        "--before-tree",
        help="one-run shapes: a checkout of an older commit (`git worktree add /tmp/before REV`) whose "
        "`info`, cold and warm, is measured in turn with this tree's, --repeat rounds",
    )
    args = p.parse_args(argv)
    if args.shape != "many-runs":
        return one_run(args)
    load_before = os.getloadavg()[0]
    results: list[tuple[str, int, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        old = old_tree(BEFORE_COMMIT, Path(tmp) / "before")
        first = old_tree(FIRST_MANIFEST_COMMIT, Path(tmp) / "first")
        sizes = sorted({min(args.segments, args.before_max), args.segments})
        for n in sizes:
            store = Path(tmp) / f"store-{n}" / "store"
            build(store, args.runs, n // args.runs)
            if n <= args.before_max:
                if not args.today_only:
                    results.append(("before (fc72bec, no manifest)", n, measure(store, old)))
                results.append(
                    ("after, cold (reads every footer, saves the manifest)", n, measure(store, REPO))
                )
            # each tree's manifest as its cold open would save it, from one footer read per distinct file
            trees = (("first manifest (4f675ea)", first), ("after, with the manifest", REPO))
            for label, tree in trees[1:] if args.today_only else trees:
                seed_manifest(store, tree)
                warm = [measure(store, tree) for _ in range(args.repeat)]
                best = min(warm, key=lambda r: r["cpu_s"])
                results.append((f"{label} (best of {args.repeat})", n, best))
            if n == args.segments:  # today's tree, the manifest saved
                analyzed = command("analyze", "--json", str(store))
    print(f"load average before the run: {load_before:.1f}")
    print("| design | segments | open (wall) | open + info (wall) | CPU (whole process) | peak RSS |")
    print("|---|---|---|---|---|---|")
    for name, n, r in results:
        assert r["files"] == n + args.runs and r["steps"] == n, r
        cells = f"{r['open_s']:.2f} s | {r['total_s']:.2f} s | {r['cpu_s']:.2f} s | {r['rss_mb']:.0f} MB"
        print(f"| {name} | {n:,} | {cells} |")
    said = f" ({analyzed['said']})" if analyzed["rc"] else ""
    print(f"\nanalyze --json, {args.segments:,} segments: {analyzed['wall_s']:.2f} s, "
          f"{analyzed['rss_mb']:.0f} MB, exit {analyzed['rc']}{said}")  # fmt: skip
    print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
