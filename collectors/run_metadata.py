"""The `runs` and `ranks` rows: what the job, its keywords to perfscope.profile() and the software
found say about a run. Any column of `runs` can be given by keyword; any other keyword becomes a tag."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from perfscope.store.schema import RUNS

from .settings import MODEL_COLUMNS, env_settings

if TYPE_CHECKING:
    from .ddp import ModelFacts
    from .rendezvous import Placement

#: columns measured at the start or end, never given by keyword
_MEASURED_ONLY = frozenset({"started_ns", "ended_ns"})
#: the job's settings (collectors/settings.py): read from the model and environment; a keyword of
#: the same name is a tag
READ_SETTINGS = frozenset({*MODEL_COLUMNS, "autocast", "env"})
SETTABLE = frozenset(RUNS.column_names) - _MEASURED_ONLY - READ_SETTINGS
_SCALING_MODES = ("strong", "weak", "")


def split_keywords(metadata: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(runs columns given by keyword, validated) and (the rest, which become tags)."""
    columns: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    types = {c.name: c.type for c in RUNS.columns}
    for key, value in metadata.items():
        if key not in SETTABLE:
            if key in _MEASURED_ONLY:
                raise ValueError(f"perfscope.profile: {key} is measured by perfscope and cannot be given")
            extra[key] = value
            continue
        if value is None:
            columns[key] = None
            continue
        typ = types[key]
        if key == "tags":
            columns[key] = value
        elif pa.types.is_integer(typ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"perfscope.profile: {key} must be an int, got {value!r}")
            columns[key] = value
        elif pa.types.is_floating(typ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"perfscope.profile: {key} must be a number, got {value!r}")
            columns[key] = float(value)
        else:
            columns[key] = str(value)
    mode = str(columns.get("scaling_mode") or "").lower()
    if mode not in _SCALING_MODES:
        raise ValueError(f"perfscope.profile: scaling_mode must be 'strong', 'weak' or '', got {mode!r}")
    if "scaling_mode" in columns:
        columns["scaling_mode"] = mode
    return columns, extra


def tags_json(tags: Any, extra: dict[str, Any]) -> str:
    """User tags plus unknown keywords as one JSON object (values that JSON cannot hold as strings)."""
    merged: dict[str, Any] = {}
    if isinstance(tags, str):
        try:
            loaded = json.loads(tags)
        except ValueError:
            loaded = {"tags": tags}
        merged.update(loaded if isinstance(loaded, dict) else {"tags": loaded})
    elif isinstance(tags, dict):
        merged.update(tags)
    elif isinstance(tags, (list, tuple, set)):
        merged.update({str(t): True for t in tags})
    merged.update(extra)
    return json.dumps(merged, default=str, sort_keys=True)


def software() -> dict[str, str]:
    """Versions of what records and trains. torch is consulted only when the job imported it."""
    out = {
        "python_version": platform.python_version(),
        "torch_version": "",
        "cuda_version": "",
        "nccl_version": "",
    }
    from perfscope.version import __version__

    out["perfscope_version"] = __version__
    torch = sys.modules.get("torch")
    if torch is None:
        return out
    out["torch_version"] = str(getattr(torch, "__version__", ""))
    try:
        if torch.cuda.is_available():
            out["cuda_version"] = str(torch.version.cuda or "")
            nccl = torch.cuda.nccl.version()
            out["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    return out


def cuda_device_name(index: int | None) -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or index is None:
        return None
    try:
        return str(torch.cuda.get_device_name(index))
    except Exception:
        return None


def cluster_from_env() -> str:
    """PERFSCOPE_CLUSTER, else SLURM's cluster/partition, else ''."""
    env = os.environ
    if env.get("PERFSCOPE_CLUSTER"):
        return env["PERFSCOPE_CLUSTER"]
    cluster, partition = env.get("SLURM_CLUSTER_NAME", ""), env.get("SLURM_JOB_PARTITION", "")
    return "/".join(x for x in (cluster, partition) if x)


def runs_row(
    p: Placement,
    columns: dict[str, Any],
    facts: ModelFacts | None,
    *,
    started_ns: int,
    ended_ns: int | None,
    hostname: str,
    device_model: str,
    driver_version: str,
    tags: str,
    autocast: str | None = None,
) -> tuple[Any, ...]:
    """What was measured, overridden by what was given by keyword (`columns`). `autocast`: as seen in
    the model's first forward (settings.autocast_now), None when not seen."""
    batch = columns.get("batch_size_per_rank")
    fields: dict[str, Any] = {
        "source": "measured",
        "started_ns": started_ns,
        "world_size": p.world_size,
        "nodes": p.nodes,
        "gpus_per_node": p.ranks_per_node,
        "backend": p.backend,
        "device_model": device_model,
        "cluster": cluster_from_env(),
        "model": facts.name if facts is not None else "",
        "global_batch_size": batch * p.world_size if batch is not None else None,
        "param_count": facts.param_count if facts is not None else None,
        "grad_bytes": facts.grad_bytes if facts is not None else None,
        "scaling_mode": "",
        "hostname": hostname,
        "driver_version": driver_version,
        "tags": tags,
        "ended_ns": ended_ns,
        **software(),
        **(facts.settings if facts is not None else {}),
        "autocast": autocast,
        "env": env_settings(),
    }
    fields.update({k: v for k, v in columns.items() if v is not None or k not in fields})
    return tuple(fields.get(c) for c in RUNS.column_names)


def ranks_row(
    p: Placement,
    hostname: str,
    device_index: int | None,
    device_name: str,
    started_ns: int,
    role: str | None,
    coords: tuple[int, int, int, int] | None = None,
    loader: tuple[Any, ...] | None = None,
) -> tuple[Any, ...]:
    """`coords`: the rank's (dp_rank, pp_stage, tp_rank, cp_rank) (collectors/layout.py); None: NULL.
    `loader`: `loader_facts` of the loop's DataLoader; None: NULL."""
    offset = p.clock_offset_ns if p.clock_offset_known else None  # NULL: not measured
    error = p.clock_error_ns if p.clock_offset_known else None
    return (p.rank, p.local_rank, p.node_rank, hostname, os.getpid(), offset,
            os.cpu_count() or 1, device_index, device_name, started_ns, role, *thread_facts(),
            *(coords or (None, None, None, None)), error, *(loader or (None,) * 5))  # fmt: skip


def loader_facts(loader: Any) -> tuple[Any, ...] | None:
    """A torch DataLoader's (num_workers, prefetch_factor, pin_memory, persistent_workers, batch_size),
    the settings that decide how fast it feeds the rank; None for any other iterable. A value that is
    not what a DataLoader holds is NULL."""
    cls = type(loader)
    if not any(c.__name__ == "DataLoader" and c.__module__.startswith("torch.") for c in cls.__mro__):
        return None

    def whole(v: Any) -> int | None:
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 else None

    def flag(v: Any) -> bool | None:
        return v if isinstance(v, bool) else None

    get = loader.__dict__.get  # never a property that could run user code
    workers = whole(get("num_workers"))
    return (workers, whole(get("prefetch_factor")) if workers else None, flag(get("pin_memory")),
            flag(get("persistent_workers")), whole(get("batch_size")))  # fmt: skip


#: An environment value longer than this is cut: it is recorded as given, not trusted.
_ENV_CHARS = 64


def thread_facts(
    env: Mapping[str, str] | None = None,
) -> tuple[int | None, str | None, str | None, int | None]:
    """The rank's torch intra-op threads (NULL when torch is not imported), OMP_NUM_THREADS and
    MKL_NUM_THREADS as set (NULL when unset) and the logical CPUs its affinity allows (NULL where
    the OS does not say): the facts that make runs of different world sizes comparable."""
    env = os.environ if env is None else env
    torch = sys.modules.get("torch")
    try:
        threads = int(torch.get_num_threads()) if torch is not None else None
    except Exception:  # a half-imported or odd torch: the fact is unknown, the job goes on
        threads = None
    try:
        cores: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        cores = None
    omp, mkl = (env.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    return threads, omp and omp[:_ENV_CHARS], mkl and mkl[:_ENV_CHARS], cores
