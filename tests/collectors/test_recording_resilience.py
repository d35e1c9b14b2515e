"""Recording survives what happens around it: a training process killed with SIGKILL in its first
second keeps its first step, a store folder deleted mid-run is made again for the rest of the run,
what killed writers, compactions and readers left behind is cleaned once old (and only that), and a
run id already in the store is made distinct instead of merging two runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import perfscope
from perfscope import PerfscopeWarning, open_store
from perfscope.store.compact import compact
from perfscope.store.leftovers import clean_leftovers
from perfscope.store.schema import PARTITION_KEY, TABLES
from perfscope.store.writer import StoreWriter, segment_dir

#: the child sets up for this long between profile() and its first step (a model, a loader)
SETUP_S = 1.0
#: killed this long after its first step ended: the first segment must be on disk by then
KILL_AFTER_S = 0.6

CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    import perfscope

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with perfscope.profile(sys.argv[1], experiment="killed", batch_size=16, poll_hz=10) as prof:
        prof.watch(model)
        time.sleep(float(sys.argv[2]))
        for i, x in enumerate(prof.steps(torch.randn(16, 64) for _ in range(100_000))):
            if i == 1:
                print("first step done", flush=True)
            with prof.phase("forward"):
                loss = model(x).square().mean()
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            time.sleep(0.02)
    """
)


def test_sigkill_in_the_first_second_keeps_the_first_step(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), str(SETUP_S)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PERFSCOPE_RUN_ID": "killed-early"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first step done"
        time.sleep(KILL_AFTER_S)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    with open_store(tmp_path) as store:
        steps = store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist()
        (run,) = store.query("SELECT run_id, experiment, world_size FROM runs").to_pylist()
        ranks = store.query("SELECT rank FROM ranks").column("rank").to_pylist()
    # the first step, and the run it belongs to, were on disk before the kill
    assert steps[:1] == [0] and steps == list(range(len(steps)))
    assert run == {"run_id": "killed-early", "experiment": "killed", "world_size": 1} and ranks == [0]


@pytest.mark.parametrize("deleted", ["store", "table", "partition"])
def test_a_folder_deleted_mid_run_is_made_again(tmp_path: Path, deleted: str) -> None:
    root = tmp_path / "store"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(root, experiment="deleted", poll_hz=0, run_id=f"del-{deleted}") as prof:
            assert prof.run_id is not None
            folder = {
                "store": root,
                "table": root / "steps",
                "partition": segment_dir(root, "steps", prof.run_id),
            }[deleted]
            for i in prof.steps(range(20)):
                if i == 10:
                    prof.flush()
                    assert folder.is_dir()
                    shutil.rmtree(folder)  # a user's clean-up script, mid-run
    texts = [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]
    assert len(texts) == 1 and "was deleted while the run was recording" in texts[0], texts
    with open_store(root) as store:
        steps = store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist()
        ended = store.query("SELECT ended_ns FROM runs WHERE ended_ns IS NOT NULL").num_rows
    # the steps written before the deletion are gone with it; every one after it is kept
    assert steps == list(range(10, 20)) and ended == 1


def _row(table: str, **values: object) -> tuple[object, ...]:
    """A row of `table` in schema order (without the partition key), NULL where not given."""
    return tuple(values.get(c) for c in TABLES[table].column_names if c != PARTITION_KEY)


STEP_ROW = _row("steps", rank=0, step=0, start_ns=1, step_ns=2, samples=1, clock="host")


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _leftovers_store(tmp_path: Path) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """A store with real segments, our leftovers (old and fresh) and things that only look alike."""
    root = tmp_path / "store"
    with StoreWriter(root, "r1") as w:
        w.append("steps", STEP_ROW)
    part = segment_dir(root, "steps", "r1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("not ours")
    (outside / ".c-0123456789ab.parquet.tmp").write_text("not in the store")
    paths = {
        "old_compaction": part / ".c-0123456789ab.parquet.tmp",
        "old_writer": part / ".r0-p1-abc-000001.parquet.deadbeef.tmp",
        "fresh_compaction": part / ".c-ba9876543210.parquet.tmp",
        "foreign": part / ".notes.tmp",
        "foreign_in_root": root / ".c-0123456789ab.parquet.tmp",
    }
    for name, p in paths.items():
        p.write_bytes(b"partial")
        if name != "fresh_compaction":
            _age(p, 7200)
    # a leftover's name on a link to a file outside, and a table folder that is a link outside
    link = part / ".c-fedcba987654.parquet.tmp"
    link.symlink_to(outside / "precious.txt")
    _age(link, 7200)
    (root / "spans").symlink_to(outside, target_is_directory=True)
    _age(outside / ".c-0123456789ab.parquet.tmp", 7200)
    paths["link"] = link
    temp = tmp_path / "tmp"
    temp.mkdir()
    spills = {
        "dead": temp / f"perfscope-duckdb-{_dead_pid()}-a1b2",
        "alive": temp / f"perfscope-duckdb-{os.getpid()}-c3d4",
        "legacy_old": temp / "perfscope-duckdb-e5f6g7",
        "legacy_fresh": temp / "perfscope-duckdb-h8i9j0",
        "foreign": temp / "other-duckdb-12345-zz",
    }
    for name, d in spills.items():
        d.mkdir()
        (d / "spill.tmp").write_bytes(b"x")
        if name != "legacy_fresh":
            _age(d, 7200)
    spill_link = temp / f"perfscope-duckdb-{_dead_pid()}-link"
    spill_link.symlink_to(outside, target_is_directory=True)
    _age(spill_link, 7200)
    spills["link"] = spill_link
    return root, paths, spills


def test_leftovers_older_than_the_grace_are_cleaned_and_nothing_else(tmp_path: Path) -> None:
    root, paths, spills = _leftovers_store(tmp_path)
    removed = clean_leftovers(root, temp_root=tmp_path / "tmp", grace_s=600)
    gone = {"old_compaction", "old_writer"}
    assert {p.name for p in removed} == {paths[n].name for n in gone} | {
        spills["dead"].name,
        spills["legacy_old"].name,
    }
    for name, p in paths.items():
        assert os.path.lexists(p) == (name not in gone), name
    assert {n for n, d in spills.items() if os.path.lexists(d)} == {
        "alive",
        "legacy_fresh",
        "foreign",
        "link",
    }
    outside = tmp_path / "outside"
    assert (outside / "precious.txt").read_text() == "not ours"
    assert (outside / ".c-0123456789ab.parquet.tmp").exists()  # behind the spans link: not followed
    segments = [p.name for p in segment_dir(root, "steps", "r1").iterdir() if p.suffix == ".parquet"]
    assert len(segments) == 1 and not segments[0].startswith(".")  # the real segment is untouched


def test_compact_and_a_starting_writer_clean_leftovers(tmp_path: Path) -> None:
    root, paths, _ = _leftovers_store(tmp_path)
    (root / "spans").unlink()  # links inside a store are another test's subject
    result = compact(root, grace_s=0)
    assert sorted(result.leftovers_removed) == sorted([paths["old_compaction"], paths["old_writer"]])
    assert not paths["old_compaction"].exists() and not paths["old_writer"].exists()
    assert paths["fresh_compaction"].exists() and paths["foreign"].exists()
    stale = segment_dir(root, "steps", "r1") / ".c-00000000aaaa.parquet.tmp"
    stale.write_bytes(b"partial")
    _age(stale, 7200)
    with StoreWriter(root, "r2", clean_leftovers=True) as w:  # closed before its first roll
        w.append("steps", STEP_ROW)
    assert not stale.exists() and paths["fresh_compaction"].exists()
    stale.write_bytes(b"partial")
    _age(stale, 7200)
    with StoreWriter(root, "r3", clean_leftovers=True, roll_interval_s=0.1) as w:  # a long run
        w.append("steps", STEP_ROW)
        deadline = time.monotonic() + 60
        while stale.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not stale.exists(), "a running writer cleans up after its first roll"
    assert paths["fresh_compaction"].exists()


SAME_ID_CHILD = textwrap.dedent(
    """
    import sys, warnings, perfscope
    warnings.simplefilter("always")
    with perfscope.profile(sys.argv[1], experiment="same-id", poll_hz=0, run_id="exp-1") as prof:
        for _ in prof.steps(range(int(sys.argv[2]))):
            pass
    print(prof.run_id)
    """
)


def _same_id_run(root: Path, steps: int, **env: str) -> tuple[str, list[str]]:
    """A separate process (its own count of ids claimed) recording `steps` steps as run 'exp-1':
    (the run id it got, its perfscope warning lines: one plain line each, 'perfscope: ...')."""
    done = subprocess.run(
        [sys.executable, "-c", SAME_ID_CHILD, str(root), str(steps)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=True,
    )
    return done.stdout.strip(), [ln for ln in done.stderr.splitlines() if ln.startswith("perfscope: ")]


def test_a_run_id_already_in_the_store_is_made_distinct(tmp_path: Path) -> None:
    first, warned = _same_id_run(tmp_path, 5)
    assert (first, warned) == ("exp-1", [])
    second, warned = _same_id_run(tmp_path, 7)  # a second job given the same id
    assert second == "exp-1-2" and len(warned) == 1 and "so that the two do not merge" in warned[0]
    third, _ = _same_id_run(tmp_path, 9)
    assert third == "exp-1-3"
    with open_store(tmp_path) as store:
        got = store.query("SELECT run_id, count(*) AS n FROM steps GROUP BY ALL ORDER BY n").to_pylist()
    assert got == [{"run_id": "exp-1", "n": 5}, {"run_id": "exp-1-2", "n": 7}, {"run_id": "exp-1-3", "n": 9}]


def test_ranks_of_one_run_that_start_alone_still_share_its_id(tmp_path: Path) -> None:
    """Without a process group each rank checks the store alone: rank 1 finds rank 0's fresh rows
    of a 2-rank run and joins them; a 3-rank job given the same id does not."""
    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert _same_id_run(tmp_path, 4, RANK="0", LOCAL_RANK="0", **torchrun) == ("exp-1", [])
    assert _same_id_run(tmp_path, 4, RANK="1", LOCAL_RANK="1", **torchrun) == ("exp-1", [])
    other, warned = _same_id_run(tmp_path, 4, RANK="1", LOCAL_RANK="1", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
    assert other == "exp-1-2" and len(warned) == 1
    with open_store(tmp_path) as store:
        got = store.query("SELECT run_id, list(DISTINCT rank ORDER BY rank) AS r FROM steps GROUP BY ALL")
    assert sorted(map(tuple, (d.values() for d in got.to_pylist()))) == [("exp-1", [0, 1]), ("exp-1-2", [1])]


def _identity_rows(root: Path, run_id: str, *, rank: int, world_size: int, started_ns: int) -> None:
    with StoreWriter(root, run_id) as w:
        w.append("ranks", _row("ranks", rank=rank, started_ns=started_ns))
        w.append("runs", _row("runs", experiment="x", world_size=world_size, started_ns=started_ns))


def test_what_counts_as_another_run_holding_the_id(tmp_path: Path) -> None:
    from perfscope.collectors.identity import run_id_taken

    now = time.time_ns()
    _identity_rows(tmp_path, "fresh", rank=0, world_size=2, started_ns=now - 5 * 10**9)
    _identity_rows(tmp_path, "old", rank=0, world_size=2, started_ns=now - 3600 * 10**9)
    assert not run_id_taken(tmp_path, "absent", rank=0, world_size=1)
    assert not run_id_taken(tmp_path, "fresh", rank=1, world_size=2)  # the same run's other rank
    assert run_id_taken(tmp_path, "fresh", rank=0, world_size=2)  # this rank already recorded it
    assert run_id_taken(tmp_path, "fresh", rank=1, world_size=3)  # another world size
    assert run_id_taken(tmp_path, "old", rank=1, world_size=2)  # started an hour ago
    # rows of the id without its identity rows, or an unreadable segment: another run's, to be safe
    with StoreWriter(tmp_path, "steps-only") as w:
        w.append("steps", STEP_ROW)
    assert run_id_taken(tmp_path, "steps-only", rank=1, world_size=2)
    (segment_dir(tmp_path, "ranks", "fresh") / "garbage.parquet").write_bytes(b"PAR1 not parquet")
    assert run_id_taken(tmp_path, "fresh", rank=1, world_size=2)
