"""Horovod timeline -> steps, comm and spans: the file is written here the way horovod/common/timeline.cc
writes it (metadata per tensor, events appended with the closing bracket moved along), read in full,
open-ended and cut mid-event; the negotiation wait per rank reaches the straggler analysis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfscope.analysis import Selection, run_analysis
from perfscope.cli import main
from perfscope.errors import PerfscopeError
from perfscope.importers import horovod
from perfscope.store.open import open_store

START_US = 1_700_000_000_000_000
TENSORS = {
    "allreduce.fc.weight": [256, 1024],
    "allreduce.fc.bias": [1024],
    "allreduce.conv1.weight": [64, 3, 7, 7],
}
STEPS = 14
STEP_US = 100_000  # one step every 100 ms
LATE_US = 5_000  # rank 1 reports every tensor 5 ms after rank 0


class TimelineWriter:
    """Horovod's TimelineWriter: `[` and pid 0's metadata first; per new tensor its process_name and
    process_sort_index; every event closes the array, the next replaces that `]` with `,`."""

    def __init__(self) -> None:
        self.text = ""
        self.pids: dict[str, int] = {}

    def event(self, tensor: str, ph: str, name: str, ts: int, args: dict | None = None) -> None:
        if not self.text:
            self.text = (
                "[\n"
                + json.dumps(
                    {
                        "name": "process_name",
                        "ph": "M",
                        "pid": 0,
                        "args": {"start_time_since_epoch_in_micros": START_US},
                    }
                )
                + ",\n"
            )
            self.text += json.dumps({"name": "process_sort_index", "ph": "M", "pid": 0,
                                     "args": {"sort_index": 0}}) + ",\n"  # fmt: skip
        else:
            self.text = self.text[:-1] + ","
        if tensor not in self.pids:
            pid = self.pids[tensor] = len(self.pids) + 1
            self.text += (
                json.dumps({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor}}) + ",\n"
            )
            self.text += json.dumps({"name": "process_sort_index", "ph": "M", "pid": pid,
                                     "args": {"sort_index": pid}}) + ",\n"  # fmt: skip
        ev: dict = {"ph": ph}
        if ph != "E":
            ev["name"] = name
        ev.update({"ts": ts, "pid": self.pids[tensor]})
        if ph == "X":
            ev["dur"] = 0
        if args:
            ev["args"] = args
        self.text += json.dumps(ev) + "]"


def timeline() -> str:
    w = TimelineWriter()
    for k in range(STEPS):
        t0 = k * STEP_US
        for i, tensor in enumerate(TENSORS):
            ready0 = t0 + 1_000 * i
            w.event(tensor, "B", "NEGOTIATE_ALLREDUCE", ready0)
            w.event(tensor, "X", "0", ready0)
            w.event(tensor, "X", "1", ready0 + LATE_US)
            w.event(tensor, "E", "", ready0 + LATE_US + 50)
        # one fused NCCL allreduce for all three tensors, as Horovod's fusion buffer does it
        s = t0 + 1_000 * (len(TENSORS) - 1) + LATE_US + 100
        for tensor in TENSORS:
            w.event(tensor, "B", "ALLREDUCE", s)
        for tensor in TENSORS:
            w.event(tensor, "B", "MEMCPY_IN_FUSION_BUFFER", s)
        for tensor in TENSORS:
            w.event(tensor, "E", "", s + 200)
        for tensor in TENSORS:
            w.event(tensor, "B", "NCCL_ALLREDUCE", s + 200)
        for tensor in TENSORS:
            w.event(tensor, "E", "", s + 3_200)
        for tensor, shape in TENSORS.items():
            w.event(
                tensor,
                "E",
                "",
                s + 3_400,
                {"dtype": "float32", "shape": "[" + ", ".join(map(str, shape)) + "]"},
            )
        w.text = w.text[:-1] + ","
        w.text += json.dumps({"ph": "i", "name": "CYCLE_START", "ts": s + 3_500, "s": "g"}) + "]"
    return w.text


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = tmp_path_factory.mktemp("hvd")
    path = d / "timeline.json"
    path.write_text(timeline())
    store = d / "store"
    assert main(["import", "horovod", str(path), "--store", str(store), "--experiment", "hvd"]) == 0
    return store


def test_parse_reads_every_collective(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(timeline())
    tl = horovod.parse(p)
    assert not tl.truncated and tl.start_epoch_us == START_US
    assert len(tl.collectives) == STEPS * len(TENSORS)
    c = tl.collectives[0]
    assert c.op == "ALLREDUCE" and c.ready_us == {0: 0.0, 1: float(LATE_US)}
    assert [a for a, _, _ in c.activities] == ["MEMCPY_IN_FUSION_BUFFER", "NCCL_ALLREDUCE"]
    assert c.nbytes == 4 * 256 * 1024


def test_rows_of_the_run(imported):
    with open_store(imported) as st:
        run = st.query("SELECT origin, source, world_size, backend, started_ns FROM runs").to_pylist()
        steps = st.query("SELECT rank, step, start_ns, step_ns, sync_exposed_ns, comm_count FROM steps "
                         "ORDER BY step, rank").to_pylist()  # fmt: skip
        comm = st.query(
            "SELECT rank, step, seq, op, bytes, start_ns, dur_ns FROM comm ORDER BY step, seq, rank"
        )
        spans = st.query("SELECT DISTINCT name FROM spans ORDER BY name").column("name").to_pylist()
    assert run == [{"origin": "horovod", "source": "measured", "world_size": 2, "backend": "horovod-nccl",
                    "started_ns": START_US * 1000}]  # fmt: skip
    assert len(steps) == 2 * STEPS and {s["comm_count"] for s in steps} == {3}
    # steady steps are 100 ms apart: end of one step's last collective to the next
    assert all(s["step_ns"] == pytest.approx(STEP_US * 1000, rel=1e-6) for s in steps[2:])
    # rank 0 reported its last tensor ready 5 ms before rank 1 and waits that much longer
    r0, r1 = steps[4], steps[5]
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["sync_exposed_ns"] - r1["sync_exposed_ns"] == pytest.approx(LATE_US * 1000, abs=1000)
    rows = comm.to_pylist()
    assert len(rows) == 2 * STEPS * len(TENSORS)
    first = [r for r in rows if r["step"] == 0 and r["seq"] == 0]
    assert {r["op"] for r in rows} == {"allreduce"} and first[0]["bytes"] == 4 * 256 * 1024
    assert first[1]["start_ns"] - first[0]["start_ns"] == LATE_US * 1000  # each rank enters at its tick
    assert first[0]["start_ns"] + first[0]["dur_ns"] == first[1]["start_ns"] + first[1]["dur_ns"]
    assert {"ALLREDUCE", "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "NCCL_ALLREDUCE"} <= set(spans)


def test_negotiation_wait_names_the_straggler(imported):
    with open_store(imported) as st:
        rows = {r["rank"]: r for r in run_analysis("stragglers", st, Selection()).to_pylist()}
    assert rows[1]["last_share"] == pytest.approx(1.0) and rows[1]["is_straggler"]
    assert rows[0]["wait_mean_ns"] == pytest.approx(LATE_US * 1000, rel=1e-6)
    assert rows[1]["wait_mean_ns"] == pytest.approx(0.0, abs=1)


def test_analyze_json_end_to_end(imported, capsys):
    capsys.readouterr()
    assert main(["analyze", str(imported), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (run,) = out["runs"]
    assert run["world_size"] == 2 and run["steady_steps"] >= 1
    assert run["step_ns"] == pytest.approx(STEP_US * 1000, rel=1e-3)


@pytest.mark.parametrize("shape", ["[" + "9" * 5000 + "]", "[99999999999, 99999999999]"])
def test_damaged_shapes_leave_bytes_unknown(tmp_path, shape):
    text = timeline().replace('"shape": "[1024]"', json.dumps({"shape": shape})[1:-1])
    bias = [
        c for c in horovod.parse(_put(tmp_path / "t.json", text)).collectives if c.tensor.endswith("bias")
    ]
    assert len(bias) == STEPS and all(c.nbytes is None for c in bias)


def test_open_and_cut_timelines_read_to_the_last_event(tmp_path, capsys):
    text = timeline()
    whole = len(horovod.parse(_put(tmp_path / "a.json", text)).collectives)
    # the job still running: Horovod had not yet written the closing bracket
    open_ended = horovod.parse(_put(tmp_path / "b.json", text[:-1]))
    assert open_ended.truncated and len(open_ended.collectives) == whole
    # killed mid-write: the file stops inside an event
    cut = text[: len(text) * 2 // 3]
    cut = cut[: cut.rfind('"ts"') + 3]
    tl = horovod.parse(_put(tmp_path / "c.json", cut))
    assert tl.truncated and 0 < len(tl.collectives) < whole
    assert main(["import", "horovod", str(tmp_path / "c.json"), "--store", str(tmp_path / "s")]) == 0
    assert "ends inside an event" in capsys.readouterr().err


def _put(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"[]", "empty JSON array"),
        (b'{"traceEvents": []}', "does not start with a JSON array"),
        (b"[1, 2, 3]", "malformed JSON"),
        (b'[{"ph": "B", "name": "x", "ts": 1}]', "without an integer pid"),
        (b'[{"ph": "B", "name": "x", "pid": 1, "ts": "soon"}]', "is not a time"),
        (
            b'[{"ph": "B", "name": "x", "pid": 1, "ts": 1}, {"ph": "E", "pid": 1, "ts": 2}]',
            "no finished collective",
        ),
        (b"[{" + b'"a": "' + b"x" * (3 << 20) + b'"}]', "over 1 MiB"),
        (b'[{"ph": "M", "pid": 0 }, {"ph": ]', "malformed JSON"),
        (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", "binary data"),
        (timeline().replace('"name": "1"', '"name": "987654321"').encode(), "is not a rank"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, content, says):
    path = _put(tmp_path / "t.json", content)
    with pytest.raises(PerfscopeError, match=says):
        horovod.import_files([path], horovod.ImportOptions(store=tmp_path / "s0"))
    assert main(["import", "horovod", str(path), "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err


def test_two_files_are_refused(tmp_path, capsys):
    a, b = _put(tmp_path / "a.json", timeline()), _put(tmp_path / "b.json", timeline())
    assert main(["import", "horovod", str(a), str(b), "--store", str(tmp_path / "s")]) == 2
    assert "one file" in capsys.readouterr().err


def test_rows_beyond_the_plausible_bound_are_refused_and_nothing_is_left(tmp_path, capsys, monkeypatch):
    """A file may claim more rows than any trace holds (ranks x collectives): refused in one line at
    the bound, with the run's partitions removed. The bound is lowered here to 2 steps' rows."""
    from perfscope.importers import common

    monkeypatch.setattr(common, "MAX_ROWS", 2 * 2)
    path = tmp_path / "t.json"
    path.write_text(timeline())
    capsys.readouterr()
    assert main(["import", "horovod", str(path), "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more than 4 comm rows" in err, err
    assert not list((tmp_path / "s").glob("*/run_id=*"))
