"""The job's settings (the run_settings analysis) in words: the report's Settings section and the
dashboard Run page's Settings table say them the same way."""

from __future__ import annotations

import json
from typing import Any

from .context import Context
from .model import Section, table_block, table_columns

_LOADER = (
    ("loader_workers", "num_workers"),
    ("loader_prefetch_factor", "prefetch_factor"),
    ("loader_pin_memory", "pin_memory"),
    ("loader_persistent_workers", "persistent_workers"),
    ("loader_batch_size", "batch_size"),
)
_DDP = (
    ("ddp_bucket_cap_mb", "bucket_cap_mb"),
    ("ddp_gradient_as_bucket_view", "gradient_as_bucket_view"),
    ("ddp_find_unused_parameters", "find_unused_parameters"),
    ("ddp_static_graph", "static_graph"),
)


def _said(row: dict[str, Any], pairs: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(
        f"{name}={row[key]:g}" if isinstance(row[key], float) else f"{name}={row[key]}"
        for key, name in pairs
        if row.get(key) is not None
    )


def _env(text: Any) -> str:
    try:
        env = json.loads(text) if text else {}
    except ValueError:
        return str(text)
    return ", ".join(f"{k}={v}" for k, v in env.items()) if isinstance(env, dict) else str(text)


def setting_pairs(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(setting, value in words) of one run_settings row; settings not recorded are left out."""
    out: list[tuple[str, str]] = []
    if row.get("cpu_count") is not None:
        out.append(("host CPUs", str(row["cpu_count"])))
    threads = ", ".join(
        x
        for x in (
            f"torch {row['torch_threads']}" if row.get("torch_threads") is not None else "",
            f"OMP_NUM_THREADS={row['omp_num_threads']}" if row.get("omp_num_threads") is not None else "",
            f"MKL_NUM_THREADS={row['mkl_num_threads']}" if row.get("mkl_num_threads") is not None else "",
        )
        if x
    )
    said = {
        "threads per rank": threads,
        "DataLoader": _said(row, _LOADER),
        "parameter dtypes": row.get("param_dtypes") or "",
        "autocast": ("off" if row["autocast"] == "" else row["autocast"])
        if row.get("autocast") is not None
        else "",
        "torch.compile": ("yes" if row["compiled"] else "no") if row.get("compiled") is not None else "",
        "DDP": _said(row, _DDP),
        "environment": _env(row.get("env")),
    }
    out += [(k, v) for k, v in said.items() if v]
    return out


def settings(ctx: Context) -> Section | None:
    """One line per run with its recorded settings; no section when no run recorded any."""
    rows_ = []
    for r in ctx.rows("run_settings"):
        pairs = dict(setting_pairs(r))
        if pairs:
            rows_.append({"run_id": r["run_id"], **pairs})
    if not rows_:
        return None
    s = Section("settings", "Settings", definitions=("settings",))
    s.blocks.append(
        [
            "The job's own settings as recorded: the host's logical CPUs, the threads and DataLoader of "
            "rank 0, the model's parameter dtypes, autocast in its first forward, torch.compile, DDP's "
            "knobs and the NCCL/OpenMP/MKL variables. Findings name them where they matter."
        ]
    )
    names = list(dict.fromkeys(k for r in rows_ for k in r if k != "run_id"))
    s.blocks.append(
        table_block(
            "run_settings",
            "Settings per run",
            table_columns(("run_id", "run"), *((n, n) for n in names)),
            rows_,
        )
    )
    return s
