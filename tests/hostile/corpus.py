"""Small hostile inputs for `perfscope import`, generated (never stored: some are file names no
repository can hold, some are hundreds of KB of brackets). Each case is a file every importer must
refuse with one line and exit status 2, never a traceback, never exit 70, never a wrong line about
disks or training (issue 22: "validate at the boundary, once, for every importer").

A case: an id, the format, the file name (bytes: it may not be UTF-8), how to make its content, the
extra flags, and a fragment the one error line must hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BASE_NS = 1_700_000_000_000_000_000
START_US = 1_700_000_000_000_000


@dataclass(frozen=True)
class Case:
    id: str
    format: str
    name: bytes
    content: Callable[[], bytes]
    says: str
    args: tuple[str, ...] = field(default_factory=tuple)


# ---- kineto --------------------------------------------------------------------------------------------


def kineto(
    *, info: dict[str, Any] | None = None, base: Any = BASE_NS, step_ts: Any = 100, corr: Any = 7
) -> bytes:
    """One rank, one ProfilerStep#1 with one kernel launched inside it: a trace that imports."""
    doc: dict[str, Any] = {
        "schemaVersion": 1,
        "distributedInfo": info if info is not None else {"backend": "nccl", "rank": 0, "world_size": 1},
        "traceEvents": [
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "ProfilerStep#1",
                "pid": 1,
                "tid": 1,
                "ts": step_ts,
                "dur": 500,
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 1,
                "tid": 1,
                "ts": 150,
                "dur": 5,
                "args": {"correlation": corr},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "volta_sgemm",
                "pid": 0,
                "tid": 7,
                "ts": 160,
                "dur": 100,
                "args": {"correlation": corr},
            },
        ],
    }
    text = json.dumps(doc)[:-1] + f', "baseTimeNanoseconds": {base}}}'
    return text.encode()


# ---- horovod -------------------------------------------------------------------------------------------


def horovod(*, tick: str = "1", start: str = str(START_US), ts: str = "10", extra: str = "") -> bytes:
    """One tensor, one allreduce negotiated by ranks 0 and `tick`: a timeline that imports."""
    return (
        "[\n"
        '{"name": "process_name", "ph": "M", "pid": 0, '
        f'"args": {{"start_time_since_epoch_in_micros": {start}}}}},\n'
        '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad"}},\n'
        f"{extra}"
        f'{{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": {ts}, "pid": 1}},\n'
        '{"ph": "X", "name": "0", "ts": 11, "dur": 0, "pid": 1},\n'
        f'{{"ph": "X", "name": {json.dumps(tick)}, "ts": 12, "dur": 0, "pid": 1}},\n'
        '{"ph": "E", "ts": 13, "pid": 1},\n'
        '{"ph": "B", "name": "ALLREDUCE", "ts": 14, "pid": 1},\n'
        '{"ph": "B", "name": "NCCL_ALLREDUCE", "ts": 15, "pid": 1},\n'
        '{"ph": "E", "ts": 40, "pid": 1},\n'
        '{"ph": "E", "ts": 41, "pid": 1, "args": {"dtype": "float32", "shape": "[1024]"}}\n'
        "]\n"
    ).encode()


# ---- nccl-tests ----------------------------------------------------------------------------------------


def nccl(*, nthread: str = "1", rank: str = "0", device: str = "0", root: str = "-1") -> bytes:
    return (
        f"# nThread {nthread} nGpus 1 minBytes 8 maxBytes 1024 step: 2(factor) warmup iters: 5 iters: 20\n"
        f"#  Rank {rank} Group  0 Pid  41001 on    node-a device {device} [0x07] NVIDIA A100-SXM4-80GB\n"
        "#  size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong\n"
        f"   8      2    float  sum   {root}  31.20  0.00  0.00  0  30.85  0.00  0.00  0\n"
        "# Avg bus bandwidth    : 0.0\n"
    ).encode()


# ---- nsys ----------------------------------------------------------------------------------------------


def nsys_generated_text() -> bytes:
    """An export whose NVTX text is a column computed on every read: 40 MB of digits a row (issue 22:
    50 such rows took 2.4 GB and 29 s to import)."""
    import sqlite3
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.sqlite"
        p.write_bytes(nsys_export())
        con = sqlite3.connect(p)
        con.executescript(
            "DROP TABLE NVTX_EVENTS;"
            "CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL,"
            " text TEXT GENERATED ALWAYS AS ('ProfilerStep#' || hex(zeroblob(20000000))) VIRTUAL,"
            " globalTid INT, textId INT, domainId INT);"
            "INSERT INTO NVTX_EVENTS (start, end, eventType, globalTid) VALUES (0, 100, 59, 16777217);"
        )
        con.commit()
        con.close()
        return p.read_bytes()


def nsys_export(*, metric: str = "90", epoch: str = str(BASE_NS), device: str = "0") -> bytes:
    """A minimal Nsight Systems export with one NVTX step range and one GPU metric: one that imports."""
    import sqlite3
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.sqlite"
        con = sqlite3.connect(p)
        con.executescript(
            "CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);"
            "CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, text TEXT,"
            " globalTid INT, textId INT, domainId INT);"
            "INSERT INTO NVTX_EVENTS VALUES (0, 100, 59, 'ProfilerStep#1', 16777217, NULL, 0);"
            "CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INT, utcTime TEXT, localTime TEXT);"
            f"INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES ({epoch}, '', '');"
            "CREATE TABLE TARGET_INFO_GPU_METRICS (typeId INT NOT NULL, sourceId INT NOT NULL,"
            " typeName TEXT NOT NULL, metricId INT NOT NULL, metricName TEXT NOT NULL);"
            "INSERT INTO TARGET_INFO_GPU_METRICS VALUES (4, 0, 'GH100', 1, 'GPU Active [Throughput %]');"
            "CREATE TABLE GPU_METRICS (timestamp INT, typeId INT NOT NULL, metricId INT NOT NULL,"
            " value INT NOT NULL);"
            f"INSERT INTO GPU_METRICS VALUES (10, 4, 1, {metric});"
            "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL,"
            " deviceId INT NOT NULL, globalPid INT, shortName INT NOT NULL);"
            "INSERT INTO StringIds VALUES (1, 'volta_sgemm');"
            f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (10, 50, {device}, 16777216, 1);"
        )
        con.commit()
        con.close()
        return p.read_bytes()


NOT_UTF8 = b"rank\xff\xfe"
DEEP = 100_000

CASES: list[Case] = [
    # file names that are not UTF-8, in every importer (default_run_id could not encode them)
    Case("kineto-name-not-utf8", "kineto", NOT_UTF8 + b".json", kineto, "not UTF-8"),
    Case("nsys-name-not-utf8", "nsys", NOT_UTF8 + b".sqlite", nsys_export, "not UTF-8"),
    Case("horovod-name-not-utf8", "horovod", NOT_UTF8 + b".json", horovod, "not UTF-8"),
    Case("nccl-name-not-utf8", "nccl-tests", NOT_UTF8 + b".txt", nccl, "not UTF-8"),
    # kineto: numbers out of any range a trace holds
    Case("kineto-correlation-1e19", "kineto", b"k.json", lambda: kineto(corr=1e19), "correlation"),
    Case("kineto-ts-1e300", "kineto", b"k.json", lambda: kineto(step_ts=1e300), "out of range"),
    Case(
        "kineto-base-time-20-digits",
        "kineto",
        b"k.json",
        lambda: kineto(base="99999999999999999999"),
        "baseTimeNanoseconds",
    ),
    Case(
        "kineto-world-size-2^40",
        "kineto",
        b"k.json",
        lambda: kineto(info={"rank": 0, "world_size": 1 << 40}),
        "world_size",
    ),
    Case(
        "kineto-step-5000-digits",
        "kineto",
        b"k.json",
        lambda: kineto().replace(b"ProfilerStep#1", b"ProfilerStep#" + b"1" * 5000),
        "no ProfilerStep#N",
    ),
    Case(
        "kineto-rank-2^40",
        "kineto",
        b"k.json",
        lambda: kineto(info={"rank": 1 << 40, "world_size": 2}),
        "rank",
    ),
    Case(
        "import-world-size-flag", "kineto", b"k.json", kineto, "--world-size", ("--world-size", "99999999999")
    ),
    # horovod: ticks, start times and timestamps no timeline holds
    Case("horovod-tick-superscript-2", "horovod", b"h.json", lambda: horovod(tick="\u00b2"), "tick"),
    Case("horovod-tick-5000-digits", "horovod", b"h.json", lambda: horovod(tick="7" * 5000), "tick"),
    Case("horovod-tick-1048575", "horovod", b"h.json", lambda: horovod(tick="1048575"), "not a rank"),
    # amplification: two ranks tick, one names rank 99,999: not 100,000 ranks of rows
    Case("horovod-tick-99999", "horovod", b"h.json", lambda: horovod(tick="99999"), "only 2 ranks tick"),
    Case("horovod-start-nan", "horovod", b"h.json", lambda: horovod(start="NaN"), "start_time"),
    Case("horovod-start-infinity", "horovod", b"h.json", lambda: horovod(start="Infinity"), "start_time"),
    Case("horovod-start-string", "horovod", b"h.json", lambda: horovod(start='"abc"'), "start_time"),
    Case("horovod-start-list", "horovod", b"h.json", lambda: horovod(start="[1]"), "start_time"),
    Case("horovod-start-1e300", "horovod", b"h.json", lambda: horovod(start="1e300"), "start_time"),
    Case("horovod-ts-nan", "horovod", b"h.json", lambda: horovod(ts="NaN"), "ts"),
    Case("horovod-ts-infinity", "horovod", b"h.json", lambda: horovod(ts="Infinity"), "ts"),
    Case("horovod-ts-1e300", "horovod", b"h.json", lambda: horovod(ts="1e300"), "ts"),
    Case(
        "horovod-nested-100k",
        "horovod",
        b"h.json",
        lambda: horovod(extra='{"ph": "i", "args": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "},\n"),
        "nested",
    ),
    # nccl-tests: numbers Python's int() refuses past 4300 digits, and a root beyond any rank
    Case(
        "nccl-nthread-5000-digits",
        "nccl-tests",
        b"all_reduce_perf.txt",
        lambda: nccl(nthread="9" * 5000),
        "nThread",
    ),
    Case(
        "nccl-rank-5000-digits", "nccl-tests", b"all_reduce_perf.txt", lambda: nccl(rank="9" * 5000), "Rank"
    ),
    Case(
        "nccl-device-5000-digits",
        "nccl-tests",
        b"all_reduce_perf.txt",
        lambda: nccl(device="9" * 5000),
        "device",
    ),
    Case(
        "nccl-root-huge",
        "nccl-tests",
        b"all_reduce_perf.txt",
        lambda: nccl(root="99999999999999999999"),
        "root",
    ),
    Case("nccl-root-2^36", "nccl-tests", b"all_reduce_perf.txt", lambda: nccl(root="68719476736"), "root"),
    Case(
        "nccl-nthread-x-ngpus",
        "nccl-tests",
        b"all_reduce_perf.txt",
        lambda: nccl(nthread="999999999"),
        "nThread x nGpus",
    ),
    # nsys: a GPU metric no counter gives (json.dumps(allow_nan=False) failed in export perfetto)
    Case(
        "nsys-gpu-metric-inf",
        "nsys",
        b"n.sqlite",
        lambda: nsys_export(metric="1e999"),
        "GPU metric",
        ("--rank", "0", "--world-size", "1"),
    ),
    Case(
        "nsys-device-2^40",
        "nsys",
        b"n.sqlite",
        lambda: nsys_export(device=str(1 << 40)),
        "device",
        ("--rank", "0", "--world-size", "1"),
    ),
    Case(
        "nsys-generated-text",
        "nsys",
        b"n.sqlite",
        nsys_generated_text,
        "computed when read",
        ("--rank", "0", "--world-size", "1"),
    ),
    Case(
        "nsys-session-start-huge",
        "nsys",
        b"n.sqlite",
        lambda: nsys_export(epoch="9223372036854775807"),
        "out of range",
        ("--rank", "0", "--world-size", "1"),
    ),
]
