"""Horovod without Horovod: a one-process stand-in shaped after horovod.torch's documented API
(init/size/rank, allreduce_async_/poll/synchronize handles, allgather_object, DistributedOptimizer
whose gradient hooks call _allreduce_grad_async and whose step() calls synchronize()).

Not covered here (needs a real Horovod build): MPI/Gloo/NCCL controllers, tensor fusion,
grouped allreduce (num_groups), sparse gradients, the Adasum optimizer."""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

import perfscope
from perfscope import open_store

torch = pytest.importorskip("torch")


def _standin_horovod(*, mpi: bool = True) -> types.ModuleType:
    hvd = types.ModuleType("horovod.torch")
    handles: dict[int, dict[str, Any]] = {}
    counter = iter(range(1, 1_000_000))

    def allreduce_async_(tensor: Any, name: str | None = None, op: Any = None, **kw: Any) -> int:
        h = next(counter)
        done = threading.Event()
        handles[h] = {"tensor": tensor, "done": done}

        def background() -> None:  # Horovod's background thread; one rank: the average is the tensor
            time.sleep(0.002)
            done.set()

        threading.Thread(target=background, daemon=True).start()
        return h

    def poll(handle: int) -> bool:
        return handles[handle]["done"].is_set()

    def synchronize(handle: int) -> Any:
        entry = handles.pop(handle)
        entry["done"].wait(5)
        return entry["tensor"]

    class DistributedOptimizer:
        def __init__(self, optimizer: Any, named_parameters: Any = None, **kw: Any) -> None:
            self._opt = optimizer
            self.param_groups = optimizer.param_groups
            self._handles: dict[Any, Any] = {}
            for group in self.param_groups:
                for p in group["params"]:
                    p.register_post_accumulate_grad_hook(self._make_hook())

        def _make_hook(self) -> Any:
            def hook(p: Any) -> None:
                self._handles[p] = self._allreduce_grad_async(p)

            return hook

        def _allreduce_grad_async(self, p: Any) -> tuple[int, None]:
            return allreduce_async_(p.grad, name=str(id(p))), None

        def synchronize(self) -> None:
            for p, (handle, _) in self._handles.items():
                p.grad.copy_(synchronize(handle))
            self._handles.clear()

        def step(self) -> None:
            self.synchronize()
            self._opt.step()

        def zero_grad(self) -> None:
            self._opt.zero_grad()

    hvd.__dict__.update(
        init=lambda: None,
        is_initialized=lambda: True,
        size=lambda: 1,
        rank=lambda: 0,
        local_rank=lambda: 0,
        local_size=lambda: 1,
        allreduce_async_=allreduce_async_,
        poll=poll,
        synchronize=synchronize,
        allgather_object=lambda obj: [obj],
        mpi_enabled=lambda: mpi,
        gloo_enabled=lambda: not mpi,
        nccl_built=lambda: False,
        DistributedOptimizer=DistributedOptimizer,
    )
    return hvd


def test_horovod_optimizer_synchronisation_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hvd = _standin_horovod(mpi=True)
    monkeypatch.setitem(__import__("sys").modules, "horovod.torch", hvd)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    n_params = len(list(model.parameters()))
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    with perfscope.profile(tmp_path, poll_hz=0, batch_size=4) as prof:
        prof.watch(model)
        opt = prof.horovod_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), hvd=hvd
        )
        for x in prof.steps([torch.randn(4, 16) for _ in range(4)]):
            with prof.phase("forward"):
                loss = model(x).pow(2).mean()
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    with open_store(tmp_path) as store:
        (run,) = store.query("SELECT backend, world_size FROM runs").to_pylist()
        comm = store.query(
            "SELECT step, list(seq ORDER BY seq) AS seqs, sum(bytes)::BIGINT AS b, count(*) AS n "
            "FROM comm GROUP BY step"
        ).to_pylist()
        steps = store.query("SELECT * FROM steps ORDER BY step").to_pylist()
        parents = store.query("SELECT DISTINCT parent FROM spans WHERE name = 'sync'").column(0).to_pylist()
    assert run == {"backend": "horovod-mpi", "world_size": 1}  # agreed through hvd.allgather_object
    assert len(comm) == 4
    for c in comm:
        assert c["seqs"] == list(range(n_params)) and c["b"] == grad_bytes and c["n"] == n_params
    assert parents == ["optimizer"]  # synchronize() ran inside step(): a sync phase within optimizer
    for s in steps:
        assert s["sync_exposed_ns"] > 0 and s["comm_count"] == n_params
        assert s["sync_exposed_ns"] <= s["comm_total_ns"]  # each allreduce spans at least the wait
        assert s["optimizer_ns"] >= 0 and s["other_ns"] >= 0


def test_without_horovod_installed_the_error_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "horovod.torch", None)
    with (
        perfscope.profile(tmp_path, poll_hz=0) as prof,
        pytest.raises(ImportError, match="pip install horovod"),
    ):
        prof.horovod_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
