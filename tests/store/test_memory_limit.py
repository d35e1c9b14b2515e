"""The analysis connection's DuckDB memory limit: 2 GB unless PERFSCOPE_MEMORY_LIMIT says otherwise (DuckDB
then gets half of it, the rest of the process the other half), and the numbers do not depend on it
(DuckDB spills beyond it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perfscope.errors import PerfscopeWarning
from perfscope.store.open import open_store

STORE = Path(__file__).resolve().parents[2] / "sample_traces" / "demo-cpu"


def _limit_gib(monkeypatch: pytest.MonkeyPatch, value: str | None) -> float:
    if value is None:
        monkeypatch.delenv("PERFSCOPE_MEMORY_LIMIT", raising=False)
    else:
        monkeypatch.setenv("PERFSCOPE_MEMORY_LIMIT", value)
    with open_store(STORE) as store:
        text = store.query("SELECT current_setting('memory_limit') AS m").column("m")[0].as_py()
    number, unit = text.split()
    return float(number) * {"MiB": 1 / 1024, "GiB": 1.0}[unit]


def test_default_limit_is_2_gb(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _limit_gib(monkeypatch, None) == pytest.approx(2e9 / 2**30, rel=0.05)


def test_the_environment_moves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _limit_gib(monkeypatch, "512MiB") == pytest.approx(0.25, rel=0.05)
    assert _limit_gib(monkeypatch, "3 GiB") == pytest.approx(1.5, rel=0.05)


@pytest.mark.parametrize("value", ["lots", "1GB; SET enable_external_access=true", "-1GB", "50%"])
def test_a_bad_value_warns_once_and_keeps_the_default(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr("perfscope.errors._seen", set())
    with pytest.warns(PerfscopeWarning, match="PERFSCOPE_MEMORY_LIMIT"):
        assert _limit_gib(monkeypatch, value) == pytest.approx(2e9 / 2**30, rel=0.05)


def test_analyze_gives_the_same_numbers_under_a_small_limit() -> None:
    def analyze(limit: str) -> dict[str, object]:
        env = {"PERFSCOPE_MEMORY_LIMIT": limit, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-m", "perfscope", "analyze", str(STORE), "--json"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=300,
        ).stdout
        return json.loads(out)

    def close(a: object, b: object) -> bool:  # floats summed in another order differ in the last bits
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, float) and isinstance(b, float):
            return a == pytest.approx(b, rel=1e-9, nan_ok=True)
        return a == b

    # the whole command grows by about 125 MB on the sample here (more threads, more on bigger
    # machines), so it runs to the end under 512 MiB with DuckDB held to 256 MiB
    assert close(analyze("512MiB"), analyze("4GB"))
