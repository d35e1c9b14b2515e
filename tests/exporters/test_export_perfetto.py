"""`perfscope export perfetto`: Chrome trace-event JSON of a run recorded by the collector on a real
2-rank gloo DDP job, of a simulated run with GPU counters, and of an imported Kineto trace; the JSON
validates and its slices and counters round-trip the store's rows."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from collect_helpers import ddp_worker, run_ranks

from perfscope import open_store
from perfscope.cli import main
from perfscope.exporters.perfetto_ideal import IDEAL_PID

REAL = Path(__file__).resolve().parents[1] / "data" / "kineto-w2-allreduce-rank0.json.gz"


@pytest.fixture(scope="module")
def ddp_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    res = run_ranks(ddp_worker, 2, str(root), {"steps": 6})
    assert all(status == "ok" for status, _ in res.values()), res
    return root


@pytest.fixture(scope="module")
def sim_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sim") / "store"
    assert main(["simulate", str(root), "--world-sizes", "2,4", "--steps", "30", "--gpus-per-node", "2"]) == 0
    return root


def _export(store: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["export", "perfetto", str(store), "-o", str(out), *extra]) == 0
    raw = out.read_bytes()
    return json.loads(gzip.decompress(raw) if out.suffix == ".gz" else raw)


def _validate(doc: dict[str, Any]) -> None:
    """What Perfetto and chrome://tracing need: the keys of each phase, numbers for times, and each
    track's events in time order."""
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
    last: dict[tuple[Any, ...], float] = {}
    for e in doc["traceEvents"]:
        assert {"ph", "name", "pid", "tid"} <= e.keys()
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "thread_name", "process_sort_index"}
            continue
        assert isinstance(e["ts"], float | int) and e["ts"] >= 0
        track = (e["ph"], e["pid"], e["tid"]) if e["ph"] == "X" else ("C", e["pid"], e["name"])
        assert e["ts"] >= last.get(track, 0.0), f"{track} goes back in time"
        last[track] = e["ts"]
        if e["ph"] == "X":
            assert isinstance(e["dur"], float | int) and e["dur"] >= 0
        else:
            assert e["ph"] == "C" and all(isinstance(v, float | int) for v in e["args"].values())


def _count(store: Path, sql: str, params: list[Any]) -> int:
    with open_store(store) as s:
        return int(s.query(sql, params).column(0)[0].as_py())


def _slices(doc: dict[str, Any], cat: str) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def test_collector_run_round_trips(ddp_store: Path, tmp_path: Path) -> None:
    doc = _export(ddp_store, tmp_path / "t.json")
    _validate(doc)
    run_id = doc["otherData"]["perfscope_run_id"]
    p = [run_id]
    assert len(_slices(doc, "step")) == _count(ddp_store, "SELECT count(*) FROM steps WHERE run_id = ?", p)
    assert len(_slices(doc, "span")) == _count(ddp_store, "SELECT count(*) FROM spans WHERE run_id = ?", p)
    assert len(_slices(doc, "comm")) == _count(ddp_store, "SELECT count(*) FROM comm WHERE run_id = ?", p) > 0
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    recorded = {pid: n for pid, n in names.items() if pid < IDEAL_PID}
    assert sorted(recorded) == [0, 1] and all(n.endswith(f"/rank {pid}") for pid, n in recorded.items())
    # beside them, the what-if's ideal step of each rank (tests/analysis/test_what_if_views.py checks
    # its times)
    assert all(n == f"ideal/rank {pid - IDEAL_PID}" for pid, n in names.items() if pid >= IDEAL_PID)
    # durations in µs, from the store's ns
    with open_store(ddp_store) as s:
        total_ns = float(s.query("SELECT sum(step_ns) FROM steps WHERE run_id = ?", p).column(0)[0].as_py())
    assert sum(e["dur"] for e in _slices(doc, "step")) == pytest.approx(total_ns / 1000, rel=1e-6)
    # a collective and a span of one rank sit inside that rank's step
    step = _slices(doc, "step")[0]
    inside = [e for e in _slices(doc, "span") if e["pid"] == step["pid"] and e["args"]["step"] == 0]
    assert inside and all(step["ts"] - 1 <= e["ts"] <= step["ts"] + step["dur"] + 1 for e in inside)


def test_step_window_and_gzip(ddp_store: Path, tmp_path: Path) -> None:
    doc = _export(ddp_store, tmp_path / "t.json.gz", "--steps", "2:3")
    _validate(doc)
    assert {e["name"] for e in _slices(doc, "step")} == {"step 2", "step 3"}
    assert {e["args"]["step"] for e in _slices(doc, "comm")} == {2, 3}
    assert Counter(e["pid"] for e in _slices(doc, "step")) == {0: 2, 1: 2}
    one = _export(ddp_store, tmp_path / "one.json", "--steps", "4")
    assert [e["name"] for e in _slices(one, "step")] == ["step 4", "step 4"]


def test_gpu_counters_of_a_simulated_run(
    sim_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["export", "perfetto", str(sim_store), "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "pick one with --run" in err and "Traceback" not in err
    with open_store(sim_store) as s:
        run_id = s.query("SELECT run_id FROM runs WHERE world_size = 4").column(0)[0].as_py()
    doc = _export(sim_store, tmp_path / "t.json", "--run", run_id)
    _validate(doc)
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    t0 = doc["otherData"]["origin_unix_ns"]
    steps_end = max(e["ts"] + e["dur"] for e in _slices(doc, "step")) * 1000 + t0
    n_util = _count(
        sim_store,
        "SELECT count(*) FROM gpu_samples WHERE run_id = ? AND util_gpu_pct IS NOT NULL "
        "AND ts_ns BETWEEN ? AND ?",
        [run_id, t0, int(steps_end) + 1],
    )
    assert sum(1 for c in counters if "utilisation" in c["name"]) == n_util > 0
    assert any("power W" in c["name"] and 10 < c["args"]["power_w"] < 2000 for c in counters)
    assert len(_slices(doc, "step")) == _count(
        sim_store, "SELECT count(*) FROM steps WHERE run_id = ?", [run_id]
    )


def test_imported_kineto_trace_exports(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert main(["import", "kineto", str(REAL), "--store", str(store)]) == 0
    doc = _export(store, tmp_path / "t.json")
    _validate(doc)
    assert len(_slices(doc, "comm")) == 21
    assert {e["name"] for e in _slices(doc, "comm")} == {"allreduce", "broadcast"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--steps", "x:y"), "--steps"),
        (("--steps", "5:2"), "before the first"),
        (("--steps", "900:999"), "no steps in the window"),
        (("--run", "no-such-run"), "no steps of run"),
    ],
)
def test_bad_requests_are_one_line(
    ddp_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    rc = main(["export", "perfetto", str(ddp_store), "-o", str(tmp_path / "t.json"), *extra])
    err = capsys.readouterr().err
    assert rc != 0 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


def test_bad_targets_are_one_line(
    ddp_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for target in (tmp_path, tmp_path / "missing" / "t.json"):
        rc = main(["export", "perfetto", str(ddp_store), "-o", str(target)])
        err = capsys.readouterr().err
        assert rc != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    rc = main(["export", "perfetto", str(tmp_path / "nostore"), "-o", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
