"""One run is a question too (issue 21): a single run whose step is mostly waiting on communication
gets that as its first finding, with the op, the peer and the role, and what to measure next.

Real 2-rank gloo jobs on CPU torch, written as people write them (phases around the compute, the
communication calls between them, one prof.step() per loop turn on every rank), recorded into a
real store and read through `perfscope analyze --json`: DDP with big gradients, a 2-stage
send/recv pipeline with no micro-batches, a parameter server (rank 0 serves, rank 1 pushes and
pulls), and a DDP job with little communication, which gets no such finding."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from perfscope import open_store
from perfscope.analysis import run_analysis
from perfscope.cli import main
from perfscope.explain.rules_patterns import COMM_WAIT_SHARE
from perfscope.explain.words import pct

pytest.importorskip("torch")
from collect_helpers import run_ranks

STEPS = 30
WARMUP = 10  # the default warm-up of a 30-step run: max(10, 5%)
#: this 2-core machine is shared: a confound finding about it is true, and ranked first by design
CONFOUNDS = {"oversubscription", "contention", "threads"}
COMM_RULES = {"communication-share", "pipeline-bubble", "parameter-server"}
#: a share recomputed from the rows agrees with the finding's within this (both read the same rows;
#: the finding's is a mean over ranks of per-rank means, the check's a ratio of sums)
SHARE_TOL = 0.05


def _init(rank: int, world_size: int) -> Any:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    return dist


def ddp_job(rank: int, world_size: int, store: str, options: dict[str, Any]) -> str:
    """DDP: `depth` layers `width` wide (16384: 34 MB of gradients a step) on `batch` rows of 256,
    the gradients in buckets of `bucket_mb` MB (with `bucket_view` the gradients are views into them);
    `device_s` of device time per forward (slept)."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    width, batch, depth = options["width"], options["batch"], options.get("depth", 2)
    layers: list[Any] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 256))
    net = nn.parallel.DistributedDataParallel(
        nn.Sequential(*layers),
        bucket_cap_mb=options.get("bucket_mb", 25),
        gradient_as_bucket_view=options.get("bucket_view", False),
    )
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    crit = nn.MSELoss()
    with perfscope.profile(store, experiment=options["name"], batch_size=batch, poll_hz=0,
                           gpu_telemetry=False) as prof:  # fmt: skip
        prof.watch(net)
        for _ in range(STEPS):
            x = torch.randn(batch, 256)
            with prof.phase("forward"):
                loss = crit(net(x), x)
                time.sleep(options.get("device_s", 0.0))
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.step()
        run_id = prof.run_id
    dist.destroy_process_group()
    return run_id


def pipeline_job(rank: int, world_size: int, store: str, options: dict[str, Any]) -> str:
    """Two stages, one batch per step (no micro-batches): stage 0 sends its activations to stage 1
    and receives their gradient back; the sends and receives sit between the phases."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    hidden, batch = 512, 64
    stage = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
    opt = torch.optim.SGD(stage.parameters(), lr=1e-4)
    with perfscope.profile(store, experiment="one-run-pipeline", batch_size=batch, poll_hz=0,
                           gpu_telemetry=False) as prof:  # fmt: skip
        for _ in range(STEPS):
            if rank == 0:
                x = torch.randn(batch, hidden)
                with prof.phase("forward"):
                    y = stage(x)
                dist.send(y.detach(), 1)
                grad = torch.empty_like(y)
                dist.recv(grad, 1)
                with prof.phase("backward"):
                    y.backward(grad)
            else:
                x = torch.empty(batch, hidden)
                dist.recv(x, 0)
                x.requires_grad_(True)
                with prof.phase("forward"):
                    loss = stage(x).square().mean()
                with prof.phase("backward"):
                    loss.backward()
                dist.send(x.grad, 0)
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.step()
        run_id = prof.run_id
    dist.destroy_process_group()
    return run_id


def ps_job(rank: int, world_size: int, store: str, options: dict[str, Any]) -> str:
    """A parameter server in one loop for both roles: rank 0 receives the gradients, updates the
    parameters and sends them back; rank 1 computes the gradients, pushes them and pulls the
    parameters. Both end each turn with prof.step(), so the server has steps too."""
    import torch
    import torch.nn as nn

    import perfscope

    dist = _init(rank, world_size)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    flat = nn.utils.parameters_to_vector(model.parameters()).detach()
    grad = torch.empty_like(flat)
    with perfscope.profile(store, experiment="one-run-ps", batch_size=32, poll_hz=0,
                           gpu_telemetry=False) as prof:  # fmt: skip
        for _ in range(STEPS):
            if rank == 0:
                dist.recv(grad, 1)
                flat -= 1e-4 * grad
                dist.send(flat, 1)
            else:
                x = torch.randn(32, 256)
                with prof.phase("forward"):
                    loss = (model(x) - x).square().mean()
                with prof.phase("backward"):
                    loss.backward()
                g = nn.utils.parameters_to_vector(p.grad for p in model.parameters())
                dist.send(g, 0)  # push
                dist.recv(flat, 0)  # pull
                nn.utils.vector_to_parameters(flat, model.parameters())
                model.zero_grad()
            prof.step()
        run_id = prof.run_id
    dist.destroy_process_group()
    return run_id


def _record(tmp_path_factory: pytest.TempPathFactory, fn: Any, opts: dict[str, Any]) -> Path:
    root = tmp_path_factory.mktemp(str(opts.get("name", fn.__name__)))
    for rank, (status, value) in run_ranks(fn, 2, str(root), opts).items():
        assert status == "ok", f"rank {rank}: {value}"
    return root


@pytest.fixture(scope="module")
def ddp_big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 34 MB of gradients in one bucket, sent after backward, for one sample of compute; the gradients
    # are views into the bucket (no copy into it in backward). On this shared 2-core machine the
    # compute phases of the two ranks differ from step to step by what the scheduler takes from each,
    # which the what-if replay reads as work that differs between ranks (data-imbalance) and, when it
    # costs half the run's wait or more, takes the wait as its symptom. With 8 MB (width 4096, the
    # gradients copied) the run waited 49-52% of a step and the what-if claimed 26-34% of it: the test
    # failed 6 runs in 10 at load 2-3 with a CPU burner. Here the wait is 57-61% of a step and the
    # what-if's share 14% (load 3-4), under the 29% that would cover the wait: 10 of 10 runs passed
    # at load 3-5.
    opts = {"name": "one-run-ddp-big", "width": 16384, "batch": 1, "bucket_mb": 100, "bucket_view": True}
    return _record(tmp_path_factory, ddp_job, opts)


@pytest.fixture(scope="module")
def ddp_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # little to send (400 KB of gradients) beside 200 ms of device time per step, slept: compute on
    # this shared 2-core machine starves one rank or the other by up to 40% of a step (measured at a
    # load of 15-19), and the other waits for it in the allreduce; a sleep, like a GPU kernel, does
    # not compete for the cores (measured: 4-16% waited at a load of 18)
    opts = {"name": "one-run-ddp-small", "width": 128, "batch": 64, "depth": 4, "device_s": 0.2}
    return _record(tmp_path_factory, ddp_job, opts)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, pipeline_job, {"name": "one-run-pipeline"})


@pytest.fixture(scope="module")
def ps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory, ps_job, {"name": "one-run-ps"})


def _analyze(store: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["analyze", str(store), "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def _first(findings: list[dict[str, Any]]) -> dict[str, Any]:
    """The first finding after the confounds (which come first by design)."""
    rest = [f for f in findings if f["rule"] not in CONFOUNDS]
    assert rest, findings
    return rest[0]


def _rows(store: Path, sql: str) -> list[dict[str, Any]]:
    with open_store(store) as s:
        return s.query(sql).to_pylist()


def _steady_from(store: Path) -> int:
    """The first steady step (perfscope's warm-up rule), read from the run's own summary."""
    with open_store(store) as s:
        (run,) = run_analysis("run_summary", s).to_pylist()
    return int(run["steps_total"] - run["steady_steps"])


def _wait_share_from_rows(store: Path) -> float:
    """Mean over ranks of each rank's exposed communication per steady step over its mean step time,
    straight from the steps table (sync_exposed_ns holds every exposed wait: DDP buckets and p2p)."""
    first = _steady_from(store)
    rows = _rows(
        store,
        f"SELECT rank, avg(sync_exposed_ns) / avg(step_ns) AS share FROM steps WHERE step >= {first} "
        "GROUP BY rank",
    )
    assert len(rows) == 2
    return sum(r["share"] for r in rows) / len(rows)


def _transfer_share_from_rows(store: Path) -> float:
    """What free communication would save, over the run's step time, straight from the steps table:
    per steady step the exposed wait of the rank that waited least (the transfer itself), their mean."""
    first = _steady_from(store)
    (row,) = _rows(
        store,
        f"SELECT avg(m) AS waited FROM (SELECT step, min(sync_exposed_ns) AS m FROM steps "
        f"WHERE step >= {first} GROUP BY step)",
    )
    with open_store(store) as s:
        (run,) = run_analysis("run_summary", s).to_pylist()
    return float(row["waited"]) / float(run["step_ns"])


def _all_rules(findings: list[dict[str, Any]]) -> set[str]:
    """Every rule that fired, also those merged into another finding as its symptoms."""
    out = set()
    for f in findings:
        out.add(f["rule"])
        out |= _all_rules(f["symptoms"]) | _all_rules(f["also_in"])
    return out


def test_ddp_with_big_gradients_says_its_wait_first(
    ddp_big: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    share = _wait_share_from_rows(ddp_big)
    assert share >= COMM_WAIT_SHARE, f"the job is meant to wait on its allreduce; waited {share:.0%}"
    first = _first(_analyze(ddp_big, capsys)["findings"])
    assert first["rule"] == "communication-share", first["title"]
    n = first["numbers"]
    # the ranks' mean wait is said; the cost is the transfer's (the least waiting rank's, per step)
    assert n["mean_wait_share"] == pytest.approx(share, abs=SHARE_TOL)
    assert n["comm_share"] == pytest.approx(_transfer_share_from_rows(ddp_big), abs=SHARE_TOL)
    assert n["comm_share"] <= n["mean_wait_share"] + 1e-9
    assert n["wait_op"] == "allreduce" and n["wait_peer"] is None and n["roles"] == "worker"
    assert "allreduce across all 2 ranks" in first["title"] and pct(n["comm_share"]) in first["title"]
    assert first["explained_loss"] == pytest.approx(n["comm_share"])
    # one world size cannot say how the job scales: the finding says what to record next
    assert n["measure_world_sizes"] == "1,4" and "N=1 and N=4" in first["recommendation"]


def test_a_two_stage_pipeline_without_micro_batches_gets_its_bubble_first(
    pipeline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first_step = _steady_from(pipeline)
    # the bubble from the rows: each stage's exposed send/recv over its steps, averaged over stages
    rows = _rows(
        pipeline,
        f"""
        WITH c AS (SELECT rank, sum(exposed_ns) AS waited FROM comm WHERE step >= {first_step} GROUP BY rank),
             s AS (SELECT rank, sum(step_ns) AS spent FROM steps WHERE step >= {first_step} GROUP BY rank)
        SELECT rank, waited / spent AS bubble FROM c JOIN s USING (rank)
        """,
    )
    bubble = sum(r["bubble"] for r in rows) / len(rows)
    assert bubble >= COMM_WAIT_SHARE, f"two stages with one batch wait for each other; waited {bubble:.0%}"
    out = _analyze(pipeline, capsys)
    first = _first(out["findings"])
    assert first["rule"] == "pipeline-bubble", [f["title"] for f in out["findings"]]
    n = first["numbers"]
    assert n["stages"] == 2 and n["micro_batches"] == 1
    assert n["ideal_bubble_fraction"] == pytest.approx(1 / 2)  # (p-1)/(m+p-1)
    assert n["bubble_fraction"] == pytest.approx(bubble, abs=SHARE_TOL)
    assert n["comm_share"] == n["bubble_fraction"]
    # the micro-batch count that brings the ideal bubble to 10%: (2-1)/(9+2-1)
    assert n["micro_batches_advised"] == 9 and "m=9" in first["recommendation"]
    # each stage's longest wait, named with its op and peer as the comm rows have it
    longest = _rows(
        pipeline,
        f"""
        SELECT rank, arg_max(op, waited) AS op, arg_max(peer, waited) AS peer FROM (
            SELECT rank, op, peer, sum(exposed_ns) AS waited FROM comm WHERE step >= {first_step}
            GROUP BY ALL
        ) GROUP BY rank
        """,
    )
    for r in longest:
        assert f"{r['op']} {'to' if r['op'] == 'send' else 'from'} rank {r['peer']}" in first["text"]
    assert {r["peer"] for r in longest} == {0, 1}
    assert "stage 0 (rank 0)" in first["text"] and "N=4" in first["recommendation"]
    # the stages are inferred from who talks to whom, and wait for each other: no straggler verdict
    assert not _all_rules(out["findings"]) & {"straggler", "communication-share", "parameter-server"}


def test_a_parameter_server_with_steps_on_the_server_gets_push_and_pull_first(
    ps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first_step = _steady_from(ps)
    with open_store(ps) as s:
        roles = {r["rank"]: r["role"] for r in run_analysis("comm_roles", s).to_pylist()}
    assert roles == {0: "server", 1: "worker"}  # the server steps too, but trains nothing
    (worker,) = _rows(
        ps,
        f"""
        SELECT sum(exposed_ns) FILTER (WHERE op = 'send') / count(DISTINCT step) AS push,
               sum(exposed_ns) FILTER (WHERE op = 'recv') / count(DISTINCT step) AS pull,
               sum(exposed_ns) / (SELECT sum(step_ns) FROM steps WHERE rank = 1 AND step >= {first_step})
                   AS share
        FROM comm WHERE rank = 1 AND peer = 0 AND step >= {first_step}
        """,
    )
    assert worker["share"] >= COMM_WAIT_SHARE, (
        f"the worker is meant to wait on push and pull; waited {worker['share']:.0%}"
    )
    out = _analyze(ps, capsys)
    first = _first(out["findings"])
    assert first["rule"] == "parameter-server", [f["title"] for f in out["findings"]]
    n = first["numbers"]
    assert n["server_rank"] == 0
    assert n["comm_share"] == pytest.approx(worker["share"], abs=SHARE_TOL)
    assert n["push_ns"] == pytest.approx(worker["push"], rel=0.05)
    assert n["pull_ns"] == pytest.approx(worker["pull"], rel=0.05)
    assert 0 < n["server_busy_share"] < 1 and pct(n["server_busy_share"]) in first["text"]
    assert "server (rank 0)" in first["text"] and "N=3 and N=5" in first["recommendation"]
    assert not _all_rules(out["findings"]) & {"straggler", "communication-share", "pipeline-bubble"}


def test_a_run_with_little_communication_gets_no_such_finding(
    ddp_small: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    share = _wait_share_from_rows(ddp_small)
    assert share < COMM_WAIT_SHARE, (
        f"the job is meant to compute far longer than it syncs; waited {share:.0%}"
    )
    out = _analyze(ddp_small, capsys)
    assert not _all_rules(out["findings"]) & COMM_RULES, [f["title"] for f in out["findings"]]
