"""GPU and host telemetry: NVML through autospec'd pynvml functions returning values in NVML's
documented units (as an H100/H200 reports them), failures, a GPU lost mid-run, NVML missing, and
one poller per host."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pynvml
import pytest

import perfscope
from perfscope import PerfscopeWarning, open_store
from perfscope.collectors.faults import Faults
from perfscope.collectors.host_metrics import HostSampler
from perfscope.collectors.nvml import NvmlGpus, open_gpus
from perfscope.collectors.poller import HostClaim, Poller
from perfscope.store.writer import StoreWriter

GIB = 1024**3
# Values as NVML documents them, shaped after an H200 (141 GiB HBM3e, 700 W board) under training:
# power in mW, energy in mJ since driver load, memory in bytes, clocks in MHz, temperature in °C,
# nvmlDeviceGetPcieThroughput in KB/s; PCIe byte counters in bytes and NVLink counters in KiB.
H200 = {
    "name": "NVIDIA H200",
    "util": (97, 41),
    "mem_total": 150_754_820_096,
    "mem_used": 101 * GIB,
    "power_mw": 612_345,
    "energy_mj": 9_876_543_210,
    "sm_mhz": 1980,
    "mem_mhz": 3201,
    "temp_c": 61,
    "reasons": 0x4,  # nvmlClocksEventReasonSwPowerCap
    "pcie_kbps": 1_250_000,
}


class FakeNvml:
    """Installs autospec'd stand-ins for the pynvml functions the collector calls. Each GPU's
    counters advance by fixed amounts per sample so rates can be checked exactly."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int = 2, *, gpm: bool = True) -> None:
        self.mp = monkeypatch
        self.gpus = gpus
        self.samples = [0] * gpus  # field-value reads per GPU
        self.mocks: dict[str, Any] = {}
        h = [f"handle{i}" for i in range(gpus)]
        idx = {hh: i for i, hh in enumerate(h)}
        self.idx = idx
        self._fake("nvmlInit", return_value=None)
        self._fake("nvmlShutdown", return_value=None)
        self._fake("nvmlSystemGetDriverVersion", return_value="550.90.07")
        self._fake("nvmlDeviceGetCount", return_value=gpus)
        self._fake("nvmlDeviceGetHandleByIndex", side_effect=lambda i: h[i])
        self._fake(
            "nvmlDeviceGetUUID", side_effect=lambda hh: f"GPU-{idx[hh]:08d}-0000-0000-0000-000000000000"
        )
        self._fake("nvmlDeviceGetName", return_value=H200["name"])
        self._fake(
            "nvmlDeviceGetUtilizationRates",
            side_effect=lambda hh: pynvml.c_nvmlUtilization_t(gpu=H200["util"][0], memory=H200["util"][1]),
        )
        self._fake(
            "nvmlDeviceGetMemoryInfo",
            side_effect=lambda hh, version=None: pynvml.c_nvmlMemory_t(
                total=H200["mem_total"], free=H200["mem_total"] - H200["mem_used"], used=H200["mem_used"]
            ),
        )
        self._fake("nvmlDeviceGetPowerUsage", return_value=H200["power_mw"])
        self._fake("nvmlDeviceGetTotalEnergyConsumption", return_value=H200["energy_mj"])
        self._fake(
            "nvmlDeviceGetClockInfo",
            side_effect=lambda hh, t: H200["sm_mhz"] if t == pynvml.NVML_CLOCK_SM else H200["mem_mhz"],
        )
        self._fake("nvmlDeviceGetTemperature", return_value=H200["temp_c"])
        self._fake("nvmlDeviceGetCurrentClocksEventReasons", return_value=H200["reasons"])
        self._fake("nvmlDeviceGetPcieThroughput", return_value=H200["pcie_kbps"])
        self._fake("nvmlDeviceGetFieldValues", side_effect=self._field_values)
        support = pynvml.c_nvmlGpmSupport_t(version=1, isSupportedDevice=1 if gpm else 0)
        self._fake("nvmlGpmQueryDeviceSupport", return_value=support)
        self._fake("nvmlGpmSampleAlloc", side_effect=lambda: pynvml.c_nvmlGpmSample_t())
        self._fake("nvmlGpmSampleFree", return_value=None)
        self._fake("nvmlGpmSampleGet", side_effect=lambda dev, s: s)
        self._fake("nvmlGpmMetricsGet", side_effect=self._gpm_metrics)

    def _fake(self, name: str, **kw: Any) -> None:
        m = mock.create_autospec(getattr(pynvml, name), **kw)
        self.mocks[name] = m
        self.mp.setattr(pynvml, name, m)

    def _field_values(self, handle: Any, field_ids: list[Any]) -> Any:
        i = self.idx[handle]
        n = self.samples[i]
        self.samples[i] += 1
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for v, (fid, scope) in zip(values, field_ids, strict=True):
            v.fieldId, v.scopeId = fid, scope
            v.timestamp = 1_000_000 * (n + 1)  # µs: one second between samples
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            v.nvmlReturn = pynvml.NVML_SUCCESS
            per_s = {
                pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: 2_000_000_000,  # bytes per second
                pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: 500_000_000,
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 300_000_000,  # KiB per second
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 290_000_000,
            }[fid]
            v.value.ullVal = 10**12 + per_s * n
        return values

    @staticmethod
    def _gpm_metrics(req: Any) -> Any:
        assert req.version == pynvml.NVML_GPM_METRICS_GET_VERSION and req.numMetrics == 2
        wanted = {pynvml.NVML_GPM_METRIC_SM_UTIL: 71.5, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 38.25}
        for k in range(2):
            req.metrics[k].value = wanted[req.metrics[k].metricId]
            req.metrics[k].nvmlReturn = pynvml.NVML_SUCCESS
        return req


class Sink:
    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[Any, ...]]] = {}

    def append(self, table: str, row: tuple[Any, ...]) -> None:
        self.rows.setdefault(table, []).append(row)


def _poller(sink: Sink, faults: Faults) -> Poller:
    gpus = NvmlGpus(pynvml, faults)
    return Poller(
        sink,
        gpus=gpus,
        host=HostSampler(lambda: [os.getpid()]),
        hz=10,
        hostname="node7",
        node_rank=3,
        wall_ns=lambda: 1_700_000_000_000_000_000,
        faults=faults,
    )


def _sample(poller: Poller, times: int) -> list[str]:
    """Sample `times` times; the texts of the PerfscopeWarnings shown meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            poller.sample_once()
    return [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]


def _gpu_dicts(sink: Sink) -> list[dict[str, Any]]:
    from perfscope.store.schema import GPU_SAMPLES

    return [dict(zip(GPU_SAMPLES.column_names, r, strict=True)) for r in sink.rows.get("gpu_samples", [])]


def test_nvml_values_land_in_their_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch, gpus=2)
    sink, faults = Sink(), Faults(0)
    poller = _poller(sink, faults)
    for _ in range(3):
        poller.sample_once()
    rows = _gpu_dicts(sink)
    assert len(rows) == 6 and {r["gpu_index"] for r in rows} == {0, 1}
    last = rows[-1]
    assert (last["ts_ns"], last["hostname"], last["node_rank"]) == (1_700_000_000_000_000_000, "node7", 3)
    assert last["gpu_uuid"] == "GPU-00000001-0000-0000-0000-000000000000"
    assert (last["util_gpu_pct"], last["util_mem_pct"]) == (97.0, 41.0)
    assert (last["mem_used_bytes"], last["mem_total_bytes"]) == (H200["mem_used"], H200["mem_total"])
    assert (last["power_mw"], last["energy_mj"]) == (612_345.0, 9_876_543_210.0)
    assert (last["sm_clock_mhz"], last["mem_clock_mhz"], last["temp_c"]) == (1980.0, 3201.0, 61.0)
    assert last["clocks_event_reasons"] == 0x4
    # rates from the counters' change over one second: bytes -> KB/s, KiB -> KiB/s
    assert (last["pcie_tx_kbps"], last["pcie_rx_kbps"]) == (2_000_000.0, 500_000.0)
    assert (last["nvlink_tx_kbps"], last["nvlink_rx_kbps"]) == (300_000_000.0, 290_000_000.0)
    assert (last["gpm_sm_active_pct"], last["gpm_tensor_active_pct"]) == (71.5, 38.25)
    first = rows[0]
    assert first["pcie_tx_kbps"] is None and first["gpm_sm_active_pct"] is None  # no interval yet
    assert faults.kinds == []
    # host metrics from the same poller, in their units
    from perfscope.store.schema import HOST_SAMPLES

    host = [dict(zip(HOST_SAMPLES.column_names, r, strict=True)) for r in sink.rows["host_samples"]]
    assert len(host) == 2  # the first sample only sets the baseline of the CPU deltas
    h = host[-1]
    assert (h["ts_ns"], h["hostname"], h["node_rank"], h["cpu_count"]) == (
        1_700_000_000_000_000_000,
        "node7",
        3,
        os.cpu_count(),
    )
    assert h["proc_cpu_pct"] >= 0 and (h["sys_cpu_pct"] is None or 0 <= h["sys_cpu_pct"] <= 100)
    assert h["rss_bytes"] > 0 and h["sys_mem_used_bytes"] > 0 and h["load1"] >= 0


def test_a_failing_metric_is_switched_off_after_one_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch, gpus=1)
    fake.mocks["nvmlDeviceGetTemperature"].side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    fake.mocks["nvmlDeviceGetPcieThroughput"].side_effect = AssertionError("counters deliver PCIe")
    sink, faults = Sink(), Faults(0)
    shown = _sample(_poller(sink, faults), 4)
    assert fake.mocks["nvmlDeviceGetTemperature"].call_count == 1
    rows = _gpu_dicts(sink)
    assert len(rows) == 4 and all(r["temp_c"] is None and r["power_mw"] == 612_345.0 for r in rows)
    assert faults.kinds == ["nvml_metric_off"]
    assert len([w for w in shown if "temperature" in w]) == 1


def test_unsupported_features_are_events_not_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch, gpus=1, gpm=False)  # no GPM: an Ampere or older GPU
    real_fields = fake.mocks["nvmlDeviceGetFieldValues"].side_effect

    def no_pcie_counters(handle: Any, ids: list[Any]) -> Any:
        values = real_fields(handle, ids)
        for v in values:
            if v.fieldId in (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES):
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    fake.mocks["nvmlDeviceGetFieldValues"].side_effect = no_pcie_counters
    sink, faults = Sink(), Faults(0)
    shown = _sample(_poller(sink, faults), 5)
    rows = _gpu_dicts(sink)
    assert all(r["gpm_sm_active_pct"] is None for r in rows)
    # PCIe falls back to nvmlDeviceGetPcieThroughput (20 ms per call), at most once a second
    assert rows[0]["pcie_tx_kbps"] == 1_250_000.0 and all(r["pcie_tx_kbps"] is None for r in rows[1:])
    assert fake.mocks["nvmlDeviceGetPcieThroughput"].call_count == 2  # tx and rx, once
    assert rows[-1]["nvlink_tx_kbps"] == 300_000_000.0
    assert set(faults.kinds) == {"nvml_metric_unsupported"}
    assert shown == []
    assert fake.mocks["nvmlGpmSampleGet"].call_count == 0


def test_a_gpu_lost_mid_run_stops_its_sampling_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNvml(monkeypatch, gpus=2)
    calls = {"n": 0}

    def power(handle: Any) -> int:
        calls["n"] += 1
        if handle == "handle1" and calls["n"] > 4:  # GPU 1 falls off the bus after two samples
            raise pynvml.NVMLError_GpuIsLost()
        return H200["power_mw"]

    fake.mocks["nvmlDeviceGetPowerUsage"].side_effect = power
    faults = Faults(0)
    writer = StoreWriter(tmp_path, "lost")
    faults.attach(writer)
    poller = _poller(Sink(), faults)
    poller.sink = writer
    shown = _sample(poller, 6)
    writer.close()
    with open_store(tmp_path) as store:
        per_gpu = store.query(
            "SELECT gpu_index, count(*) AS n FROM gpu_samples GROUP BY 1 ORDER BY 1"
        ).to_pylist()
        events = store.query("SELECT kind, message FROM events").to_pylist()
    assert per_gpu == [{"gpu_index": 0, "n": 6}, {"gpu_index": 1, "n": 2}]
    assert [e["kind"] for e in events] == ["gpu_lost"] and "GPU 1" in events[0]["message"]
    assert len([w for w in shown if "lost" in w]) == 1


def test_a_profile_with_nvml_records_gpus_and_the_driver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    FakeNvml(monkeypatch, gpus=2)
    with perfscope.profile(tmp_path, poll_hz=100, timing="host") as prof:
        for _ in prof.steps(range(3)):
            with prof.phase("forward"):
                pass
        prof.flush()
    with open_store(tmp_path) as store:
        (run,) = store.query("SELECT driver_version FROM runs").to_pylist()
        n = store.query("SELECT count(DISTINCT gpu_uuid) FROM gpu_samples").column(0)[0].as_py()
    assert run["driver_version"] == "550.90.07" and n == 2


@pytest.mark.parametrize("how", ["no driver", "no module"])
def test_without_nvml_only_host_metrics_and_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    if how == "no driver":
        init = mock.create_autospec(pynvml.nvmlInit, side_effect=pynvml.NVMLError_DriverNotLoaded())
        monkeypatch.setattr(pynvml, "nvmlInit", init)
    else:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr("perfscope.errors._seen", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(tmp_path, poll_hz=100) as prof:
            for _ in prof.steps(range(3)):
                with prof.phase("forward"):
                    sum(range(100_000))
    with open_store(tmp_path) as store:
        gpu = store.query("SELECT count(*) FROM gpu_samples").column(0)[0].as_py()
        host = store.query("SELECT count(*) FROM host_samples").column(0)[0].as_py()
        kinds = store.query("SELECT kind FROM events").column(0).to_pylist()
    assert gpu == 0 and host >= 1 and kinds == ["nvml_unavailable"]
    assert len([w for w in caught if "NVML is not available" in str(w.message)]) == 1


def test_open_gpus_off_on_request() -> None:
    faults = Faults(0)
    assert open_gpus(faults, enabled=False).sample() == [] and faults.kinds == []


def test_one_poller_per_host_without_local_ranks(tmp_path: Path) -> None:
    run_id, me = "claim", (os.getpid(),)
    first = HostClaim(run_id, "hostA", None, me, lock_dir=tmp_path)
    second = HostClaim(run_id, "hostA", None, me, lock_dir=tmp_path)  # a second process's view
    other_host = HostClaim(run_id, "hostB", None, me, lock_dir=tmp_path)
    try:
        assert (first.owner, second.owner, other_host.owner) == (True, False, True)
        assert first.pids() == (os.getpid(),)
    finally:
        for c in (first, second, other_host):
            c.release()
    assert HostClaim(run_id, "hostA", 0, ()).owner and not HostClaim(run_id, "hostA", 1, ()).owner
