"""Nsight Systems SQLite export -> steps, spans, comm and gpu_samples: exports are built here with the
tables and columns of Nsight Systems' documented export schema (one file per rank, as
`nsys profile -o rank%q{RANK}` writes them); bad exports are refused with one line."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from perfscope.analysis import run_analysis
from perfscope.analysis.sync import fit_points
from perfscope.cli import main
from perfscope.errors import PerfscopeError
from perfscope.importers import nsys
from perfscope.store.open import open_store

EPOCH_NS = 1_700_000_000_000_000_000
MS = 1_000_000
STEPS = 14
STEP_NS = 20 * MS

SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT, category INT,
    color INT, text TEXT, globalTid INT, endGlobalTid INT, textId INT REFERENCES StringIds(id), domainId INT,
    uint64Value INT, int64Value INT, doubleValue REAL, uint32Value INT, int32Value INT, floatValue REAL,
    jsonTextId INT, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT,
    demangledName INT NOT NULL, shortName INT NOT NULL, mangledName INT, launchType INT, cacheConfig INT,
    registersPerThread INT NOT NULL, gridX INT NOT NULL, gridY INT NOT NULL, gridZ INT NOT NULL,
    blockX INT NOT NULL, blockY INT NOT NULL, blockZ INT NOT NULL, staticSharedMemory INT NOT NULL,
    dynamicSharedMemory INT NOT NULL, localMemoryPerThread INT NOT NULL, localMemoryTotal INT NOT NULL,
    gridId INT NOT NULL, sharedMemoryExecuted INT);
CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INT, utcTime TEXT, localTime TEXT);
CREATE TABLE TARGET_INFO_SYSTEM_ENV (globalVid INT, devStateName TEXT NOT NULL, name TEXT NOT NULL,
    nameEnum INT NOT NULL, value TEXT NOT NULL);
CREATE TABLE TARGET_INFO_GPU (vmId INT NOT NULL, id INT NOT NULL, name TEXT, busLocation TEXT,
    totalMemory INT NOT NULL, smCount INT NOT NULL, computeMajor INT NOT NULL, computeMinor INT NOT NULL);
CREATE TABLE TARGET_INFO_GPU_METRICS (typeId INT NOT NULL, sourceId INT NOT NULL, typeName TEXT NOT NULL,
    metricId INT NOT NULL, metricName TEXT NOT NULL);
CREATE TABLE GPU_METRICS (timestamp INT, typeId INT NOT NULL, metricId INT NOT NULL, value INT NOT NULL);
"""

# per step: forward 0-5 ms, backward 5-15 ms, optimizer 15-18 ms; compute kernels run 0-4 and 5-12 ms,
# the NCCL allreduce 10-16 ms: 2 ms overlap compute, 3 ms are exposed inside backward, 1 ms in optimizer.
PHASES = (("forward", 0, 5), ("backward", 5, 15), ("optimizer", 15, 18))


def make_export(
    path: Path, *, pid: int, late_ms: float = 0.0, steps: bool = True, metrics: bool = True
) -> Path:
    con = sqlite3.connect(path)
    con.executescript(SCHEMA)
    strings: dict[str, int] = {}

    def sid(s: str) -> int:
        if s not in strings:
            strings[s] = len(strings) + 1
            con.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[s], s))
        return strings[s]

    gtid = (pid << 24) | pid  # Nsight's serialised global thread id: pid << 24 | tid
    gpid = pid << 24
    nvtx = (
        "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId) "
        "VALUES (?,?,?,?,?,?,?)"
    )
    con.execute(nvtx, (0, None, 75, "perfscope", gtid, None, 1))  # the domain's creation names it
    kernel = (
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, deviceId, contextId, streamId, globalPid, "
        "demangledName, shortName, registersPerThread, gridX, gridY, gridZ, blockX, blockY, blockZ, "
        "staticSharedMemory, dynamicSharedMemory, localMemoryPerThread, localMemoryTotal, gridId) "
        "VALUES (?,?,0,1,?,?,?,?,32,1,1,1,128,1,1,0,0,0,0,1)"
    )
    late = int(late_ms * MS)
    for k in range(STEPS):
        t0 = 1 * MS + k * STEP_NS
        if steps:
            con.execute(nvtx, (t0, t0 + STEP_NS, 60, None, gtid, sid("step"), 1))
        for name, a, b in PHASES:
            con.execute(nvtx, (t0 + a * MS + late, t0 + b * MS + late, 59, None, gtid, sid(name), 1))
        con.execute(nvtx, (t0 + 6 * MS, t0 + 7 * MS, 59, "cudaMemcpy", gtid, None, 0))  # default domain
        for a, b, name in ((0, 4, "volta_sgemm_128x64_nn"), (5, 12, "void at::native::elementwise_kernel")):
            con.execute(kernel, (t0 + a * MS + late, t0 + b * MS + late, 7, gpid, sid(name), sid(name)))
        nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
        con.execute(kernel, (t0 + 10 * MS + late, t0 + 16 * MS, 13, gpid, sid(nccl), sid(nccl)))
    con.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '', '')", (EPOCH_NS,))
    con.execute("INSERT INTO TARGET_INFO_SYSTEM_ENV VALUES (1, 'n', 'Hostname', 1, 'gpu-node-1')")
    con.execute("INSERT INTO TARGET_INFO_GPU VALUES (1, 0, 'NVIDIA H100 80GB HBM3', '0:1b', 85e9, 132, 9, 0)")
    if metrics:
        con.executemany(
            "INSERT INTO TARGET_INFO_GPU_METRICS VALUES (?, 0, 'GH100', ?, ?)",
            [(4, 1, "GPU Active [Throughput %]"), (4, 2, "SMs Active [Throughput %]"),
             (4, 3, "DRAM Read Bandwidth [Throughput %]")],
        )  # fmt: skip
        for i in range(20):
            ts = i * 10 * MS
            con.executemany(
                "INSERT INTO GPU_METRICS VALUES (?, 4, ?, ?)", [(ts, 1, 90), (ts, 2, 60), (ts, 3, 5)]
            )
    con.commit()
    con.close()
    return path


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("nsys")
    files = [make_export(d / "rank0.sqlite", pid=4101), make_export(d / "rank1.sqlite", pid=4102, late_ms=1)]
    store = d / "store"
    assert main(["import", "nsys", *map(str, files), "--store", str(store), "--experiment", "nsys"]) == 0
    return store


def test_parse_reads_ranges_kernels_and_metrics(tmp_path):
    ex = nsys.parse(make_export(tmp_path / "r.sqlite", pid=77))
    assert (
        ex.epoch_ns == EPOCH_NS and ex.hostname == "gpu-node-1" and ex.device_model.startswith("NVIDIA H100")
    )
    (proc,) = ex.processes.values()
    assert proc.pid == 77
    # only ranges that can be steps or phases are kept: not the default domain's cudaMemcpy
    assert {r.domain for r in proc.ranges} == {"perfscope"}
    assert {r.name for r in proc.ranges} == {"step", "forward", "backward", "optimizer"}
    ks = list(nsys.kernels(ex, 77))
    assert len(ks) == 3 * STEPS and [k[0] for k in ks] == sorted(k[0] for k in ks)
    nccl = [k for k in ks if k[2] is not None]
    assert len(nccl) == STEPS and {k[2] for k in nccl} == {"allreduce"} and ks[0][3] == 0
    assert list(nsys.kernels(ex, 78)) == []  # another process's kernels are not this one's
    samples = list(nsys.gpu_samples(ex))
    assert (
        len(samples) == 20 and samples[0]["util_gpu_pct"] == 90.0 and samples[0]["gpm_sm_active_pct"] == 60.0
    )
    assert "DRAM" not in json.dumps(samples)


def test_rows_of_the_run(two_ranks):
    with open_store(two_ranks) as st:
        run = st.query("SELECT origin, world_size, backend, device_model, hostname FROM runs").to_pylist()
        steps = st.query(
            "SELECT rank, step, step_ns, forward_ns, backward_ns, sync_exposed_ns, optimizer_ns, other_ns, "
            "comm_total_ns, comm_count, clock FROM steps ORDER BY rank, step"
        ).to_pylist()
        comm = st.query("SELECT rank, op, dur_ns, clock FROM comm ORDER BY rank, step").to_pylist()
        spans = st.query("SELECT DISTINCT name, depth FROM spans ORDER BY name").to_pylist()
        gpu = st.query(
            "SELECT count(*) AS n, avg(util_gpu_pct) AS u, avg(gpm_sm_active_pct) AS sm FROM gpu_samples"
        )
    assert run == [{"origin": "nsys", "world_size": 2, "backend": "nccl",
                    "device_model": "NVIDIA H100 80GB HBM3", "hostname": "gpu-node-1"}]  # fmt: skip
    assert len(steps) == 2 * STEPS
    s = steps[3]  # rank 0, a steady step
    assert s["step_ns"] == STEP_NS and s["clock"] == "host"  # NVTX ranges are host-side
    assert s["forward_ns"] == 5 * MS
    assert s["sync_exposed_ns"] == 4 * MS  # NCCL 10-16 ms minus the compute kernel up to 12 ms
    assert s["backward_ns"] == 10 * MS - 3 * MS and s["optimizer_ns"] == 3 * MS - 1 * MS
    assert s["other_ns"] == STEP_NS - 5 * MS - 7 * MS - 4 * MS - 2 * MS
    assert s["comm_total_ns"] == 6 * MS and s["comm_count"] == 1
    r1 = steps[STEPS + 3]  # rank 1 runs 1 ms late, its allreduce waits 1 ms less
    assert r1["sync_exposed_ns"] == 3 * MS and r1["comm_total_ns"] == 5 * MS
    assert {c["op"] for c in comm} == {"allreduce"} and len(comm) == 2 * STEPS
    assert {"forward", "backward", "optimizer"} <= {x["name"] for x in spans}
    assert "cudaMemcpy" not in {x["name"] for x in spans}  # other domains' ranges are not phases
    g = gpu.to_pylist()[0]
    assert g["n"] == 40 and g["u"] == pytest.approx(90.0) and g["sm"] == pytest.approx(60.0)


def test_analyze_json_end_to_end(two_ranks, capsys):
    capsys.readouterr()
    assert main(["analyze", str(two_ranks), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["world_size"] == 2 and run["step_ns"] == pytest.approx(STEP_NS, rel=1e-6)


def test_profiler_step_ranges_are_steps(tmp_path):
    path = make_export(tmp_path / "p.sqlite", pid=9, steps=False, metrics=False)
    con = sqlite3.connect(path)
    for k in range(3):
        t0 = 1 * MS + k * STEP_NS
        con.execute(
            "INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId) "
            "VALUES (?,?,59,?,?,0)",
            (t0, t0 + STEP_NS, f"ProfilerStep#{k + 5}", (9 << 24) | 9),
        )
    con.commit()
    con.close()
    store = tmp_path / "s"
    assert main(["import", "nsys", str(path), "--store", str(store), "--rank", "0", "--world-size", "1"]) == 0
    with open_store(store) as st:
        assert st.query("SELECT count(*) AS n FROM steps").to_pylist()[0]["n"] == 3


def _cut(tmp_path: Path) -> Path:
    data = make_export(tmp_path / "whole.sqlite", pid=1).read_bytes()
    p = tmp_path / "cut.sqlite"
    p.write_bytes(data[: len(data) // 3])
    return p


def _no_steps(tmp_path: Path) -> Path:
    return make_export(tmp_path / "hpc.sqlite", pid=1, steps=False)


def _no_nvtx(tmp_path: Path) -> Path:
    p = tmp_path / "plain.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.close()
    return p


def _foreign_schema(tmp_path: Path) -> Path:
    p = tmp_path / "other.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE NVTX_EVENTS (start INT, stop INT, label TEXT)")
    con.close()
    return p


def _wrong_types(tmp_path: Path) -> Path:
    p = make_export(tmp_path / "typed.sqlite", pid=3)
    con = sqlite3.connect(p)
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'yesterday' WHERE rowid = 3")
    con.commit()
    con.close()
    return p


def _raw(content: bytes):
    def make(tmp_path: Path) -> Path:
        p = tmp_path / "x.sqlite"
        p.write_bytes(content)
        return p

    return make


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_raw(b""), "not an SQLite file"),
        (_raw(b"hello, not a database\n"), "not an SQLite file"),
        (_raw(b'{"traceEvents": []}'), "not an SQLite file"),
        (_raw(b"SQLite format 3\0" + b"\xff" * 200), "unreadable SQLite"),
        (_cut, "unreadable SQLite"),
        (_no_nvtx, "no NVTX_EVENTS table"),
        (_no_steps, "no step ranges"),
        (_foreign_schema, "not Nsight Systems' export schema"),
        (_wrong_types, "wrong type"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, make, says):
    path = make(tmp_path)
    assert main(["import", "nsys", str(path), "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err
    with pytest.raises(PerfscopeError, match=says):
        nsys.import_files([path], nsys.ImportOptions(store=tmp_path / "s2"))


def _stretched(path: Path, factor: float, hostname: str) -> Path:
    """The export with every time multiplied by `factor` (slower steps) and another host name."""
    con = sqlite3.connect(path)
    for table, cols in (("NVTX_EVENTS", "start = start * ?, end = end * ?"),
                        ("CUPTI_ACTIVITY_KIND_KERNEL", "start = start * ?, end = end * ?")):  # fmt: skip
        con.execute(f"UPDATE {table} SET {cols.replace('?', str(factor))}")
    con.execute("UPDATE TARGET_INFO_SYSTEM_ENV SET value = ? WHERE name = 'Hostname'", (hostname,))
    con.commit()
    con.close()
    return path


def test_scaling_study_of_exports_without_bytes_analyses_reports_and_finds_the_knee(tmp_path, capsys):
    """nsys records no bytes per collective: every analysis, rule and chart takes bytes as unknown
    (issue 22: `report` exited 70 and three rules failed on float(None))."""
    store = tmp_path / "store"
    layouts = {1: [("gpu-node-1", 1.0)], 2: [("gpu-node-1", 1.0)] * 2,
               4: [("gpu-node-1", 1.5)] * 2 + [("gpu-node-2", 1.5)] * 2}  # fmt: skip
    for n, ranks in layouts.items():
        files = []
        for r, (host, factor) in enumerate(ranks):
            p = make_export(tmp_path / f"w{n}r{r}.sqlite", pid=100 * n + r, metrics=False)
            files.append(_stretched(p, factor, host) if factor != 1.0 or host != "gpu-node-1" else p)
        args = ["import", "nsys", *map(str, files), "--store", str(store), "--experiment", "knee"]
        assert main([*args, "--batch-size", "32"]) == 0
    with open_store(store) as st:
        assert st.query("SELECT count(*) AS n FROM comm WHERE bytes IS NOT NULL").to_pylist()[0]["n"] == 0
        nodes = st.query("SELECT world_size, nodes FROM runs ORDER BY world_size").to_pylist()
    assert [(r["world_size"], r["nodes"]) for r in nodes] == [(1, 1), (2, 1), (4, 2)]
    capsys.readouterr()
    assert main(["analyze", str(store), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "failed" not in err and "Error" not in err, err
    doc = json.loads(out)
    knee = [f for f in doc["findings"] if f["rule"] == "node-boundary-knee"]
    assert len(knee) == 1 and knee[0]["numbers"]["relative_drop"] == pytest.approx(1 - 1 / 1.5, rel=0.05)
    # no bytes: no bandwidth and no alpha-beta point, never a made-up one
    with open_store(store) as st:
        sync = run_analysis("sync", st).to_pylist()
        fits = run_analysis("allreduce_fit", st).to_pylist()
    assert len(sync) == 3 and all(r["busbw_gb_per_s"] is None and r["bytes_per_step"] is None for r in sync)
    assert all(r["bw_source"] is None for r in sync)
    assert all(r["points"] == 0 and r["alpha_s"] is None for r in fits)
    unknown = {"p": 4, "n": None, "k": 1.0, "t": 0.01, "data_source": "comm"}
    assert fit_points([unknown, unknown | {"p": 8}]) is None  # no known point, no fit, no float(None)
    assert "alpha_intra_s" not in knee[0]["numbers"]
    report = tmp_path / "report.html"
    assert main(["report", str(store), "-o", str(report)]) == 0
    assert main(["top", str(store)]) == 0
    err = capsys.readouterr().err
    assert "failed" not in err and "internal error" not in err, err
