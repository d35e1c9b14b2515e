"""The start-up exchange cannot hang a job: real 3-process gloo jobs where one rank never opens
perfscope.profile (a data-loading or evaluation rank) and where all do; and the exchange over a
real c10d key-value store, between 'hosts' with skewed clocks and with garbage under its keys."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from perfscope import PerfscopeWarning, open_store
from perfscope.collectors import rendezvous
from perfscope.collectors.faults import Faults
from perfscope.collectors.rendezvous import TIMEOUT_ENV, ExchangeIncomplete, Peer, StoreExchange, agree

pytest.importorskip("torch")
import torch
from collect_helpers import free_port, results_ok, run_ranks

STEPS = 5
#: the process group's own timeout: far beyond the test's deadline, so a hang fails the test
PG_TIMEOUT_S = 600
RDV_TIMEOUT_S = 3


def profile_worker(
    rank: int, world_size: int, store: str, absent: int | None, late: int | None = None
) -> dict[str, Any]:
    """Every rank but `absent` records STEPS steps (rank `late` opens profile after the others
    stopped waiting for it); then all meet in the job's own barrier."""
    import torch.distributed as dist

    import perfscope

    os.environ[TIMEOUT_ENV] = str(RDV_TIMEOUT_S)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
    out: dict[str, Any] = {"recorded": rank != absent}
    if rank == late:
        time.sleep(RDV_TIMEOUT_S + 2)
    if rank != absent:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with perfscope.profile(store, experiment="rdv", poll_hz=0, gpu_telemetry=False) as prof:
                for _ in prof.steps(range(STEPS)):
                    time.sleep(0.005)
        assert prof.placement is not None
        out.update(
            run_id=prof.run_id,
            exchanged=prof.placement.exchanged,
            offset_known=prof.placement.clock_offset_known,
            warnings=[str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)],
        )
    dist.barrier()  # the job goes on together: nobody was left behind in our exchange
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("absent", [2, 0])
def test_a_rank_that_never_opens_profile_does_not_hang_the_others(tmp_path: Path, absent: int) -> None:
    out = results_ok(run_ranks(profile_worker, 3, str(tmp_path), absent, timeout_s=240))
    assert not out[absent]["recorded"]
    present = [r for r in range(3) if r != absent]
    # the lowest rank heard gives the run id (rank 1 reads rank 0's, or ranks 1 and 2 take rank 1's)
    assert len({out[r]["run_id"] for r in present}) == 1
    # one host: a rank that heard rank 0 shares its clock; without rank 0 the offset is unknown
    offset = 0 if absent != 0 else None
    for r in present:
        assert not out[r]["exchanged"] and out[r]["offset_known"] == (offset is not None)
        (warning,) = out[r]["warnings"]  # exactly one, and it says who is missing
        assert f"rank(s) {absent} " in warning and "recording goes on" in warning
    with open_store(tmp_path) as store:
        per_rank = store.query(
            "SELECT rank, count(*) AS n, count(DISTINCT run_id) AS runs FROM steps GROUP BY ALL ORDER BY rank"
        ).to_pylist()
        assert per_rank == [{"rank": r, "n": STEPS, "runs": 1} for r in present]
        ranks = store.query("SELECT rank, clock_offset_ns FROM ranks ORDER BY rank").to_pylist()
        assert ranks == [{"rank": r, "clock_offset_ns": offset} for r in present]
        # one runs row, from the lowest rank heard, with the group's size
        (run,) = store.query("SELECT world_size FROM runs WHERE ended_ns IS NOT NULL").to_pylist()
        assert run["world_size"] == 3
        events = store.query("SELECT rank, kind FROM events ORDER BY rank").to_pylist()
        assert events == [{"rank": r, "kind": "rendezvous_incomplete"} for r in present]


def test_a_rank_that_opens_profile_late_joins_the_run_the_others_record(tmp_path: Path) -> None:
    out = results_ok(run_ranks(profile_worker, 3, str(tmp_path), None, 0, timeout_s=240))
    assert len({o["run_id"] for o in out.values()}) == 1  # rank 1's id: the lowest the others heard
    assert "opened perfscope.profile after the other ranks had stopped waiting" in out[0]["warnings"][0]
    assert all("rank(s) 0 " in out[r]["warnings"][0] for r in (1, 2))
    with open_store(tmp_path) as store:
        ranks = store.query("SELECT DISTINCT rank FROM steps ORDER BY rank").column("rank").to_pylist()
        runs = store.query("SELECT count(*) FROM runs WHERE ended_ns IS NOT NULL").column(0)[0].as_py()
    assert ranks == [0, 1, 2] and runs == 1  # one run, one runs row (rank 1's), every rank's steps


def test_ranks_that_all_open_profile_agree_without_a_warning(tmp_path: Path) -> None:
    out = results_ok(run_ranks(profile_worker, 3, str(tmp_path), None, timeout_s=240))
    assert len({o["run_id"] for o in out.values()}) == 1
    assert all(o["exchanged"] and o["offset_known"] and o["warnings"] == [] for o in out.values())
    with open_store(tmp_path) as store:
        ranks = store.query("SELECT rank, local_rank, clock_offset_ns FROM ranks ORDER BY rank").to_pylist()
        assert ranks == [{"rank": r, "local_rank": r, "clock_offset_ns": 0} for r in range(3)]
        assert store.query("SELECT count(*) FROM events").column(0)[0].as_py() == 0


# -- the exchange itself over a real TCPStore, ranks as threads ---------------------------------------
class _Group:
    """What StoreExchange asks of torch.distributed: the rank, the size and the backend."""

    def __init__(self, rank: int, world_size: int) -> None:
        self._rank, self._world = rank, world_size

    def get_backend(self) -> str:
        return "gloo"

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self._world


def _tcp_stores(n: int) -> list[Any]:
    port = free_port()
    master = torch.distributed.TCPStore(
        "127.0.0.1", port, n, True, timedelta(seconds=30), wait_for_workers=False
    )
    return [master] + [
        torch.distributed.TCPStore("127.0.0.1", port, n, False, timedelta(seconds=30)) for _ in range(n - 1)
    ]


def test_clock_offsets_across_hosts_over_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = ["a", "b", "b"]
    skew_ns = {"a": 0, "b": -7_000_000}  # host b's clock runs 7 ms behind host a's
    local = threading.local()
    real_time_ns = time.time_ns
    monkeypatch.setattr(rendezvous.time, "time_ns", lambda: real_time_ns() + skew_ns[local.host])
    stores = _tcp_stores(len(hosts))
    exchanges = [StoreExchange(_Group(r, 3), stores[r], timeout_s=30) for r in range(3)]
    # every rank of one profile() shares a key prefix (they count profiles alike)
    for ex in exchanges[1:]:
        ex.prefix = exchanges[0].prefix
    placements: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        local.host = hosts[rank]
        me = Peer(rank, hosts[rank], 100 + rank, 8, None, f"id-of-{rank}")
        placements[rank] = agree(exchanges[rank], me, rounds=5)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {p.run_id for p in placements.values()} == {"id-of-0"}
    assert [(placements[r].node_rank, placements[r].local_rank) for r in range(3)] == [(0, 0), (1, 0), (1, 1)]
    assert placements[0].clock_offset_ns == 0
    for r in (1, 2):
        assert placements[r].clock_offset_ns == pytest.approx(7_000_000, abs=2_000_000)
        assert placements[r].clock_offset_known and placements[r].exchanged


def _peer_json(**change: Any) -> bytes:
    peer = {"rank": 1, "hostname": "b", "pid": 2, "cpu_count": 1, "env_local_rank": None, "run_id": "r"}
    return json.dumps({**peer, **change}).encode()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x80not json{",
        b"[1, 2, 3]",
        _peer_json(rank=0),  # claims to be another rank
        _peer_json(pid="7"),
        _peer_json(run_id="../../etc"),  # a run id names a folder of the store
        _peer_json(run_id=".hidden"),
        _peer_json(extra=1),
    ],
)
def test_garbage_under_a_key_is_a_rank_not_heard(garbage: bytes) -> None:
    stores = _tcp_stores(2)
    ex0 = StoreExchange(_Group(0, 2), stores[0], timeout_s=0.5)
    # a hostile or broken writer puts something that is no peer where rank 1's answer goes
    stores[1].set(f"{ex0.prefix}1/1", garbage)
    with pytest.raises(ExchangeIncomplete) as caught:
        ex0.all_gather(Peer(0, "a", 1, 1, None, "run-a"))
    assert set(caught.value.present) == {0}
    faults = Faults(0)  # (the warning itself is shown once per process: see the real jobs above)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        placement = rendezvous._without_all(ex0, Peer(0, "a", 1, 1, None, "run-a"), caught.value, faults)
    assert (placement.run_id, placement.world_size, placement.exchanged) == ("run-a", 2, False)
    assert faults.kinds == ["rendezvous_incomplete"]


def test_a_store_whose_server_is_gone_ends_the_exchange() -> None:
    stores = _tcp_stores(2)
    ex1 = StoreExchange(_Group(1, 2), stores[1], timeout_s=30)
    del stores[0]  # the server (rank 0's process) is gone
    gc.collect()
    with pytest.raises(ExchangeIncomplete) as caught:
        ex1.all_gather(Peer(1, "b", 2, 1, None, "run-b"))
    assert caught.value.present == {} and "\n" not in caught.value.what


@pytest.mark.parametrize("raw", ["soon", "nan", "-1", "0", "inf", "1e9"])
def test_a_bad_timeout_setting_falls_back_to_the_default(raw: str) -> None:
    with warnings.catch_warnings():  # said once per process
        warnings.simplefilter("ignore", PerfscopeWarning)
        assert rendezvous.timeout_s({TIMEOUT_ENV: raw}) == rendezvous.DEFAULT_TIMEOUT_S
    assert rendezvous.timeout_s({TIMEOUT_ENV: " 2.5 "}) == 2.5 and rendezvous.timeout_s({}) == 10.0
