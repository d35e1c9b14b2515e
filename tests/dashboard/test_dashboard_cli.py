"""`perfscope dashboard`: errors before starting, the Streamlit command line, SIGTERM off localhost."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from storegen import make_run
from test_dashboard_browser import dashboard_server, free_port

from perfscope import sample_traces
from perfscope.cli import main
from perfscope.commands.dashboard import _store, command


def test_missing_store_is_an_error_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dashboard", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_a_file_is_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "runs.parquet"
    f.write_bytes(b"PAR1")
    assert main(["dashboard", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_bad_port_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboard", str(tmp_path), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_without_a_store_it_opens_the_bundled_sample() -> None:
    assert _store(None) == sample_traces.path(sample_traces.DEFAULT)


def test_streamlit_runs_headless_local_and_without_usage_statistics(tmp_path: Path) -> None:
    cmd = command(tmp_path, "127.0.0.1", 8600)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("serve.py") and Path(cmd[4]).is_file()
    for flag in (
        "--server.headless=true",
        "--server.address=127.0.0.1",
        "--server.port=8600",
        "--browser.gatherUsageStats=false",
    ):
        assert flag in cmd


def test_another_host_and_sigterm_stops_the_server(tmp_path: Path) -> None:
    make_run(tmp_path / "store", "r1", world_size=2)
    log = tmp_path / "server.log"
    # 127.0.0.2 is loopback too: a non-default address without leaving this machine
    with dashboard_server(tmp_path / "store", log, host="127.0.0.2") as (url, proc):
        text = log.read_text()
        assert f"perfscope dashboard: {url}" in text
        proc.send_signal(signal.SIGTERM)  # to the CLI alone: it must take its Streamlit server along
        proc.wait(timeout=20)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/_stcore/health", timeout=2)


def test_the_memory_limit_bounds_the_server_too(tmp_path: Path) -> None:
    """PERFSCOPE_MEMORY_LIMIT bounds the dashboard as it bounds `analyze` (issue 33): the Streamlit
    server, the command's child, counts; past the limit the command says so in one line, exits 1 and
    takes its server along. (A limit of 20 MB: the server's own start passes it.)"""
    make_run(tmp_path / "store", "r1", world_size=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "perfscope", "dashboard", str(tmp_path / "store"), "--port", str(free_port()),
         "--no-token"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PERFSCOPE_MEMORY_LIMIT": "20MB"},
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    assert "perfscope dashboard: stopped: its memory grew past PERFSCOPE_MEMORY_LIMIT=20MB" in err
    # the server went with it: nothing is left in the command's session
    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["pid"]) if _session(p) == proc.pid]
    assert left == [], left


def _session(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid)
    except OSError:
        return None
