"""The one exchange between ranks at start: a shared run id, who runs on which host, each rank's
clock offset. Over torch.distributed's key-value store (no collective: a rank that never opens
profile() cannot hang the others; every wait has a deadline) or Horovod; never at close.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from perfscope.errors import warn_once

from . import identity as ids
from .clocks import align, timed_barriers
from .faults import Faults
from .identity import Identity

#: seconds the ranks wait for each other at start before recording on with what they know
TIMEOUT_ENV = "PERFSCOPE_RENDEZVOUS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
#: the exchange looks for the others' keys this often, backing off: thousands of ranks must not
#: flood the store's server (rank 0's process), and a blocking wait would log C++ noise on timeout
_FIRST_POLL_S, _MAX_POLL_S = 0.005, 0.2


def _safe_run_id(run_id: str) -> bool:
    """A run id names a folder of the store: only what identity.safe_run_id keeps, no leading dot."""
    return bool(run_id) and ids.safe_run_id(run_id) == run_id and not run_id.startswith(".")


@dataclass(frozen=True)
class Peer:
    """What each rank tells the others once."""

    rank: int
    hostname: str
    pid: int
    cpu_count: int
    env_local_rank: int | None
    run_id: str

    @classmethod
    def from_json(cls, raw: Any) -> Peer:
        """A Peer from its JSON form; ValueError for anything else (the store is not trusted)."""
        d = json.loads(raw)
        ok = isinstance(d, dict) and set(d) == {f for f in cls.__dataclass_fields__}
        ints = ("rank", "pid", "cpu_count")
        if not ok or not all(type(d[k]) is int for k in ints):
            raise ValueError("not a peer")
        if not (isinstance(d["hostname"], str) and isinstance(d["run_id"], str)):
            raise ValueError("not a peer")
        if not _safe_run_id(d["run_id"]):
            raise ValueError("not a run id")
        if d["env_local_rank"] is not None and type(d["env_local_rank"]) is not int:
            raise ValueError("not a peer")
        return cls(**d)


@dataclass(frozen=True)
class Placement:
    """What the ranks agreed on; for a process alone, what its environment says."""

    run_id: str
    rank: int
    world_size: int
    local_rank: int | None
    node_rank: int
    nodes: int
    ranks_per_node: int
    local_pids: tuple[int, ...]
    clock_offset_ns: int
    backend: str
    exchanged: bool
    #: False when the offset could not be measured (0 is then a guess, and the ranks row says NULL)
    clock_offset_known: bool = True
    #: the offset's error bound (see clocks.Alignment); None when not measured
    clock_error_ns: int | None = None
    #: this rank writes the run's `runs` row: rank 0, or the lowest rank heard when rank 0 was not
    writes_runs_row: bool = True


class ExchangeIncomplete(Exception):
    """Not every rank answered before the deadline; `present` holds what those that did said."""

    def __init__(self, present: dict[int, Any], what: str) -> None:
        super().__init__(f"{what}: heard from ranks {sorted(present)}")
        self.present = present
        self.what = what


class Exchange(Protocol):
    backend: str
    rank: int
    world_size: int

    def barrier(self) -> None: ...
    def all_gather(self, obj: Any) -> list[Any]: ...


def timeout_s(env: Mapping[str, str] | None = None) -> float:
    """PERFSCOPE_RENDEZVOUS_TIMEOUT_S, else the default; a value that is no positive number of
    seconds under a day is ignored with a warning."""
    raw = (os.environ if env is None else env).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if 0 < value < 86_400:
        return value
    warn_once(
        "rendezvous-timeout-env",
        f"perfscope: {TIMEOUT_ENV}={raw[:40]!r} is not a number of seconds between 0 and 86400; "
        f"using {DEFAULT_TIMEOUT_S:g}.",
    )
    return DEFAULT_TIMEOUT_S


_generation = 0


class StoreExchange:
    """torch.distributed without a collective: keys in the store the process group rendezvoused
    through (TCPStore, FileStore ...), under a prefix of their own per profile() of the process
    (every rank runs the same sequence of profiles). Values are JSON, read defensively."""

    def __init__(self, dist: Any, store: Any, *, timeout_s: float) -> None:
        global _generation
        _generation += 1
        self.store = store
        self.backend = str(dist.get_backend())
        self.rank = int(dist.get_rank())
        self.world_size = int(dist.get_world_size())
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
        self.prefix = f"perfscope/{restart}/{_generation}/"
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._round = 0
        if self.backend.startswith("cpu:") or "," in self.backend:
            # "cpu:gloo,cuda:nccl": the device that matters for gradients is the accelerator's
            parts = dict(p.split(":", 1) for p in self.backend.split(",") if ":" in p)
            self.backend = parts.get("cuda", parts.get("cpu", self.backend))

    def _next(self) -> str:
        self._round += 1
        return f"{self.prefix}{self._round}/"

    def barrier(self) -> None:
        key = self._next()
        if int(self.store.add(key + "n", 1)) >= self.world_size:
            self.store.set(key + "go", b"1")
        # the store wakes every waiter at once: as tight as a collective barrier
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            self.store.wait([key + "go"], timedelta(seconds=remaining))
        except Exception:
            raise ExchangeIncomplete({}, "a barrier") from None

    def all_gather(self, obj: Any) -> list[Any]:
        if self.store is None:
            raise ExchangeIncomplete({}, "torch.distributed offers no key-value store to meet in")
        try:
            return self._all_gather(obj)
        except ExchangeIncomplete:
            raise
        except Exception as exc:  # the store itself failed (its server gone, a torch of other ways)
            first_line = (str(exc).splitlines() or [""])[0]  # torch appends a C++ stack
            raise ExchangeIncomplete({}, f"the start exchange ({type(exc).__name__}: {first_line})") from None

    def _all_gather(self, obj: Any) -> list[Any]:
        what = f"the start exchange (waited {self.timeout_s:g} s)"
        key = self._next()
        peer = isinstance(obj, Peer)
        self.store.set(key + str(self.rank), json.dumps(asdict(obj) if peer else obj))
        keys = [key + str(r) for r in range(self.world_size)]
        pause = _FIRST_POLL_S
        while not self.store.check(keys):
            if time.monotonic() >= self.deadline:
                present = [r for r in range(self.world_size) if self.store.check([keys[r]])]
                raise ExchangeIncomplete(self._read(keys, present, peer), what)
            time.sleep(min(pause, max(0.0, self.deadline - time.monotonic())))
            pause = min(_MAX_POLL_S, pause * 1.5)
        got = self._read(keys, range(self.world_size), peer)
        if len(got) < self.world_size:
            raise ExchangeIncomplete(got, what)
        return [got[r] for r in range(self.world_size)]

    def decide(self, run_id: str, leader: int) -> None:
        """Ranks that stopped waiting say what they record as, for a rank that arrives later."""
        with contextlib.suppress(Exception):
            self.store.set(self.prefix + "decided", json.dumps([run_id, leader]))

    def decided(self) -> tuple[str, int] | None:
        """What ranks that stopped waiting recorded as (run id, the rank writing the runs row)."""
        key = self.prefix + "decided"
        try:
            if self.store is None or not self.store.check([key]):
                return None
            run_id, leader = json.loads(self.store.get(key))
        except Exception:
            return None
        if type(leader) is not int or not isinstance(run_id, str) or not _safe_run_id(run_id):
            return None
        return run_id, leader

    def _read(self, keys: list[str], ranks: Any, peer: bool) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for r in ranks:
            try:
                raw = self.store.get(keys[r])
                value: Any = Peer.from_json(raw) if peer else _ints(json.loads(raw))
            except Exception:  # garbage under our key: that rank is not heard
                continue
            if not peer or value.rank == r:
                out[r] = value
        return out


def _ints(value: Any) -> int | list[int]:
    """An int or a list of ints (clock readings) from the store; ValueError for anything else."""
    if isinstance(value, list) and len(value) <= 64 and all(type(x) is int for x in value):
        return value
    if type(value) is int:
        return value
    raise ValueError("not clock readings")


class HorovodExchange:
    """Horovod (module horovod.torch), through its object collectives."""

    def __init__(self, hvd: Any, *, on_gpu: bool = False) -> None:
        self.hvd = hvd
        self.rank = int(hvd.rank())
        self.world_size = int(hvd.size())
        self.backend = horovod_backend(hvd, on_gpu=on_gpu)

    def barrier(self) -> None:
        barrier = getattr(self.hvd, "barrier", None)
        if barrier is not None:
            barrier()
        else:  # older Horovod: any collective is a barrier
            self.hvd.allgather_object(None)

    def all_gather(self, obj: Any) -> list[Any]:
        return list(self.hvd.allgather_object(obj))


def horovod_backend(hvd: Any, *, on_gpu: bool) -> str:
    """horovod-nccl, horovod-mpi or horovod-gloo: the library moving the gradients."""

    def flag(name: str) -> bool:
        fn = getattr(hvd, name, None)
        try:
            return bool(fn()) if fn is not None else False
        except Exception:
            return False

    if on_gpu and flag("nccl_built"):
        return "horovod-nccl"
    if flag("mpi_enabled"):
        return "horovod-mpi"
    if flag("gloo_enabled"):
        return "horovod-gloo"
    return "horovod"


def _default_store(dist: Any) -> Any:
    """The key-value store of the default process group; None where this torch has none to give."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def find_exchange(*, on_gpu: bool = False) -> Exchange | None:
    """The collective layer the job has already initialised. Nothing is imported: a job that has
    not imported torch.distributed or horovod.torch has no group to talk over."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return StoreExchange(dist, _default_store(dist), timeout_s=timeout_s())
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None:
        try:
            initialised = bool(hvd.is_initialized())
        except Exception:
            initialised = False
        if initialised:
            return HorovodExchange(hvd, on_gpu=on_gpu)
    return None


def agree(exchange: Exchange, me: Peer, *, rounds: int = 4) -> Placement:
    """Gather every rank's Peer, take rank 0's run id, place ranks on hosts, estimate clock offsets.
    Raises ExchangeIncomplete when a rank does not answer in time.

    Clock offset (clocks.timed_barriers, clocks.align): every rank reads its wall clock just before
    and just after each of `rounds` back-to-back barriers, and the readings are gathered once. One
    instant lies inside every rank's window of a round, so each host's offset to rank 0's host lies
    in an interval; its midpoint is the offset and its half-width the error bound (about half the
    barrier's round trip), both the same for every rank of a host. Ranks on rank 0's host share its
    clock: offset and error exactly 0."""
    peers: list[Peer] = exchange.all_gather(me)
    host_of = {p.rank: p.hostname for p in peers}
    offset, error = 0, 0
    # every rank sees the same host list, so all skip the rounds together on a single host
    if len(set(host_of.values())) > 1:
        try:
            marks = exchange.all_gather(timed_barriers(exchange.barrier, rounds))
        except ExchangeIncomplete:
            raise ExchangeIncomplete({p.rank: p for p in peers}, "the clock exchange") from None
        if me.hostname != host_of[0]:
            on = [r for r, h in sorted(host_of.items()) if h == me.hostname]
            ref = [r for r, h in sorted(host_of.items()) if h == host_of[0]]
            found = align(marks, ref, on)
            if found is None:  # unusable readings: the offset is not known
                return _placement(exchange, me, peers, clock_offset_ns=None, exchanged=True)
            offset, error = found.offset_ns, found.error_ns
    return _placement(exchange, me, peers, clock_offset_ns=offset, exchanged=True, clock_error_ns=error)


def _placement(
    exchange: Exchange,
    me: Peer,
    peers: list[Peer],
    *,
    clock_offset_ns: int | None,
    exchanged: bool,
    clock_error_ns: int | None = None,
) -> Placement:
    """Hosts in order of their lowest rank; the run id of the lowest rank heard from.
    `clock_offset_ns` None: not measured (0, marked unknown, and no error)."""
    ordered = sorted(peers, key=lambda p: p.rank)
    hosts = list(dict.fromkeys(p.hostname for p in ordered))
    on_host = [p for p in ordered if p.hostname == me.hostname]
    local_rank = me.env_local_rank
    if local_rank is None:
        local_rank = [p.rank for p in on_host].index(me.rank)
    return Placement(
        run_id=ordered[0].run_id,
        rank=exchange.rank,
        world_size=exchange.world_size,
        local_rank=local_rank,
        node_rank=hosts.index(me.hostname),
        nodes=len(hosts),
        ranks_per_node=max(sum(1 for p in ordered if p.hostname == h) for h in hosts),
        local_pids=tuple(p.pid for p in on_host),
        clock_offset_ns=clock_offset_ns or 0,
        backend=exchange.backend,
        exchanged=exchanged,
        clock_offset_known=clock_offset_ns is not None,
        clock_error_ns=clock_error_ns if clock_offset_ns is not None else None,
        writes_runs_row=ordered[0].rank == me.rank,
    )


def _without_all(exchange: Exchange, me: Peer, exc: ExchangeIncomplete, faults: Faults) -> Placement:
    """The exchange gave up: record on with the ranks that answered, with one warning."""
    heard = {r: p for r, p in exc.present.items() if isinstance(p, Peer)}
    heard[me.rank] = me
    peers = list(heard.values())
    rank0 = heard.get(0)
    # one clock per host: a rank on rank 0's host knows its offset (0) without measuring it
    offset = 0 if rank0 is not None and rank0.hostname == me.hostname else None
    placement = _placement(exchange, me, peers, clock_offset_ns=offset, exchanged=False, clock_error_ns=0)
    missing = [r for r in range(exchange.world_size) if r not in heard]
    shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    why = f"no answer from rank(s) {shown} (they never opened perfscope.profile, or started late)"
    faults.report(
        "rendezvous_incomplete",
        f"perfscope: rank {exchange.rank}, {exc.what}: "
        + (why if missing else "a rank stopped answering")
        + f"; recording goes on as run {placement.run_id} with "
        f"{len(heard)} of {exchange.world_size} ranks known"
        + ("" if offset is not None else ", clock offset unknown (0 assumed, NULL in the ranks table)")
        + f". Set {TIMEOUT_ENV} to wait longer.",
    )
    if isinstance(exchange, StoreExchange):
        exchange.decide(placement.run_id, min(heard))
    return placement


def _late(exchange: Exchange, placement: Placement, faults: Faults) -> Placement:
    """A rank that met everyone's keys after some had stopped waiting joins the run they record."""
    decided = exchange.decided() if isinstance(exchange, StoreExchange) else None
    if decided is None:
        return placement
    run_id, leader = decided
    faults.report(
        "rendezvous_late",
        f"perfscope: rank {exchange.rank} opened perfscope.profile after the other ranks had stopped "
        f"waiting for it; it records into their run {run_id}.",
    )
    return replace(placement, run_id=run_id, writes_runs_row=leader == exchange.rank)


def alone(identity: Identity, run_id: str) -> Placement:
    """No group to talk over: the environment's word, no clock offset."""
    return Placement(
        run_id=run_id,
        rank=identity.rank,
        world_size=identity.world_size,
        local_rank=identity.local_rank,
        node_rank=identity.node_rank or 0,
        nodes=identity.nodes or 1,
        ranks_per_node=identity.local_world_size or 1,
        local_pids=(identity.pid,),
        clock_offset_ns=0,
        backend="none",
        exchanged=False,
        # the process is its own reference when alone or rank 0; another rank's 0 is a guess
        clock_error_ns=0 if identity.rank == 0 or identity.world_size <= 1 else None,
        writes_runs_row=identity.rank == 0,
    )


def place(
    me: Identity,
    requested_run_id: str | None,
    faults: Faults,
    *,
    on_gpu: bool = False,
    store: str | os.PathLike[str] | None = None,
) -> Placement:
    """This rank's placement and the run id shared by all ranks, in this order of preference:
    `run_id=` or PERFSCOPE_RUN_ID; else rank 0's generated id over the process group (or Horovod);
    else an id derived from the launcher (torchelastic, SLURM); else a generated one. An id from the
    environment is reused by every profile() of a process, so later runs get '-2', '-3' ...; an id
    that another run already has in `store` gets the next free suffix, with a warning."""
    proposed = requested_run_id or ids.explicit_run_id()
    if proposed is not None:
        proposed = ids.claim_run_id(ids.safe_run_id(proposed))
    exchange = find_exchange(on_gpu=on_gpu)
    if exchange is not None:
        faults.rank = exchange.rank  # mp.spawn sets no environment: the group knows the rank
        if proposed is not None:
            proposed = _not_taken(store, proposed, exchange.rank, exchange.world_size, faults)
        local_rank = me.local_rank if me.launcher != "single" else None  # mp.spawn: the exchange decides
        peer = Peer(exchange.rank, me.hostname, me.pid, os.cpu_count() or 1, local_rank,
                    proposed or ids.generate_run_id())  # fmt: skip
        try:
            return _late(exchange, agree(exchange, peer), faults)
        except ExchangeIncomplete as exc:
            return _without_all(exchange, peer, exc, faults)
    launcher = ids.launcher_run_id()
    if proposed is None and launcher is not None:
        proposed = ids.claim_run_id(ids.safe_run_id(launcher))
    if proposed is None:
        proposed = ids.generate_run_id()
        if me.world_size > 1:
            faults.report(
                "run_id_not_shared",
                f"perfscope: rank {me.rank} of {me.world_size} cannot agree on a run id with the others "
                "(no process group yet, no launcher id); each rank records its own run. Initialise "
                "torch.distributed before perfscope.profile(), or set PERFSCOPE_RUN_ID.",
            )
    else:
        proposed = _not_taken(store, proposed, me.rank, me.world_size, faults)
    return alone(me, proposed)


def _not_taken(
    store: str | os.PathLike[str] | None, run_id: str, rank: int, world_size: int, faults: Faults
) -> str:
    """`run_id`, or the first '<id>-N' that no other run holds in the store (see identity.run_id_taken)."""
    if store is None:
        return run_id
    free = ids.distinct_run_id(Path(store), run_id, rank=rank, world_size=world_size)
    if free != run_id:
        faults.report(
            "run_id_taken",
            f"perfscope: the store {store} already holds a run '{run_id}' (other ranks, another world "
            f"size or an earlier start); this run is recorded as '{free}' so that the two do not merge. "
            "Give each run its own run_id= or PERFSCOPE_RUN_ID.",
        )
    return free
