"""GPU telemetry: NVML (module `pynvml` from nvidia-ml-py) behind a small device interface, and an
empty stand-in when NVML is missing, so measuring never breaks the job.

Units are NVML's own, kept in the column names: power in mW, energy in mJ, memory in bytes,
clocks in MHz, PCIe in KB/s, NVLink in KiB/s, utilisation in %. `util_gpu_pct` is
nvmlDeviceGetUtilizationRates().gpu: the share of the last 1/6-1 s in which some kernel ran.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .faults import Faults

#: how often the slow nvmlDeviceGetPcieThroughput (it samples a counter over 20 ms) may be called
PCIE_FALLBACK_INTERVAL_S = 1.0
_UINT_MAX = 0xFFFFFFFF  # NVLink throughput fields: scopeId UINT_MAX sums over all links


class GpuTelemetry(Protocol):
    driver_version: str
    device_names: list[str]

    def sample(self) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...


class NoGpus:
    """The stand-in without NVML: no devices, no samples."""

    def __init__(self) -> None:
        self.driver_version = ""
        self.device_names: list[str] = []

    def sample(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    off: set[str] = field(default_factory=set)
    lost: bool = False
    counters: dict[int, tuple[float, float]] = field(default_factory=dict)  # field id -> (t_s, value)
    pcie_next_s: float = 0.0
    gpm_prev: Any = None
    gpm_cur: Any = None
    gpm_primed: bool = False


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlGpus:
    """Samples every local GPU through NVML. A metric that fails on a device is switched off there
    after its first failure: one warning and one `events` row (an unsupported metric only gets the
    row: NULL is its documented value). A lost GPU (NVML_ERROR_GPU_IS_LOST) stops being sampled."""

    def __init__(self, nvml: Any, faults: Faults) -> None:
        self.nvml = nvml
        self.faults = faults
        nvml.nvmlInit()
        self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        self.devices: list[_Device] = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            self.devices.append(
                _Device(i, h, _text(nvml.nvmlDeviceGetUUID(h)), _text(nvml.nvmlDeviceGetName(h)))
            )
        self.device_names = [d.name for d in self.devices]
        m = nvml
        self._fields = [
            (m.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0, "pcie_tx_kbps", 1e-3),  # bytes -> KB
            (m.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0, "pcie_rx_kbps", 1e-3),
            (m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _UINT_MAX, "nvlink_tx_kbps", 1.0),  # KiB
            (m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _UINT_MAX, "nvlink_rx_kbps", 1.0),
        ]
        self._metrics = [
            ("utilization", self._utilization),
            ("memory", self._memory),
            ("power", self._power),
            ("energy", self._energy),
            ("clocks", self._clocks),
            ("temperature", self._temperature),
            ("clocks_event_reasons", self._reasons),
            ("throughput_counters", self._counters),
            ("pcie_throughput", self._pcie_fallback),
            ("gpm", self._gpm),
        ]
        for d in self.devices:
            self._setup_gpm(d)

    # -- one sample of every device ---------------------------------------------------------------
    def sample(self) -> list[dict[str, Any]]:
        rows = []
        now_s = time.monotonic()
        for d in self.devices:
            if d.lost:
                continue
            out: dict[str, Any] = {"gpu_index": d.index, "gpu_uuid": d.uuid}
            for name, read in self._metrics:
                if name in d.off:
                    continue
                try:
                    read(d, out, now_s)
                except Exception as exc:
                    self._failed(d, name, exc)
                    if d.lost:
                        break
            if not d.lost:
                rows.append(out)
        return rows

    def _failed(self, d: _Device, metric: str, exc: Exception) -> None:
        m = self.nvml
        code = getattr(exc, "value", None)
        if isinstance(exc, m.NVMLError) and code == m.NVML_ERROR_GPU_IS_LOST:
            d.lost = True
            self.faults.report(
                "gpu_lost",
                f"perfscope: NVML reports GPU {d.index} ({d.uuid}) lost; it is no longer sampled. "
                "Check the node (nvidia-smi, dmesg): the job may be failing with it.",
                key=d.uuid,
            )
            return
        d.off.add(metric)
        unsupported = isinstance(exc, m.NVMLError) and code in (
            m.NVML_ERROR_NOT_SUPPORTED,
            m.NVML_ERROR_FUNCTION_NOT_FOUND,
        )
        if unsupported:
            self.faults.report(
                "nvml_metric_unsupported",
                f"NVML metric {metric!r} is not supported on GPU {d.index} ({d.name}); "
                "its columns stay NULL.",
                key=f"{metric}-{d.index}",
                warn=False,
            )
        else:
            self.faults.report(
                "nvml_metric_off",
                f"perfscope: NVML metric {metric!r} failed on GPU {d.index} ({exc!r}) and is switched off "
                "for the rest of the run.",
                key=f"{metric}-{d.index}",
            )

    # -- metrics ----------------------------------------------------------------------------------
    def _utilization(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        u = self.nvml.nvmlDeviceGetUtilizationRates(d.handle)
        out["util_gpu_pct"] = float(u.gpu)
        out["util_mem_pct"] = float(u.memory)

    def _memory(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        mem = self.nvml.nvmlDeviceGetMemoryInfo(d.handle)
        out["mem_used_bytes"] = int(mem.used)
        out["mem_total_bytes"] = int(mem.total)

    def _power(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        out["power_mw"] = float(self.nvml.nvmlDeviceGetPowerUsage(d.handle))

    def _energy(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        out["energy_mj"] = float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(d.handle))

    def _clocks(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        m = self.nvml
        out["sm_clock_mhz"] = float(m.nvmlDeviceGetClockInfo(d.handle, m.NVML_CLOCK_SM))
        out["mem_clock_mhz"] = float(m.nvmlDeviceGetClockInfo(d.handle, m.NVML_CLOCK_MEM))

    def _temperature(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        m = self.nvml
        out["temp_c"] = float(m.nvmlDeviceGetTemperature(d.handle, m.NVML_TEMPERATURE_GPU))

    def _reasons(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        out["clocks_event_reasons"] = int(self.nvml.nvmlDeviceGetCurrentClocksEventReasons(d.handle))

    def _counters(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        """PCIe byte and NVLink KiB counters (cumulative) in one call; rates from the change since
        the previous sample. A field the device does not have is dropped from later calls."""
        wanted = [f for f in self._fields if f[2] not in d.off]
        if not wanted:
            d.off.add("throughput_counters")
            return
        values = self.nvml.nvmlDeviceGetFieldValues(d.handle, [(fid, scope) for fid, scope, _, _ in wanted])
        for (fid, _, column, scale), v in zip(wanted, values, strict=True):
            if v.nvmlReturn != 0:
                d.off.add(column)
                self.faults.report(
                    "nvml_metric_unsupported",
                    f"NVML field {column!r} is not supported on GPU {d.index} ({d.name}); "
                    "its column stays NULL"
                    + (
                        " (PCIe is read with nvmlDeviceGetPcieThroughput instead)."
                        if "pcie" in column
                        else "."
                    ),
                    key=f"{column}-{d.index}",
                    warn=False,
                )
                continue
            value = _field_value(v)
            t_s = v.timestamp / 1e6 if v.timestamp else now_s  # NVML stamps fields in microseconds
            prev = d.counters.get(fid)
            d.counters[fid] = (t_s, value)
            if prev is not None and t_s > prev[0] and value >= prev[1]:
                out[column] = (value - prev[1]) * scale / (t_s - prev[0])

    def _pcie_fallback(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        if "pcie_tx_kbps" not in d.off and "throughput_counters" not in d.off:
            return  # the counters deliver PCIe
        if now_s < d.pcie_next_s:
            return
        d.pcie_next_s = now_s + PCIE_FALLBACK_INTERVAL_S
        m = self.nvml
        out["pcie_tx_kbps"] = float(m.nvmlDeviceGetPcieThroughput(d.handle, m.NVML_PCIE_UTIL_TX_BYTES))
        out["pcie_rx_kbps"] = float(m.nvmlDeviceGetPcieThroughput(d.handle, m.NVML_PCIE_UTIL_RX_BYTES))

    def _setup_gpm(self, d: _Device) -> None:
        m = self.nvml
        try:
            supported = bool(m.nvmlGpmQueryDeviceSupport(d.handle).isSupportedDevice)
            if supported:
                d.gpm_prev, d.gpm_cur = m.nvmlGpmSampleAlloc(), m.nvmlGpmSampleAlloc()
        except Exception:
            supported = False
        if not supported:
            d.off.add("gpm")

    def _gpm(self, d: _Device, out: dict[str, Any], now_s: float) -> None:
        """GPM SM and tensor activity over the interval between two GPM samples (Hopper and newer)."""
        m = self.nvml
        m.nvmlGpmSampleGet(d.handle, d.gpm_cur)
        if d.gpm_primed:
            req = m.c_nvmlGpmMetricsGet_t()
            req.version = m.NVML_GPM_METRICS_GET_VERSION
            req.numMetrics = 2
            req.sample1 = d.gpm_prev
            req.sample2 = d.gpm_cur
            req.metrics[0].metricId = m.NVML_GPM_METRIC_SM_UTIL
            req.metrics[1].metricId = m.NVML_GPM_METRIC_ANY_TENSOR_UTIL
            m.nvmlGpmMetricsGet(req)
            if req.metrics[0].nvmlReturn == 0:
                out["gpm_sm_active_pct"] = float(req.metrics[0].value)
            if req.metrics[1].nvmlReturn == 0:
                out["gpm_tensor_active_pct"] = float(req.metrics[1].value)
        d.gpm_prev, d.gpm_cur = d.gpm_cur, d.gpm_prev
        d.gpm_primed = True

    def close(self) -> None:
        m = self.nvml
        for d in self.devices:
            for s in (d.gpm_prev, d.gpm_cur):
                if s is not None:
                    with contextlib.suppress(Exception):
                        m.nvmlGpmSampleFree(s)
        with contextlib.suppress(Exception):
            m.nvmlShutdown()


def _field_value(v: Any) -> int | float:
    kind = v.valueType
    val = v.value
    # NVML_VALUE_TYPE_*: 0 double, 1 uint, 2 ulong, 3 ulonglong, 4 slonglong, 5 sint, 6 ushort
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(
        kind, "ullVal"
    )
    return getattr(val, attr)


def open_gpus(faults: Faults, *, enabled: bool = True) -> GpuTelemetry:
    """NVML when it loads, else the stand-in with one warning saying GPU metrics are absent."""
    if not enabled:
        return NoGpus()
    try:
        nvml = importlib.import_module("pynvml")
        return NvmlGpus(nvml, faults)
    except Exception as exc:
        faults.report(
            "nvml_unavailable",
            f"perfscope: NVML is not available ({exc!r}); recording host metrics only, no GPU telemetry. "
            "On a GPU node, check the NVIDIA driver and `pip install nvidia-ml-py`.",
        )
        return NoGpus()
