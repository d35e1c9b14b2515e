"""User SQL is bounded in time and memory by a watchdog over the query's own process (issue 33, item 7).

DuckDB's interrupt does not stop a list lambda (`list_reduce` of 10^8 items ran ~340 s past a 5 s limit,
holding a dashboard query slot all along), and its memory limit does not cover `repeat` (4 GB past a
2 GB limit, exit 0). The bounds here are generous: the point is minutes against seconds, gigabytes
against a stated bound, on a loaded machine.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from storegen import make_run

from perfscope import PerfscopeError, open_store
from perfscope.cli import main
from perfscope.sizes import parse_size
from perfscope.store import user_sql
from perfscope.store.user_sql import UserSql, worker_memory_bound

LAMBDA = "SELECT list_reduce(range(1, 100000000), (a, b) -> a + b) AS s"
REPEAT = "SELECT length(repeat('x', 2000000000)) AS n"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("watchdog") / "store"
    make_run(root, "r1", world_size=2, steps=5)
    return root


def test_a_list_lambda_is_stopped_at_the_time_limit(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    began = time.monotonic()
    assert main(["sql", str(store), LAMBDA, "--timeout", "3"]) == 1
    took = time.monotonic() - began
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "time limit of 3 s" in err[0], err
    assert took < 60, took  # before: ~340 s


#: the CLI in a process of its own; the largest resident memory of it and its children (the worker)
PEAK = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(done.returncode)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.stderr.write(done.stderr)
"""


def test_repeat_is_stopped_at_the_memory_bound(store: Path) -> None:
    cli = [sys.executable, "-m", "perfscope", "sql", str(store), REPEAT, "--memory-limit", "500MB"]
    out = subprocess.run(
        [sys.executable, "-c", PEAK, *cli], capture_output=True, text=True, timeout=300, check=False
    )
    code, peak = (int(x) for x in out.stdout.split())
    err = out.stderr.strip().splitlines()
    assert code == 1, out.stderr[-2000:]  # before: exit 0, at 4 GB
    assert len(err) == 1 and "stopped when it held" in err[0] and "500MB" in err[0], err
    bound = worker_memory_bound(parse_size("500MB") or 0)
    # the watchdog looks every 20 ms; repeat grows at about 100 MB/s: 200 MB is room to spare
    assert peak < bound + 200 * 2**20, f"peak {peak / 2**20:.0f} MB, bound {bound / 2**20:.0f} MB"


def test_sessions_over_their_time_free_their_query_slots(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two dashboard sessions running the lambda held both of the server's query slots for minutes and
    every other session was refused; now each is stopped at its limit and the third one's query runs."""
    monkeypatch.setattr(user_sql, "SLOT_WAIT_S", 60.0)  # before: refused after waiting all of it
    with open_store(store) as s:
        sessions = [UserSql(s) for _ in range(user_sql.RUNNING_QUERIES + 1)]
        errors: list[str] = []

        def run(session: UserSql) -> None:
            try:
                session.fetch(LAMBDA, timeout_s=3)
            except PerfscopeError as exc:
                errors.append(exc.message)

        busy = [threading.Thread(target=run, args=(x,)) for x in sessions[:-1]]
        for t in busy:
            t.start()
        deadline = time.monotonic() + 30
        while user_sql._slots._value > 0 and time.monotonic() < deadline:  # both slow ones have a slot
            time.sleep(0.01)
        assert user_sql._slots._value == 0
        assert sessions[-1].fetch("SELECT 1 AS x").table.to_pylist() == [{"x": 1}]
        for t in busy:
            t.join(60)
        for session in sessions:
            session.close()
    assert len(errors) == 2 and all("time limit of 3 s" in e for e in errors), errors


def test_a_worker_ends_with_the_process_that_started_it(store: Path) -> None:
    """A CLI killed by SIGKILL takes its watchdog with it: the query's process ends too, rather than
    run a lambda on for minutes (Linux: PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the worker ends with its parent on Linux")
    import psutil

    cli = subprocess.Popen(
        [sys.executable, "-m", "perfscope", "sql", str(store), LAMBDA, "--timeout", "600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        workers: list[psutil.Process] = []
        while not workers and time.monotonic() < deadline:
            workers = psutil.Process(cli.pid).children()
            time.sleep(0.1)
        assert workers, "no worker started"
    finally:
        cli.kill()
        cli.wait()
    _gone, alive = psutil.wait_procs(workers, timeout=30)
    for p in alive:
        p.kill()
    assert not alive


def test_a_row_larger_than_a_batch_may_hold_is_refused_in_one_line(store: Path) -> None:
    """Whatever the query, what reaches the server's Python comes in pieces of at most
    MAX_BATCH_BYTES: a single row past it is refused, not held."""
    from perfscope.store.sql_worker import MAX_BATCH_BYTES

    with open_store(store) as s, UserSql(s) as session:
        with pytest.raises(PerfscopeError, match="a row of the result holds") as err:
            session.fetch(f"SELECT repeat('x', {MAX_BATCH_BYTES + 2**20}) AS s")
        assert "\n" not in err.value.message and err.value.exit_code == 1
        # wide rows that fit come whole, split into pieces under the bound
        got = session.fetch("SELECT repeat('x', 1000000) AS s FROM range(100)")
        assert got.complete and got.table.num_rows == 100
