"""Host telemetry through psutil: CPU and memory of the training processes on this host, system CPU,
memory in use and load."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

#: DataLoader workers come and go; rescanning for them costs a walk of /proc, so not every sample.
CHILDREN_RESCAN_S = 2.0


class HostSampler:
    """`proc_cpu_pct` sums the CPU of the training processes and their children (DataLoader workers
    do training work), in % of one core. `rss_bytes` sums the resident memory of the training
    processes only: forked workers share most pages with their parent and would count them twice.
    System CPU comes from psutil.cpu_times() deltas of our own, not psutil.cpu_percent(), whose
    module-level state the job may be using too."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self._pids = pids
        self._ranks: dict[int, psutil.Process] = {}
        self._children: dict[int, psutil.Process] = {}
        self._next_scan = 0.0
        self._prev_cpu: dict[int, float] = {}
        self._prev_t: float | None = None
        self._prev_sys: Any = None
        self.cpu_count = psutil.cpu_count() or os.cpu_count() or 1

    def _refresh(self, now: float) -> None:
        if now < self._next_scan:
            return
        self._next_scan = now + CHILDREN_RESCAN_S
        wanted = set(self._pids())
        for pid in list(self._ranks):
            if pid not in wanted:
                del self._ranks[pid]
        for pid in wanted - self._ranks.keys():
            with contextlib.suppress(psutil.Error):
                self._ranks[pid] = psutil.Process(pid)
        children: dict[int, psutil.Process] = {}
        for proc in list(self._ranks.values()):
            try:
                for child in proc.children(recursive=True):
                    children[child.pid] = self._children.get(child.pid, child)
            except psutil.Error:
                pass
        self._children = children

    def sample(self) -> dict[str, Any] | None:
        """One sample; None on the first call, which only sets the baseline of the CPU deltas."""
        now = time.monotonic()
        self._refresh(now)
        cpu: dict[int, float] = {}
        rss = 0
        for pid, proc in list(self._ranks.items()) + list(self._children.items()):
            try:
                with proc.oneshot():
                    t = proc.cpu_times()
                    cpu[pid] = t.user + t.system
                    if pid in self._ranks:
                        rss += proc.memory_info().rss
            except psutil.Error:
                self._ranks.pop(pid, None)
                self._children.pop(pid, None)
        sys_times = psutil.cpu_times()
        prev_t, prev_cpu, prev_sys = self._prev_t, self._prev_cpu, self._prev_sys
        self._prev_t, self._prev_cpu, self._prev_sys = now, cpu, sys_times
        if prev_t is None or now <= prev_t:
            return None
        # a process present in both samples contributes its delta; one that just came or went, nothing
        used = sum(max(0.0, c - prev_cpu[pid]) for pid, c in cpu.items() if pid in prev_cpu)
        vm = psutil.virtual_memory()
        return {
            "proc_cpu_pct": 100.0 * used / (now - prev_t),
            "sys_cpu_pct": _busy_pct(prev_sys, sys_times),
            "rss_bytes": rss,
            "sys_mem_used_bytes": int(vm.total - vm.available),
            "load1": os.getloadavg()[0],
            "cpu_count": self.cpu_count,
        }


def _busy_pct(before: Any, after: Any) -> float | None:
    total = sum(after) - sum(before)
    if total <= 0:
        return None
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0))
    return max(0.0, min(100.0, 100.0 * (total - idle) / total))
