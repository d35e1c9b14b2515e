"""perfscope.profile in one process on a real model and a real store: metadata, steps, FLOPs, and
the faults that must never reach the training loop (errors in phases, a full or read-only disk)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import perfscope
import perfscope.store.live
from perfscope import PerfscopeWarning, open_store
from perfscope.collectors.run_metadata import READ_SETTINGS as SETTINGS_READ
from perfscope.store.schema import RUNS

torch = pytest.importorskip("torch")
nn = torch.nn


def _loader(n: int = 64, batch: int = 8) -> Any:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(
        torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)
    )
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def _train(prof: Any, model: Any, loader: Any, *, fail_at: int | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, (x, y) in enumerate(prof.steps(loader)):
        with prof.phase("forward"):
            if i == fail_at:
                raise KeyError("user bug")
            loss = nn.functional.cross_entropy(model(x), y)
        with prof.phase("backward"):
            loss.backward()
        with prof.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        prof.log(loss=loss.item())
        losses.append(loss.item())
    return losses


def _model() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def test_every_runs_column_can_be_given_by_keyword(tmp_path: Path) -> None:
    given = {
        "cluster": "taurus/alpha",
        "backend": "horovod-nccl",
        "scaling_mode": "Weak",
        "tags": {"optimizer": "sgd"},
        "flops_per_step": 1.5e9,
        "device_peak_flops": 9.9e14,
        "dataset_samples": 50_000,
        "model": "resnet50",
        "device_model": "NVIDIA A100-SXM4-40GB",
        "global_batch_size": 600,
        "world_size": 8,
        "nodes": 2,
        "gpus_per_node": 4,
        # the parallel layout's sizes (schema v3): 8 ranks = 4 data-parallel x 2 pipeline stages
        "dp_size": 4,
        "pp_size": 2,
        "tp_size": 1,
        "cp_size": 1,
        "param_count": 25_000_000,
        "grad_bytes": 100_000_000,
        "hostname": "node-1",
        "driver_version": "550.54",
        "cuda_version": "12.4",
        "nccl_version": "2.21.5",
        "torch_version": "2.4.0",
        "python_version": "3.11.9",
        "perfscope_version": "0.0.1",
        "source": "measured",
        "lr": 0.1,  # no column: becomes a tag
    }
    with perfscope.profile(tmp_path, experiment="kw", batch_size=75, poll_hz=0, **given) as prof:
        prof.watch(_model())
        _train(prof, _model(), _loader(16))
    with open_store(tmp_path) as store:
        (row,) = store.query("SELECT * FROM runs").to_pylist()
    assert row["experiment"] == "kw" and row["batch_size_per_rank"] == 75 and row["scaling_mode"] == "weak"
    for key, value in given.items():
        if key in ("tags", "scaling_mode", "lr"):
            continue
        assert row[key] == value, key
    assert json.loads(row["tags"]) == {"optimizer": "sgd", "lr": 0.1}
    assert row["ended_ns"] > row["started_ns"]
    # origin names an imported trace format: NULL for the collector, never a keyword
    settable = set(RUNS.column_names) - {
        "experiment",
        "batch_size_per_rank",
        "started_ns",
        "ended_ns",
        "origin",
        # the job's settings: read from the model and the environment, never given (test_collect_settings)
        *SETTINGS_READ,
    }
    assert settable <= set(given), "every runs column is exercised by this test"


def test_keyword_errors_are_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="world_size"):
        perfscope.profile(tmp_path, world_size="8")
    with pytest.raises(ValueError, match="scaling_mode"):
        perfscope.profile(tmp_path, scaling_mode="linear")
    with pytest.raises(ValueError, match="ended_ns"):
        perfscope.profile(tmp_path, ended_ns=5)


def test_a_measured_run_reads_back(tmp_path: Path) -> None:
    model = _model()
    with perfscope.profile(tmp_path, experiment="e", batch_size=8, poll_hz=50, gpu_telemetry=False) as prof:
        assert prof.watch(model) is model
        losses = _train(prof, model, _loader(64))
        run_id = prof.run_id
    with open_store(tmp_path) as store:
        runs = store.query("SELECT * FROM runs").to_pylist()
        steps = store.query("SELECT * FROM steps ORDER BY step").to_pylist()
        metrics = store.query("SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step").to_pylist()
        ranks = store.query("SELECT * FROM ranks").to_pylist()
        host = store.query("SELECT * FROM host_samples").to_pylist()
        raw_runs = store.query("SELECT count(*) AS n FROM read_parquet(?)", [f"{tmp_path}/runs/*/*.parquet"])
    assert [r["run_id"] for r in runs] == [run_id]
    assert raw_runs.column("n")[0].as_py() == 2  # written when the loop started and again at close
    run = runs[0]
    params = sum(p.numel() for p in model.parameters())
    assert (run["param_count"], run["grad_bytes"], run["model"]) == (params, params * 4, "Sequential")
    assert (run["world_size"], run["backend"], run["device_model"], run["dataset_samples"]) == (
        1,
        "none",
        "cpu",
        64,
    )
    assert run["torch_version"] == torch.__version__ and run["source"] == "measured"
    assert [s["step"] for s in steps] == list(range(8)) and all(s["samples"] == 8 for s in steps)
    for s in steps:
        parts = s["data_ns"] + s["forward_ns"] + s["backward_ns"] + s["sync_exposed_ns"] + s["optimizer_ns"]
        assert s["other_ns"] >= 0 and parts + s["other_ns"] == s["step_ns"]
    assert [m["value"] for m in metrics] == pytest.approx(losses)
    assert ranks[0]["pid"] == os.getpid() and ranks[0]["clock_offset_ns"] == 0
    assert host and all(h["cpu_count"] == os.cpu_count() and h["rss_bytes"] > 0 for h in host)


def test_flops_are_counted_once_when_asked(tmp_path: Path) -> None:
    # one bias-free Linear(32, 64) on a batch of 8: forward x@W^T is 2*8*32*64 FLOPs, backward
    # computes only the weight's gradient (the input needs none): the same again
    model = nn.Linear(32, 64, bias=False)
    with perfscope.profile(tmp_path, batch_size=8, count_flops=True, poll_hz=0) as prof:
        prof.watch(model)
        for x in prof.steps([torch.randn(8, 32) for _ in range(3)]):
            with prof.phase("forward"):
                loss = model(x).sum()
            with prof.phase("backward"):
                loss.backward()
    with open_store(tmp_path) as store:
        (flops,) = store.query("SELECT flops_per_step FROM runs").column(0).to_pylist()
    assert flops == 2 * (2 * 8 * 32 * 64)


def test_explicit_steps_without_a_loader(tmp_path: Path) -> None:
    with perfscope.profile(tmp_path, batch_size=4, poll_hz=0) as prof:
        for i in range(5):
            with prof.phase("forward"):
                pass
            with prof.phase("sync"):
                pass
            prof.step(samples=i + 1)
    with open_store(tmp_path) as store:
        steps = store.query("SELECT step, samples, sync_exposed_ns FROM steps ORDER BY step").to_pylist()
    assert [(s["step"], s["samples"]) for s in steps] == [(i, i + 1) for i in range(5)]
    assert all(s["sync_exposed_ns"] >= 0 for s in steps)


def test_leaving_the_loop_at_the_top_adds_no_step(tmp_path: Path) -> None:
    with perfscope.profile(tmp_path, poll_hz=0) as prof:
        for i, _ in enumerate(prof.steps(range(100))):
            if i == 3:
                break
            with prof.phase("forward"):
                pass
    with open_store(tmp_path) as store:
        assert store.query("SELECT step FROM steps ORDER BY step").column(0).to_pylist() == [0, 1, 2]


def test_an_exception_in_a_phase_is_recorded_and_reraised_untouched(tmp_path: Path) -> None:
    with pytest.raises(KeyError) as caught, perfscope.profile(tmp_path, poll_hz=0) as prof:
        _train(prof, _model(), _loader(64), fail_at=2)
    assert caught.value.args == ("user bug",)
    assert caught.traceback[-1].name == "_train"  # raised where the user raised it, not re-wrapped
    with open_store(tmp_path) as store:
        assert store.query("SELECT step FROM steps ORDER BY step").column(0).to_pylist() == [0, 1]
        errs = store.query("SELECT step, name, error FROM spans WHERE error IS NOT NULL").to_pylist()
        (run,) = store.query("SELECT ended_ns FROM runs").to_pylist()
    assert errs == [{"step": 2, "name": "forward", "error": "KeyError"}]
    assert run["ended_ns"] is not None


def test_runs_in_one_process_get_their_own_ids(tmp_path: Path) -> None:
    ids = []
    for _ in range(2):
        with perfscope.profile(tmp_path, poll_hz=0, run_id="fixed") as prof:
            prof.step()
            ids.append(prof.run_id)
    assert ids[0] == "fixed" and ids[1] != ids[0]


def test_disabled_by_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFSCOPE_DISABLE", "1")
    store = tmp_path / "store"
    with perfscope.profile(store) as prof:
        losses = _train(prof, _model(), _loader(16))
        assert not prof.recording
    assert len(losses) == 2 and not store.exists()


def test_a_full_disk_costs_rows_not_the_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(perfscope.store.live.LiveSegment, "append", no_space)  # every batch meets a full disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(tmp_path, poll_hz=0, roll_interval_s=0.05) as prof:
            losses = _train(prof, _model(), _loader(64))
            writer = prof._writer
    assert len(losses) == 8
    assert writer is not None and writer.stats.rows_dropped > 0 and writer.stats.rows_written == 0
    texts = [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]
    assert any("No space left" in t for t in texts)
    assert len([t for t in texts if "could not write" in t]) == 1  # one warning, not one per segment


@contextlib.contextmanager
def _read_only_dir(path: Path) -> Iterator[Path]:
    """A folder this process cannot write into: mode 0555, or for root (who ignores modes) the
    immutable attribute, which binds root too."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if (
        shutil.which("chattr") is None
        or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode
    ):
        pytest.skip("running as root without chattr +i: no way to make a folder read-only for this process")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_store_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    with _read_only_dir(tmp_path / "ro") as ro:
        with pytest.raises(OSError):
            (ro / "probe").touch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with perfscope.profile(ro / "store", poll_hz=20, roll_interval_s=0.05) as prof:
                losses = _train(prof, _model(), _loader(64))
        assert len(losses) == 8 and not (ro / "store").exists()
    texts = [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]
    assert len([t for t in texts if "could not write to the store" in t]) == 1


class RecordingDomain:
    """The calls an NVTX tool would see, in place of the domain nvtx returns when one is attached."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.attributes_made: list[str] = []

    def get_registered_string(self, name: str) -> str:
        return f"registered:{name}"

    def get_event_attributes(self, message: Any = None, color: Any = None) -> str:
        self.attributes_made.append(message)
        return f"attrs:{message}"

    def push_range(self, attrs: Any) -> None:
        self.calls.append(("push", attrs))

    def pop_range(self) -> None:
        self.calls.append(("pop", None))

    def start_range(self, attrs: Any) -> int:
        self.calls.append(("start", attrs))
        return len(self.calls)

    def end_range(self, range_id: int) -> None:
        self.calls.append(("end", range_id))


def test_nvtx_ranges_for_steps_and_phases_with_cached_attributes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nvtx

    domain = RecordingDomain()
    monkeypatch.setattr(nvtx, "get_domain", lambda name: domain if name == "perfscope" else None)
    with perfscope.profile(tmp_path, poll_hz=0) as prof:
        for _ in prof.steps(range(4)):
            with prof.phase("forward"), prof.span("inner"):
                pass
    kinds = [k for k, _ in domain.calls]
    # data, forward, inner per step, and the last wait on the loader that ended the loop
    assert kinds.count("push") == kinds.count("pop") == 4 * 3 + 1
    assert sorted(domain.attributes_made) == sorted(
        f"registered:{n}" for n in ("data", "forward", "inner", "step")
    )
    starts = [i + 1 for i, (k, _) in enumerate(domain.calls) if k == "start"]
    ends = [rid for k, rid in domain.calls if k == "end"]
    assert len(starts) == 5 and sorted(ends) == starts  # every step range closed, the last at close
    assert ("push", "attrs:registered:forward") in domain.calls


class HostTimedEvent:
    """A stand-in for torch.cuda.Event on a machine without CUDA: record() notes the host clock,
    query() says whether the (imaginary) device has passed it, elapsed_time() answers in ms. It has
    no synchronize(): perfscope must never wait for the device."""

    passed = True

    def record(self) -> None:
        self.t_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return HostTimedEvent.passed

    def elapsed_time(self, end: HostTimedEvent) -> float:
        return (end.t_ns - self.t_ns) / 1e6


def test_cuda_timing_path_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from perfscope.collectors.cuda_timing import CudaMarks

    monkeypatch.setattr(CudaMarks, "for_torch", classmethod(lambda cls: cls(HostTimedEvent)))
    HostTimedEvent.passed = False  # the device lags: nothing can be resolved during the loop
    with perfscope.profile(tmp_path, timing="cuda", poll_hz=0) as prof:
        for i, x in enumerate(prof.steps([torch.ones(4, 2)] * 5)):
            with prof.phase("forward"):
                time.sleep(0.002)
            prof.log(loss=x.sum() * i)  # a tensor: converted once its step is resolved
        assert prof._timeline.steps_written == 0 and len(prof._timeline.pending) == 5
        HostTimedEvent.passed = True  # the device catches up before close
    with open_store(tmp_path) as store:
        steps = store.query("SELECT * FROM steps ORDER BY step").to_pylist()
        losses = store.query("SELECT value FROM metrics ORDER BY step").column(0).to_pylist()
    assert [s["clock"] for s in steps] == ["cuda"] * 5
    assert all(s["forward_ns"] >= 2_000_000 and s["step_ns"] >= s["forward_ns"] for s in steps)
    assert losses == [8.0 * i for i in range(5)]


def test_a_bug_of_ours_stops_recording_not_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from perfscope.collectors.phases import Timeline

    calls = {"n": 0}
    real_end_step = Timeline.end_step

    def broken_after_two(self: Timeline, samples: int | None = None) -> None:
        calls["n"] += 1
        if calls["n"] > 2:
            raise ZeroDivisionError("a bug in perfscope")
        real_end_step(self, samples)

    monkeypatch.setattr(Timeline, "end_step", broken_after_two)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(tmp_path, poll_hz=0) as prof:
            losses = _train(prof, _model(), _loader(64))
            assert not prof.recording
    assert len(losses) == 8  # every step trained
    assert len([w for w in caught if "internal error" in str(w.message)]) == 1
    with open_store(tmp_path) as store:
        assert store.query("SELECT count(*) FROM steps").column(0)[0].as_py() == 2
        assert store.query("SELECT kind FROM events").column(0).to_pylist() == ["internal_error"]
