"""`perfscope import kineto` of several rank files: read in a pool of processes, the rows equal those of
one process reading them in turn; the piecewise msgspec reader gives exactly what the streaming
parser gives, and hands files of any other shape to it; an error in a worker is the same one line."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from perfscope import open_store
from perfscope.cli import main
from perfscope.importers import kineto
from perfscope.importers.kineto import WORKERS_ENV, RankTrace, read_files, read_trace

REAL = Path(__file__).resolve().parents[1] / "data" / "kineto-w2-allreduce-rank0.json.gz"
TABLES = {
    "steps": "rank, step",
    "comm": "rank, step, seq",
    "spans": "rank, step, name, start_ns",
}
#: columns that say when or by which process the rows were written, not what was measured
UNSTABLE = {"ingest_ns", "written_ns", "segment", "writer_pid", "host_pid"}


def _rank_files(folder: Path, ranks: int) -> list[Path]:
    """The real trace as `ranks` ranks of one job, each on a clock a little later."""
    doc = json.loads(gzip.decompress(REAL.read_bytes()))
    paths = []
    for rank in range(ranks):
        d = {**doc, "distributedInfo": {**doc["distributedInfo"], "rank": rank, "world_size": ranks}}
        d["traceEvents"] = [
            {**e, "ts": e["ts"] + 1_000.0 * rank} if isinstance(e.get("ts"), (int, float)) else e
            for e in doc["traceEvents"]
        ]
        path = folder / f"rank{rank}.json"
        path.write_text(json.dumps(d))
        paths.append(path)
    return paths


def _rows(store: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    with open_store(store) as s:
        for table, order in TABLES.items():
            rows = s.query(f"SELECT * FROM {table} ORDER BY {order}").to_pylist()
            out[table] = [{k: v for k, v in r.items() if k not in UNSTABLE} for r in rows]
    return out


def test_files_read_in_parallel_give_exactly_the_rows_of_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: the import reads in one process")
    paths = _rank_files(tmp_path, 3)
    monkeypatch.setenv(WORKERS_ENV, "2")
    pids = {f.pid for f in read_files(paths)}
    assert len(pids) == 2 and os.getpid() not in pids  # two workers, not this process
    stores = {}
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        stores[workers] = tmp_path / f"store{workers}"
        assert main(["import", "kineto", *map(str, paths), "--store", str(stores[workers])]) == 0
    out = capsys.readouterr().out
    assert out.count("3 ranks, 9 steps, 63 collectives") == 2, out
    serial, parallel = _rows(stores["1"]), _rows(stores["2"])
    assert len(serial["steps"]) == 9 and len(serial["comm"]) == 63 and serial["spans"]
    assert parallel == serial


def test_one_process_reads_the_files_in_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _rank_files(tmp_path, 2)
    monkeypatch.setenv(WORKERS_ENV, "1")
    assert {f.pid for f in read_files(paths)} == {os.getpid()}


@pytest.mark.parametrize("value", ["0", "two", "-1", "²"])
def test_a_bad_worker_count_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    paths = _rank_files(tmp_path, 2)
    monkeypatch.setenv(WORKERS_ENV, value)
    rc = main(["import", "kineto", *map(str, paths), "--store", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"perfscope import: error: {WORKERS_ENV}=")
    assert line.endswith("is not a number of processes (1 or more)")


def test_an_error_in_a_worker_is_the_same_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """rank1.json holds an event at an impossible time: the worker's PerfscopeError reaches the user as
    the line the serial import prints, and nothing is written."""
    paths = _rank_files(tmp_path, 3)
    doc = json.loads(paths[1].read_text())
    doc["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1e300, "dur": 1})
    paths[1].write_text(json.dumps(doc))
    lines = {}
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        store = tmp_path / f"store{workers}"
        rc = main(["import", "kineto", *map(str, paths), "--store", str(store)])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        lines[workers] = err.strip()
        assert not any(store.glob("*/run_id=*"))
    assert lines["2"] == lines["1"]
    assert "rank1.json: an event's time is out of range" in lines["1"]


def _streamed(path: Path, monkeypatch: pytest.MonkeyPatch) -> RankTrace:
    with monkeypatch.context() as m:
        m.setattr(kineto, "_read_fast", lambda p, ops=False: None)
        return read_trace(path)


def _same(a: RankTrace, b: RankTrace) -> None:
    for name in ("st_index", "st_start", "st_end", "st_tid", "data", "optimizer", "backward_start",
                 "backward_end", "k_start", "k_end", "k_corr", "cc_tid", "cc_start", "cc_end", "l_corr",
                 "l_ts", "cpu_tid", "cpu_start", "cpu_end"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    assert [(vars(c), i) for c, i in a.comm_kernels] == [(vars(c), i) for c, i in b.comm_kernels]
    assert [vars(c) for c in a.comm_ranges] == [vars(c) for c in b.comm_ranges]
    for name in ("events", "last_us", "rank", "world_size", "backend", "hostname", "device_model",
                 "base_ns", "truncated", "threads"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name


def test_the_piecewise_reader_reads_what_the_streaming_parser_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real trace, plain and gzip, cut into many pieces (small blocks): the same arrays, counts and
    metadata as ijson's, and the fast reader did read it (it did not hand it over)."""
    plain = tmp_path / "rank0.json"
    plain.write_bytes(gzip.decompress(REAL.read_bytes()))
    monkeypatch.setattr(kineto, "_BLOCK_BYTES", 10_000)  # hundreds of pieces, cut mid-event too
    for path in (REAL, plain):
        fast = kineto._read_fast(path)
        assert fast is not None and fast.events > 40_000
        _same(fast, _streamed(path, monkeypatch))


@pytest.mark.parametrize(
    ("change", "handed_over"),
    [
        (lambda text: text.replace('"args": {', '"args": 5, "more": {', 1), True),
        (lambda text: text.replace('"traceEvents": [', '"traceEvents": [7, ', 1), True),
        (lambda text: text[: len(text) // 2], True),  # cut short
        (lambda text: text.rstrip()[:-1] + ', "x": }', True),  # malformed after the events
        # a second array: ijson reads both, so does the fast reader
        (
            lambda text: (
                text.rstrip()[:-1] + ', "traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1}]}'
            ),
            False,
        ),
    ],
    ids=["args-not-an-object", "a-number-among-the-events", "truncated", "malformed-tail", "two-arrays"],
)
def test_a_file_of_another_shape_is_read_as_the_streaming_parser_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, handed_over: bool
) -> None:
    path = tmp_path / "rank0.json"
    text = gzip.decompress(REAL.read_bytes()).decode()
    path.write_text(change(text))
    assert (kineto._read_fast(path) is None) == handed_over
    _same(read_trace(path), _streamed(path, monkeypatch))


#: a script that imports in-process with no `if __name__` guard (as Streamlit's AppTest script runs)
UNGUARDED = """
import sys
from perfscope.cli import main
sys.exit(main(["import", "kineto", *sys.argv[2:], "--store", sys.argv[1]]))
"""


def test_an_unguarded_script_calling_the_import_reads_its_files_in_turn(tmp_path: Path) -> None:
    """Worker processes import the parent's main script again: an unguarded one would run its import
    once more in every worker (they died: BrokenProcessPool after a dashboard test left AppTest's
    script as __main__). Such a caller reads its files one after another, and the import succeeds."""
    import subprocess
    import sys

    paths = _rank_files(tmp_path, 2)
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {k: v for k, v in os.environ.items() if k != WORKERS_ENV}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "S"), *map(str, paths)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 ranks" in out.stdout and "Traceback" not in out.stderr
    assert {r["rank"] for r in _rows(tmp_path / "S")["steps"]} == {0, 1}
    # and a guarded script still reads in parallel: the guard is what makes the workers safe
    assert kineto._main_can_be_reimported()  # pytest's own main module is guarded
