"""What-if of interleaved pipelines (issue 23, vpp > 1): the op tables of Megatron-LM's interleaved
1F1B schedule (tests/analysis/test_what_if.py `synthetic(..., vpp=N)`, timed by its own simulation)
imported with `--vpp`, their transfers paired across stages, chunks and directions, replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_what_if import _recorded_step, _what_if, synthetic


@pytest.mark.parametrize(
    ("dp", "pp", "vpp", "m", "batched"),
    [(2, 4, 2, 8, False), (2, 2, 3, 4, False), (2, 4, 2, 8, True), (2, 2, 3, 4, True)],
)
def test_interleaved_step_replays_as_recorded(
    tmp_path: Path, dp: int, pp: int, vpp: int, m: int, batched: bool
) -> None:
    """pp = 2: the two stages send each other forward and backward transfers both ways (chunk c of
    stage 1 feeds chunk c + 1 of stage 0); each direction is paired on its own, also where a batch's
    transfers are recorded with one start and one end (Megatron-LM's batch_isend_irecv)."""
    table = synthetic(dp, pp, m=m, steps=8, vpp=vpp, batched=batched)
    w = _what_if(tmp_path, table, dp, pp, "t", "--vpp", vpp)
    assert w["replay_error"] < 0.02
    assert w["actual_step_ns"] / 1e9 == pytest.approx(_recorded_step(table), rel=0.01)
    assert w["cause"] == "none" and w["slowdown"] == pytest.approx(1.0, abs=0.03)
    assert w["findings"] == []


@pytest.mark.parametrize(("pp", "vpp", "m", "long"), [(4, 2, 8, 2), (2, 3, 4, 1)])
def test_interleaved_long_stage_is_stage_imbalance(
    tmp_path: Path, pp: int, vpp: int, m: int, long: int
) -> None:
    """One stage holds 1.8 times the others' layers at every dp rank: stage-imbalance on that stage, and
    the ideal step is the same job with its layers shared evenly (every stage at (pp - 1 + 1.8) / pp)."""
    slow = {(d, long): 1.8 for d in range(2)}
    w = _what_if(tmp_path, synthetic(2, pp, m=m, steps=8, vpp=vpp, slow=slow), 2, pp, "t", "--vpp", vpp)
    assert w["replay_error"] < 0.02
    assert w["cause"] == "stage-imbalance"
    assert w["by_stage"][0]["stage"] == long
    assert all(r["slowdown"] < 1.03 for r in w["by_stage"][1:])
    assert w["slowdown"] > 1.15
    even = {(d, s): (pp - 1 + 1.8) / pp for d in range(2) for s in range(pp)}
    balanced = _recorded_step(synthetic(2, pp, m=m, steps=8, vpp=vpp, slow=even))
    assert w["ideal_step_ns"] / 1e9 == pytest.approx(balanced, rel=0.04)
    (f,) = w["findings"]
    assert f"stage {long}" in f.title and "fewer layers" in f.recommendation


def test_interleaved_slow_worker_ideal_is_the_job_without_it(tmp_path: Path) -> None:
    w = _what_if(tmp_path, synthetic(2, 4, m=8, steps=8, vpp=2, slow={(1, 1): 1.8}), 2, 4, "t", "--vpp", 2)
    assert w["cause"] == "slow-worker"
    assert (w["by_worker"][0]["dp_rank"], w["by_worker"][0]["stage"]) == (1, 1)
    without = _recorded_step(synthetic(2, 4, m=8, steps=8, vpp=2))
    assert w["ideal_step_ns"] / 1e9 == pytest.approx(without, rel=0.05)
