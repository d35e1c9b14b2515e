"""The clock alignment and its error, recorded per rank in `ranks` (issue 24), on one machine: real
2-process gloo jobs recorded by perfscope.profile. On one host both ranks share rank 0's clock (offset
and error exactly 0); with rank 1 posing as a second host whose wall clock runs an hour ahead, its
offset is recovered within the error it records, and its steps land on rank 0's clock. A store
written before the error was recorded reads it as NULL. (tests/collectors/test_two_nodes.py checks the same on
two namespaced nodes.)"""

from __future__ import annotations

import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from perfscope import open_store
from perfscope.collectors.clocks import align

pytest.importorskip("torch")
from collect_helpers import results_ok, run_ranks

STEPS = 8
#: rank 1's wall clock in the two-host job: an hour ahead of the machine's
SHIFT_NS = 3_600 * 10**9
#: the error bound a clock exchange over loopback may claim on a loaded 2-core machine; measured
#: 44-58 µs here at load 6 (half a TCPStore barrier's round trip over loopback)
MAX_ERROR_NS = 50_000_000


def clock_worker(rank: int, world_size: int, store: str, shift_ns: int) -> dict[str, Any]:
    """STEPS steps of a 2 ms sleep and an allreduce; with shift_ns, rank 1 reads a wall clock
    shift_ns ahead and calls its host `other-host` (two hosts on one machine)."""
    import torch
    import torch.distributed as dist

    import perfscope

    if shift_ns and rank == 1:
        real_time_ns = time.time_ns
        time.time_ns = lambda: real_time_ns() + shift_ns  # this process's wall clock only
        socket.gethostname = lambda: "other-host"
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    with perfscope.profile(store, experiment="clocks", poll_hz=0, gpu_telemetry=False) as prof:
        for _ in prof.steps(range(STEPS)):
            time.sleep(0.002)
            dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()
    return {"run_id": prof.run_id}


def _ranks(store: Path) -> list[dict[str, Any]]:
    with open_store(store) as s:
        return s.query(
            "SELECT rank, hostname, clock_offset_ns, clock_error_ns FROM ranks ORDER BY rank"
        ).to_pylist()


def test_one_host_shares_rank_0s_clock_exactly(tmp_path: Path) -> None:
    results_ok(run_ranks(clock_worker, 2, str(tmp_path), 0, timeout_s=240))
    ranks = _ranks(tmp_path)
    assert [(r["rank"], r["clock_offset_ns"], r["clock_error_ns"]) for r in ranks] == [(0, 0, 0), (1, 0, 0)]
    # a store written before the error was recorded: the same segments without the column
    old = tmp_path / "old"
    shutil.copytree(tmp_path, old, ignore=shutil.ignore_patterns("old"))
    files = list((old / "ranks").rglob("*.parquet"))
    assert files
    for f in files:
        t = pq.read_table(f)
        pq.write_table(t.drop_columns(["clock_error_ns"]).replace_schema_metadata(t.schema.metadata), f)
    ranks = _ranks(old)
    assert [(r["rank"], r["clock_offset_ns"], r["clock_error_ns"]) for r in ranks] == [
        (0, 0, None),
        (1, 0, None),
    ]


def test_a_second_hosts_clock_an_hour_ahead_is_aligned_within_its_recorded_error(tmp_path: Path) -> None:
    results_ok(run_ranks(clock_worker, 2, str(tmp_path), SHIFT_NS, timeout_s=240))
    ranks = _ranks(tmp_path)
    assert [r["hostname"] for r in ranks] == [socket.gethostname(), "other-host"]
    assert (ranks[0]["clock_offset_ns"], ranks[0]["clock_error_ns"]) == (0, 0)
    offset, error = ranks[1]["clock_offset_ns"], ranks[1]["clock_error_ns"]
    # the true offset is -SHIFT_NS exactly (one machine's clock): the recorded error bounds the miss
    assert 0 < error < MAX_ERROR_NS, error
    assert abs(offset + SHIFT_NS) <= error, (offset, error)
    # and rank 1's timestamps land on rank 0's clock: the allreduce ends each step on both ranks together
    with open_store(tmp_path) as s:
        ends = s.query(
            "SELECT median(abs((a.start_ns + a.step_ns) - (b.start_ns + b.step_ns))) AS skew FROM steps a "
            "JOIN steps b ON a.run_id = b.run_id AND a.step = b.step AND a.rank = 0 AND b.rank = 1"
        ).to_pylist()[0]["skew"]
    assert ends < error + 20_000_000, (ends, error)


def test_the_error_is_half_the_best_round_trip_narrowed_by_the_others() -> None:
    """align() on readings with known windows: host b's clock is 1000 ns ahead; a round's window on
    each host holds the barrier's shared instant (at true time 100, 200, 300)."""
    true_offset = -1000  # add to b's timestamps to get a's clock
    marks = [
        [90, 130, 190, 205, 295, 340],  # rank 0, host a
        [60 + 1000, 101 + 1000, 180 + 1000, 230 + 1000, 299 + 1000, 301 + 1000],  # rank 1, host b
    ]
    got = align(marks, [0], [1])
    assert got is not None
    # rounds give [90-1101, 130-1060] = [-1011, -930], [-1040, -975], [-1006, -959]: intersection
    # [-1006, -975]
    assert (got.offset_ns, got.error_ns) == (-991, 16)
    assert abs(got.offset_ns - true_offset) <= got.error_ns
    # ranks of one host share its clock: a second rank of b narrows b's windows
    marks.append([70 + 1000, 102 + 1000, 200 + 1000, 221 + 1000, 250 + 1000, 305 + 1000])
    both = align(marks, [0], [1, 2])
    assert both is not None and (both.offset_ns, both.error_ns) == (-1001, 6)
    assert abs(both.offset_ns - true_offset) <= both.error_ns
    # a clock stepped between rounds (the windows disagree): the narrowest round alone
    stepped = [[90, 130, 190, 205, 295, 340], [1060, 1101, 5180, 5230, 1299, 1301]]
    one = align(stepped, [0], [1])
    assert one is not None and (one.offset_ns, one.error_ns) == (-983, 24)
    # malformed readings (from an untrusted store) are no readings
    assert align([[90, 130], "garbage"], [0], [1]) is None
