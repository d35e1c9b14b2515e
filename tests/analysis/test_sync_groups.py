"""Collectives on two groups of the same size, matched with their own group's members (issue 23), on a
real 4-rank gloo job recorded by perfscope.profile.

Ranks 0-3 make tensor-parallel pairs {0,1}, {2,3} and data-parallel pairs {0,2}, {1,3}
(torch.distributed.new_group); every step each rank all-reduces the same tensor on its tp pair, then
on its dp pair. Rank 3 sleeps before its tp all-reduce: rank 2 waits for it there, and the dp
partners of the late pair (ranks 0 and 1) wait for it at the dp all-reduce. The job's own clock
(time.perf_counter_ns right before each call, the same monotonic clock for every process of one host)
goes to a file per rank; the wait at collective perfscope reads from its store must agree with it.
Matched by op and group size alone, ranks 0 and 1 would wait twice: once at the tp all-reduce for a
pair they are not in.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from collect_helpers import results_ok, run_ranks

from perfscope.analysis import run_analysis
from perfscope.store.open import open_store
from perfscope.store.process_groups import COMM_MEMBERS_SQL

WORLD = 4
TP = ((0, 1), (2, 3))
DP = ((0, 2), (1, 3))
STEPS = 20
WORK_S = 0.004
LATE_S = 0.03  # rank 3's sleep before its tp all-reduce
#: perfscope's mean wait per rank against the job's clock: measured within 0.08 ms (0.4 ms in one step)
#: at load 5 on 2 cores, but past 2 ms once at load 8 (a rank descheduled between its own clock
#: reading and the recorder's); matched by op and group size alone, ranks 0 and 1 are off by LATE_S,
#: five times this tolerance
TOL_NS = LATE_S * 1e9 / 5


def _group(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    return next(g for g in groups if rank in g)


def tp_dp_job(rank: int, world_size: int, store: str, out: str) -> str:
    import torch
    import torch.distributed as dist

    import perfscope

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    # every rank creates every group, in the same order
    tp: dict[tuple[int, ...], Any] = {g: dist.new_group(list(g)) for g in TP}
    dp: dict[tuple[int, ...], Any] = {g: dist.new_group(list(g)) for g in DP}
    x = torch.ones(64)
    entries: list[tuple[int, int]] = []
    with perfscope.profile(store, poll_hz=0, gpu_telemetry=False, batch_size=2) as prof:
        run_id = prof.run_id
        for _ in range(STEPS):
            with prof.phase("forward"):
                time.sleep(WORK_S)
                if rank == 3:
                    time.sleep(LATE_S)
            with prof.phase("sync"):
                t_tp = time.perf_counter_ns()
                dist.all_reduce(x, group=tp[_group(TP, rank)])
                t_dp = time.perf_counter_ns()
                dist.all_reduce(x, group=dp[_group(DP, rank)])
            entries.append((t_tp, t_dp))
            prof.step()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"run_id": run_id, "entries": entries}))
    dist.destroy_process_group()
    return str(run_id)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("sync_groups")
    out = root / "clock"
    out.mkdir()
    results_ok(run_ranks(tp_dp_job, WORLD, str(root / "store"), str(out), timeout_s=240))
    clock = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}
    return root / "store", clock


def _own_clock_waits(clock: dict[int, Any]) -> dict[tuple[int, int], float]:
    """(rank, step) -> the wait at the step's collectives by the job's own clock: per call, the last
    entry among the call's group's members minus the rank's own entry."""
    waits = {}
    for step in range(STEPS):
        for r in range(WORLD):
            tp_in = [clock[m]["entries"][step][0] for m in _group(TP, r)]
            dp_in = [clock[m]["entries"][step][1] for m in _group(DP, r)]
            mine = clock[r]["entries"][step]
            waits[(r, step)] = float(max(tp_in) - mine[0] + max(dp_in) - mine[1])
    return waits


def test_groups_are_recorded(job: tuple[Path, dict[int, Any]]) -> None:
    store, _ = job
    with open_store(store) as s:
        got = s.query(
            "SELECT rank, list(DISTINCT group_ranks ORDER BY group_ranks) AS g "
            f"FROM ({COMM_MEMBERS_SQL}) comm GROUP BY rank"
        )
    groups = {r["rank"]: r["g"] for r in got.to_pylist()}
    for r in range(WORLD):
        assert sorted(groups[r]) == sorted(",".join(map(str, g)) for g in (_group(TP, r), _group(DP, r)))


def test_wait_at_collective_matches_the_jobs_own_clock(job: tuple[Path, dict[int, Any]]) -> None:
    store, clock = job
    own = _own_clock_waits(clock)
    with open_store(store) as s:
        heat = run_analysis("collective_wait", s).to_pylist()
        st = {r["rank"]: r for r in run_analysis("stragglers", s).to_pylist()}
    assert {h["steps_in_bucket"] for h in heat} == {1}
    steps = sorted({h["step"] for h in heat})
    assert len(steps) >= 5
    for r in range(WORLD):
        got = [h["wait_ns"] for h in heat if h["rank"] == r]
        want = [own[(r, step)] for step in steps]
        assert len(got) == len(steps)
        mean_got, mean_want = sum(got) / len(got), sum(want) / len(want)
        # the recorder's entry is a few µs after the job's; under load a rank may be descheduled
        # between the two (TOL_NS)
        assert mean_got == pytest.approx(mean_want, abs=TOL_NS), r
        assert st[r]["wait_per_step_ns"] == pytest.approx(mean_got, rel=1e-9)
    # the late rank's partners wait about its sleep, each once a step; the late rank waits for no one
    for r in (0, 1, 2):
        assert st[r]["wait_per_step_ns"] == pytest.approx(LATE_S * 1e9, rel=0.3), r
    assert st[3]["wait_per_step_ns"] < 0.1 * LATE_S * 1e9
    assert st[3]["is_straggler"] and st[3]["last_share"] > 0.9
