"""A real 4-rank gloo job leaves one file per table for its host, and a SIGKILL of every rank at a
random moment keeps each rank's steps up to about one roll interval before the kill, none doubled."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from perfscope import open_store
from perfscope.store.compact import compact

pytest.importorskip("torch")
from collect_helpers import run_ranks, start_ranks

WORLD = 4
#: the promise: a SIGKILL of the whole job loses at most this much of every rank's steps; the test
#: rolls every 0.5 s (the default is 1 s), leaving the rest to scheduling on a shared 2-core machine
MAX_LOSS_S = 1.5
ROLL_S = 0.5


def _train(rank: int, world_size: int, store: str, options: dict[str, Any]) -> str:
    """Steps of an all-reduce and a short sleep under perfscope.profile; touches `ready-<rank>` in
    the store's parent once a few steps are done."""
    import torch
    import torch.distributed as dist

    import perfscope

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    t = torch.ones(256)
    with perfscope.profile(
        store,
        experiment="per-host",
        batch_size=8,
        poll_hz=10,
        gpu_telemetry=False,
        roll_interval_s=options["roll_s"],
    ) as prof:
        # the job's own account of its steps, beside perfscope's: "<step> <wall ns>" once each step's
        # work is done, straight to the OS (a SIGKILL keeps it), so a stalled job is not a lost roll
        log = os.open(Path(store).parent / f"steps-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        for i in prof.steps(range(options["steps"])):
            dist.all_reduce(t)
            time.sleep(options["sleep_s"])
            os.write(log, f"{i} {time.time_ns()}\n".encode())
            if i == 5:
                (Path(store).parent / f"ready-{rank}").touch()
        os.close(log)
        run_id = str(prof.run_id)
    dist.destroy_process_group()
    return run_id


def _data_files(root: Path) -> dict[str, list[Path]]:
    """Files that are not temporary (hidden), per table folder."""
    return {
        table.name: [p for p in table.rglob("*") if p.is_file() and not p.name.startswith(".")]
        for table in root.iterdir()
        if table.is_dir() and not table.name.startswith((".", "_"))
    }


def test_a_four_rank_job_leaves_one_file_per_table(tmp_path: Path) -> None:
    store = tmp_path / "store"
    steps = 300
    results = run_ranks(_train, WORLD, str(store), {"steps": steps, "roll_s": 0.05, "sleep_s": 0.002})
    assert all(status == "ok" for status, _ in results.values()), results
    files = _data_files(store)
    # every rank rolled a batch per table every 50 ms: one Parquet file per table with rows, no live segment
    assert files and all(len(f) == 1 and f[0].suffix == ".parquet" for f in files.values()), files
    assert sum(len(f) for f in files.values()) <= 12
    with open_store(store) as s:
        per_rank = s.query(
            "SELECT rank, count(*) AS n, count(DISTINCT step) AS d, max(step) AS last "
            "FROM steps GROUP BY rank"
        ).to_pylist()
        assert sorted(per_rank, key=lambda r: r["rank"]) == [
            {"rank": r, "n": steps, "d": steps, "last": steps - 1} for r in range(WORLD)
        ]
        assert s.query("SELECT count(*) FROM comm").column(0)[0].as_py() >= WORLD * steps
        assert not s.skipped


def _kill_all_at_random(tmp_path: Path, seed: int, roll_s: float) -> tuple[Path, int]:
    """Start the job, wait until every rank is stepping, SIGKILL all at a random moment; the store
    and the kill's wall-clock time."""
    store = tmp_path / "store"
    options = {"steps": 1_000_000, "roll_s": roll_s, "sleep_s": 0.005}
    procs, _ = start_ranks(_train, WORLD, str(store), options)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in range(WORLD)):
            assert time.monotonic() < deadline, "the job did not start"
            assert all(p.is_alive() for p in procs), "a rank died"
            time.sleep(0.05)
        time.sleep(random.Random(seed).uniform(MAX_LOSS_S + 0.2, MAX_LOSS_S + 2.5))
        killed_ns = time.time_ns()
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(30)
    return store, killed_ns


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_of_every_rank_loses_at_most_a_roll_of_steps(tmp_path: Path, seed: int) -> None:
    store, killed_ns = _kill_all_at_random(tmp_path, seed, roll_s=ROLL_S)
    query = (
        "SELECT rank, count(*) AS n, count(DISTINCT step) AS d, min(step) AS first, max(step) AS last, "
        "max(start_ns + step_ns) AS last_end_ns FROM steps GROUP BY rank ORDER BY rank"
    )
    with open_store(store) as s:
        kept = s.query(query).to_pylist()
    assert [r["rank"] for r in kept] == list(range(WORLD))
    for r in kept:
        # nothing doubled, nothing missing in the middle: a gap-free prefix of the steps taken
        assert r["n"] == r["d"] == r["last"] + 1 and r["first"] == 0, r
        # every step the job had finished MAX_LOSS_S before the kill is in the store: step i had ended
        # by the time step i + 1's work was logged (a job stalled by a loaded machine ends no steps,
        # and losing none of them is no failure of the writer's)
        logged = [line.split() for line in (tmp_path / f"steps-{r['rank']}.log").read_text().splitlines()]
        done_by = [
            int(i) - 1 for i, ns in logged if len(ns) >= 18 and int(ns) <= killed_ns - MAX_LOSS_S * 1e9
        ]
        if done_by:
            lost_s = (killed_ns - r["last_end_ns"]) / 1e9
            assert r["last"] >= max(done_by), (
                f"rank {r['rank']} kept steps up to {r['last']}, but step {max(done_by)} had ended more "
                f"than {MAX_LOSS_S} s before the kill ({lost_s:.3f} s of steps lost, seed {seed})"
            )
    # `perfscope compact` seals the killed writers' live segments: the same rows, all in Parquet
    result = compact(store, grace_s=0)
    assert result.live_sealed and not list(store.rglob("*.arrows"))
    with open_store(store) as s:
        assert s.query(query).to_pylist() == kept
