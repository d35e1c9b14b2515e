"""Rollups (issue 15): the analyses read per-step and per-window aggregates that compaction writes,
and every number is the one the raw rows give; a stale or hostile rollup is never used."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from storegen import MS, T0_NS, Comm, make_run, ring_transfer_ns, row
from tables import assert_tables_close
from test_analysis_steady import alternating, unaligned_run

from perfscope.analysis import ANALYSES, Selection, run_analysis
from perfscope.cli import main
from perfscope.errors import PerfscopeWarning
from perfscope.store.compact import compact
from perfscope.store.open import open_store
from perfscope.store.rollups import META_ROLLUP, ROLLUP_DIR, rollup_index, write_rollups
from perfscope.store.writer import StoreWriter

#: A small window grid, so that short test runs span many windows and cuts fall inside them.
WINDOW = 7
SELECTIONS = [
    Selection(),
    Selection(warmup_steps=0),
    Selection(warmup_steps=12),  # a cut inside a window: its raw rows complete the sums
    Selection(warmup_steps=31),
    Selection(experiments=("exp",), warmup_steps=5),
]


def _straggler(rank: int, step: int) -> dict[str, float | None]:
    """Rank 1 computes longer on every third step and waits less at the sync; noise elsewhere."""
    slow = rank == 1 and step % 3 == 0
    return {
        "forward": (14 if slow else 10) * MS + (rank * 37 + step * 11) % 50_000,
        "sync_exposed": (0.5 if slow else 3) * MS + (rank * 13 + step * 7) % 20_000,
    }


def _broken(rank: int, step: int) -> dict[str, float | None]:
    """A negative step (forward far below zero), a NULL phase, a slow periodic step."""
    if step == 25 and rank == 0:
        return {"forward": -1000 * MS}
    if step == 40:
        return {"forward": None, "data": None}
    return {"backward": (40 if step % 10 == 0 else 20) * MS + rank * 1000}


def _extra_rows(
    root: Path, run_id: str, steps: range, *, step_ns: int | None, writer: str, merge_at_close: bool = True
) -> None:
    """Step rows written by another writer (another segment): NULL step times, or steps after a gap."""
    with StoreWriter(root, run_id, writer_id=writer, merge_at_close=merge_at_close) as w:
        w.extend(
            "steps",
            [
                row("steps", rank=r, step=s, start_ns=T0_NS + s * 40 * MS, step_ns=step_ns,
                    forward_ns=None if step_ns is None else 10 * MS, samples=32, clock="cuda")
                for s in steps
                for r in range(2)
            ],
        )  # fmt: skip


def _study(root: Path) -> None:
    """Several runs and world sizes: stragglers, a missing rank, NULL and negative step times, a gap
    in the steps, collectives recorded as comm rows, a second experiment, ranks whose step
    boundaries are not aligned (the steady window's wall clock is not the sum of per-step maxima)."""
    make_run(root, "n1", world_size=1, steps=60)
    make_run(root, "n2", world_size=2, steps=75, phase_fn=_straggler)
    _extra_rows(root, "n2", range(75, 80), step_ns=None, writer="late")
    make_run(root, "n4", world_size=4, steps=90, ranks_present={0, 1, 3}, phase_fn=_broken)
    make_run(root, "n8", world_size=8, steps=33, gpus_per_node=4, phase_fn=_straggler)
    _extra_rows(root, "n8", range(50, 58), step_ns=41 * MS, writer="gap")
    make_run(
        root,
        "comm4",
        world_size=4,
        steps=45,
        experiment="other",
        comm=Comm([2**20, 2**22], lambda nb: ring_transfer_ns(4, nb, 5e-6, 1e-10), lambda r, s: r * 1e5),
    )
    unaligned_run(root, "alt", alternating, steps=50)


def _tables(root: Path, sel: Selection) -> dict[str, pa.Table]:
    with open_store(root) as store:
        return {name: run_analysis(name, store, sel) for name in ANALYSES}


def _analyze_json(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["analyze", str(root), "--json", *args]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    out.pop("store")  # the folder's path: the one thing that differs
    return out


def _assert_json_close(got: object, want: object, where: str = "") -> None:
    if isinstance(want, float) and isinstance(got, float | int):
        assert math.isclose(got, want, rel_tol=1e-9) or got == want, f"{where}: {got} != {want}"
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_json_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_json_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _covered(root: Path) -> set[str]:
    with open_store(root) as store:
        return set(rollup_index(store))


@pytest.fixture(scope="module")
def rolled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The study, compacted (which writes rollups), then rolled up on the small window grid."""
    root = tmp_path_factory.mktemp("rollups")
    _study(root)
    compact(root, grace_s=0)
    assert (root / ROLLUP_DIR / "run_id=n2" / "by_step.parquet").is_file()
    assert write_rollups(root, window_steps=WINDOW) == 6
    assert write_rollups(root, window_steps=WINDOW) == 0  # up to date: nothing rewritten
    return root


def _without_rollups(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(ROLLUP_DIR))
    return dest


@pytest.mark.parametrize("sel", SELECTIONS, ids=lambda s: f"warmup={s.warmup_steps}-{len(s.experiments)}")
def test_every_analysis_is_the_same_with_and_without_rollups(
    rolled: Path, tmp_path: Path, sel: Selection
) -> None:
    assert _covered(rolled) == {"n1", "n2", "n4", "n8", "comm4", "alt"}
    raw = _without_rollups(rolled, tmp_path / "raw")
    assert _covered(raw) == set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerfscopeWarning)  # no rollup here is doubted
        got = _tables(rolled, sel)
    want = _tables(raw, sel)
    for name in ANALYSES:
        # abs_tol: a perfect fit's error (SMAPE 1e-14 %) is rounding, whichever rows were read
        assert_tables_close(got[name], want[name], rel=1e-9, abs_tol=1e-9, what=name)
    # the study exercises what it claims to
    if sel == Selection():  # the wall clock of the window (25 ms a step), not the sum of maxima (30)
        alt = next(r for r in want["run_summary"].to_pylist() if r["run_id"] == "alt")
        assert alt["step_ns"] == pytest.approx(25 * MS) and alt["step_median_ns"] == pytest.approx(30 * MS)
    quality = {r["kind"] for r in want["quality"].to_pylist()}
    assert "impossible_durations" in quality
    assert any(r["is_straggler"] for r in want["stragglers"].to_pylist())


def test_analyze_json_is_the_same_with_and_without_rollups(
    rolled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = _without_rollups(rolled, tmp_path / "raw")
    for args in ((), ("--warmup", "12")):
        _assert_json_close(_analyze_json(rolled, capsys, *args), _analyze_json(raw, capsys, *args))


def test_a_stale_rollup_is_ignored_silently(rolled: Path, tmp_path: Path) -> None:
    root = tmp_path / "stale"
    shutil.copytree(rolled, root)
    # a segment after compaction, from a writer that does not roll up at close (flock-less mount)
    _extra_rows(root, "n2", range(80, 84), step_ns=39 * MS, writer="after", merge_at_close=False)
    raw = _without_rollups(root, tmp_path / "raw")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerfscopeWarning)
        assert _covered(root) == {"n1", "n4", "n8", "comm4", "alt"}
        got = _tables(root, Selection())
    want = _tables(raw, Selection())
    for name in ("run_summary", "rank_breakdown", "stragglers", "quality", "comm_by_role"):
        assert_tables_close(got[name], want[name], what=name)
    # a vanished segment makes it stale too
    for seg in (root / "steps" / "run_id=n4").glob("*.parquet"):
        seg.unlink()
    assert "n4" not in _covered(root)


def _rewrite(path: Path, table: pa.Table, meta: bytes) -> None:
    pq.write_table(table.replace_schema_metadata({META_ROLLUP: meta}), path)


def _hostile_garbage(part: Path, other: Path) -> None:
    (part / "by_window.parquet").write_bytes(b"PAR1 not really" * 10)


def _hostile_other_runs_contents(part: Path, other: Path) -> None:
    """Another run's rollup under this run's sources: the contents disagree with the footers."""
    meta = pq.read_schema(part / "by_step.parquet").metadata[META_ROLLUP]
    _rewrite(part / "by_step.parquet", pq.read_table(other / "by_step.parquet"), meta)


def _hostile_double_counted(part: Path, other: Path) -> None:
    t = pq.read_table(part / "by_window.parquet")
    meta = t.schema.metadata[META_ROLLUP]
    _rewrite(part / "by_window.parquet", pa.concat_tables([t, t.slice(0, 1)]), meta)


def _hostile_inflated_rows(part: Path, other: Path) -> None:
    t = pq.read_table(part / "by_window.parquet")
    rows = pa.array([v + 1 for v in t.column("rows_all").to_pylist()], pa.int64())
    t = t.set_column(t.schema.get_field_index("rows_all"), "rows_all", rows)
    _rewrite(part / "by_window.parquet", t, t.schema.metadata[META_ROLLUP])


def _hostile_wrong_types(part: Path, other: Path) -> None:
    t = pq.read_table(part / "by_window.parquet")
    meta = t.schema.metadata[META_ROLLUP]
    i = t.schema.get_field_index("step_sum")
    _rewrite(part / "by_window.parquet", t.set_column(i, "step_sum", t.column(i).cast(pa.float64())), meta)


def _hostile_metadata(part: Path, other: Path) -> None:
    t = pq.read_table(part / "by_step.parquet")
    meta = json.loads(t.schema.metadata[META_ROLLUP])
    meta["anchor"] = "zero"
    _rewrite(part / "by_step.parquet", t, json.dumps(meta).encode())


def _hostile_off_grid(part: Path, other: Path) -> None:
    """Windows moved off the recorded grid (a step in two windows' sums would count twice)."""
    t = pq.read_table(part / "by_window.parquet")
    meta = json.loads(t.schema.metadata[META_ROLLUP])
    meta["anchor"] += 1
    raw = json.dumps(meta).encode()
    _rewrite(part / "by_window.parquet", t, raw)
    _rewrite(
        part / "by_step.parquet",
        pq.read_table(part / "by_step.parquet"),
        raw.replace(b"by_window", b"by_step"),
    )


def _scaled(path: Path, factors: dict[str, float], rows: slice = slice(None)) -> None:
    """The rollup at `path` with columns scaled (in `rows` only), its metadata kept as written."""
    t = pq.read_table(path)
    meta = t.schema.metadata[META_ROLLUP]
    cols = []
    for name in t.column_names:
        values = t.column(name).to_pylist()
        if name in factors:
            values[rows] = [None if v is None else int(v * factors[name]) for v in values[rows]]
        cols.append(pa.array(values, t.schema.field(name).type))
    _rewrite(path, pa.Table.from_arrays(cols, schema=t.schema.remove_metadata()), meta)


def _hostile_sums_forged(part: Path, other: Path) -> None:
    """Issue 22's forge: the sums edited, the counts and bounds and metadata kept (forward halved,
    exposed sync x10), which no count or footer statistic can tell."""
    _scaled(part / "by_window.parquet", {"forward_sum": 0.5, "sync_exposed_sum": 10, "step_sum": 1})


def _hostile_one_window_forged(part: Path, other: Path) -> None:
    """The first window's exposed sync x10 (the sample always holds the first and last rows)."""
    before = pq.read_table(part / "by_window.parquet").column("sync_exposed_sum")[0].as_py()
    _scaled(part / "by_window.parquet", {"sync_exposed_sum": 10}, slice(0, 1))
    assert (
        before and pq.read_table(part / "by_window.parquet").column("sync_exposed_sum")[0].as_py() != before
    )


def _hostile_step_rows_forged(part: Path, other: Path) -> None:
    """by_step's most exposed sync x10 on every step (no footer statistic bounds it)."""
    _scaled(part / "by_step.parquet", {"sync_max_ns": 10, "sync_min_ns": 10})


HOSTILE = [
    _hostile_sums_forged,
    _hostile_one_window_forged,
    _hostile_step_rows_forged,
    _hostile_garbage,
    _hostile_other_runs_contents,
    _hostile_double_counted,
    _hostile_inflated_rows,
    _hostile_wrong_types,
    _hostile_metadata,
    _hostile_off_grid,
]


@pytest.mark.parametrize("spoil", HOSTILE, ids=lambda f: f.__name__.removeprefix("_hostile_"))
def test_a_hostile_rollup_is_named_and_never_changes_a_number(
    rolled: Path, tmp_path: Path, spoil: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "hostile"
    shutil.copytree(rolled, root)
    spoil(root / ROLLUP_DIR / "run_id=n2", root / ROLLUP_DIR / "run_id=n4")
    raw = _without_rollups(root, tmp_path / "raw")
    with pytest.warns(PerfscopeWarning, match="rollup"):
        assert _covered(root) == {"n1", "n4", "n8", "comm4", "alt"}
    with pytest.warns(PerfscopeWarning, match="rollup"):
        got = _tables(root, Selection(warmup_steps=12))
    want = _tables(raw, Selection(warmup_steps=12))
    for name in ("run_summary", "rank_breakdown", "stragglers", "quality", "pop"):
        assert_tables_close(got[name], want[name], what=name)
    # the command says so in one line and gives the raw rows' numbers
    _assert_json_close(_analyze_json(root, capsys), _analyze_json(raw, capsys))


def test_a_rollup_linked_from_outside_the_store_is_not_read(rolled: Path, tmp_path: Path) -> None:
    root = tmp_path / "linked"
    shutil.copytree(rolled, root)
    outside = tmp_path / "outside.parquet"
    part = root / ROLLUP_DIR / "run_id=n2"
    shutil.move(part / "by_step.parquet", outside)
    (part / "by_step.parquet").symlink_to(outside)
    assert "n2" not in _covered(root)


def test_the_default_cut_is_on_the_window_grid(rolled: Path) -> None:
    """Windows start at the run's default warm-up cut, so the default steady window is whole windows
    and its per-rank sums read no raw step row."""
    with open_store(rolled) as store:
        index = rollup_index(store)
        thr = store.query(
            "SELECT run_id, min(step) AS first, max(step) - min(step) + 1 AS n FROM steps GROUP BY run_id"
        ).to_pylist()
    for r in thr:
        n = r["n"]
        warmup = max(10, math.ceil(0.05 * n)) if n - max(10, math.ceil(0.05 * n)) >= 5 else n // 2
        assert index[r["run_id"]].anchor == r["first"] + warmup


def test_a_real_job_leaves_its_rollups_at_close(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The last writer to close rolls its run up (no `perfscope compact`), and the analyses that read
    the rollups give the raw rows' numbers."""
    from collect_helpers import ddp_worker, results_ok, run_ranks

    root = tmp_path / "store"
    ran = results_ok(run_ranks(ddp_worker, 2, str(root), {"steps": 30}))
    run_id = ran[0]["run_id"]
    assert not list((root / "steps").rglob("*.arrows")), "every live segment sealed at close"
    assert _covered(root) == {run_id}
    raw = _without_rollups(root, tmp_path / "raw")
    assert _covered(raw) == set()
    _assert_json_close(_analyze_json(root, capsys), _analyze_json(raw, capsys))


def test_a_closing_writer_leaves_a_run_too_large_for_it_to_compact(tmp_path: Path) -> None:
    """Rollups at close are bounded like the merge: a run whose steps exceed the bound is rolled up by
    `perfscope compact`, not by the writer that closes last."""
    from perfscope.store.compact import compact_host
    from perfscope.store.writer import host_tag

    _study(tmp_path)  # its writers rolled up each run as they closed
    assert _covered(tmp_path) == {"n1", "n2", "n4", "n8", "comm4", "alt"}
    shutil.rmtree(tmp_path / ROLLUP_DIR)
    assert compact_host(tmp_path, "n2", host_tag(), max_bytes=1) is not None
    assert _covered(tmp_path) == set()
    assert compact_host(tmp_path, "n2", host_tag(), max_bytes=1 << 30) is not None
    assert _covered(tmp_path) == {"n2"}
