"""Who this process is in its job, read from the environment: torchrun, SLURM, MPI, Horovod or nothing;
and run ids: from the environment, generated, or made distinct from a run the store already holds.

The process group, when one is initialised, has the final word on rank and world size (mp.spawn
sets no environment at all); see rendezvous.py for what the ranks agree on together.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (launcher, rank, world size, local rank, local world size, node rank), most specific launcher first:
# torchrun inside a SLURM allocation sets both, and RANK is the training rank there.
_LAUNCHERS: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
     "HOROVOD_CROSS_RANK"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
    ("mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ""),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "", "SLURM_NODEID"),
)  # fmt: skip


@dataclass(frozen=True)
class Identity:
    """This process's place in the job as far as the environment says; None where it does not."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    node_rank: int | None
    nodes: int | None
    hostname: str
    pid: int


def _int(env: Mapping[str, str], name: str) -> int | None:
    if not name:
        return None
    value = env.get(name, "").strip()
    try:
        return int(value)
    except ValueError:
        return None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": the count on this node is what matters here.
    raw = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    first = raw.split(",")[0].split("(")[0]
    return int(first) if first.isdigit() else None


def from_environment(env: Mapping[str, str] | None = None) -> Identity:
    env = os.environ if env is None else env
    hostname = socket.gethostname()
    for launcher, rk, ws, lr, lws, nr in _LAUNCHERS:
        rank, world = _int(env, rk), _int(env, ws)
        if rank is None or world is None:
            continue
        local_world = _int(env, lws) if launcher != "slurm" else _slurm_tasks_per_node(env)
        nodes = None
        if launcher == "slurm":
            nodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
        elif launcher == "horovod":
            nodes = _int(env, "HOROVOD_CROSS_SIZE")
        if nodes is None and local_world:
            nodes = -(-world // local_world)
        return Identity(
            launcher, rank, world, _int(env, lr), local_world, _int(env, nr), nodes, hostname, os.getpid()
        )
    return Identity("single", 0, 1, 0, 1, 0, 1, hostname, os.getpid())


def generate_run_id() -> str:
    """Sortable by start time, unique without coordination: '20260102T030405Z-1a2b3c4d'."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def explicit_run_id(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get("PERFSCOPE_RUN_ID", "").strip() or None


def launcher_run_id(env: Mapping[str, str] | None = None) -> str | None:
    """An id every rank of the job can derive alone: torchelastic's run id (plus its restart count)
    or the SLURM job and step. Used only when the ranks cannot talk yet."""
    env = os.environ if env is None else env
    elastic = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic.lower() != "none":
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
        return f"torchelastic-{elastic}" + (f"-r{restart}" if restart not in ("", "0") else "")
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        step = env.get("SLURM_STEP_ID", "").strip()
        return f"slurm-{job}" + (f".{step}" if step else "")
    return None


_uses: dict[str, int] = {}


def claim_run_id(run_id: str) -> str:
    """The id itself the first time this process records a run under it, then '<id>-2', '<id>-3'
    ... Every rank runs the same sequence of profiles, so an id taken from the environment stays
    shared by the ranks while two runs of one process never merge."""
    n = _uses[run_id] = _uses.get(run_id, 0) + 1
    return run_id if n == 1 else f"{run_id}-{n}"


def safe_run_id(run_id: str) -> str:
    """Run ids become folder names (run_id=<id>): keep letters, digits and -_."""
    cleaned = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in run_id.strip())
    if cleaned.lower() == "null":  # DuckDB reads a folder run_id=NULL as no run id
        cleaned += "-run"
    return cleaned or generate_run_id()


#: ranks of one run open profile() within this of each other; rows older than that are another run's
SAME_RUN_WINDOW_NS = 120 * 10**9


def _partition_rows(folder: Path, columns: list[str]) -> list[dict[str, Any]]:
    """The rows of every segment in one partition folder (regular files only, never a link);
    raises OSError or an Arrow error for a file that cannot be read."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    with os.scandir(folder) as it:
        entries = [e for e in it if not e.name.startswith(".") and e.name.endswith(".parquet")]
    for e in entries:
        if not e.is_file(follow_symlinks=False):
            raise OSError(f"{e.path} is not a regular file")
        rows += pq.read_table(e.path, columns=columns).to_pylist()
    return rows


def run_id_taken(root: Path, run_id: str, *, rank: int, world_size: int, now_ns: int | None = None) -> bool:
    """Whether another run already holds `run_id` in the store at `root`. The same run's other
    ranks may have started writing (ranks that could not meet at start check alone), so rows under
    the id are ours only when none is this rank's, the world size matches, and every start lies
    within SAME_RUN_WINDOW_NS of now. Anything unreadable counts as taken: two runs merged
    silently are worse than one run split with a warning."""
    from perfscope.store.schema import PARTITION_KEY, TABLES

    parts = [root / t / f"{PARTITION_KEY}={run_id}" for t in TABLES]
    if not any(os.path.lexists(p) for p in parts):
        return False
    now_ns = time.time_ns() if now_ns is None else now_ns
    try:
        ranks = _partition_rows(parts[list(TABLES).index("ranks")], ["rank", "started_ns"])
        runs = _partition_rows(parts[list(TABLES).index("runs")], ["world_size", "started_ns"])
    except Exception:  # a missing folder, a foreign or broken file
        return True
    starts = [r["started_ns"] for r in ranks + runs]
    return (
        not ranks
        or any(r["rank"] == rank for r in ranks)
        or any(r["world_size"] != world_size for r in runs)
        or any(s is None or abs(now_ns - s) > SAME_RUN_WINDOW_NS for s in starts)
    )


def distinct_run_id(root: Path, run_id: str, *, rank: int, world_size: int) -> str:
    """`run_id` if no other run holds it in the store, else the first free '<id>-2', '<id>-3' ...
    (every rank of a run walks the same sequence, so they land on the same id)."""
    for n in range(1, 1000):
        candidate = run_id if n == 1 else f"{run_id}-{n}"
        if not run_id_taken(root, candidate, rank=rank, world_size=world_size):
            return candidate
    return f"{run_id}-{secrets.token_hex(4)}"
