"""The quick pass's measured times (tests/durations.py): a real pytest run's JUnit report read back as
`module::test` seconds, skipped tests left out, and folded into the file without losing the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import durations
import pytest


def test_a_junit_report_gives_each_test_its_time_by_module_and_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = tmp_path / "room"
    room.mkdir()
    (room / "test_tiny.py").write_text(
        "import time, pytest\n"
        "def test_slow():\n    time.sleep(0.3)\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_quick(n):\n    assert n\n"
        "def test_skipped():\n    pytest.skip('no')\n"
    )
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(room)],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
        check=True,
        capture_output=True,
        timeout=120,
    )
    times = durations.measured(report)
    assert set(times) == {"test_tiny::test_slow", "test_tiny::test_quick[1]", "test_tiny::test_quick[2]"}
    assert times["test_tiny::test_slow"] >= 0.3 > times["test_tiny::test_quick[1]"]

    file = tmp_path / "durations.json"
    file.write_text(json.dumps({"test_other::test_kept": 2.5, "test_tiny::test_slow": 9.0}))
    monkeypatch.setattr(durations, "FILE", file)
    assert durations.update(report) == 0
    folded = durations.load()
    assert folded["test_other::test_kept"] == 2.5  # not in the report: kept
    assert folded["test_tiny::test_slow"] == times["test_tiny::test_slow"]  # measured again: replaced
    assert durations.key("tests.room.test_tiny", "test_slow") == "test_tiny::test_slow"


def test_a_broken_file_counts_every_test_as_not_yet_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for text in ("", "{not json", "[1, 2]"):
        (tmp_path / "durations.json").write_text(text)
        monkeypatch.setattr(durations, "FILE", tmp_path / "durations.json")
        assert durations.load() == {}
