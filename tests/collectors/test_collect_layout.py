"""A live job's parallel layout and process groups (issue 23), on real 4-rank gloo jobs.

One launch of 4 processes records five runs, one after the other, each into its own store:

- `degrees`: profile(parallel={"dp": 2, "pp": 2}), a 2-stage pipeline (send/recv of every
  micro-batch, sleeps for work) with a data-parallel allreduce of each stage's gradients on that
  stage's own group; its rank r is dp r // 2 at stage r % 2 (the dimensions as given, the last
  fastest, like init_device_mesh);
- `dp`: parallel={"dp": 4}, every rank a data-parallel rank, rank 3 slower;
- `mesh`: profile(parallel=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")));
- `bad`: parallel={"dp": 3, "pp": 3} on 4 ranks: one warning, NULL coordinates, the job goes on;
- `ddp`: a DDP model on each stage's data-parallel group (its buckets are that group's);
- `megatron_off`, `megatron`: a small module shaped after Megatron-LM's documented
  megatron.core.parallel_state (its function names; tensor fastest, then data, then pipeline),
  imported but not initialised (nothing recorded), then initialised with pp = 2.

Results come back through the queue of run_ranks and the stores, never through stdout.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from collect_helpers import results_ok, run_ranks

from perfscope import open_store
from perfscope.cli import main
from perfscope.store.process_groups import COMM_MEMBERS_SQL

WORLD = 4
#: the pipeline's steps: the steady state drops 10 warm-up steps
STEPS = 14
MICRO = 2
WORK_S = 0.008
#: stage 1's extra forward work per micro-batch: a stage to find (large beside the scheduling noise
#: of 4 ranks on 2 cores: at 6 ms against 4 ms of work the cause was read as data imbalance in 1 of 6
#: runs at load 8-9)
EXTRA_S = 0.024
HIDDEN = 8

FAKE_MEGATRON = '''
"""A stand-in for megatron.core.parallel_state: the documented function names, Megatron's default
rank order (tensor fastest, then context, data, pipeline)."""
import torch.distributed as dist

_STATE = None


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              context_parallel_size=1):
    global _STATE
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = world // (tp * pp * cp)
    _STATE = {"tp": (rank % tp, tp), "cp": ((rank // tp) % cp, cp), "dp": ((rank // (tp * cp)) % dp, dp),
              "pp": (rank // (tp * cp * dp), pp)}


def destroy_model_parallel():
    global _STATE
    _STATE = None


def model_parallel_is_initialized():
    return _STATE is not None


def get_data_parallel_rank(with_context_parallel=False):
    return _STATE["dp"][0]


def get_data_parallel_world_size(with_context_parallel=False):
    return _STATE["dp"][1]


def get_pipeline_model_parallel_rank():
    return _STATE["pp"][0]


def get_pipeline_model_parallel_world_size():
    return _STATE["pp"][1]


def get_tensor_model_parallel_rank():
    return _STATE["tp"][0]


def get_tensor_model_parallel_world_size():
    return _STATE["tp"][1]


def get_context_parallel_rank():
    return _STATE["cp"][0]


def get_context_parallel_world_size():
    return _STATE["cp"][1]
'''


def _pipeline(prof: Any, rank: int, stage_groups: list[Any], steps: int) -> None:
    """dp x pp = 2 x 2: rank r at stage r % 2 sends to / receives from its neighbour r ^ 1; each
    stage's dp ranks allreduce their gradients on the stage's group."""
    import torch
    import torch.distributed as dist

    stage, peer = rank % 2, rank ^ 1
    grads = torch.ones(16)
    for _ in range(steps):
        with prof.phase("forward"):
            for _ in range(MICRO):
                x = torch.zeros(2, HIDDEN)
                if stage == 1:
                    dist.recv(x, peer)
                time.sleep(WORK_S + (EXTRA_S if stage == 1 else 0.0))
                if stage == 0:
                    dist.send(x + 1, peer)
        with prof.phase("backward"):
            for _ in range(MICRO):
                g = torch.zeros(2, HIDDEN)
                if stage == 0:
                    dist.recv(g, peer)
                time.sleep(WORK_S)
                if stage == 1:
                    dist.send(g + 1, peer)
        with prof.phase("sync"):
            dist.all_reduce(grads, group=stage_groups[stage])
        with prof.phase("optimizer"):
            time.sleep(0.001)
        prof.step()


def layout_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import perfscope

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    stage_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    opts: dict[str, Any] = {"poll_hz": 0, "gpu_telemetry": False, "batch_size": 2}
    runs: dict[str, str | None] = {}

    def small(prof: Any) -> None:
        for _ in range(2):
            with prof.phase("sync"):
                dist.all_reduce(torch.ones(4))
            prof.step()

    with perfscope.profile(f"{root}/degrees", parallel={"dp": 2, "pp": 2}, **opts) as prof:
        runs["degrees"] = prof.run_id
        _pipeline(prof, rank, stage_groups, STEPS)
    with perfscope.profile(f"{root}/dp", parallel={"dp": world_size}, **opts) as prof:
        for _ in range(STEPS):
            with prof.phase("forward"):
                time.sleep(WORK_S + (WORK_S if rank == 3 else 0.0))  # rank 3: a slow worker
            with prof.phase("sync"):
                dist.all_reduce(torch.ones(4))
            prof.step()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    with perfscope.profile(f"{root}/mesh", parallel=mesh, **opts) as prof:
        runs["mesh"] = prof.run_id
        small(prof)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(f"{root}/bad", parallel={"dp": 3, "pp": 3}, **opts) as prof:
            runs["bad"] = prof.run_id
            small(prof)
            bad_steps = 2
    layout_warnings = [str(w.message) for w in caught if "parallel layout" in str(w.message)]
    # DDP on each stage's data-parallel group: its buckets are that group's
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(4, 4), process_group=stage_groups[rank % 2]
    )
    with perfscope.profile(f"{root}/ddp", **opts) as prof:
        prof.watch(model)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
            prof.all_reduce(torch.ones(2), group=stage_groups[rank % 2])  # a hand-written one
            prof.step()
    sys.path.insert(0, f"{root}/fake")
    import megatron.core.parallel_state as ps  # the stand-in

    with perfscope.profile(f"{root}/megatron_off", **opts) as prof:  # imported, not initialised
        runs["megatron_off"] = prof.run_id
        small(prof)
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    with perfscope.profile(f"{root}/megatron", **opts) as prof:
        runs["megatron"] = prof.run_id
        small(prof)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"runs": runs, "layout_warnings": layout_warnings, "bad_steps": bad_steps}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("layout")
    pkg = root / "fake" / "megatron" / "core"
    pkg.mkdir(parents=True)
    (root / "fake" / "megatron" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel_state.py").write_text(FAKE_MEGATRON)
    return root, results_ok(run_ranks(layout_job, WORLD, str(root), timeout_s=240))


def _query(store: Path, sql: str) -> list[dict[str, Any]]:
    with open_store(str(store)) as st:
        return list(st.query(sql).to_pylist())


#: comm with each call's group members (the store keeps them once per group: process_groups)
COMM = f"({COMM_MEMBERS_SQL}) comm"
_COORDS = "SELECT rank, dp_rank, pp_stage, tp_rank, cp_rank FROM ranks ORDER BY rank"
_SIZES = "SELECT DISTINCT dp_size, pp_size, tp_size, cp_size FROM runs"


def test_parallel_degrees_give_every_rank_its_coordinates(recorded: tuple[Path, dict[int, Any]]) -> None:
    root, _ = recorded
    ranks = _query(root / "degrees", _COORDS)
    assert [(r["rank"], r["dp_rank"], r["pp_stage"], r["tp_rank"], r["cp_rank"]) for r in ranks] == [
        (r, r // 2, r % 2, 0, 0) for r in range(WORLD)
    ]
    assert _query(root / "degrees", _SIZES) == [{"dp_size": 2, "pp_size": 2, "tp_size": 1, "cp_size": 1}]


def test_a_device_mesh_gives_the_same_coordinates(recorded: tuple[Path, dict[int, Any]]) -> None:
    root, _ = recorded
    assert _query(root / "mesh", _COORDS) == _query(root / "degrees", _COORDS)
    assert _query(root / "mesh", _SIZES) == [{"dp_size": 2, "pp_size": 2, "tp_size": 1, "cp_size": 1}]


def test_megatron_parallel_state_is_read_once_initialised(recorded: tuple[Path, dict[int, Any]]) -> None:
    root, _ = recorded
    # Megatron's order: data-parallel rank varies faster than the pipeline stage
    ranks = _query(root / "megatron", _COORDS)
    assert [(r["dp_rank"], r["pp_stage"], r["tp_rank"], r["cp_rank"]) for r in ranks] == [
        (r % 2, r // 2, 0, 0) for r in range(WORLD)
    ]
    assert _query(root / "megatron", _SIZES) == [{"dp_size": 2, "pp_size": 2, "tp_size": 1, "cp_size": 1}]
    # imported but not initialised: no layout
    off = _query(root / "megatron_off", _COORDS)
    assert len(off) == WORLD and all(r["dp_rank"] is None and r["pp_stage"] is None for r in off)


def test_a_layout_that_does_not_fit_the_world_warns_once_and_the_job_goes_on(
    recorded: tuple[Path, dict[int, Any]],
) -> None:
    root, results = recorded
    # one line for the job (the first rank to see it), not one per rank; every rank's events row below
    said = [m for res in results.values() for m in res["layout_warnings"]]
    assert len(said) == 1, said
    assert "\n" not in said[0] and "multiply to 9, not the world size 4" in said[0]
    ranks = _query(root / "bad", _COORDS)
    assert len(ranks) == WORLD and all(r["dp_rank"] is None and r["pp_stage"] is None for r in ranks)
    assert _query(root / "bad", _SIZES) == [
        {"dp_size": None, "pp_size": None, "tp_size": None, "cp_size": None}
    ]
    steps = _query(root / "bad", "SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank")
    assert [(s["rank"], s["n"]) for s in steps] == [(r, results[r]["bad_steps"]) for r in range(WORLD)]
    events = _query(
        root / "bad", "SELECT rank, count(*) AS n FROM events WHERE kind = 'layout_unusable' GROUP BY rank"
    )
    assert sorted((e["rank"], e["n"]) for e in events) == [(r, 1) for r in range(WORLD)]


def test_collectives_record_their_process_group(recorded: tuple[Path, dict[int, Any]]) -> None:
    root, _ = recorded
    rows = _query(
        root / "degrees",
        f"SELECT rank, op, peer, group_size, group_ranks, count(*) AS n FROM {COMM} "
        "GROUP BY ALL ORDER BY rank, op",
    )
    seen = {(r["rank"], r["op"]): (r["peer"], r["group_size"], r["group_ranks"]) for r in rows}
    for rank in range(WORLD):
        stage_group = "0,2" if rank % 2 == 0 else "1,3"
        assert seen[(rank, "allreduce")] == (None, 2, stage_group)
        pair = f"{rank & ~1},{rank | 1}"  # the rank and its neighbour stage
        for op in ("send", "recv"):  # the default group's size; the transfer's two sides
            assert seen[(rank, op)] == (rank ^ 1, WORLD, pair)
    buckets = _query(
        root / "ddp",
        f"SELECT DISTINCT rank, group_size, group_ranks FROM {COMM} WHERE bucket IS NOT NULL",
    )
    assert sorted((b["rank"], b["group_size"], b["group_ranks"]) for b in buckets) == [
        (r, 2, "0,2" if r % 2 == 0 else "1,3") for r in range(WORLD)
    ]
    manual = _query(
        root / "ddp",
        f"SELECT DISTINCT rank, group_size, group_ranks FROM {COMM} WHERE bucket IS NULL",
    )
    assert sorted((m["rank"], m["group_size"], m["group_ranks"]) for m in manual) == [
        (r, 2, "0,2" if r % 2 == 0 else "1,3") for r in range(WORLD)
    ]
    # the default group is every rank
    world = _query(
        root / "mesh",
        f"SELECT DISTINCT group_ranks, group_size FROM {COMM} WHERE op = 'allreduce'",
    )
    assert world == [{"group_ranks": "0,1,2,3", "group_size": WORLD}]


def test_analyze_reads_the_recorded_layout_in_what_if(
    recorded: tuple[Path, dict[int, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, results = recorded
    capsys.readouterr()
    assert main(["analyze", str(root / "degrees"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["run_id"]: r for r in out["what_if"]}
    run = results[0]["runs"]["degrees"]
    assert set(rows) == {run}
    d = rows[run]
    # the workers are the layout's: dp rank x stage, rank = 2 * dp + stage
    workers = sorted((w["dp_rank"], w["stage"], w["ranks"]) for w in d["by_worker"])
    assert workers == [(dp, st, [2 * dp + st]) for dp in range(2) for st in range(2)]
    # read as a recorded job: its phases are ops (not only its transfers), its longer stage is found
    assert {"forward", "backward", "forward-send", "allreduce"} <= {o["op_type"] for o in d["by_op_type"]}, d
    assert d["by_stage"][0]["stage"] == 1 and d["cause"] == "stage-imbalance", d
    assert d["by_stage"][1]["slowdown"] < 1 + (d["by_stage"][0]["slowdown"] - 1) / 2, d
    assert d["steps"] >= 1 and d["replay_error"] < 0.05, d


def functional_job(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Functional collectives (what DTensor runs) inside a profile: recorded, nothing said."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import perfscope

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    original = (funcol.all_reduce, funcol.wait_tensor, funcol._maybe_wrap_tensor)
    sums = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(store, poll_hz=0, gpu_telemetry=False, batch_size=2) as prof:
            for _ in range(3):
                with prof.phase("sync"):
                    out = funcol.all_reduce(torch.full((4,), float(rank + 1)), "sum", list(range(world_size)))
                    sums.append(float(funcol.wait_tensor(out)[0]))
                    dist.all_reduce(torch.ones(2))
                prof.step()
            run_id = prof.run_id
    restored = (funcol.all_reduce, funcol.wait_tensor, funcol._maybe_wrap_tensor) == original
    dist.destroy_process_group()
    said = [str(w.message) for w in caught if "functional collectives" in str(w.message)]
    return {"run_id": run_id, "sums": sums, "said": said, "restored": restored}


def test_functional_collectives_are_recorded_and_the_job_is_unchanged(tmp_path: Path) -> None:
    store = tmp_path / "store"
    results = results_ok(run_ranks(functional_job, 2, str(store)))
    for rank, res in results.items():
        assert res["sums"] == [3.0, 3.0, 3.0] and res["restored"], (rank, res)
        assert res["said"] == [], (rank, res["said"])
    # each rank: three functional all-reduces (async: issued, then waited) beside three torch.distributed ones
    ops = _query(
        store,
        f"SELECT rank, op, is_async, group_ranks, count(*) AS n, sum(bytes) AS bytes FROM {COMM} "
        "WHERE exposed_ns <= dur_ns GROUP BY ALL ORDER BY ALL",
    )
    assert [(o["rank"], o["op"], o["is_async"], o["group_ranks"], o["n"], o["bytes"]) for o in ops] == [
        (r, "allreduce", is_async, "0,1", 3, 3 * (16 if is_async else 8))
        for r in (0, 1)
        for is_async in (False, True)
    ]


def test_degrees_are_a_mesh_in_the_order_given() -> None:
    from perfscope.collectors.layout import LayoutError, resolve

    # pp outermost, then dp, tp fastest (Megatron's order, written as a mesh): rank = pp*4 + dp*2 + tp
    got = [resolve({"pp": 2, "dp": 2, "tp": 2}, r, 8) for r in range(8)]
    assert [g.rank_columns() for g in got if g is not None] == [
        (r // 2 % 2, r // 4, r % 2, 0) for r in range(8)
    ]
    assert got[0] is not None and got[0].run_columns() == {
        "dp_size": 2,
        "pp_size": 2,
        "tp_size": 2,
        "cp_size": 1,
    }
    # torchtitan's two data-parallel dimensions make one: dp rank = replicate * shard size + shard
    titan = resolve({"dp_replicate": 2, "dp_shard": 2}, 3, 4)
    assert titan is not None and titan.rank_columns() == (3, 0, 0, 0) and titan.sizes == (4, 1, 1, 1)
    for bad, why in (
        ({"dp": 3, "pp": 3}, "multiply to 9, not the world size 4"),
        ({"dp": 2, "ep": 2}, "unknown dimension ep"),
        ({"dp": 0, "pp": 4}, "positive integers"),
        ({"dp": 2.0, "pp": 2}, "positive integers"),
    ):
        with pytest.raises(LayoutError, match=why):
            resolve(bad, 0, 4)
    with pytest.raises(LayoutError, match="dict of degrees or a DeviceMesh"):
        resolve([2, 2], 0, 4)
    # nothing given and no Megatron in the process: unknown
    assert "megatron.core.parallel_state" not in sys.modules and resolve(None, 0, 4) is None


def test_analyze_reads_a_recorded_data_parallel_layout(
    recorded: tuple[Path, dict[int, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = recorded
    ranks = _query(root / "dp", _COORDS)
    assert [(r["dp_rank"], r["pp_stage"], r["tp_rank"], r["cp_rank"]) for r in ranks] == [
        (r, 0, 0, 0) for r in range(WORLD)
    ]
    capsys.readouterr()
    assert main(["analyze", str(root / "dp"), "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)["what_if"]
    # read as a recorded data-parallel job: its phases are ops, every rank a worker at stage 0
    assert {"forward", "allreduce"} <= {o["op_type"] for o in d["by_op_type"]}, d
    assert sorted((w["dp_rank"], w["stage"], w["ranks"]) for w in d["by_worker"]) == [
        (r, 0, [r]) for r in range(WORLD)
    ]
    assert d["by_worker"][0]["ranks"] == [3] and d["cause"] == "slow-worker", d
