"""What the issue-10 checks of every file (real path inside the store, regular file, footer hash for
identical copies, column types against the schema) cost when a store is opened, cold.

    .venv/bin/python benchmarks/store_listing.py                       # 2,000 small segments
    .venv/bin/python benchmarks/store_listing.py --store /tmp/bench/10000000 --repeat 5

Each measurement is a fresh process listing the store once (nothing cached), alternately with the
checks and with them switched off (the listing as it was before), so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import perfscope.store as S
if sys.argv[2] == "off":
    S._footprint = lambda path: ""
    S._type_problem = lambda schema, table: ""
    S._outside = lambda path, root: None
    def _names_only(found, listing):
        replaced = {r.name for seg in found for r in seg.replaces}
        return [seg for seg in found if seg.path.name not in replaced]
    S._partition_segments = _names_only
c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
listing = S.list_store(Path(sys.argv[1]))
c1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": time.perf_counter() - t0,
                  "cpu_s": c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime,
                  "files": sum(len(v) for v in listing.segments.values())}))
"""


def small_segments(root: Path, runs: int = 4, segments: int = 500) -> Path:
    from perfscope.writer import StoreWriter

    for r in range(runs):
        with StoreWriter(root, f"run{r}") as w:
            for s in range(segments):
                for i in range(10):
                    step = s * 10 + i
                    w.append("steps", (0, step, step, 7, 1, 1, 1, 1, 1, 1, 1, 1, 4, "host"))
                w.flush()
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", help="an existing store (default: a new one of 2,000 small segments)")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.store) if args.store else small_segments(Path(tmp) / "store")
        runs: dict[str, list[dict[str, float]]] = {"checks": [], "off": []}
        for _ in range(args.repeat):
            for mode, flag in (("checks", "on"), ("off", "off")):
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(root), flag], check=True, capture_output=True, text=True
                ).stdout
                runs[mode].append(json.loads(out))
    for mode, got in runs.items():
        best = min(got, key=lambda r: r["cpu_s"])
        print(
            f"{mode:>6}: {best['files']} files, fastest of {len(got)}: {best['wall_s']:.3f} s wall, "
            f"{best['cpu_s']:.3f} s CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
