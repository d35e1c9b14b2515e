"""Who this process is in its job, read from the environment: torchrun, SLURM, MPI, Horovod or nothing.

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
    return cleaned or generate_run_id()
