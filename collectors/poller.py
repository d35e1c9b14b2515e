"""The background telemetry poller: one per host, sampling NVML and psutil (10 Hz by default) into
the `gpu_samples` and `host_samples` tables."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from perfscope.store.schema import GPU_SAMPLES

from .faults import Faults, RowSink
from .host_metrics import HostSampler
from .nvml import GpuTelemetry, NoGpus

_GPU_COLUMNS = GPU_SAMPLES.column_names[3:]  # after ts_ns, hostname, node_rank
_HOST_COLUMNS = ("proc_cpu_pct", "sys_cpu_pct", "rss_bytes", "sys_mem_used_bytes", "load1", "cpu_count")


class Poller:
    """Samples on its own daemon thread. A sampler that raises is switched off with one warning;
    `stop()` joins for a bounded time, so a stuck driver call cannot hold up the job's exit."""

    def __init__(
        self,
        sink: RowSink,
        *,
        gpus: GpuTelemetry,
        host: HostSampler | None,
        hz: float,
        hostname: str,
        node_rank: int,
        wall_ns: Callable[[], int],
        faults: Faults,
    ) -> None:
        self.sink = sink
        self.gpus = gpus
        self.host = host
        self.interval_s = 1.0 / hz
        self.hostname = hostname
        self.node_rank = node_rank
        self.wall_ns = wall_ns
        self.faults = faults
        self.samples = 0
        self.cpu_ns = 0  # CPU time of the poller thread itself
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perfscope-poller", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.faults.report(
                "poller_stuck", f"perfscope: the telemetry poller did not stop within {timeout_s:.0f} s."
            )
            return
        self.sample_once()  # the last interval: even a run shorter than one period gets a sample
        with contextlib.suppress(Exception):
            self.gpus.close()
        with contextlib.suppress(Exception):
            if self.host is not None:
                self.host.close()

    def _run(self) -> None:
        next_t = time.monotonic()
        while True:
            cpu0 = time.thread_time_ns()
            self.sample_once()
            self.cpu_ns += time.thread_time_ns() - cpu0
            next_t += self.interval_s
            now = time.monotonic()
            if next_t < now:  # fell behind (a slow driver call): skip, do not burst
                next_t = now + self.interval_s
            if self._stop.wait(next_t - now):
                return

    def sample_once(self) -> None:
        ts = self.wall_ns()
        head = (ts, self.hostname, self.node_rank)
        if self.gpus is not None:
            try:
                rows = self.gpus.sample()
                if rows:
                    for r in rows:
                        self.sink.append("gpu_samples", head + tuple(r.get(c) for c in _GPU_COLUMNS))
            except Exception as exc:
                self.faults.report(
                    "gpu_sampling_off", f"perfscope: GPU sampling failed ({exc!r}) and is off."
                )
                self.gpus = NoGpus()
        if self.host is not None:
            try:
                h = self.host.sample()
                if h is not None:
                    self.sink.append("host_samples", head + tuple(h[c] for c in _HOST_COLUMNS))
                    memory = (h["host_available_bytes"], h["host_total_bytes"])
                    for pid, rss in h["proc_rss"]:
                        self.sink.append("proc_memory", (*head, pid, rss, *memory))
            except Exception as exc:
                self.faults.report(
                    "host_sampling_off", f"perfscope: host sampling failed ({exc!r}) and is off."
                )
                self.host = None
        self.samples += 1


class HostClaim:
    """Decides which process of a host polls. With local ranks known (torchrun, SLURM, or the start
    exchange), local rank 0 does. Without, the first process to take an exclusive lock on a file
    named after the run and host does, and every process leaves its pid in a folder beside it so
    the poller knows which processes are the job's."""

    def __init__(
        self,
        run_id: str,
        hostname: str,
        local_rank: int | None,
        pids: tuple[int, ...],
        *,
        lock_dir: Path | None = None,
    ) -> None:
        self._lock_file: BinaryIO | None = None
        self._pid_file: Path | None = None
        self._static_pids = pids
        self._pid_dir: Path | None = None
        if local_rank is not None:
            self.owner = local_rank == 0
            return
        base = (lock_dir or Path(tempfile.gettempdir())) / f"perfscope-{run_id}-{hostname}"
        self._pid_dir = base.with_name(base.name + ".pids")
        try:
            self._pid_dir.mkdir(exist_ok=True)
            self._pid_file = self._pid_dir / str(os.getpid())
            self._pid_file.touch()
        except OSError:
            self._pid_dir = None
        self.owner = self._try_lock(base.with_name(base.name + ".lock"))

    def _try_lock(self, path: Path) -> bool:
        import fcntl

        try:
            f = open(path, "ab")  # noqa: SIM115 - held open for the run: the lock lives with the file
        except OSError:
            return False
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._lock_file = f
        return True

    def pids(self) -> tuple[int, ...]:
        if self._pid_dir is None:
            return self._static_pids
        try:
            found = tuple(int(p.name) for p in self._pid_dir.iterdir() if p.name.isdigit())
        except OSError:
            return self._static_pids
        return found or self._static_pids

    def release(self) -> None:
        if self._pid_file is not None:
            with contextlib.suppress(OSError):
                self._pid_file.unlink()
        if self._pid_dir is not None:
            with contextlib.suppress(OSError):
                self._pid_dir.rmdir()  # the last process of the host leaves no folder behind
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                self._lock_file.close()
            self._lock_file = None
