"""Importers: existing traces (Kineto, Nsight Systems, Horovod, nccl-tests) into a store, as the
same records the collector writes. One module per format; this registry names them.

Each module has `import_files(paths, opts) -> ImportResult` (see common.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path

from .common import ImportOptions, ImportResult

ImportFn = Callable[[Sequence[Path], ImportOptions], ImportResult]

#: format -> (module under perfscope.importers, one-line help). A format is listed once it works.
IMPORTERS: dict[str, tuple[str, str]] = {
    "kineto": ("kineto", "torch.profiler (Kineto) JSON traces, one file per rank, plain or .gz"),
    "nsys": ("nsys", "an Nsight Systems SQLite export (nsys export --type sqlite), one per rank"),
    "horovod": ("horovod", "a Horovod timeline (HOROVOD_TIMELINE), open-ended or cut files included"),
    "nccl-tests": (
        "nccl_tests",
        "nccl-tests output (all_reduce_perf ...): a cluster's reference bus bandwidth",
    ),
    "op-table": (
        "op_table",
        "a 3D-parallel job's op table (the straggler study's columns, Parquet or CSV); --meta or --dp/--pp",
    ),
}


def importer(name: str) -> ImportFn:
    """The import function of format `name`."""
    try:
        module, _ = IMPORTERS[name]
    except KeyError:
        raise KeyError(f"unknown trace format {name!r}; formats are {', '.join(IMPORTERS)}") from None
    fn: ImportFn = importlib.import_module(f"{__name__}.{module}").import_files
    return fn


__all__ = ["IMPORTERS", "ImportFn", "ImportOptions", "ImportResult", "importer"]
