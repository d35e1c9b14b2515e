"""Tensor parallelism recorded (issue 32): a DTensor dp2 x tp2 job on real 4-rank gloo, an MLP
parallelised with ColwiseParallel/RowwiseParallel on the tp mesh, its gradients all-reduced over the
dp group, under perfscope.profile(parallel=mesh) and torch.profiler at once.

DTensor's collectives go through torch.distributed._functional_collectives: each is a `comm` row on
its tensor-parallel group (0,1 or 2,3) with its bytes, total and exposed time; the gradient
all-reduce is a row on the dp group (0,2 or 1,3). torch.profiler's view of the same calls (the
`_c10d_functional` issue ops and their `wait_tensor`) is the independent clock: the same count,
bytes from the recorded shapes, and the same exposed time within 25%.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from collect_helpers import results_ok, run_ranks

from perfscope import open_store
from perfscope.analysis import run_analysis
from perfscope.analysis.selection import Selection
from perfscope.store.process_groups import COMM_MEMBERS_SQL

WORLD = 4
STEPS = 8
BATCH = 16
HIDDEN = 256
ROOT = str(Path(__file__).resolve().parents[2])
#: torch.profiler's events of one functional collective: its issue, its result's wrapper, its wait
FUNCTIONAL_EVENTS = {
    "_c10d_functional::all_reduce": "issue",
    "_c10d_functional::_wrap_tensor_autograd": "wrap",
    "_c10d_functional::wait_tensor": "wait",
}


def tp_job(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.profiler import ProfilerActivity, profile, record_function

    import perfscope

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.ReLU(), nn.Linear(4 * HIDDEN, HIDDEN))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_group = mesh["dp"].get_group()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1 + mesh["dp"].get_local_rank())  # tp ranks share their samples
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)  # its gradient: an all-reduce in backward
    losses = []
    with (
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as torch_prof,
        perfscope.profile(store, parallel=mesh, poll_hz=0, gpu_telemetry=False, batch_size=BATCH) as prof,
    ):
        for _ in range(STEPS):
            with prof.phase("forward"):
                loss = model(x).pow(2).mean()
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("sync"), record_function("dp_grad_sync"):
                for p in model.parameters():
                    dist.all_reduce(p.grad.to_local(), group=dp_group)
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
            prof.step()
        run_id = prof.run_id
    # torch.profiler's view of the functional collectives on this (the training) thread: the issue
    # op, the autograd wrapper of its result, the wait
    calls: dict[str, list[Any]] = {"issue": [], "wrap": [], "wait": []}
    for e in torch_prof.events():
        kind = FUNCTIONAL_EVENTS.get(e.name)
        if kind is not None:
            shape = e.input_shapes[0] if e.input_shapes else []
            calls[kind].append((e.cpu_time_total * 1e3, int(math.prod(shape)) * 4))
    grad_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    dist.destroy_process_group()
    return {"run_id": run_id, "losses": losses, "calls": calls, "grad_bytes": grad_bytes}


def _q(store: Path, sql: str) -> list[dict[str, Any]]:
    return open_store(store).query(sql).to_pylist()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    store = tmp_path_factory.mktemp("tp") / "store"
    return store, results_ok(run_ranks(tp_job, WORLD, str(store), timeout_s=240))


def test_tensor_parallel_collectives_are_recorded_on_their_group(
    recorded: tuple[Path, dict[int, Any]],
) -> None:
    store, results = recorded
    rows = _q(
        store,
        "SELECT rank, op, phase, group_ranks, group_size, count(*) AS n, sum(bytes)::BIGINT AS bytes, "
        "sum(dur_ns)::BIGINT AS total, sum(exposed_ns)::BIGINT AS exposed, bool_and(is_async) AS async "
        f"FROM ({COMM_MEMBERS_SQL}) comm GROUP BY ALL ORDER BY ALL",
    )
    for rank in range(WORLD):
        res = results[rank]
        assert all(math.isfinite(v) for v in res["losses"]), res["losses"]
        tp_pair, dp_pair = ("0,1" if rank < 2 else "2,3"), ("0,2" if rank % 2 == 0 else "1,3")
        mine = {(r["group_ranks"], r["phase"]): r for r in rows if r["rank"] == rank}
        assert set(mine) == {(tp_pair, "forward"), (tp_pair, "backward"), (dp_pair, "sync")}, mine
        tp = [mine[(tp_pair, "forward")], mine[(tp_pair, "backward")]]
        # RowwiseParallel's output in forward, the replicated input's gradient in backward: one each a step
        assert [(r["op"], r["n"], r["group_size"], r["async"]) for r in tp] == [
            ("allreduce", STEPS, 2, True)
        ] * 2
        issued, waited = res["calls"]["issue"], res["calls"]["wait"]
        assert len(issued) == len(waited) == 2 * STEPS, res["calls"]
        assert sum(r["bytes"] for r in tp) == sum(b for _, b in issued) == 2 * STEPS * BATCH * HIDDEN * 4
        # exposed: the issue call (the op and its result's wrapper) and the wait, against torch.profiler
        profiled = sum(ns for kind in ("issue", "wrap", "wait") for ns, _ in res["calls"][kind])
        exposed = sum(r["exposed"] for r in tp)
        assert abs(exposed - profiled) <= 0.25 * profiled, (rank, exposed, profiled)
        assert all(r["total"] >= r["exposed"] > 0 for r in tp), tp
        dp = mine[(dp_pair, "sync")]  # the gradient sync on the dp group: four parameters a step
        assert (dp["op"], dp["n"], dp["bytes"]) == ("allreduce", 4 * STEPS, STEPS * res["grad_bytes"]), dp


def _sync_row(store: Path) -> dict[str, Any]:
    with open_store(store) as s:
        rows = run_analysis("sync", s).to_pylist()
    assert len(rows) == 1, rows
    return rows[0]


def test_tensor_parallel_traffic_is_its_own_figure_beside_gradient_sync(
    recorded: tuple[Path, dict[int, Any]],
) -> None:
    store, _ = recorded
    sync = _sync_row(store)
    assert sync["tp_comm_count"] == pytest.approx(2.0) and sync["comm_count"] == pytest.approx(4.0), sync
    per_step = [
        r["exposed"]
        for r in _q(
            store,
            f"SELECT rank, step, sum(exposed_ns) AS exposed FROM ({COMM_MEMBERS_SQL}) comm "
            "WHERE group_ranks IN ('0,1', '2,3') "
            "GROUP BY ALL",
        )
    ]
    assert min(per_step) <= sync["tp_comm_exposed_ns"] <= max(per_step), (sync, per_step)
    assert sync["tp_comm_total_ns"] >= sync["tp_comm_exposed_ns"], sync


def test_report_and_dashboard_show_tensor_parallel_traffic(recorded: tuple[Path, dict[int, Any]]) -> None:
    from streamlit.testing.v1 import AppTest

    from perfscope.explain.rules_patterns import waits_on
    from perfscope.report import render_report
    from perfscope.report.model import format_value

    store, results = recorded
    sync = _sync_row(store)
    with open_store(store) as s:
        report = render_report(s, Selection(), fmt="html").decode()
    assert "TP collectives/step" in report and "exposed TP comm" in report
    assert "across all 2 ranks" not in report
    # a 2-rank group of a 4-rank job is a group of 2 of 4, the whole world is "all"
    assert waits_on({"wait_op": "allreduce", "wait_group_size": 2, "world_size": 4}) == (
        "allreduce on a group of 2 of 4 ranks"
    )
    assert waits_on({"wait_op": "allreduce", "wait_group_size": 4}, 4) == "allreduce across all 4 ranks"
    at = AppTest.from_function(_dashboard, args=(str(store), "run"), default_timeout=120)
    at.query_params["run"] = results[0]["run_id"]
    at.query_params["run_tab"] = "Communication"
    at = at.run()
    assert not at.exception, [e.message for e in at.exception]
    shown = {m.label: m.value for m in at.metric}
    assert shown["Tensor-parallel exposed"] == f"{sync['tp_comm_exposed_ns'] / 1e6:,.2f} ms", shown
    assert shown["Gradient sync exposed"] == f"{sync['sync_exposed_ns'] / 1e6:,.2f} ms", shown
    assert format_value("tp_comm_exposed_ns", sync["tp_comm_exposed_ns"])


def _dashboard(store: str, page: str) -> None:
    # AppTest runs this function's body as the script: it imports what it needs itself.
    from perfscope.dashboard.app import main

    main(store=store, page=page)


#: a 4-rank job that makes two collector warnings on every rank: a layout that does not fit the
#: world (dp 3 x tp 3 on 4 ranks) and a compiled DTensor module (its collectives run in the graph)
WARNED_JOB = """
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import perfscope

torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
compiled = torch.compile(model, backend="aot_eager")
opts = {"poll_hz": 0, "gpu_telemetry": False, "batch_size": 4}
with perfscope.profile("S", parallel={"dp": 3, "tp": 3}, **opts) as prof:
    for _ in range(3):
        with prof.phase("forward"):
            loss = compiled(torch.ones(4, 32)).sum()
        with prof.phase("backward"):
            loss.backward()
        prof.step()
dist.barrier()
dist.destroy_process_group()
print("done", flush=True)
"""


def test_a_collector_warning_is_one_line_per_job_not_one_per_rank(tmp_path: Path) -> None:
    script = tmp_path / "warned.py"
    script.write_text(WARNED_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD)]
    out = subprocess.run(
        [*torchrun, script.name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.count("done") == WORLD, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    layout = [line for line in lines if "multiply to 9, not the world size 4" in line]
    compiled = [line for line in lines if "into a torch.compile graph" in line]
    assert len(layout) == 1 and len(compiled) == 1, out.stderr[-3000:]
    # every rank still carries its own events row
    events = _q(
        tmp_path / "S", "SELECT kind, count(DISTINCT rank) AS ranks, count(*) AS n FROM events GROUP BY kind"
    )
    seen = {e["kind"]: (e["ranks"], e["n"]) for e in events}
    assert seen["layout_unusable"] == (WORLD, WORLD) and seen["functional_collectives_compiled"] == (
        WORLD,
        WORLD,
    )
