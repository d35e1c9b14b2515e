"""A store on S3 (moto's server on 127.0.0.1): one upload pass of a store's folder, and `perfscope info`
on the s3:// address cold (empty mirror), warm (nothing changed) and on the local folder, in one run.

    .venv/bin/python benchmarks/s3_store.py                 # the bundled seed study (386 files)
    .venv/bin/python benchmarks/s3_store.py --store PATH --repeat 3

Each `info` is a fresh process (imports included); wall time is the median of --repeat. moto is a
Python server on the same 2 cores: a real S3 endpoint is slower per request and faster per byte.
Needs the dev extra (moto[server]).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"], stdout=out, stderr=out
        )
    for _ in range(300):
        m = re.search(r"Running on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's server did not start")


def timed_info(store: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "perfscope", "info", store, "--json"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def main() -> None:
    import perfscope.sample_traces as sample_traces

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, default=sample_traces.path(sample_traces.DEFAULT))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="perfscope-bench-s3-"))
    proc, endpoint = start_moto(work / "moto.log")
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        PERFSCOPE_CACHE_DIR=str(work / "cache"),
    )
    os.environ.update(env)
    try:
        from pyarrow import fs

        from perfscope.store import objectstore

        fs.S3FileSystem(
            endpoint_override=endpoint.split("://")[1], scheme="http", allow_bucket_creation=True
        ).create_dir("bench")
        staging = work / "staging"
        shutil.copytree(args.store, staging)
        files = [p for p in staging.rglob("*") if p.is_file() and not p.name.startswith(".")]
        size = sum(p.stat().st_size for p in files)
        url = "s3://bench/study"
        up = objectstore.Uploader(url, staging, interval_s=3600)
        t0 = time.perf_counter()
        assert up.sync_once()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert up.sync_once()
        again = time.perf_counter() - t0
        print(f"store: {args.store} ({len(files)} files, {size / 1e6:.1f} MB); load {os.getloadavg()[0]:.1f}")
        rate = f"{len(files) / first:.0f} files/s, {size / first / 1e6:.1f} MB/s"
        print(f"upload pass, all new: {first:.2f} s ({rate})")
        print(f"upload pass, nothing changed: {again * 1e3:.1f} ms")
        cold = []
        for _ in range(args.repeat):
            shutil.rmtree(work / "cache" / "s3", ignore_errors=True)
            cold.append(timed_info(url, env))
        warm = [timed_info(url, env) for _ in range(args.repeat)]
        local = [timed_info(str(args.store), env) for _ in range(args.repeat)]
        for name, xs in (("cold mirror", cold), ("warm mirror", warm), ("local folder", local)):
            print(f"perfscope info, {name}: {statistics.median(xs):.2f} s (median of {len(xs)})")
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
