"""What every importer shares: the options of `perfscope import`, the run id, and `RunImport`, which
writes an imported run as the same `runs`, `ranks`, `steps`, `spans` and `comm` rows the collector
writes (source = 'measured', the trace format in `runs.origin`).

An import either completes or leaves nothing behind: a failure removes the run's partitions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PerfscopeError, one_line
from ..output import store_target
from ..rollups import ROLLUP_DIR
from ..schema import PARTITION_KEY, TABLES
from ..store import partition_value_problem
from ..writer import StoreWriter, segment_dir

#: canonical phases of a steps row, in column order (after rank, step, start_ns, step_ns)
PHASES = ("data", "forward", "backward", "sync", "optimizer")

# What a file may claim, checked where it is read (a number beyond these is a damaged or forged
# file, and would otherwise overflow a column or multiply into millions of rows):
#: ranks of one job: the largest training jobs run on about 10^5 GPUs
MAX_RANKS = 1 << 18
#: a wall-clock time in ns (2100-01-01), and a trace's own µs from its origin or the epoch: any
#: sum of the two stays inside int64
MAX_EPOCH_NS = 4_102_444_800 * 10**9
MAX_TRACE_US = 4.2e15
#: digits of a step number, tick or count a file may spell (Python refuses int() past 4300)
MAX_DIGITS = 18
#: rows of one table one import may write: a step row per rank and step, a comm row per rank and
#: collective. Most formats write a row per event of the file, but a Horovod timeline writes one per
#: rank for each collective rank 0 saw; 2^31 rows is hours of writing and tens of GB, past any trace
MAX_ROWS = 1 << 31


def ranks_in_range(n: int, what: str) -> int:
    """`n` (a world size or rank count a file or flag claims), or a one-line error."""
    if n < 1:
        raise PerfscopeError(f"{what} is {shown(n)}: a job has at least one rank")
    if n > MAX_RANKS:
        raise PerfscopeError(f"{what} is {shown(n)}: no job has more than {MAX_RANKS:,} ranks")
    return n


def shown(value: object, limit: int = 40) -> str:
    """A value from a file as it may appear in a one-line message: escaped, at most `limit` chars."""
    text = one_line(str(value))
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text):,} chars)"


@dataclass(frozen=True)
class ImportOptions:
    """What the user said on the command line (or to the library call)."""

    store: Path
    experiment: str = "imported"
    run_id: str | None = None
    rank: int | None = None
    world_size: int | None = None
    #: samples per step on one rank, when the user says (traces rarely do); throughput needs it
    batch_size: int | None = None


@dataclass
class ImportResult:
    run_id: str
    origin: str
    ranks: int = 0
    steps: int = 0
    comm: int = 0
    spans: int = 0
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"imported {self.origin} run {self.run_id}: {self.ranks} ranks, {self.steps} steps, "
            f"{self.comm} collectives, {self.spans} spans"
        )


@dataclass
class StepTimes:
    """One rank's step: its start and length and the canonical phases' own times, all in ns."""

    start_ns: int
    step_ns: int
    data_ns: int = 0
    forward_ns: int = 0
    backward_ns: int = 0
    sync_exposed_ns: int = 0
    optimizer_ns: int = 0
    comm_total_ns: int = 0
    comm_count: int = 0
    samples: int | None = None

    @property
    def other_ns(self) -> int:
        known = self.data_ns + self.forward_ns + self.backward_ns + self.sync_exposed_ns + self.optimizer_ns
        return max(0, self.step_ns - known)


def check_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The input files, each an existing readable regular file, or a one-line error."""
    if not paths:
        raise PerfscopeError("give at least one trace file to import")
    out = []
    for p in paths:
        path = Path(p)
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            raise PerfscopeError(
                f"{shown(path, 200)}: the file name is not UTF-8; rename the file "
                "(its name goes into the store)"
            ) from None
        if not path.exists():
            raise PerfscopeError(f"{path}: no such file")
        if not path.is_file():
            raise PerfscopeError(f"{path}: not a regular file")
        if not os.access(path, os.R_OK):
            raise PerfscopeError(f"{path}: not readable")
        out.append(path)
    if len({p.resolve() for p in out}) != len(out):
        raise PerfscopeError("the same file is given twice")
    return out


def default_run_id(origin: str, experiment: str, paths: Sequence[Path]) -> str:
    """A run id that is the same each time the same files are imported, so a second import of them
    is refused instead of doubling the run."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda q: q.name):
        h.update(os.fsencode(p.name))  # bytes as the file system has them, UTF-8 or not
        h.update(str(p.stat().st_size).encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 16))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)[:60].strip(".") or "run"
    return f"{origin}-{safe}-{h.hexdigest()[:10]}"


def check_run_id(run_id: str) -> str:
    if (
        not run_id
        or len(run_id) > 200
        or run_id.startswith(".")
        or any(c in run_id for c in "/\0\n")
        or partition_value_problem(run_id)
    ):
        raise PerfscopeError(f"run id {run_id!r} cannot name a folder; use letters, digits, '-', '_', '.'")
    return run_id


def prepare_store(root: Path, run_id: str) -> None:
    """The store folder exists (or is made) and does not yet hold `run_id`."""
    store_target(root, create=True)
    if any(segment_dir(root, t, run_id).exists() for t in TABLES):
        raise PerfscopeError(
            f"{root} already holds run {run_id}: these traces were imported before "
            "(give another --run-id to import them again)"
        )


class RunImport:
    """Writes one imported run. Rows go through the collector's StoreWriter, buffered and bounded,
    so a long trace never sits in memory; `finish` writes the `runs` row and closes. Use as a context
    manager: leaving it by an exception removes everything written for the run."""

    def __init__(self, opts: ImportOptions, origin: str, run_id: str) -> None:
        self.opts = opts
        self.origin = origin
        self.root = Path(opts.store)
        self.result = ImportResult(run_id=check_run_id(run_id), origin=origin)
        prepare_store(self.root, run_id)
        self._writer = StoreWriter(self.root, run_id, writer_id=f"import-{origin}", roll_interval_s=3600.0)
        self._ranks: set[int] = set()
        self._finished = False

    @property
    def run_id(self) -> str:
        return self.result.run_id

    def rank(
        self,
        rank: int,
        *,
        hostname: str = "",
        pid: int | None = None,
        device_index: int | None = None,
        device_name: str = "",
        started_ns: int | None = None,
        local_rank: int | None = None,
        node_rank: int | None = None,
    ) -> None:
        if rank in self._ranks:
            raise PerfscopeError(f"rank {rank} appears in two traces; give one file per rank")
        self._ranks.add(rank)
        self.result.ranks += 1
        self._writer.append(
            "ranks",
            (rank, local_rank, node_rank, hostname, pid, 0, None, device_index, device_name, started_ns),
        )

    def step(self, rank: int, step: int, t: StepTimes, *, clock: str) -> None:
        self.result.steps += 1
        if self.result.steps > MAX_ROWS:
            self._too_many("step")
        samples = t.samples if t.samples is not None else self.opts.batch_size
        self._writer.append(
            "steps",
            (rank, step, t.start_ns, t.step_ns, t.data_ns, t.forward_ns, t.backward_ns, t.sync_exposed_ns,
             t.optimizer_ns, t.other_ns, t.comm_total_ns, t.comm_count, samples, clock),
        )  # fmt: skip

    def span(
        self,
        rank: int,
        step: int,
        name: str,
        start_ns: int,
        dur_ns: int,
        *,
        clock: str,
        parent: str | None = None,
        depth: int = 0,
    ) -> None:
        self.result.spans += 1
        if self.result.spans > MAX_ROWS:
            self._too_many("span")
        self._writer.append("spans", (rank, step, name, parent, depth, start_ns, dur_ns, clock, None))

    def comm(
        self,
        rank: int,
        step: int,
        seq: int,
        op: str,
        nbytes: int | None,
        start_ns: int,
        dur_ns: int,
        *,
        clock: str,
        bucket: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """One collective. `extra` holds further columns of `comm` by name."""
        self.result.comm += 1
        if self.result.comm > MAX_ROWS:
            self._too_many("comm")
        values = {"rank": rank, "step": step, "seq": seq, "op": op, "bucket": bucket, "bytes": nbytes,
                  "start_ns": start_ns, "dur_ns": dur_ns, "clock": clock, **(extra or {})}  # fmt: skip
        self._writer.append("comm", _row("comm", values))

    def rows(self, table: str, rows: Iterable[Sequence[Any]]) -> None:
        """Rows of any other table in schema order (gpu_samples, events ...)."""
        self._writer.extend(table, rows)

    def _too_many(self, table: str) -> None:
        raise PerfscopeError(
            f"these files would make more than {MAX_ROWS:,} {table} rows; no trace holds that many "
            "(a damaged or forged file, or give --world-size if the ranks were counted wrong)"
        )

    def warn(self, message: str) -> None:
        self.result.warnings.append(message)

    def finish(self, **columns: Any) -> ImportResult:
        """Write the `runs` row from `columns` (any column of `runs`; `tags` may be a dict) and close."""
        tags = columns.get("tags") or {}
        fields: dict[str, Any] = {
            "experiment": self.opts.experiment,
            "source": "measured",
            "origin": self.origin,
            "world_size": len(self._ranks) or None,
            "scaling_mode": "",
            **columns,
            "tags": json.dumps(tags, sort_keys=True, default=str) if isinstance(tags, dict) else str(tags),
        }
        from .. import __version__

        fields.setdefault("perfscope_version", __version__)
        batch = self.opts.batch_size
        if batch is not None:
            fields.setdefault("batch_size_per_rank", batch)
            if fields.get("world_size"):
                fields.setdefault("global_batch_size", batch * fields["world_size"])
        self._writer.append("runs", _row("runs", fields))
        stats = self._writer.close()
        self._finished = True
        if stats.rows_dropped:
            self._remove()
            raise PerfscopeError(
                f"could not write run {self.run_id} to {self.root} ({stats.write_errors} failed writes); "
                "check that the folder is writable and the disk has space"
            )
        return self.result

    def _remove(self) -> None:
        for t in (*TABLES, ROLLUP_DIR):  # the writer's close summarises what it wrote into rollups
            shutil.rmtree(self.root / t / f"{PARTITION_KEY}={self.run_id}", ignore_errors=True)

    def __enter__(self) -> RunImport:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            if not self._finished:
                self._writer.close()
            self._remove()


def _row(table: str, values: dict[str, Any]) -> tuple[Any, ...]:
    """A row of `table` in schema order from values by column name (absent columns are NULL)."""
    names = TABLES[table].column_names
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"not columns of {table}: {sorted(unknown)}")
    return tuple(values.get(n) for n in names)
