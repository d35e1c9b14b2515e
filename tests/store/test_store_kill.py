"""A writer killed with SIGKILL loses at most the segment in flight; everything closed reads back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from perfscope import open_store
from perfscope.store.compact import compact

ROLL_S = 0.25

#: what the writer's thread may lag behind its roll on a loaded 2-core machine
SLACK_S = 0.35

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from perfscope.store.writer import StoreWriter
    w = StoreWriter(sys.argv[1], "killed", roll_interval_s=float(sys.argv[2]))
    # the job's own account of its appends, straight to the OS (a SIGKILL keeps it)
    log = os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    i = 0
    while True:
        now = time.time_ns()
        w.append("steps", (0, i, now, 1_000_000, 0, 0, 0, 0, 0, 0, 0, 0, 1, "host"))
        os.write(log, f"{i} {now}\\n".encode())
        if i == 0:
            print("started", flush=True)
        i += 1
        time.sleep(0.001)
    """
)


def test_sigkill_loses_at_most_one_roll_interval(tmp_path: Path) -> None:
    appended = tmp_path.parent / f"{tmp_path.name}-appended.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), str(ROLL_S), str(appended)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    time.sleep(1.6)
    killed_ns = time.time_ns()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with open_store(tmp_path) as store:
        got = store.query("SELECT count(*) AS n, max(step) AS last, max(start_ns) AS last_ns FROM steps")
        n, last, last_ns = (got.column(c)[0].as_py() for c in ("n", "last", "last_ns"))
        steps = store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist()
    # every closed segment reads back, and the rows kept are a gap-free prefix of what was appended
    assert n > 0 and steps == list(range(last + 1))
    # at most the roll interval in flight, plus the writer's slack on a loaded 2-core machine: every
    # row appended before that is kept (a job stalled by the machine appends none, and losing none
    # of them is no failure of the writer's)
    logged = [line.split() for line in appended.read_text().splitlines()]
    due = [int(i) for i, ns in logged if len(ns) >= 18 and int(ns) <= killed_ns - (ROLL_S + SLACK_S) * 1e9]
    lost_s = (killed_ns - last_ns) / 1e9
    assert due and last >= max(due), f"kept rows up to {last} of {max(due)} due ({lost_s:.3f} s lost)"
    # the batch in flight never shows: the killed writer's live segments read up to their last
    # complete batch; nothing else but temporary (hidden) files is left
    leftovers = [
        p.name for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith((".parquet", ".arrows"))
    ]
    assert all(name.startswith(".") for name in leftovers)
    # `perfscope compact` seals them: the same rows, now all in Parquet
    result = compact(tmp_path, grace_s=0)
    assert result.live_sealed and not list(tmp_path.rglob("*.arrows"))
    with open_store(tmp_path) as store:
        assert store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist() == steps


FIRST_ROWS = textwrap.dedent(
    """
    import sys
    from perfscope.store.writer import StoreWriter
    comm = (0, 1, 0, "send", None, 8, 1, 2, "host", 1, 2, 2, None, "forward")
    with StoreWriter(sys.argv[1], "first", roll_interval_s=60) as w:
        for seq, is_async in enumerate((False, True, None)):
            w.append("comm", comm[:2] + (seq,) + comm[3:12] + (is_async,) + comm[13:])
        w.flush()
        print("pandas" in sys.modules, flush=True)
    """
)


def test_a_runs_first_rows_are_written_without_importing_pandas(tmp_path: Path) -> None:
    """The writer's thread builds a run's first rows, comm's booleans included, from buffers:
    pa.array imports pandas, 0.4 s of CPU holding the GIL, and 3 s and more of a loaded 2-core
    machine's time, during which the rows of every step waited and a SIGKILL lost them."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_ROWS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], "pandas was imported to write the first rows"
    with open_store(tmp_path) as store:
        got = store.query("SELECT seq, is_async FROM comm ORDER BY seq").to_pylist()
    assert got == [{"seq": 0, "is_async": False}, {"seq": 1, "is_async": True}, {"seq": 2, "is_async": None}]
