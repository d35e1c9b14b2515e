"""Trackers: a store's per-step phase times, scaling summary and findings sent to TensorBoard, MLflow
(local file store) and W&B (offline), each read back with its library's own reader."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from storegen import MS, make_run

import perfscope
from perfscope.analysis import run_analysis
from perfscope.cli import main
from perfscope.exporters.trackers import payloads

STEPS = 24


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """World sizes 1 and 4 where exposed sync grows from 0 to 30 ms: communication-bound."""
    root = tmp_path_factory.mktemp("trackers") / "S"
    for n, sync_ms in ((1, 0), (4, 30)):
        phases = {"data": 1 * MS, "forward": 10 * MS, "backward": 20 * MS, "sync_exposed": sync_ms * MS,
                  "optimizer": 1 * MS, "other": 1 * MS}  # fmt: skip
        make_run(root, f"n{n}", world_size=n, steps=STEPS, phases=phases, experiment="trk")
    return root


def _expected(study: Path) -> dict[str, dict[str, Any]]:
    with perfscope.open_store(study) as store:
        return {r["run_id"]: r for r in run_analysis("scaling", store).to_pylist()}


def _titles(study: Path, run_id: str) -> list[str]:
    with perfscope.open_store(study) as store:
        return [f["title"] for f in next(p for p in payloads(store) if p.run_id == run_id).findings]


def test_payloads_hold_the_analyses_numbers(study: Path) -> None:
    scaling = _expected(study)
    with perfscope.open_store(study) as store:
        runs = {p.run_id: p for p in payloads(store)}
    assert set(runs) == {"n1", "n4"}
    n4 = runs["n4"]
    assert len(n4.steps) == STEPS
    for _, m in n4.steps:
        assert m["forward_ms"] == pytest.approx(10.0, rel=1e-6)
        assert m["sync_exposed_ms"] == pytest.approx(30.0, rel=1e-6)
    assert n4.summary["efficiency"] == pytest.approx(scaling["n4"]["efficiency"], rel=1e-9)
    assert n4.summary["efficiency"] < 0.8
    assert n4.summary["step_ms"] == pytest.approx(scaling["n4"]["step_ns"] / 1e6, rel=1e-9)
    assert n4.params["world_size"] == "4" and n4.params["experiment"] == "trk"
    assert n4.findings and all("n4" in f["evidence"]["run_ids"] for f in n4.findings)


def test_tensorboard_event_files(study: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["report", str(study), "--to", "tensorboard", "-o", str(tmp_path / "tb")]) == 0
    acc = EventAccumulator(str(tmp_path / "tb" / "n4"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    fwd = acc.Scalars("perfscope/forward_ms")
    assert [e.step for e in fwd] == list(range(STEPS))
    assert all(e.value == pytest.approx(10.0, rel=1e-5) for e in fwd)
    eff = acc.Scalars("perfscope/summary/efficiency")[0].value
    assert eff == pytest.approx(_expected(study)["n4"]["efficiency"], rel=1e-5)
    text = acc.Tensors("perfscope/findings/text_summary")[0].tensor_proto.string_val[0].decode()
    titles = _titles(study, "n4")
    assert titles and all(t in text for t in titles)


def _read_mlflow(uri: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The user's MLflow, in a process of its own: the experiments and runs it finds at `uri`."""
    code = (
        "import sys, mlflow; c = mlflow.MlflowClient(tracking_uri=sys.argv[1]); "
        "e = c.get_experiment_by_name('trk'); "
        "print(sorted(r.info.run_name for r in c.search_runs([e.experiment_id])))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PERFSCOPE_"))}
    return subprocess.run(
        [sys.executable, "-c", code, uri], env={**clean, **env}, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip


def test_mlflow_file_store(
    study: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["report", str(study), "--to", "mlflow", "-o", str(tmp_path / "mlruns")]) == 0
    # perfscope's permission to write a folder store does not stay in the process (a training job's)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    uri = (tmp_path / "mlruns").as_uri()
    err = capsys.readouterr().err.strip().splitlines()
    notes = [line for line in err if not line.startswith("sent to ")]
    plain = _read_mlflow(uri, {})
    if plain.returncode != 0:  # an MLflow that refuses folder stores: the user is told, in one line
        assert "MLFLOW_ALLOW_FILE_STORE" in plain.stderr
        assert len(notes) == 1 and "MLFLOW_ALLOW_FILE_STORE=true" in notes[0] and uri in notes[0]
    else:
        assert notes == []
    opened = _read_mlflow(uri, {"MLFLOW_ALLOW_FILE_STORE": "true"})
    assert opened.returncode == 0, opened.stderr[-2000:]
    assert opened.stdout.strip() == "['n1', 'n4']"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("trk")
    assert exp is not None
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"n1", "n4"}
    n4 = runs["n4"]
    assert n4.data.params["world_size"] == "4"
    assert n4.data.metrics["perfscope/summary/efficiency"] == pytest.approx(
        _expected(study)["n4"]["efficiency"]
    )
    history = client.get_metric_history(n4.info.run_id, "perfscope/sync_exposed_ms")
    assert sorted(m.step for m in history) == list(range(STEPS))
    assert all(m.value == pytest.approx(30.0) for m in history)
    local = client.download_artifacts(n4.info.run_id, "perfscope/findings.json", str(tmp_path))
    findings = json.loads(Path(local).read_text())
    assert findings and int(n4.data.tags["perfscope.findings"]) == len(findings)


def test_mlflow_database_store_without_sqlalchemy_is_one_line(
    study: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """mlflow-skinny has no SQLAlchemy: `-o sqlite:///...` (and MLflow's own default store) exited 70
    from deep inside MLflow. It is one line naming what to install, exit 2, nothing written."""
    mlflow = pytest.importorskip("mlflow")
    for module in ("sqlalchemy", "alembic"):
        monkeypatch.setitem(sys.modules, module, None)  # absent, as under mlflow-skinny alone
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "m.db"
    dests = [["-o", f"sqlite:///{db}"]]
    if mlflow.get_tracking_uri().startswith("sqlite:"):
        dests.append([])  # no -o: MLflow's own default store (sqlite:///mlflow.db since MLflow 3)
    for dest in dests:
        assert main(["report", str(study), "--to", "mlflow", *dest]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install sqlalchemy alembic" in err[0], err
        assert "Traceback" not in err[0] and "internal error" not in err[0]
    assert not db.exists() and not (tmp_path / "mlflow.db").exists()


def test_mlflow_database_store(study: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With SQLAlchemy and alembic installed, the sqlite store MLflow reads by default is written,
    and the user's MLflow opens it with no setting."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["report", str(study), "--to", "mlflow", "-o", uri]) == 0
    opened = _read_mlflow(uri, {})
    assert opened.returncode == 0, opened.stderr[-2000:]
    assert opened.stdout.strip() == "['n1', 'n4']"


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of an offline run file: W&B's header, then a LevelDB-style log of
    32 KiB blocks whose chunks (crc32, length, type) are joined into records."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    records, pending, off, block = [], b"", 7, 32768
    while off + 7 <= len(raw):
        if block - off % block < 7:  # a block's tail too short for a header is padding
            off += block - off % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[off : off + 7])
        chunk, off = raw[off + 7 : off + 7 + length], off + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def test_wandb_offline(study: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["report", str(study), "--to", "wandb", "-o", str(tmp_path / "wb"), "--runs", "n4"]) == 0
    files = list((tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for rec in _wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            )
        elif kind == "summary":
            summary.update(
                {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in rec.summary.update}
            )
        elif kind == "run":
            assert rec.run.display_name == "n4" and rec.run.project == "trk"
    steps = [h for h in history if "perfscope/forward_ms" in h]
    assert [h["_step"] for h in steps] == list(range(STEPS))
    assert all(h["perfscope/forward_ms"] == pytest.approx(10.0) for h in steps)
    assert summary["perfscope/summary/efficiency"] == pytest.approx(_expected(study)["n4"]["efficiency"])
    table = next(h for h in history if h.get("perfscope/findings/_type") == "table-file")
    rows = json.loads((files[0].parent / "files" / table["perfscope/findings/path"]).read_text())
    titles = _titles(study, "n4")
    assert [r[1] for r in rows["data"]] == titles and rows["columns"][1] == "title"


def test_bad_selection_is_one_line(study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["report", str(study), "--to", "tensorboard", "-o", str(tmp_path), "--runs", "no-such-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no runs" in err[0]
