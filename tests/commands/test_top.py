"""`perfscope top`: driven in a pseudo-terminal (pexpect) while a store is written, its screen read
back; `--once` for scripts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from storegen import MS, make_run

from perfscope.cli import main

pexpect = pytest.importorskip("pexpect")
PERFSCOPE = str(Path(sys.executable).parent / "perfscope")


def _slow_rank_1(rank: int, step: int) -> dict[str, float]:
    """Rank 1 computes 8 ms longer; rank 0 waits for it in its sync."""
    return (
        {"forward": 18 * MS, "sync_exposed": 2 * MS}
        if rank == 1
        else {"forward": 10 * MS, "sync_exposed": 10 * MS}
    )


def test_once_prints_ranks_slowest_and_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_run(tmp_path / "S", "job", world_size=2, steps=30, phase_fn=_slow_rank_1)
    assert main(["top", str(tmp_path / "S"), "--once", "--window", "10"]) == 0
    screen = capsys.readouterr().out
    assert "run job" in screen and "world size 2" in screen
    lines = {ln.split()[0]: ln.split() for ln in screen.splitlines() if ln.strip()[:1] in ("0", "1")}
    # default phases: data 1, forward, backward 20, sync, optimizer 1, other 1 ms: 43 ms either way
    assert float(lines["0"][2]) == pytest.approx(43.0) and float(lines["1"][2]) == pytest.approx(43.0)
    assert lines["0"][1] == "29"  # the last step seen
    assert round(float(lines["0"][4])) == round(100 * 10 / 43)  # forward share on rank 0
    assert lines["1"][-1] == "slowest" and "slowest" not in lines["0"]
    assert "findings so far" in screen


def test_live_view_refreshes_and_leaves_on_ctrl_c(tmp_path: Path) -> None:
    store = tmp_path / "S"
    env = {**os.environ, "NO_COLOR": "1"}
    child = pexpect.spawn(
        PERFSCOPE,
        ["top", str(store), "--interval", "0.3"],
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 160),
    )
    try:
        child.expect("waiting for")  # started before the job wrote anything
        make_run(store, "first", world_size=2, steps=12)
        child.expect("run first")
        child.expect("findings so far")
        assert "slowest\r\n" not in child.before  # ranks alike: nobody is named
        make_run(
            store, "second", world_size=2, steps=12, start_ns=1_800_000_000_000_000_000, phase_fn=_slow_rank_1
        )
        child.expect("run second")
        child.expect("slowest\r\n")  # the mark at the end of rank 1's row
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus in (0, 130)
    assert "Traceback" not in (child.before or "")


@pytest.mark.parametrize(
    ("argv", "needle"), [(["--interval", "0"], "--interval"), (["--window", "0"], "--window")]
)
def test_bad_flags_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    make_run(tmp_path / "S", "job", world_size=1, steps=3)
    assert main(["top", str(tmp_path / "S"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_missing_store_once_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", str(tmp_path / "nope"), "--once"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


def test_piped_output_gets_one_frame(tmp_path: Path) -> None:
    import subprocess

    make_run(tmp_path / "S", "job", world_size=2, steps=5)
    out = subprocess.run([PERFSCOPE, "top", str(tmp_path / "S")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("run job") == 1 and "\x1b[H" not in out.stdout


def test_once_says_which_run_it_picked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "S"
    make_run(store, "older", world_size=2, steps=12)
    make_run(store, "newer", world_size=2, steps=12, start_ns=1_800_000_000_000_000_000)
    assert main(["top", str(store), "--once", "--no-findings"]) == 0
    screen = capsys.readouterr().out
    assert "run newer" in screen and "run older" not in screen
    assert "the run that wrote a step last, of 2 runs in the store; --run RUN_ID shows another" in screen
    assert main(["top", str(store), "--once", "--no-findings", "--run", "older"]) == 0
    screen = capsys.readouterr().out
    assert "run older" in screen and "wrote a step last" not in screen  # asked for: nothing to say
    make_run(tmp_path / "one", "only", world_size=1, steps=12, experiment="")
    assert main(["top", str(tmp_path / "one"), "--once", "--no-findings"]) == 0
    screen = capsys.readouterr().out
    assert "the only run in the store" in screen and "experiment" not in screen.splitlines()[1]
