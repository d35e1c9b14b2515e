"""The job's own settings that decide its speed, recorded in `runs` (schema.py): the model's parameter
dtypes, autocast, whether it is compiled, DDP's bucketing knobs, and the NCCL/OpenMP/MKL variables of
the environment. Every reader here only looks at attributes and the environment: nothing runs the
job's code, and a failure leaves the setting NULL."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

#: environment variables recorded by name prefix or name (values as given, cut, never interpreted)
ENV_PREFIXES = ("NCCL_",)
ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: at most this many variables, each value cut at this many characters: a bounded row
ENV_MAX_VARS = 32
ENV_MAX_CHARS = 64

#: the runs columns this module fills, in schema order (settings_columns)
MODEL_COLUMNS = (
    "param_dtypes",
    "compiled",
    "ddp_bucket_cap_mb",
    "ddp_gradient_as_bucket_view",
    "ddp_find_unused_parameters",
    "ddp_static_graph",
)


def env_settings(env: Mapping[str, str] | None = None) -> str | None:
    """NCCL_* and OMP_NUM_THREADS/MKL_NUM_THREADS as one JSON object (sorted by name, ENV_MAX_VARS
    variables of ENV_MAX_CHARS characters at most); None when none is set."""
    env = os.environ if env is None else env
    names = sorted(k for k in env if k in ENV_NAMES or k.startswith(ENV_PREFIXES))
    if not names:
        return None
    return json.dumps(
        {k[:ENV_MAX_CHARS]: env[k][:ENV_MAX_CHARS] for k in names[:ENV_MAX_VARS]}, sort_keys=True
    )


def _flag(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def unwrap_compiled(model: Any) -> tuple[Any, bool]:
    """(the module inside torch.compile's OptimizedModule, whether there was one)."""
    modules = getattr(model, "__dict__", {}).get("_modules")  # no property of the user's runs
    inner = modules.get("_orig_mod") if isinstance(modules, dict) else None
    return (inner, True) if inner is not None else (model, False)


def is_ddp(model: Any) -> bool:
    """A DistributedDataParallel model (torch.nn.parallel imported by the job, never by us)."""
    ddp_class = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    return ddp_class is not None and isinstance(model, ddp_class)


def model_settings(model: Any) -> dict[str, Any]:
    """The MODEL_COLUMNS of a model as given to prof.watch (or found by the DDP finder): DDP wrapped in
    torch.compile and torch.compile inside DDP are both seen through. DDP columns are None without DDP."""
    outer, compiled = unwrap_compiled(model)
    ddp_model = outer if is_ddp(outer) else None
    inner = ddp_model.module if ddp_model is not None else outer
    inner, compiled_inside = unwrap_compiled(inner)
    out: dict[str, Any] = dict.fromkeys(MODEL_COLUMNS)
    out["compiled"] = compiled or compiled_inside
    counts: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + p.numel()
    if counts:  # the dtype holding most parameters first
        out["param_dtypes"] = ",".join(sorted(counts, key=lambda k: (-counts[k], k)))
    if ddp_model is not None:
        get = ddp_model.__dict__.get  # attributes DDP sets in __init__ (and _set_static_graph)
        cap = get("bucket_bytes_cap")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
            out["ddp_bucket_cap_mb"] = cap / 2**20
        out["ddp_gradient_as_bucket_view"] = _flag(get("gradient_as_bucket_view"))
        out["ddp_find_unused_parameters"] = _flag(get("find_unused_parameters"))
        out["ddp_static_graph"] = _flag(get("static_graph"))
    return out


def autocast_now() -> str | None:
    """The autocast regions active where this is called (inside a module's forward): 'cuda:bfloat16',
    'cpu:bfloat16,cuda:float16' ..., '' when none is; None without torch or when torch cannot say."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    active = []
    try:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                active.append(f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}")
    except Exception:  # an older torch without the device argument
        return None
    return ",".join(active)
