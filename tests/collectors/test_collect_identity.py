"""Who a rank is: launcher environments, run ids, and the start exchange (placement on hosts, clock
offsets) over an in-process exchange standing in for ranks on several hosts."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from perfscope.collectors import rendezvous
from perfscope.collectors.identity import (
    claim_run_id,
    explicit_run_id,
    from_environment,
    launcher_run_id,
    safe_run_id,
)
from perfscope.collectors.rendezvous import Peer, agree


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
             "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
            ("torchrun", 5, 8, 1, 4, 1, 2),
        ),
        (
            {"SLURM_PROCID": "6", "SLURM_NTASKS": "12", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
             "SLURM_JOB_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "4(x3)"},
            ("slurm", 6, 12, 2, 4, 1, 3),
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
            ("mpi", 3, 4, 1, 2, None, 2),
        ),
        (
            {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2",
             "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"},
            ("horovod", 2, 4, 0, 2, 1, 2),
        ),
        ({}, ("single", 0, 1, 0, 1, 0, 1)),
    ],
)  # fmt: skip
def test_launcher_environments(env: dict[str, str], expected: tuple[Any, ...]) -> None:
    me = from_environment(env)
    assert (
        me.launcher,
        me.rank,
        me.world_size,
        me.local_rank,
        me.local_world_size,
        me.node_rank,
        me.nodes,
    ) == expected


def test_run_ids_from_the_environment() -> None:
    assert explicit_run_id({"PERFSCOPE_RUN_ID": " exp-1 "}) == "exp-1" and explicit_run_id({}) is None
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default: no id
    assert (
        launcher_run_id({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
        == "torchelastic-abc-r2"
    )
    assert launcher_run_id({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}) == "slurm-4242.3"
    assert safe_run_id("a/b c") == "a-b-c"
    base = f"claim-{time.monotonic_ns()}"
    assert [claim_run_id(base) for _ in range(3)] == [base, f"{base}-2", f"{base}-3"]


class ThreadExchange:
    """Ranks as threads of this process, each reading the wall clock of its own 'host'."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._local = threading.local()

    def for_rank(self, rank: int) -> ThreadExchange:
        self._local.rank = rank
        return self

    @property
    def rank(self) -> int:
        return int(self._local.rank)

    backend = "gloo"

    def barrier(self) -> None:
        self._barrier.wait(10)

    def all_gather(self, obj: Any) -> list[Any]:
        self._slots[self.rank] = obj
        self._barrier.wait(10)
        out = list(self._slots)
        self._barrier.wait(10)
        return out


def test_placement_and_clock_offsets_across_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = ["a", "a", "b", "b", "b"]
    skew_ns = {"a": 0, "b": -7_000_000}  # host b's clock runs 7 ms behind host a's
    exchange = ThreadExchange(len(hosts))
    local = threading.local()
    real_time_ns = time.time_ns
    monkeypatch.setattr(rendezvous.time, "time_ns", lambda: real_time_ns() + skew_ns[local.host])
    placements: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        local.host = hosts[rank]
        ex = exchange.for_rank(rank)
        placements[rank] = agree(ex, Peer(rank, hosts[rank], 1000 + rank, 8, None, f"id-of-{rank}"), rounds=5)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(placements) == len(hosts)
    assert {p.run_id for p in placements.values()} == {"id-of-0"}  # rank 0's id wins
    assert [(placements[r].node_rank, placements[r].local_rank) for r in range(5)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert {(p.nodes, p.ranks_per_node) for p in placements.values()} == {(2, 3)}
    assert placements[3].local_pids == (1002, 1003, 1004)
    assert placements[0].clock_offset_ns == placements[1].clock_offset_ns == 0
    for r in (2, 3, 4):  # add the offset to b's timestamps to land on a's clock
        assert placements[r].clock_offset_ns == pytest.approx(7_000_000, abs=2_000_000)
    assert len({placements[r].clock_offset_ns for r in (2, 3, 4)}) == 1  # one clock per host
