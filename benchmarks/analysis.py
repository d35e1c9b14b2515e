"""Time and peak memory of the analysis on large synthetic stores (1M, 10M, 100M step rows).

    .venv/bin/python benchmarks/analysis.py                  # 1e6, 1e7, 1e8 rows under /tmp
    .venv/bin/python benchmarks/analysis.py --rows 1e7 --keep --dir /tmp/bench

For each size it writes a store of synthetic runs (8 configurations x world sizes 1..64, realistic
phase times with noise, Parquet segments with 1M-row row groups written by perfscope's own
segment writer), then measures, each in a fresh process: the scaling summary
(`run_analysis("scaling")`, timed inside the process) and the whole `perfscope analyze --json`
command (wall time of the process). Peak memory is the child's maximum RSS (os.wait4).
The stores are deleted afterwards unless --keep is given.

Rollups (issue 15): `--rollups` writes the step rows with DuckDB's COPY from range() straight
into the store's hive layout (schema and perfscope metadata included; about 1 B rows in minutes),
then `perfscope compact` writes the rollups (perfscope/store/rollups.py), and `perfscope analyze --json` is
measured with them and without them (the `_rollups` folder moved aside), checking that both give
the same numbers:

    .venv/bin/python benchmarks/analysis.py --generator duckdb --rows 1e8 1e9 \
        --world-sizes 8 16 32 64 128 256 512 --rollups
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from perfscope.store.rollups import ROLLUP_DIR
from perfscope.store.schema import META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES
from perfscope.store.segments import write_segment
from perfscope.store.writer import StoreWriter, segment_dir

WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONFIGS = [(c, b, bs) for c in ("alpha", "hpdlf") for b in ("nccl", "mpi") for bs in (32, 64)]
GPUS_PER_NODE = 8
T0_NS = 1_700_000_000_000_000_000
ROW_GROUP = 1_000_000

SCALING_CHILD = """
import sys, time, json, resource
from perfscope.store import open_store
from perfscope.analysis import run_analysis
def cpu():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
t, c = time.perf_counter(), cpu()
with open_store(sys.argv[1]) as store:
    table = run_analysis("scaling", store)
print(json.dumps({"seconds": time.perf_counter() - t, "cpu_s": cpu() - c, "rows": table.num_rows}))
"""


def _row(table: str, **values: Any) -> tuple[Any, ...]:
    """A row tuple in schema order; columns not given are NULL."""
    return tuple(values.get(c) for c in TABLES[table].column_names)


def _steps_table(rng: np.random.Generator, n: int, steps: int, batch: int, sync_ms: float) -> pa.Table:
    m = n * steps
    rank = np.tile(np.arange(n, dtype=np.int32), steps)
    step = np.repeat(np.arange(steps, dtype=np.int64), n)
    fwd = rng.normal(10e6 * batch / 32, 2e5, m).astype(np.int64)
    bwd = (2 * fwd).astype(np.int64)
    sync = (sync_ms * 1e6 + rng.exponential(1e5, m)).astype(np.int64)
    data = rng.integers(50_000, 150_000, m, dtype=np.int64)
    opt = np.full(m, 500_000, np.int64)
    other = rng.integers(20_000, 80_000, m, dtype=np.int64)
    step_ns = data + fwd + bwd + sync + opt + other
    per_step = step_ns.reshape(steps, n).max(axis=1)
    start = T0_NS + np.repeat(np.concatenate([[0], np.cumsum(per_step)[:-1]]), n)
    cols = {
        "rank": rank,
        "step": step,
        "start_ns": start,
        "step_ns": step_ns,
        "data_ns": data,
        "forward_ns": fwd,
        "backward_ns": bwd,
        "sync_exposed_ns": sync,
        "optimizer_ns": opt,
        "other_ns": other,
        "comm_total_ns": sync * 2,
        "comm_count": np.full(m, 4, np.int32),
        "samples": np.full(m, batch, np.int32),
    }
    schema = TABLES["steps"].arrow_schema
    arrays = [pa.array(cols[f.name], type=f.type) for f in schema if f.name != "clock"]
    arrays.append(pa.DictionaryArray.from_arrays(np.zeros(m, np.int8), ["cuda"]).cast(pa.string()))
    return pa.Table.from_arrays(arrays, schema=schema)


def _write_meta(root: Path, run_id: str, n: int, nodes: int, backend: str, cluster: str, batch: int) -> None:
    """The run's `runs` row and its ranks' `ranks` rows."""
    with StoreWriter(root, run_id, writer_id="bench-meta") as w:
        w.append("runs", _row(
            "runs", experiment="bench", source="measured", started_ns=T0_NS, world_size=n,
            nodes=nodes, gpus_per_node=min(n, GPUS_PER_NODE), backend=backend,
            device_model="NVIDIA H100", device_peak_flops=989e12, cluster=cluster, model="resnet",
            batch_size_per_rank=batch, global_batch_size=batch * n, param_count=25_000_000,
            grad_bytes=100_000_000, scaling_mode="weak", dataset_samples=1_281_167,
            hostname="node0", tags="{}", ended_ns=T0_NS + 10**12,
        ))  # fmt: skip
        w.extend("ranks", [
            _row("ranks", rank=r, local_rank=r % GPUS_PER_NODE, node_rank=r // GPUS_PER_NODE,
                 hostname=f"node{r // GPUS_PER_NODE}", pid=1000 + r, clock_offset_ns=0, cpu_count=64,
                 device_index=r % GPUS_PER_NODE, device_name="NVIDIA H100", started_ns=T0_NS)
            for r in range(n)
        ])  # fmt: skip


def generate(root: Path, target_rows: int, seed: int = 0) -> int:
    """Write runs whose step rows add up to about `target_rows`; returns the exact count."""
    rng = np.random.default_rng(seed)
    steps = max(40, target_rows // (len(CONFIGS) * sum(WORLD_SIZES)))
    total = 0
    for cluster, backend, batch in CONFIGS:
        for n in WORLD_SIZES:
            run_id = f"bench-{cluster}-{backend}-b{batch}-n{n}"
            nodes = -(-n // GPUS_PER_NODE)
            sync_ms = 0.0 if n == 1 else (0.5 if nodes == 1 else 2.0) * np.log2(n)
            table = _steps_table(rng, n, steps, batch, sync_ms)
            d = segment_dir(root, "steps", run_id)
            d.mkdir(parents=True, exist_ok=True)
            write_segment(d / "bench-000001.parquet", table, row_group_size=ROW_GROUP)
            total += table.num_rows
            _write_meta(root, run_id, n, nodes, backend, cluster, batch)
    return total


def generate_duckdb(
    root: Path, target_rows: int, world_sizes: tuple[int, ...], seed: int = 0, *, link: bool = False
) -> int:
    """Like `generate`, but each run's step rows come from one DuckDB COPY of range() (hash noise
    instead of numpy's), written as one Parquet file per run with 1M-row row groups. With `link`,
    the runs of one world size share the first configuration's file (hard links): a store of that
    many rows written in a fraction of the time."""
    first: dict[int, Path] = {}
    steps = max(40, target_rows // (len(CONFIGS) * sum(world_sizes)))
    kv = f"{{'{META_TABLE.decode()}': 'steps', '{META_VERSION.decode()}': '{SCHEMA_VERSION}'}}"
    total = 0
    con = duckdb.connect(":memory:")
    con.execute("SET enable_progress_bar=false")
    for k, (cluster, backend, batch) in enumerate(CONFIGS):
        for n in world_sizes:
            run_id = f"bench-{cluster}-{backend}-b{batch}-n{n}"
            nodes = -(-n // GPUS_PER_NODE)
            sync_ns = 0 if n == 1 else int((0.5 if nodes == 1 else 2.0) * math.log2(n) * 1e6)
            fwd_ns = int(10e6 * batch / 32)
            d = segment_dir(root, "steps", run_id)
            d.mkdir(parents=True, exist_ok=True)
            total += n * steps
            _write_meta(root, run_id, n, nodes, backend, cluster, batch)
            if link and n in first:
                os.link(first[n], d / "bench-000001.parquet")
                continue
            first[n] = d / "bench-000001.parquet"
            path = str(d / "bench-000001.parquet").replace("'", "''")
            con.execute(
                f"""
                COPY (
                    WITH g AS (SELECT i, hash(i + {seed + 7919 * k + n}) AS h FROM range({n * steps}) t(i)),
                    p AS (
                        SELECT (i % {n})::INTEGER AS rank, (i // {n})::BIGINT AS step,
                               {fwd_ns} + (h % 400000)::BIGINT - 200000 AS forward_ns,
                               {sync_ns} + ((h >> 20) % 200000)::BIGINT AS sync_exposed_ns,
                               50000 + ((h >> 40) % 100000)::BIGINT AS data_ns,
                               20000 + ((h >> 8) % 60000)::BIGINT AS other_ns
                        FROM g
                    )
                    SELECT rank, step,
                           {T0_NS} + step * {3 * fwd_ns + sync_ns + 800_000}::BIGINT AS start_ns,
                           data_ns + 3 * forward_ns + sync_exposed_ns + 500000 + other_ns AS step_ns,
                           data_ns, forward_ns, 2 * forward_ns AS backward_ns, sync_exposed_ns,
                           500000::BIGINT AS optimizer_ns, other_ns, 2 * sync_exposed_ns AS comm_total_ns,
                           4::INTEGER AS comm_count, {batch}::INTEGER AS samples, 'cuda' AS clock
                    FROM p
                ) TO '{path}' (FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {ROW_GROUP}, KV_METADATA {kv})
                """
            )
    con.close()
    return total


def _measure(cmd: list[str]) -> dict[str, Any]:
    """Run `cmd` as the only child of a fresh Python, so its RUSAGE_CHILDREN figures are cmd's
    alone: wall time, CPU time (user + system, less sensitive to other load) and peak RSS."""
    wrapper = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "wall = time.perf_counter() - t\n"
        "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': p.returncode, 'wall_s': wall, 'cpu_s': ru.ru_utime + ru.ru_stime,"
        " 'peak_rss_mb': ru.ru_maxrss / 1024, 'stdout': p.stdout, 'stderr': p.stderr[-2000:]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    data: dict[str, Any] = json.loads(out.stdout)
    if data["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {data['stderr']}")
    return data


def _fastest(cmd: list[str], repeat: int) -> dict[str, Any]:
    """The fastest of `repeat` runs: on a shared machine the others measure the neighbours."""
    return min((_measure(cmd) for _ in range(repeat)), key=lambda r: float(r["wall_s"]))


def bench(root: Path, rows: int, repeat: int = 1) -> dict[str, object]:
    t = time.perf_counter()
    exact = generate(root, rows)
    gen_s = time.perf_counter() - t
    size_mb = sum(p.stat().st_size for p in root.rglob("*.parquet")) / 2**20
    scaling = _fastest([sys.executable, "-c", SCALING_CHILD, str(root)], repeat)
    inner = json.loads(scaling["stdout"].strip().splitlines()[-1])  # after any DuckDB progress bar
    analyze = _fastest([sys.executable, "-m", "perfscope", "analyze", str(root), "--json"], repeat)
    report = json.loads(analyze["stdout"])
    return {
        "step_rows": exact,
        "store_mb": round(size_mb, 1),
        "generate_s": round(gen_s, 1),
        "repeat": repeat,
        "load1_before": round(os.getloadavg()[0], 2),
        "scaling_summary_s": round(inner["seconds"], 2),
        "scaling_summary_cpu_s": round(inner["cpu_s"], 2),
        "scaling_process_wall_s": round(scaling["wall_s"], 2),
        "scaling_process_cpu_s": round(scaling["cpu_s"], 2),
        "scaling_peak_rss_mb": round(scaling["peak_rss_mb"]),
        "analyze_wall_s": round(analyze["wall_s"], 2),
        "analyze_cpu_s": round(analyze["cpu_s"], 2),
        "analyze_peak_rss_mb": round(analyze["peak_rss_mb"]),
        "analyze_findings": len(report["findings"]),
    }


def _max_rel_diff(a: object, b: object) -> float:
    """The largest relative difference between two JSON documents' numbers; inf when they differ
    in anything else (a key, a string, a length)."""
    if (
        isinstance(a, bool)
        or isinstance(b, bool)
        or not (isinstance(a, int | float) and isinstance(b, int | float))
    ):
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            return max((_max_rel_diff(a[k], b[k]) for k in a), default=0.0)
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return max((_max_rel_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
        return 0.0 if a == b else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def bench_rollups(
    root: Path,
    rows: int,
    world_sizes: tuple[int, ...],
    repeat: int = 1,
    *,
    link: bool = False,
    raw: bool = True,
) -> dict[str, object]:
    """Write a store with DuckDB, compact it (which writes the rollups), then time `analyze --json`
    with the rollups and without them, and compare the two outputs' numbers. With `link`, the
    rollups of the runs sharing one file are written once (timed) and copied (their sources are
    the same file: they check out)."""
    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    exact = generate_duckdb(root, rows, world_sizes, link=link)
    gen_s = time.perf_counter() - t
    size_mb = sum(p.stat().st_size for p in root.rglob("*.parquet")) / 2**20
    built = {}
    if link:
        cluster, backend, batch = CONFIGS[0]
        firsts = [f"bench-{cluster}-{backend}-b{batch}-n{n}" for n in world_sizes]
        code = (
            "import sys; from perfscope.store.rollups import write_rollups; "
            "write_rollups(sys.argv[1], run_ids=sys.argv[2:])"
        )
        built = _measure([sys.executable, "-c", code, str(root), *firsts])
        for cluster, backend, batch in CONFIGS[1:]:
            for n, src in zip(world_sizes, firsts, strict=True):
                dest = root / ROLLUP_DIR / f"run_id=bench-{cluster}-{backend}-b{batch}-n{n}"
                shutil.copytree(root / ROLLUP_DIR / f"run_id={src}", dest)
    compact = _measure([sys.executable, "-m", "perfscope", "compact", str(root)])
    rollup_mb = sum(p.stat().st_size for p in (root / ROLLUP_DIR).rglob("*.parquet")) / 2**20
    cmd = [sys.executable, "-m", "perfscope", "analyze", str(root), "--json"]
    rolled = _fastest(cmd, repeat)
    aside = root / f"{ROLLUP_DIR}-aside"
    unrolled: dict[str, Any] = {"wall_s": None, "cpu_s": None, "peak_rss_mb": None}
    diff = math.nan
    if raw:
        os.rename(root / ROLLUP_DIR, aside)
        try:
            unrolled = _fastest(cmd, repeat)
        finally:
            os.rename(aside, root / ROLLUP_DIR)
        diff = _max_rel_diff(json.loads(rolled["stdout"]), json.loads(unrolled["stdout"]))
    return {
        "step_rows": exact,
        "world_sizes": list(world_sizes),
        "runs": len(CONFIGS) * len(world_sizes),
        "store_mb": round(size_mb, 1),
        "generate_s": round(gen_s, 1),
        "linked_runs_share_files": link,
        "rollups_of_distinct_files_wall_s": round(built["wall_s"], 1) if built else None,
        "rollups_of_distinct_files_cpu_s": round(built["cpu_s"], 1) if built else None,
        "compact_with_rollups_wall_s": round(compact["wall_s"], 1),
        "compact_cpu_s": round(compact["cpu_s"], 1),
        "compact_peak_rss_mb": round(compact["peak_rss_mb"]),
        "rollups_mb": round(rollup_mb, 1),
        "repeat": repeat,
        "analyze_rollups_wall_s": round(rolled["wall_s"], 2),
        "analyze_rollups_cpu_s": round(rolled["cpu_s"], 2),
        "analyze_rollups_peak_rss_mb": round(rolled["peak_rss_mb"]),
        "analyze_raw_wall_s": _rounded(unrolled["wall_s"], 2),
        "analyze_raw_cpu_s": _rounded(unrolled["cpu_s"], 2),
        "analyze_raw_peak_rss_mb": _rounded(unrolled["peak_rss_mb"], 0),
        "max_rel_diff_rollups_vs_raw": diff,
        "load1_before": round(load_before, 2),
        "load1_after": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=float, default=[1e6, 1e7, 1e8], help="step rows per store")
    p.add_argument("--dir", default="/tmp/perfscope-bench-analysis", help="where the stores are written")
    p.add_argument("--keep", action="store_true", help="keep the generated stores")
    p.add_argument("--repeat", type=int, default=1, help="measure each this many times, keep the fastest")
    p.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES), help="ranks per run")
    p.add_argument(
        "--rollups",
        action="store_true",
        help="write the steps with DuckDB, compact, then time analyze --json with and without rollups",
    )
    p.add_argument(
        "--link",
        action="store_true",
        help="with --rollups: the runs of one world size share one file (hard links), rollups built once",
    )
    p.add_argument("--no-raw", action="store_true", help="with --rollups: do not time analyze without them")
    args = p.parse_args(argv)
    base = Path(args.dir)
    print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}")
    for rows in args.rows:
        root = base / f"rows_{int(rows):d}"
        shutil.rmtree(root, ignore_errors=True)
        try:
            if args.rollups:
                result = bench_rollups(
                    root, int(rows), tuple(args.world_sizes), args.repeat, link=args.link, raw=not args.no_raw
                )
            else:
                result = bench(root, int(rows), args.repeat)
            print(json.dumps(result), flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
