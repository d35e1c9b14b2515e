"""PERFSCOPE_MEMORY_LIMIT bounds a command's whole process, not DuckDB alone (issue 22): past it the
command stops with one line and exit 1, leaving nothing half-written; under it nothing changes."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perfscope import open_store
from perfscope.sizes import parse_size

DEMO = Path(__file__).resolve().parents[2] / "sample_traces" / "demo-cpu"
STEP = '{"ph":"X","cat":"user_annotation","name":"ProfilerStep#1","pid":1,"tid":1,"ts":100,"dur":10}'


def _perfscope(limit: str | None, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    if limit is not None:
        env["PERFSCOPE_MEMORY_LIMIT"] = limit
    return subprocess.run(
        [sys.executable, "-m", "perfscope", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _stopped(out: subprocess.CompletedProcess[str], verb: str, limit: str) -> None:
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"perfscope {verb}: stopped: its memory grew past PERFSCOPE_MEMORY_LIMIT={limit}"
    )
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr


def test_sizes() -> None:
    assert parse_size("512MiB") == 512 << 20 and parse_size("4GB") == 4 * 10**9
    assert parse_size(" 1.5 gib ") == int(1.5 * (1 << 30)) and parse_size("300mb") == 300 * 10**6
    for bad in ("", "lots", "12 parsecs", "-1GB", "1KB", "nanGB", "1e400GB", "GB"):
        assert parse_size(bad) is None, bad


def test_a_query_past_the_limit_stops_in_one_line(tmp_path: Path) -> None:
    """Rows of 20,000 characters build GBs of Arrow outside DuckDB's limit: stopped, and no CSV."""
    sql = "SELECT repeat('x', 20000) AS s FROM range(100000)"
    out = _perfscope("256MiB", "sql", str(DEMO), sql, "--format", "csv", "-o", "wide.csv", cwd=tmp_path)
    _stopped(out, "sql", "256MiB")
    assert not (tmp_path / "wide.csv").exists()


def test_an_analysis_stopped_inside_a_query_says_so_and_prints_nothing(tmp_path: Path) -> None:
    """The stop arrives in a rule's DuckDB query as "Query interrupted": the rule must not be skipped
    as if it had failed on odd data, leaving a half explanation printed with exit 0."""
    out = _perfscope("8MiB", "analyze", str(DEMO), "--json", cwd=tmp_path)
    _stopped(out, "analyze", "8MiB")
    assert out.stdout == "" and "failed" not in out.stderr


def test_an_import_past_the_limit_stops_and_publishes_nothing(tmp_path: Path) -> None:
    trace = tmp_path / "steps.pt.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        f.write('{"traceEvents":[' + ",".join([STEP] * 1_000_000) + "]}")
    out = _perfscope("16MiB", "import", "kineto", str(trace), "--store", "S", cwd=tmp_path)
    _stopped(out, "import", "16MiB")
    store = tmp_path / "S"
    if store.exists():
        with open_store(store) as s:
            assert s.query("SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 0}]
    # the same import with room: it runs as before
    out = _perfscope("1GiB", "import", "kineto", str(trace), "--store", "S", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    with open_store(store) as s:
        assert s.query("SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 1}]


@pytest.mark.parametrize("limit", ["1GiB", None])
def test_under_the_limit_a_command_answers_as_before(tmp_path: Path, limit: str | None) -> None:
    out = _perfscope(limit, "analyze", str(DEMO), "--json", cwd=tmp_path)
    assert out.returncode == 0 and '"findings"' in out.stdout, out.stderr[-2000:]
    assert "stopped" not in out.stderr


@pytest.mark.parametrize("bad", ["garbage", "1KB", "nanGB", "0", "-1GB", "2 parsecs", "infGB"])
@pytest.mark.parametrize("verb", ["info", "dashboard"])
def test_a_mistyped_limit_is_refused_before_the_command_starts(tmp_path: Path, bad: str, verb: str) -> None:
    """It was one warning, "using 2GB", and then no whole-process limit at all (issue 33)."""
    out = _perfscope(bad, verb, str(DEMO), cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"perfscope {verb}: error: PERFSCOPE_MEMORY_LIMIT={bad} is not a size")
    assert "512MiB" in lines[0] and "at least 1 MB" in lines[0] and out.stdout == ""


@pytest.mark.parametrize(
    ("value", "limit"), [("512MiB", 512 << 20), (" 1.5 GB ", 15 * 10**8), ("2g", 2 * 10**9)]
)
def test_a_parsed_limit_is_the_process_limit(monkeypatch: pytest.MonkeyPatch, value: str, limit: int) -> None:
    from perfscope.memory_guard import guard_for

    monkeypatch.setenv("PERFSCOPE_MEMORY_LIMIT", value)
    guard = guard_for("analyze")
    assert guard is not None and guard.limit == limit
    assert guard_for("run") is None  # the training job's memory is its own
    dashboard = guard_for("dashboard")  # the server's analyses count (issue 33)
    assert dashboard is not None and dashboard.limit == limit


def test_1mb_is_the_smallest_limit() -> None:
    from perfscope import PerfscopeError
    from perfscope.sizes import read_size

    assert read_size("1MB", "X") == 10**6 and read_size("1 mib", "X") == 1 << 20
    with pytest.raises(PerfscopeError, match="X=999KB is not a size"):
        read_size("999KB", "X")
