"""A host without NVML says so once, not once per rank: a real 3-process gloo job on one host asks
for GPU telemetry; only the host's poller (local rank 0) opens NVML, so one rank warns and the run
holds one `nvml_unavailable` event."""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

import pytest

from perfscope import PerfscopeWarning, open_store

pytest.importorskip("torch")
from collect_helpers import results_ok, run_ranks

NVML_SAYS = "NVML is not available"


def telemetry_worker(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch.distributed as dist

    import perfscope

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(store, experiment="nvml", poll_hz=20, gpu_telemetry=True) as prof:
            for _ in prof.steps(range(5)):
                time.sleep(0.01)
    dist.destroy_process_group()
    said = [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]
    return {"run_id": prof.run_id, "nvml_warnings": [m for m in said if NVML_SAYS in m]}


def test_a_host_without_nvml_warns_once_not_once_per_rank(tmp_path: Any) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML loads on this machine: nothing to warn about")
    except Exception:
        pass
    out = results_ok(run_ranks(telemetry_worker, 3, str(tmp_path)))
    assert len({o["run_id"] for o in out.values()}) == 1
    assert sorted(len(o["nvml_warnings"]) for o in out.values()) == [0, 0, 1], out
    with open_store(tmp_path) as store:
        events = store.query("SELECT rank, kind FROM events WHERE kind = 'nvml_unavailable'").to_pylist()
    assert len(events) == 1, events
