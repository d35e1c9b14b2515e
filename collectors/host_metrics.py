"""Host telemetry: CPU and memory of the training processes on this host, system CPU, memory in use
and load. psutil finds the processes; their CPU counters are read straight from /proc on Linux."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

#: DataLoader workers come and go; rescanning for them costs a walk of /proc, so not every sample.
CHILDREN_RESCAN_S = 2.0
#: memory moves slowly and costs more to read than CPU times (/proc/meminfo, /proc/<pid>/statm):
#: it is read once a second and repeated in the samples between
MEMORY_EVERY_S = 1.0
_LINUX = sys.platform.startswith("linux")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if _LINUX else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if _LINUX else 4096
#: /proc/<pid>/task/<tid>/children exists (Linux with CONFIG_PROC_CHILDREN, the distributions' default)
_PROC_CHILDREN = _LINUX and os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


class _ProcFile:
    """A /proc file held open and re-read with pread: opening one costs several times more than
    reading it (about 45 against 12 us here), and the poller reads two per sample, ten times a second."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def read(self) -> bytes:
        return os.pread(self.fd, 4096, 0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class _ProcessCpu:
    """CPU seconds (user + system) of one process."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self._stat = _ProcFile(f"/proc/{proc.pid}/stat") if _LINUX else None
        self._statm: _ProcFile | None = None  # opened on the first rss()

    def rss(self) -> int:
        """Resident set size in bytes, from /proc/<pid>/statm held open (a few us), else psutil."""
        if not _LINUX:
            return int(self.proc.memory_info().rss)
        if self._statm is None:
            self._statm = _ProcFile(f"/proc/{self.proc.pid}/statm")
        data = self._statm.read()
        if not data:
            raise psutil.NoSuchProcess(self.proc.pid)
        return int(data.split()[1]) * _PAGE_BYTES

    def seconds(self) -> float:
        if self._stat is None:
            t = self.proc.cpu_times()
            return float(t.user + t.system)
        data = self._stat.read()
        if not data:
            raise psutil.NoSuchProcess(self.proc.pid)
        # the command name (field 2) may hold spaces and parentheses: count fields after its ')'
        fields = data[data.rindex(b")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime (fields 14, 15)

    def close(self) -> None:
        if self._stat is not None:
            self._stat.close()
        if self._statm is not None:
            self._statm.close()


class _SystemCpu:
    """Busy and total CPU time of the whole host, from /proc/stat's first line (or psutil)."""

    def __init__(self) -> None:
        self._stat = _ProcFile("/proc/stat") if _LINUX else None

    def busy_total(self) -> tuple[float, float]:
        if self._stat is None:
            t = psutil.cpu_times()
            total = float(sum(t))
            return total - t.idle - getattr(t, "iowait", 0.0), total
        first = self._stat.read().split(b"\n", 1)[0].split()
        # cpu user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
        ticks = [int(x) for x in first[1:9]]
        total = float(sum(ticks))
        return total - ticks[3] - ticks[4], total


def _descendants(proc: psutil.Process) -> list[int]:
    """Pids of the children of `proc`, recursively. On Linux from /proc/<pid>/task/<tid>/children,
    a few reads per thread; psutil's own walk reads /proc/<pid>/stat of every process on the host
    (about 2 ms at 100 processes), holding the training process's GIL between its hundreds of reads."""
    if not _PROC_CHILDREN:
        try:
            return [child.pid for child in proc.children(recursive=True)]
        except psutil.Error:
            return []
    found: list[int] = []
    todo = [proc.pid]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):  # a process or thread that ended meanwhile
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
                    found += kids
                    todo += kids
    return found


class HostSampler:
    """`proc_cpu_pct` sums the CPU of the training processes and their children (DataLoader workers
    do training work), in % of one core. `rss_bytes` sums the resident memory of the training
    processes only: forked workers share most pages with their parent and would count them twice.
    Memory is read once a second (MEMORY_EVERY_S), CPU at every sample; `proc_rss` (each training
    process's own RSS, the proc_memory table) at every sample, from /proc/<pid>/statm held open."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self._pids = pids
        self._ranks: dict[int, _ProcessCpu] = {}
        self._children: dict[int, _ProcessCpu] = {}
        self._system = _SystemCpu()
        self._next_scan = 0.0
        self._next_memory = 0.0
        self._rss = 0
        self._sys_mem = 0
        self._available: int | None = None
        self._total: int | None = None
        self._prev_cpu: dict[int, float] = {}
        self._prev_t: float | None = None
        self._prev_sys: tuple[float, float] | None = None
        self.cpu_count = psutil.cpu_count() or os.cpu_count() or 1

    def _track(self, pid: int, known: dict[int, _ProcessCpu]) -> _ProcessCpu | None:
        if pid in known:
            return known[pid]
        try:
            return _ProcessCpu(psutil.Process(pid))
        except (psutil.Error, OSError):
            return None

    def _refresh(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + CHILDREN_RESCAN_S
        ranks: dict[int, _ProcessCpu] = {}
        for pid in set(self._pids()):
            tracked = self._track(pid, self._ranks)
            if tracked is not None:
                ranks[pid] = tracked
        children: dict[int, _ProcessCpu] = {}
        for rank in ranks.values():
            for child in _descendants(rank.proc):
                tracked = self._track(child, self._children)
                if tracked is not None:
                    children[child] = tracked
        for old, new in ((self._ranks, ranks), (self._children, children)):
            for pid, gone in old.items():
                if pid not in new:
                    gone.close()
        self._ranks, self._children = ranks, children

    def sample(self) -> dict[str, Any] | None:
        """One sample; None on the first call, which only sets the baseline of the CPU deltas."""
        now = time.monotonic()
        self._refresh(now)
        cpu: dict[int, float] = {}
        for group in (self._ranks, self._children):
            for pid, proc in list(group.items()):
                try:
                    cpu[pid] = proc.seconds()
                except (psutil.Error, OSError, ValueError, IndexError):
                    proc.close()
                    del group[pid]
        if now >= self._next_memory:
            self._next_memory = now + MEMORY_EVERY_S
            rss = 0
            for proc in self._ranks.values():
                with contextlib.suppress(psutil.Error):
                    rss += proc.proc.memory_info().rss
            vm = psutil.virtual_memory()
            self._rss, self._sys_mem = rss, int(vm.total - vm.available)
            self._available, self._total = int(vm.available), int(vm.total)
        proc_rss: list[tuple[int, int]] = []
        for pid, proc in self._ranks.items():
            with contextlib.suppress(psutil.Error, OSError, ValueError, IndexError):
                proc_rss.append((pid, proc.rss()))
        sys_now = self._system.busy_total()
        prev_t, prev_cpu, prev_sys = self._prev_t, self._prev_cpu, self._prev_sys
        self._prev_t, self._prev_cpu, self._prev_sys = now, cpu, sys_now
        if prev_t is None or prev_sys is None or now <= prev_t:
            return None
        # a process present in both samples contributes its delta; one that just came or went, nothing
        used = sum(max(0.0, c - prev_cpu[pid]) for pid, c in cpu.items() if pid in prev_cpu)
        busy, total = sys_now[0] - prev_sys[0], sys_now[1] - prev_sys[1]
        return {
            "proc_cpu_pct": 100.0 * used / (now - prev_t),
            "sys_cpu_pct": max(0.0, min(100.0, 100.0 * busy / total)) if total > 0 else None,
            "rss_bytes": self._rss,
            "sys_mem_used_bytes": self._sys_mem,
            "load1": os.getloadavg()[0],
            "cpu_count": self.cpu_count,
            "proc_rss": proc_rss,
            "host_available_bytes": self._available,
            "host_total_bytes": self._total,
        }

    def close(self) -> None:
        for group in (self._ranks, self._children):
            for proc in group.values():
                proc.close()
        if self._system._stat is not None:
            self._system._stat.close()
