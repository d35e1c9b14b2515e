"""nccl-tests output (all_reduce_perf, all_gather_perf ...) into the store's `reference_bw` table: a
cluster's reference bus bandwidth by collective, message size and rank count.

The text parsed is what the benchmarks print: a `# nThread .. nGpus ..` line, one `# Rank N ... on
HOST device D [..] MODEL` line per rank, a column header (`size count type redop root time algbw busbw
#wrong time algbw busbw #wrong`: out-of-place columns, then in-place ones; older versions print
`bytes N type op` and `error` instead), one line per message size, and `# Avg bus bandwidth : X`.
Several tests may follow each other in one file; NCCL INFO lines and other noise are skipped.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..collectors.run_metadata import cluster_from_env
from ..errors import PerfscopeError
from .common import (
    MAX_DIGITS,
    MAX_RANKS,
    ImportOptions,
    ImportResult,
    check_run_id,
    prepare_store,
    ranks_in_range,
    shown,
)

#: a line longer than this is not nccl-tests output
MAX_LINE_BYTES = 64 << 10
#: the benchmarks' names, longest first so `all_reduce` wins over `reduce`
OPS = ("reduce_scatter", "all_reduce", "all_gather", "alltoall", "broadcast", "sendrecv", "hypercube",
       "gather", "scatter", "reduce")  # fmt: skip
#: bytes per element of the types nccl-tests prints
TYPE_BYTES = {"int8": 1, "uint8": 1, "char": 1, "int32": 4, "int": 4, "uint32": 4, "int64": 8, "uint64": 8,
              "half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4, "double": 8, "float64": 8,
              "f8e4m3": 1, "f8e5m2": 1}  # fmt: skip

_RANK_LINE = re.compile(r"#\s*Rank\s+(\d+)\b.*?\bon\s+(\S+)\s+device\s+(\d+)\s+\[[^\]]*\]\s*(.*)$")
_TEST_NAME = re.compile(r"\b(" + "|".join(OPS) + r")_perf\b")
_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_NTHREAD = re.compile(r"nThread\s+(\d+)\s+nGpus\s+(\d+)")


@dataclass
class Measurement:
    """One line of the table: a message size, out-of-place and in-place results."""

    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int | None
    oop_time_us: float | None
    oop_algbw_gb_per_s: float | None
    oop_busbw_gb_per_s: float | None
    ip_time_us: float | None
    ip_algbw_gb_per_s: float | None
    ip_busbw_gb_per_s: float | None
    wrong: float | None


@dataclass
class Table:
    """One benchmark's table and what its header says about where it ran."""

    op: str | None = None
    ranks: dict[int, tuple[str, int, str]] = field(default_factory=dict)  # rank -> host, device, model
    threads_x_gpus: int | None = None
    rows: list[Measurement] = field(default_factory=list)
    avg_busbw_gb_per_s: float | None = None
    op_guessed: bool = False

    @property
    def rank_count(self) -> int:
        return len(self.ranks) or self.threads_x_gpus or 1

    @property
    def nodes(self) -> int:
        return len({h for h, _, _ in self.ranks.values()}) or 1


def _lines(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES:
                raise PerfscopeError(
                    f"{path}: a line longer than {MAX_LINE_BYTES >> 10} KiB; not nccl-tests output"
                )
            if b"\0" in raw:
                raise PerfscopeError(f"{path}: binary data; not nccl-tests output")
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _num(tok: str) -> float | None:
    if tok in ("N/A", "n/a", "-"):
        return None
    try:
        value = float(tok)
    except ValueError:
        return None
    return value if math.isfinite(value) and abs(value) < 1e15 else None  # nan, inf: not a measurement


def _header_columns(tokens: list[str]) -> tuple[int, int, dict[str, int]] | None:
    """(index of the out-of-place 'time', of the in-place 'time', leading column -> index) of a header."""
    times = [i for i, t in enumerate(tokens) if t == "time"]
    if not times or "algbw" not in tokens or "busbw" not in tokens:
        return None
    lead = {}
    for i, t in enumerate(tokens[: times[0]]):
        lead[{"bytes": "size", "N": "count", "op": "redop"}.get(t, t)] = i
    if "size" not in lead:
        return None
    return times[0], (times[1] if len(times) > 1 else -1), lead


def _op_from_columns(table: Table) -> str | None:
    """The collective a table measured, told from its first line: redop, root, and how the element
    count relates to the size (count x element = size for allreduce, size / ranks for allgather ...)."""
    r = table.rows[0]
    per_elem = TYPE_BYTES.get(r.dtype)
    n = table.rank_count
    full = per_elem is not None and r.count * per_elem == r.size_bytes
    if r.redop == "none":  # data movement: broadcast has a root, allgather a count per rank
        if r.root is not None and r.root >= 0:
            return "broadcast"
        return None if full else "all_gather"
    if r.root is not None and r.root >= 0:
        return "reduce"
    if full:
        return "all_reduce"
    if per_elem is not None and r.count * per_elem * n == r.size_bytes:
        return "reduce_scatter"
    return None


def _count(path: Path, token: str, what: str) -> int:
    """A count the header prints (`# nThread N`, `# Rank N`, `device N`), or a one-line refusal."""
    if len(token) > MAX_DIGITS:
        raise PerfscopeError(f"{path}: {what} {shown(token)} is not a count; not nccl-tests output")
    return int(token)


def _root(token: str) -> int | None:
    """The root column: -1 (none) or a rank; `-` or N/A is none; anything else is refused."""
    if token in ("N/A", "n/a", "-"):
        return None
    if not re.fullmatch(r"-?[0-9]{1,9}", token) or not -1 <= int(token) < MAX_RANKS:
        raise _BadRoot(token)
    return int(token)


class _BadRoot(Exception):
    """A result line whose root is no rank."""


def _measurement(tokens: list[str], oop: int, ip: int, lead: dict[str, int]) -> Measurement:
    """One result line, by the positions of its header's columns (`ip` -1 without in-place ones)."""

    def at(i: int) -> float | None:
        return _num(tokens[i]) if 0 <= i < len(tokens) else None

    root = _root(tokens[lead["root"]]) if "root" in lead and lead["root"] < len(tokens) else None
    count = at(lead["count"]) if "count" in lead else None
    wrong_at = oop + 3
    size = int(tokens[lead["size"]])
    if size >= 1 << 62:
        raise ValueError("not a message size")
    return Measurement(
        size_bytes=size,
        count=int(count or 0),
        dtype=tokens[lead["type"]] if "type" in lead else "",
        redop=tokens[lead["redop"]] if "redop" in lead else "",
        root=root,
        oop_time_us=at(oop),
        oop_algbw_gb_per_s=at(oop + 1),
        oop_busbw_gb_per_s=at(oop + 2),
        ip_time_us=at(ip) if ip > 0 else None,
        ip_algbw_gb_per_s=at(ip + 1) if ip > 0 else None,
        ip_busbw_gb_per_s=at(ip + 2) if ip > 0 else None,
        wrong=at(wrong_at) if ip < 0 or wrong_at < ip else None,
    )


def parse(path: Path) -> list[Table]:
    """Every benchmark table in the file; a file with none is refused with the reason."""
    tables: list[Table] = []
    cur = Table()
    cols: tuple[int, int, dict[str, int]] | None = None
    width = 0
    saw_any = False

    def close() -> None:
        nonlocal cur
        if cur.rows:
            tables.append(cur)
        cur = Table(op=None)

    for line in _lines(path):
        s = line.strip()
        if not s:
            continue
        m = _TEST_NAME.search(s)
        if m and s.startswith("#") and ("starting" in s or "test" in s.lower()):
            close()
            cur.op = m.group(1)
            continue
        m = _NTHREAD.search(s)
        if m:
            if cur.rows:
                close()
            threads = _count(path, m.group(1), "# nThread")
            gpus = _count(path, m.group(2), "nGpus")
            cur.threads_x_gpus = ranks_in_range(threads * gpus, f"{path}: nThread x nGpus")
            saw_any = True
            continue
        m = _RANK_LINE.match(s)
        if m:
            if cur.rows:
                close()
            rank = _count(path, m.group(1), "# Rank")
            if rank >= MAX_RANKS:
                raise PerfscopeError(f"{path}: # Rank {rank:,} is beyond any job; not nccl-tests output")
            device = _count(path, m.group(3), "device")
            cur.ranks[rank] = (m.group(2)[:200], device, m.group(4).strip()[:200])
            continue
        m = _AVG.match(s)
        if m:
            cur.avg_busbw_gb_per_s = _num(m.group(1))
            close()
            continue
        if s.startswith("#"):
            tokens = s.lstrip("#").split()
            found = _header_columns(tokens)
            if found is not None:
                cols, width = found, len(tokens)
                saw_any = True
            continue
        if cols is None:
            continue
        tokens = s.split()
        if len(tokens) != width or not tokens[0].isdigit():
            continue  # NCCL INFO lines, warnings, a line cut short
        try:
            cur.rows.append(_measurement(tokens, *cols))
        except _BadRoot as exc:
            raise PerfscopeError(
                f"{path}: a root of {shown(exc.args[0])} is not a rank; not nccl-tests output"
            ) from None
        except ValueError:
            continue  # a number no benchmark prints
    close()
    if not tables:
        why = "a column header but no result lines" if saw_any else "no nccl-tests header or result table"
        raise PerfscopeError(f"{path}: {why}; give the output of all_reduce_perf, all_gather_perf ...")
    named = _TEST_NAME.search(path.name)
    for t in tables:
        if t.op is None and named:
            t.op = named.group(1)
        elif t.op is None:
            t.op = _op_from_columns(t)
            t.op_guessed = True
        if t.op is None:
            raise PerfscopeError(
                f"{path}: cannot tell which collective the table measured; name the file after the "
                "benchmark (e.g. all_reduce_perf.txt)"
            )
    return tables


@dataclass
class ReferenceImport(ImportResult):
    """What an nccl-tests import wrote: reference measurements, not a run."""

    tables: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"imported nccl-tests reference {self.run_id}: {self.comm} message sizes of "
            f"{', '.join(self.tables)} into table reference_bw"
        )


def op_name(benchmark: str) -> str:
    """The store's name of a collective (comm.op): all_reduce -> allreduce."""
    return benchmark.replace("_", "")


def _us_to_ns(us: float | None) -> int | None:
    return round(us * 1000) if us is not None else None


def import_files(paths: Sequence[Path], opts: ImportOptions) -> ImportResult:
    """Every table of every file into `reference_bw`, under one import id (the partition)."""
    parsed = [(p, parse(p)) for p in paths]
    cluster = cluster_from_env()  # PERFSCOPE_CLUSTER or SLURM's, as the collector labels runs
    if opts.run_id is not None:
        ref_id = opts.run_id
    else:
        h = hashlib.sha256()
        for p in sorted(paths, key=lambda q: q.name):
            h.update(os.fsencode(p.name) + p.read_bytes()[: 1 << 16])
        ref_id = f"nccl-tests-{h.hexdigest()[:10]}"
    check_run_id(ref_id)
    staging = prepare_store(Path(opts.store), ref_id)
    result = ReferenceImport(run_id=ref_id, origin="nccl-tests")
    try:
        writer = staging.writer("import-nccl-tests")
    except BaseException:
        staging.discard()
        raise
    try:
        for path, tables in parsed:
            for t in tables:
                hosts = sorted({h for h, _, _ in t.ranks.values()})
                models = sorted({m for _, _, m in t.ranks.values() if m})
                if t.op_guessed:
                    result.warnings.append(f"{path.name}: took the collective to be {t.op} from its columns")
                for r in t.rows:
                    writer.append(
                        "reference_bw",
                        (cluster, op_name(t.op or ""), t.rank_count, t.nodes, r.size_bytes, r.count,
                         r.dtype, r.redop, r.root, _us_to_ns(r.oop_time_us), r.oop_algbw_gb_per_s,
                         r.oop_busbw_gb_per_s, _us_to_ns(r.ip_time_us), r.ip_algbw_gb_per_s,
                         r.ip_busbw_gb_per_s, ",".join(hosts), ",".join(models), path.name),
                    )  # fmt: skip
                    result.comm += 1
                result.ranks = max(result.ranks, t.rank_count)
                result.tables.append(f"{t.op} on {t.rank_count} ranks")
    except BaseException:
        writer.close()
        staging.discard()  # all or nothing: a bad row after good ones leaves none of them
        raise
    stats = writer.close()
    if stats.rows_dropped:
        staging.discard()
        raise PerfscopeError(f"could not write to {opts.store}; check that it is writable and has space")
    staging.publish()
    return result
