"""The collector's GPU paths on a real GPU: CUDA-event timing (no per-step synchronize), real NVML
values, DDP over NCCL, NVTX ranges under Nsight Systems. Skipped without CUDA and a driver."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import perfscope
from perfscope import open_store

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_event_timing_without_synchronize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden() -> None:
        raise AssertionError("perfscope synchronized the device")

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(256, 1024, device="cuda") for _ in range(20)]
    cycles = 20_000_000  # torch.cuda._sleep spins the GPU: ~10 ms at ~2 GHz
    with perfscope.profile(tmp_path, batch_size=256, gpu_telemetry=True) as prof:
        prof.watch(model)
        monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
        for x in prof.steps(batches):
            with prof.phase("forward"):
                torch.cuda._sleep(cycles)
                loss = model(x).square().mean()
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.log(loss=loss.detach())  # a CUDA tensor: converted once its step is resolved
        monkeypatch.undo()
    with open_store(tmp_path) as store:
        steps = store.query("SELECT * FROM steps ORDER BY step").to_pylist()
        (run,) = store.query("SELECT device_model, cuda_version, driver_version FROM runs").to_pylist()
        (rank,) = store.query("SELECT device_index, device_name FROM ranks").to_pylist()
        losses = store.query("SELECT value FROM metrics WHERE name = 'loss'").column(0).to_pylist()
    assert len(steps) == 20 and {s["clock"] for s in steps} == {"cuda"}
    sleep_ns = [s["forward_ns"] for s in steps[2:]]
    # the host returns at once from _sleep; only device timing sees the ~10 ms
    assert min(sleep_ns) > 2_000_000, sleep_ns
    assert all(s["other_ns"] >= 0 and s["step_ns"] >= s["forward_ns"] for s in steps)
    assert (
        run["device_model"] == torch.cuda.get_device_name(0) and run["cuda_version"] and run["driver_version"]
    )
    assert rank["device_index"] == 0 and len(losses) == 20 and all(v == v for v in losses)


def test_real_nvml_values_are_in_documented_ranges() -> None:
    import pynvml

    from perfscope.collectors.faults import Faults
    from perfscope.collectors.nvml import NvmlGpus

    faults = Faults(0)
    gpus = NvmlGpus(pynvml, faults)
    try:
        x = torch.randn(8192, 8192, device="cuda")
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
        gpus.sample()
        torch.cuda.synchronize()
        rows = gpus.sample()
    finally:
        gpus.close()
    assert rows and gpus.driver_version
    r = rows[0]
    total = torch.cuda.get_device_properties(0).total_memory
    assert r["mem_total_bytes"] >= total and 0 < r["mem_used_bytes"] <= r["mem_total_bytes"]
    assert 10_000 < r["power_mw"] < 2_000_000  # 10 W .. 2 kW, in mW
    assert r["energy_mj"] > 0 and 5 < r["temp_c"] < 110 and r["sm_clock_mhz"] > 100
    assert 0 <= r["util_gpu_pct"] <= 100 and 0 <= r["util_mem_pct"] <= 100
    print("NVML sample:", r, "events:", faults.kinds)


def test_ddp_over_nccl_records_buckets_with_cuda_events(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, torch, torch.distributed as dist, perfscope
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=8)
        with perfscope.profile({str(tmp_path)!r}, batch_size=64) as prof:
            prof.watch(ddp)
            for x in prof.steps([torch.randn(64, 2048, device="cuda") for _ in range(10)]):
                with prof.phase("forward"):
                    loss = ddp(x).square().mean()
                with prof.phase("backward"):
                    loss.backward()
        dist.destroy_process_group()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    with open_store(tmp_path) as store:
        (run,) = store.query("SELECT backend, grad_bytes, nccl_version FROM runs").to_pylist()
        sums = store.query("SELECT sum(bytes)::BIGINT FROM comm GROUP BY step").column(0).to_pylist()
        steps = store.query("SELECT * FROM steps").to_pylist()
        clocks = store.query("SELECT DISTINCT clock FROM comm").column(0).to_pylist()
    assert run["backend"] == "nccl" and run["nccl_version"] and set(sums) == {run["grad_bytes"]}
    assert clocks == ["cuda"]
    assert all(0 <= s["sync_exposed_ns"] <= s["comm_total_ns"] + 100_000 for s in steps)


@pytest.mark.skipif(shutil.which("nsys") is None, reason="needs Nsight Systems (nsys) to see NVTX ranges")
def test_nvtx_ranges_appear_in_nsight_systems(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch, perfscope
            with perfscope.profile({str(tmp_path / "store")!r}, poll_hz=0) as prof:
                for x in prof.steps([torch.randn(8, 8, device="cuda") for _ in range(5)]):
                    with prof.phase("forward"):
                        y = x @ x
            """
        )
    )
    report = tmp_path / "trace"
    env = {**os.environ}
    subprocess.run(["nsys", "profile", "-t", "nvtx,cuda", "-o", str(report), sys.executable, str(script)],
                   check=True, timeout=300, env=env)  # fmt: skip
    stats = subprocess.run(
        ["nsys", "stats", "-r", "nvtx_sum", f"{report}.nsys-rep"], capture_output=True, text=True, timeout=300
    )
    assert "forward" in stats.stdout and "data" in stats.stdout, stats.stdout
