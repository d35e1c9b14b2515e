"""`perfscope compare` of experiments and scaling groups, world size by world size (issue 34): stores
written through the real StoreWriter (tests/storegen.py) with steps of known distributions; the
verdict per world size and overall, the gate naming the world size, what is on one side only, and
hostile picks refused in one line with the store left as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from storegen import DEFAULT_PHASES, MS, T0_NS, make_run

from perfscope.analysis.compare_sets import set_verdict
from perfscope.cli import main

#: the runs' steps: 40, of which 30 steady (the first 10 are warm-up)
STEPS = 40
HOSTILE = "x'; DROP TABLE runs; --"


def _run(
    root: Path, run_id: str, experiment: str, n: int, *, seed: int, slower: float = 1.0, start: int = 0
) -> None:
    """One run of weak scaling (32 samples per rank): the forward phase varies by 2% from step to step
    (a seeded draw of one distribution), every phase `slower` times as long."""
    noise = np.random.default_rng(seed).normal(0.0, 0.02, STEPS)
    make_run(
        root,
        run_id,
        experiment=experiment,
        world_size=n,
        steps=STEPS,
        start_ns=T0_NS + start,
        phases={p: v * slower if n > 1 or p != "sync_exposed" else 0 for p, v in DEFAULT_PHASES.items()},
        phase_fn=lambda rank, step: {"forward": 10 * MS * slower * (1 + noise[step])},
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v1 and v2: the same job at world sizes 1, 2, 4 (v2 twice at 2, the later run standing for it);
    v3: the job 20% slower at world size 4 only, and also at 8; solo: one run at world size 8."""
    root = tmp_path_factory.mktemp("sets") / "store"
    for i, n in enumerate((1, 2, 4)):
        _run(root, f"v1-n{n}", "v1", n, seed=10 + i)
        _run(root, f"v2-n{n}", "v2", n, seed=20 + i)
        _run(root, f"v3-n{n}", "v3", n, seed=30 + i, slower=1.2 if n == 4 else 1.0)
    _run(root, "v2-n2-again", "v2", 2, seed=40, start=10**12)
    _run(root, "v3-n8", "v3", 8, seed=38)
    _run(root, "solo-n8", "solo", 8, seed=50)
    return root


def _cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> dict:
    code, out, err = _cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_the_same_job_in_two_experiments_is_no_change_and_passes(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pick = ("--base-experiment", "v1", "--candidate-experiment", "v2")
    doc = _json(capsys, store, store, *pick)
    assert doc["verdict"] == "no-change"
    rows = {r["world_size"]: r for r in doc["by_world_size"]}
    assert sorted(rows) == [1, 2, 4] and doc["only_in_base"] == [] and doc["only_in_candidate"] == []
    assert all(r["verdict"] == "no-change" for r in rows.values())
    assert all(r["ci"][0] < 1.02 and r["ci"][1] > 0.98 for r in rows.values())
    # two runs of v2 at world size 2: the later one stands for it, and a note says so
    assert rows[2]["candidate_run_id"] == "v2-n2-again" and rows[2]["base_run_id"] == "v1-n2"
    assert any("2 runs at world size 2" in n and "v2-n2-again" in n for n in doc["notes"])
    # each comparison is the single-run JSON of that pair
    assert set(doc["comparisons"]) == {"1", "2", "4"}
    assert doc["comparisons"]["4"]["base"]["run_id"] == "v1-n4"
    assert doc["comparisons"]["4"]["candidate"]["run_id"] == "v2-n4"
    assert rows[1]["base_efficiency"] == pytest.approx(1.0)
    assert rows[4]["candidate_efficiency"] == pytest.approx(rows[4]["base_efficiency"], rel=0.02)
    code, out, err = _cli(capsys, store, store, *pick, "--fail-if-slower", "5")
    assert code == 0, err
    assert len(err.strip().splitlines()) == 1 and "pass" in err
    assert "verdict: no-change" in out and "world size 4, the largest" in out


def test_a_slowdown_at_one_world_size_is_slower_and_fails_naming_it(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pick = ("--base-experiment", "v1", "--candidate-experiment", "v3")
    doc = _json(capsys, store, store, *pick)
    assert doc["verdict"] == "slower" and doc["decided_by"] == 4
    rows = {r["world_size"]: r for r in doc["by_world_size"]}
    assert rows[4]["verdict"] == "slower" and rows[4]["ci"][0] > 1.1
    assert rows[4]["step_ratio"] == pytest.approx(1.2, rel=0.02)
    assert rows[1]["verdict"] == rows[2]["verdict"] == "no-change"
    assert rows[4]["candidate_efficiency"] < 0.9 * rows[4]["base_efficiency"]
    assert rows[2]["candidate_efficiency"] == pytest.approx(rows[2]["base_efficiency"], rel=0.02)
    assert doc["only_in_candidate"] == [8] and doc["only_in_base"] == []
    assert doc["comparisons"]["4"]["verdict"] == "slower"
    code, out, err = _cli(capsys, store, store, *pick, "--fail-if-slower", "5")
    assert code == 1
    (line,) = err.strip().splitlines()
    assert "FAIL" in line and "world size 4" in line
    assert "verdict: slower" in out and "world size 4 decides" in out
    assert "only in CANDIDATE, not compared: world size 8" in out
    # then the full single-run section of world size 4
    assert out.index("world size 4 decides") < out.index("compare: base v1-n4") < out.index("by phase")
    # not slower than 25% with confidence: the gate passes
    assert _cli(capsys, store, store, *pick, "--fail-if-slower", "25")[0] == 0


def test_scaling_groups_and_two_stores(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    shutil.copytree(store, other)
    doc = _json(
        capsys,
        store,
        other,
        "--base-group",
        "v1/c1/nccl/mlp/weak:b32",
        "--candidate-group",
        "v3/c1/nccl/mlp/weak:b32",
    )
    assert doc["verdict"] == "slower" and doc["decided_by"] == 4
    assert doc["comparisons"]["4"]["candidate"]["store"] == str(other)
    # an experiment on one side, a group on the other
    doc = _json(
        capsys, store, other, "--base-group", "v1/c1/nccl/mlp/weak:b32", "--candidate-experiment", "v2"
    )
    assert doc["verdict"] == "no-change"


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], *args: str | Path) -> str:
    code, out, err = _cli(capsys, *args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


def test_picks_that_cannot_be_used_are_one_line_and_exit_2(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_exit_2(capsys, store, store, "--base-run", "v1-n1", "--base-experiment", "v1")
    assert "--base-run and --base-experiment" in line
    line = _one_line_exit_2(capsys, store, store, "--base-run", "v1-n1", "--candidate-experiment", "v2")
    assert "set of runs" in line and "--base-run picks one run" in line
    line = _one_line_exit_2(capsys, store, store, "--candidate-group", "v1/c1/nccl/mlp/weak:b32")
    assert "set of runs" in line and "BASE is one run" in line
    line = _one_line_exit_2(capsys, store, store, "--base-experiment", "nope", "--candidate-experiment", "v2")
    assert "no experiment nope" in line and "solo, v1, v2, v3" in line
    line = _one_line_exit_2(capsys, store, store, "--base-experiment", "v1", "--candidate-group", "v9")
    assert "CANDIDATE: no group v9" in line and "v1/c1/nccl/mlp/weak:b32" in line
    line = _one_line_exit_2(capsys, store, store, "--base-experiment", "v1", "--candidate-experiment", "v1")
    assert "same runs" in line
    line = _one_line_exit_2(capsys, store, store, "--base-experiment", "v1", "--candidate-experiment", "solo")
    assert "share no world size (BASE: 1, 2, 4; CANDIDATE: 8)" in line


def test_a_hostile_name_is_a_value_not_sql(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(store)
    for option in ("--base-experiment", "--base-group"):
        line = _one_line_exit_2(capsys, store, store, option, HOSTILE, "--candidate-experiment", "v2")
        assert f"no {option.split('-')[-1]} {HOSTILE}" in line and "it holds" in line
    assert _snapshot(store) == before
    assert _json(capsys, store, store, "--base-experiment", "v1", "--candidate-experiment", "v2")["verdict"]


def test_the_set_verdict_and_the_world_size_that_decides() -> None:
    assert set_verdict({1: "no-change", 2: "slower", 4: "faster", 8: "slower"}) == ("slower", 8)
    assert set_verdict({1: "faster", 2: "faster", 4: "no-change"}) == ("faster", 2)
    assert set_verdict({1: "no-change", 4: "no-change"}) == ("no-change", 4)
