"""Issue 22's smaller items: what perfscope echoes of a value stays short, and its warnings read as one
plain line wherever they are shown (a job's log, a library caller's console), not Python's
"perfscope:0: PerfscopeWarning: perfscope: ..."."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from perfscope.cli import main
from perfscope.sample_traces import path as sample_path


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        ("7" * 5000, "give A:B"),
        ("1:" + "9" * 5000, "give A:B"),
        ("99999999999999999999:", "give A:B"),  # past a BIGINT: refused, not an overflow in DuckDB
        ("5:" + "0" * 3000 + "1", "give A:B"),
    ],
    ids=["5000-digits", "5000-digit-end", "past-bigint", "3000-zeros"],
)
def test_a_huge_steps_value_is_refused_in_one_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str, says: str
) -> None:
    store = sample_path("demo-cpu")
    assert main(["export", "perfetto", str(store), "--steps", steps, "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert len(err) < 200, f"{len(err)} characters echoed"
    assert not (tmp_path / "t.json").exists()


def test_a_warning_is_one_plain_line_outside_the_cli() -> None:
    code = textwrap.dedent(
        """
        import warnings
        from perfscope.errors import warn_once
        warn_once("k", "perfscope: could not read the GPU counters; host metrics only.")
        warnings.warn("someone else's", UserWarning)
        """
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    lines = err.splitlines()
    assert lines[0] == "perfscope: could not read the GPU counters; host metrics only.", err
    assert "PerfscopeWarning" not in err and "perfscope:0" not in err
    assert lines[1].endswith("UserWarning: someone else's"), err  # other warnings as Python shows them
