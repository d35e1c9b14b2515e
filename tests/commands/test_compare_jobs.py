"""`perfscope compare` on real 2-rank gloo jobs recorded by perfscope.profile (issue 34): the same job
twice is no change and passes the gate; rank 1 sleeping EXTRA_S more in every forward (a third of the
step) is slower, the interval excluding 1, forward and rank 1 named, and fails the gate; the reverse is
faster; a loader with num_workers changed is listed first among the set-up changes, its data phase named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from compare_jobs import EXTRA_S, record

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    return record(
        root,
        [
            {"base": {}, "same": {}},  # the same job twice, side by side
            {"healthy": {}, "slow": {"slow_rank": 1}},  # the slow job beside its twin
            {"workers": {"num_workers": 2}},
        ],
    )


def compare(base: Path, cand: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "perfscope", "compare", str(base), str(cand), *extra],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def as_json(base: Path, cand: Path) -> dict[str, Any]:
    res = compare(base, cand, "--json")
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def test_the_same_job_twice_is_no_change_and_passes_the_gate(stores: dict[str, Path]) -> None:
    out = as_json(stores["base"], stores["same"])
    assert out["verdict"] == "no-change", out
    assert out["culprit"] is None or out["verdict"] == "no-change"
    assert [s["setting"] for s in out["setup_changes"]] == []
    res = compare(stores["base"], stores["same"], "--fail-if-slower", "5")
    assert res.returncode == 0, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "pass" in res.stderr


def test_a_rank_slower_in_forward_is_slower_with_forward_and_that_rank_named(stores: dict[str, Path]) -> None:
    out = as_json(stores["healthy"], stores["slow"])
    assert out["verdict"] == "slower", out
    lo, hi = out["ci"]
    assert 1.0 < lo <= out["step_ratio"] <= hi
    assert out["culprit"]["rank"] == 1 and out["culprit"]["every_rank"] is False
    assert out["culprit"]["phase"] == "forward"
    # rank 1's own work grew by about the injection; rank 0 only waits for it (never the culprit)
    r0, r1 = sorted(out["by_rank"], key=lambda r: r["rank"])
    assert r1["culprit"] and not r0["culprit"]
    assert r1["delta_own_ns"] == pytest.approx(EXTRA_S * 1e9, rel=0.5)
    forward = next(p for p in out["by_phase"] if p["phase"] == "forward")
    assert forward["delta_ns"] == pytest.approx(forward["candidate_ns"] - forward["base_ns"], rel=1e-9)
    assert forward["delta_ns"] > 0.25 * EXTRA_S * 1e9  # the mean over two ranks of one rank's +EXTRA_S
    assert sum(p["delta_ns"] for p in out["by_phase"]) == pytest.approx(
        out["candidate"]["step_ns"] - out["base"]["step_ns"], rel=1e-6, abs=1e3
    )
    res = compare(stores["healthy"], stores["slow"], "--fail-if-slower", "5")
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "FAIL" in res.stderr
    res = compare(stores["healthy"], stores["slow"])
    text = " ".join(res.stdout.split())  # as read, unwrapped
    assert res.returncode == 0 and "verdict: slower" in text
    assert "culprit: rank 1" in text and "most in forward" in text


def test_the_reverse_is_faster(stores: dict[str, Path]) -> None:
    out = as_json(stores["slow"], stores["healthy"])
    assert out["verdict"] == "faster", out
    assert out["ci"][1] < 1.0
    assert out["culprit"]["rank"] == 1 and out["culprit"]["phase"] == "forward"
    assert compare(stores["slow"], stores["healthy"], "--fail-if-slower", "5").returncode == 0


def test_a_changed_loader_is_listed_first_with_its_data_phase(stores: dict[str, Path]) -> None:
    out = as_json(stores["base"], stores["workers"])
    changed = {s["setting"]: s for s in out["setup_changes"]}
    assert changed["loader_workers"]["base"] == "0" and changed["loader_workers"]["candidate"] == "2"
    text = " ".join(compare(stores["base"], stores["workers"]).stdout.split())  # as read, unwrapped
    assert text.index("set-up changes") < text.index("verdict:")
    assert "ranks.loader_workers" in text and "the data phase (loader wait) went" in text
