"""What every importer shares: the options of `perfscope import`, the run id, and `RunImport`, which
writes an imported run as the same `runs`, `ranks`, `steps`, `spans` and `comm` rows the collector
writes (source = 'measured', the trace format in `runs.origin`).

An import either completes or leaves nothing behind: its rows are written into a hidden staging
store inside the store (`.imports/`, which no reader lists) under a claim of the run id only one
importer holds, and renamed into the store's tables once all are written (`Staging`). A failure, a
signal or a kill leaves nothing a reader sees; what a killed importer staged is removed by the next
import into the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PerfscopeError, one_line, shown
from ..output import store_target
from ..store.imports import (
    IMPORTS_DIR,
    PUBLISHED,
    PUBLISHING,
    STAGING,
    recover_stale_imports,
    run_partitions,
    same_file,
    undo_import,
)
from ..store.listing import partition_value_problem
from ..store.rollups import ROLLUP_DIR
from ..store.schema import MAX_RUN_ID_BYTES, PARTITION_KEY, TABLES, run_id_size_problem
from ..store.writer import StoreWriter, segment_dir

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
    #: kineto: also every operator as a span of its step (perfscope compare's op types)
    ops: bool = False


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
        or run_id_size_problem(run_id)  # bytes: a folder name is at most 255 of them
        or run_id.startswith(".")
        or any(c in run_id for c in "/\0\n")
        or partition_value_problem(run_id)
    ):
        shown = repr(run_id) if len(run_id) <= 80 else f"{run_id[:60]!r}... ({len(run_id):,} characters)"
        raise PerfscopeError(
            f"run id {shown} cannot name a folder; use up to {MAX_RUN_ID_BYTES} bytes of letters, digits, "
            "'-', '_', '.'"
        )
    return run_id


def prepare_store(root: Path, run_id: str) -> Staging:
    """The store folder exists (or is made), does not yet hold `run_id`, and `run_id` is claimed for
    this import: rows go to the staging store returned, to be published (or discarded) at the end."""
    imports = root / IMPORTS_DIR
    if imports.is_dir() and not imports.is_symlink():  # what killed importers left goes first
        recover_stale_imports(root)
        with contextlib.suppress(OSError):
            imports.rmdir()  # when empty
    try:
        store_target(root, create=True)
    except PerfscopeError:
        # a new folder that holds only the imports running into it (another importer's claim)
        with contextlib.suppress(OSError):
            if [e.name for e in os.scandir(root)] == [IMPORTS_DIR]:
                return Staging(root, run_id)
        raise
    return Staging(root, run_id)


class Staging:
    """One import's claim of a run id and the hidden staging store its rows are written to.

    The claim is a file in `<store>/.imports/`, made with O_EXCL and held under an exclusive flock for
    the importer's life: a second importer of the same run id fails in one line and touches nothing; a
    claim whose lock is free belongs to a killed importer, and whoever finds it removes what that
    importer left (its staging store, and the partitions it had begun to publish). `publish` renames
    the run's partition folders from the staging store into the store (`runs` last); `discard`
    removes the staging store. Either way the claim goes."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.root = root
        self.run_id = run_id
        self._dir = root / IMPORTS_DIR
        self._key = hashlib.blake2b(run_id.encode("utf-8", "surrogateescape"), digest_size=10).hexdigest()
        self._fd: int | None = None
        try:
            self._dir.mkdir(exist_ok=True)
            recover_stale_imports(root)
            self._fd = self._claim()
        except OSError as exc:
            raise PerfscopeError(
                f"cannot import into {root}: {exc.strerror or exc}; is it writable?"
            ) from None
        self.path = self._dir / f"{self._key}.{secrets.token_hex(4)}"
        try:
            if any(segment_dir(root, t, run_id).exists() for t in TABLES):
                raise PerfscopeError(
                    f"{root} already holds run {run_id}: these traces were imported before "
                    "(give another --run-id to import them again)"
                )
            self.path.mkdir()
            self._state(STAGING)
        except BaseException:
            self._release()
            raise

    @property
    def _claim_path(self) -> Path:
        return self._dir / f"{self._key}.claim"

    def _claim(self) -> int:
        path = self._claim_path
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:  # released meanwhile: claim it afresh
                    continue
            except FileNotFoundError:  # the last importer removed the (empty) folder meanwhile
                self._dir.mkdir(exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise PerfscopeError(
                    f"another import of run {self.run_id} into {self.root} is running; wait for it, "
                    "or give another --run-id"
                ) from None
            if not same_file(fd, path):  # released and removed between our open and our lock
                os.close(fd)
                continue
            undo_import(self.root, fd, self._key)  # a killed importer's claim: what it left goes
            return fd

    def _state(self, state: str) -> None:
        assert self._fd is not None
        text = json.dumps(
            {"run_id": self.run_id, "pid": os.getpid(), "staging": self.path.name, "state": state}
        )
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode("utf-8", "surrogateescape"), 0)
        os.fsync(self._fd)

    def writer(self, writer_id: str) -> StoreWriter:
        return StoreWriter(self.path, self.run_id, writer_id=writer_id, roll_interval_s=3600.0)

    def publish(self) -> None:
        """Rename the run's partitions from the staging store into the store, `runs` last."""
        global _publishing
        _publishing = True
        try:
            self._publish()
        finally:
            _publishing = False

    def _publish(self) -> None:
        self._state(PUBLISHING)
        # rollups of a run the store does not hold (an older perfscope's failed import left them)
        shutil.rmtree(self.root / ROLLUP_DIR / f"{PARTITION_KEY}={self.run_id}", ignore_errors=True)
        moved: list[tuple[Path, Path]] = []
        try:
            for dst in run_partitions(self.root, self.run_id):
                src = self.path / dst.relative_to(self.root)
                if not src.is_dir():
                    continue
                dst.parent.mkdir(exist_ok=True)
                os.rename(src, dst)  # refused when dst holds anything: a run of that id appeared
                moved.append((src, dst))
        except OSError as exc:
            for src, dst in reversed(moved):
                with contextlib.suppress(OSError):
                    os.rename(dst, src)
            self.discard()
            raise PerfscopeError(
                f"could not put run {self.run_id} into {self.root} ({one_line(exc.strerror or str(exc))}); "
                "nothing was imported"
            ) from None
        self._state(PUBLISHED)
        self.discard()

    def discard(self) -> None:
        """Remove the staging store and let the claim go."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if same_file(self._fd, self._claim_path):
                self._claim_path.unlink()
        os.close(self._fd)  # the lock goes with it
        self._fd = None
        with contextlib.suppress(OSError):
            self._dir.rmdir()  # when no other import is running: the store is left as it was


#: set while a publish renames partitions: a signal then waits until the run is whole in the store
_publishing = False


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP stop an import as Ctrl-C does (an exception: its staging store is removed,
    nothing is published), and none of the three cuts a publish short (the import then completes).
    Only in the main thread (signal handlers can be set nowhere else); elsewhere nothing changes."""

    def handler(signum: int, frame: object) -> None:
        if _publishing:
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        raise PerfscopeError(f"stopped by {name}: nothing was imported", exit_code=128 + signum)

    wanted = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    try:
        before = {s: signal.signal(s, handler) for s in wanted}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


class RunImport:
    """Writes one imported run. Rows go through the collector's StoreWriter, buffered and bounded,
    so a long trace never sits in memory; `finish` writes the `runs` row and closes. Use as a context
    manager: leaving it by an exception removes everything written for the run."""

    def __init__(self, opts: ImportOptions, origin: str, run_id: str) -> None:
        self.opts = opts
        self.origin = origin
        self.root = Path(opts.store)
        self.result = ImportResult(run_id=check_run_id(run_id), origin=origin)
        self._staging = prepare_store(self.root, run_id)
        try:
            self._writer = self._staging.writer(f"import-{origin}")
        except BaseException:
            self._staging.discard()
            raise
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
            raise PerfscopeError(
                f"could not write run {self.run_id} to {self.root} ({stats.write_errors} failed writes); "
                "check that the folder is writable and the disk has space"
            )
        self._staging.publish()
        return self.result

    def __enter__(self) -> RunImport:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            if not self._finished:
                self._writer.close()
            self._staging.discard()


def _row(table: str, values: dict[str, Any]) -> tuple[Any, ...]:
    """A row of `table` in schema order from values by column name (absent columns are NULL)."""
    names = TABLES[table].column_names
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"not columns of {table}: {sorted(unknown)}")
    return tuple(values.get(n) for n in names)
