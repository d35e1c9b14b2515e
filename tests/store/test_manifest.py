"""The store's manifest (perfscope.store.manifest): a store of 100,000 segments opens without reading a
footer; a missing, broken, foreign, stale or lying manifest is rebuilt to the truth, and a lie it
may still tell is bounded; a SIGKILL mid-save leaves the old manifest or the new one, whole."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pytest
from storegen import MS, T0_NS, make_run, row

import perfscope.store.listing as store_mod
from perfscope import sample_traces
from perfscope.commands.info import summary
from perfscope.errors import StoreError
from perfscope.store.compact import compact
from perfscope.store.leftovers import clean_leftovers
from perfscope.store.listing import Listing, list_store
from perfscope.store.manifest import MANIFEST_NAME, SAVE_MIN_CHANGES, Manifest
from perfscope.store.reader import Store
from perfscope.store.segments import replaces_metadata, write_segment
from perfscope.store.writer import rows_to_table

RANKS = 8


def _steps_segment(path: Path, i: int, rows: int = 1) -> None:
    """Segment `i`: `rows` steps of rank i % RANKS, one ms each, starting at T0 + i ms."""
    data = [
        row("steps", rank=i % RANKS, step=i * rows + k, start_ns=T0_NS + (i * rows + k) * MS, step_ns=MS)
        for k in range(rows)
    ]
    write_segment(path, rows_to_table("steps", data))


def _runs_segment(path: Path, world_size: int = RANKS) -> None:
    data = [row("runs", experiment="scale", source="measured", world_size=world_size, backend="gloo")]
    write_segment(path, rows_to_table("runs", data))


def _linked_store(root: Path, src: Path, runs: int, per_run: int) -> None:
    """`runs` runs of `per_run` distinct steps segments each: the same files hard-linked into every
    run's folder (copies in different partitions are distinct segments), and a runs row per run."""
    src.mkdir()
    for i in range(per_run):
        _steps_segment(src / f"s{i:06d}.parquet", i)
    _runs_segment(src / "runs.parquet")
    for r in range(runs):
        steps = root / "steps" / f"run_id=r{r:04d}"
        steps.mkdir(parents=True)
        for i in range(per_run):
            os.link(src / f"s{i:06d}.parquet", steps / f"w-{i:06d}.parquet")
        (root / "runs" / f"run_id=r{r:04d}").mkdir(parents=True)
        os.link(src / "runs.parquet", root / "runs" / f"run_id=r{r:04d}" / "w-000000.parquet")


@pytest.fixture
def footer_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The files whose footer is read from now on (this process's cache emptied first)."""
    reads: list[str] = []
    real = store_mod._inspect_uncached

    def counting(path: Path, table: str) -> store_mod.Segment | store_mod.SkippedFile:
        reads.append(str(path))
        return real(path, table)

    monkeypatch.setattr(store_mod, "_inspect_cache", {})
    monkeypatch.setattr(store_mod, "_inspect_uncached", counting)
    yield reads


def _forget() -> None:
    """Empty this process's cache of footers, as a new process starts."""
    store_mod._inspect_cache.clear()


def _facts(listing: Listing) -> list[tuple[object, ...]]:
    return sorted(
        (s.file, s.table, s.version, tuple(sorted(s.columns)), s.num_rows, s.footprint, s.ranges, s.replaces)
        for segs in listing.segments.values()
        for s in segs
    )


def test_a_store_of_100000_segments_opens_from_its_manifest(tmp_path: Path, footer_reads: list[str]) -> None:
    root = tmp_path / "store"
    runs, per_run = 100, 1000
    _linked_store(root, tmp_path / "src", runs, per_run)
    # the manifest a first open (or `perfscope compact`) leaves: one footer read per distinct file here
    seeded = Manifest(str(root))
    facts = {}
    for table in ("steps", "runs"):
        for part in sorted((root / table).iterdir()):
            for entry in os.scandir(part):
                st = entry.stat()
                if st.st_ino not in facts:
                    seg = store_mod._inspect_uncached(Path(entry.path), table)
                    assert isinstance(seg, store_mod.Segment)
                    facts[st.st_ino] = seg
                seeded.note(entry.path, st.st_size, st.st_mtime_ns, facts[st.st_ino])
    assert seeded.save()
    _forget()
    footer_reads.clear()

    with Store(root) as store:
        assert footer_reads == []  # every segment's facts came from the manifest
        assert store.row_count("steps") == runs * per_run and len(store.segments("steps")) == 100_000
        info = summary(store)
        assert "steps" in store._views_due  # info bound no view over the 100,000 files
        assert info["files"]["steps"] == 100_000 and info["rows"]["runs"] == runs
        assert info["runs_without_metadata"] == []
        assert {r["run_id"] for r in info["runs"]} == {f"r{r:04d}" for r in range(runs)}
        assert {(r["ranks_seen"], r["step_rows"]) for r in info["runs"]} == {(RANKS, per_run)}
        assert info["first_step_ns"] == T0_NS and info["last_step_end_ns"] == T0_NS + per_run * MS


def test_a_cold_open_saves_the_manifest_and_the_next_reads_no_footer(
    tmp_path: Path, footer_reads: list[str]
) -> None:
    root = tmp_path / "store"
    _linked_store(root, tmp_path / "src", runs=3, per_run=SAVE_MIN_CHANGES // 3 + 10)
    truth = list_store(root, save_manifest=False)
    assert not (root / MANIFEST_NAME).exists()
    _forget()
    Store(root).close()  # reads every footer, and saves what it learnt: enough to be worth a write
    assert (root / MANIFEST_NAME).is_file()
    _forget()
    footer_reads.clear()
    again = list_store(root)
    assert footer_reads == [] and _facts(again) == _facts(truth)
    mtime = (root / MANIFEST_NAME).stat().st_mtime_ns
    list_store(root)
    assert (root / MANIFEST_NAME).stat().st_mtime_ns == mtime  # nothing changed: not rewritten


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, Listing]:
    """A store of 3 runs x 12 segments of 5 rows, its manifest saved; and its true listing."""
    root = tmp_path / "store"
    for r in range(3):
        part = root / "steps" / f"run_id=r{r}"
        part.mkdir(parents=True)
        for i in range(12):
            _steps_segment(part / f"w-{i:03d}.parquet", i, rows=5)
        (root / "runs" / f"run_id=r{r}").mkdir(parents=True)
        _runs_segment(root / "runs" / f"run_id=r{r}" / "w.parquet")
    truth = list_store(root, save_manifest=False)
    _forget()
    list_store(root, save_manifest=True)
    assert len(Manifest.load(str(root))) == 39
    return root, truth


def _read(path: Path) -> pa.Table:
    return pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()


def _write(t: pa.Table, path: Path) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t)


def _rewrite(root: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrite the manifest's table as `change` says, keeping its schema and metadata."""
    path = root / MANIFEST_NAME
    t = _read(path)
    _write(change(t).cast(t.schema), path)


def _set(t: pa.Table, column: str, index: int, value: object) -> pa.Table:
    values = t.column(column).to_pylist()
    values[index] = value
    return t.set_column(
        t.schema.get_field_index(column), column, pa.array(values, t.schema.field(column).type)
    )


def _paths(root: Path) -> list[str]:
    """The store-relative paths of the manifest's entries, in its order."""
    t = _read(root / MANIFEST_NAME)
    folders, names = t.column("folder").to_pylist(), t.column("name").to_pylist()
    return [f"{f}/{n}" for f, n in zip(folders, names, strict=True)]


def _entry_of(root: Path, name: str) -> int:
    return next(i for i, p in enumerate(_paths(root)) if p.endswith(name))


@pytest.mark.parametrize(
    "damage",
    ["deleted", "truncated", "garbage", "foreign", "other version", "a link", "a FIFO", "empty"],
)
def test_a_broken_manifest_is_rebuilt_from_the_files(
    small: tuple[Path, Listing], footer_reads: list[str], damage: str
) -> None:
    root, truth = small
    path = root / MANIFEST_NAME
    good = path.read_bytes()
    path.unlink()
    if damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        path.write_bytes(random.Random(1).randbytes(len(good)))
    elif damage == "foreign":  # a Parquet file, but no manifest
        path.write_bytes((root / "steps" / "run_id=r0" / "w-000.parquet").read_bytes())
    elif damage == "other version":
        path.write_bytes(good)
        t = _read(path)
        _write(t.replace_schema_metadata({b"perfscope.manifest": b"99"}), path)
    elif damage == "a link":  # even to a good manifest: never followed
        (root.parent / "elsewhere").write_bytes(good)
        path.symlink_to(root.parent / "elsewhere")
    elif damage == "a FIFO":
        os.mkfifo(path)
    elif damage == "empty":
        path.write_bytes(b"")
    _forget()
    footer_reads.clear()
    listing = list_store(root, save_manifest=True)
    assert _facts(listing) == _facts(truth)
    assert len(footer_reads) == 39  # all read again
    if damage not in ("a link", "a FIFO"):  # rewritten; a link or FIFO is replaced by the rename too
        assert len(Manifest.load(str(root))) == 39
    _forget()
    footer_reads.clear()
    assert _facts(list_store(root)) == _facts(truth) and footer_reads == []


def test_an_entry_for_a_file_gone_adds_nothing_and_is_dropped(
    small: tuple[Path, Listing], footer_reads: list[str]
) -> None:
    root, truth = small
    gone = root / "steps" / "run_id=r1" / "w-004.parquet"
    gone.unlink()
    _forget()
    listing = list_store(root, save_manifest=True)
    assert gone.as_posix() not in {s.file for s in listing.segments["steps"]}
    assert listing.segments["steps"].__len__() == len(truth.segments["steps"]) - 1
    assert footer_reads == []
    paths = _paths(root)
    assert "steps/run_id=r1/w-004.parquet" not in paths and len(paths) == 38


def test_an_entry_lying_about_rows_is_not_used_once_the_file_changed(
    small: tuple[Path, Listing], footer_reads: list[str]
) -> None:
    root, truth = small
    name = "run_id=r2/w-007.parquet"
    _rewrite(root, lambda t: _set(t, "num_rows", _entry_of(root, name), 5000))
    target = root / "steps" / name
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    _forget()
    with Store(root) as store:
        assert footer_reads == [str(target)]  # the stale entry was not trusted: its footer was read
        assert store.row_count("steps") == 3 * 12 * 5
        assert summary(store)["rows"]["steps"] == 3 * 12 * 5
    truth_rows = {s.file: s.num_rows for s in truth.segments["steps"]}
    assert truth_rows[str(target)] == 5


def test_what_a_matching_lying_entry_can_change_is_bounded(
    small: tuple[Path, Listing], footer_reads: list[str]
) -> None:
    """A forged entry that matches a file's name, size and mtime is trusted for the listing's facts
    (what `info` counts), never for the rows a query reads; a forged claim to replace another
    segment is checked against that segment's real bytes and rows."""
    root, _ = small
    liar, victim = "run_id=r0/w-000.parquet", "run_id=r0/w-001.parquet"
    victim_path = root / "steps" / victim
    victim_seg = next(s for s in list_store(root).segments["steps"] if s.file == str(victim_path))
    claim = replaces_metadata([victim_seg])
    _rewrite(root, lambda t: _set(t, "num_rows", _entry_of(root, liar), 5000))
    _rewrite(root, lambda t: _set(t, "replaces", _entry_of(root, liar), claim))
    _forget()
    with Store(root, warn=False) as store:
        assert footer_reads == []
        assert summary(store)["rows"]["steps"] == 3 * 12 * 5 - 5 + 5000  # the bound: counts trust it
        rows = store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py()
        assert rows == 3 * 12 * 5  # queries read the real files: the victim's rows are all there
        assert str(victim_path) in {s.file for s in store.segments("steps")}
        assert any("claim to replace segments ignored" in d.reason for d in store.doubtful)


def test_a_sigkill_mid_save_leaves_the_old_manifest_or_the_new(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _linked_store(root, tmp_path / "src", runs=5, per_run=1000)
    truth = _facts(list_store(root, save_manifest=True))
    n = len(Manifest.load(str(root)))
    assert n == 5 * 1000 + 5
    # each pass finds "no manifest" (and this process's cache warm), so each saves all n entries
    saver = textwrap.dedent(
        f"""
        import perfscope.store.listing as S
        S.list_store({str(root)!r})
        S.Manifest.load = classmethod(lambda cls, root: cls(root))
        print("ready", flush=True)
        while True:
            S.list_store({str(root)!r})
        """
    )
    rng = random.Random(7)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", saver], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.1, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(Manifest.load(str(root))) == n  # the old one or the new one, never half of one
        _forget()
        assert _facts(list_store(root, save_manifest=False)) == truth
    leftovers = sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp"))
    removed = clean_leftovers(root, grace_s=0, temp_root=tmp_path / "no-spill")
    assert sorted(p.name for p in removed) == leftovers
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_a_store_that_cannot_take_the_manifest_still_opens_quietly(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _linked_store(root, tmp_path / "src", runs=1, per_run=40)
    (root / MANIFEST_NAME).mkdir()  # the rename over it fails, as in a read-only folder
    _forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        listing = list_store(root, save_manifest=True)
        with Store(root) as store:
            assert store.row_count("steps") == 40
    assert len(listing.segments["steps"]) == 40
    assert (root / MANIFEST_NAME).is_dir() and not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def _tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    )


def test_opening_the_bundled_stores_writes_nothing_into_them() -> None:
    stores = sample_traces.bundled()
    assert stores
    before = {name: _tree(path) for name, path in stores.items()}
    _forget()
    for path in stores.values():
        with Store(path, warn=False) as store:
            summary(store)
    assert {name: _tree(path) for name, path in stores.items()} == before
    assert not any((path / MANIFEST_NAME).exists() for path in stores.values())


def test_compact_leaves_a_manifest_of_the_files_it_left(small: tuple[Path, Listing]) -> None:
    root, truth = small
    compact(root, grace_s=0)
    on_disk = sorted(
        str(p.relative_to(root)) for t in ("steps", "runs") for p in (root / t).rglob("*.parquet")
    )
    paths = sorted(_paths(root))
    assert paths == on_disk and all(p.endswith(".parquet") for p in paths)
    assert any(Path(p).name.startswith("c-") for p in paths)
    _forget()
    with Store(root) as store:
        assert store.row_count("steps") == sum(s.num_rows for s in truth.segments["steps"])


def test_info_counts_from_the_listing_equal_the_rows(tmp_path: Path) -> None:
    """Ranks, rows and time span as the old SQL over every row computed them, on runs written by the
    real writer (segments of several ranks: counted in the rows) and on one-rank segments."""
    root = tmp_path / "store"
    make_run(root, "multi", world_size=4, steps=30)
    part = root / "steps" / "run_id=single"
    part.mkdir(parents=True)
    for i in range(20):
        _steps_segment(part / f"w-{i:03d}.parquet", i, rows=3)
    (root / "runs" / "run_id=single").mkdir(parents=True)
    _runs_segment(root / "runs" / "run_id=single" / "w.parquet")
    orphan = root / "steps" / "run_id=orphan"
    orphan.mkdir()
    _steps_segment(orphan / "w.parquet", 99, rows=2)
    with Store(root) as store:
        info = summary(store)
        oracle = store.query(
            """SELECT r.run_id,
                      (SELECT count(DISTINCT s.rank) FROM steps s WHERE s.run_id = r.run_id) AS ranks_seen,
                      (SELECT count(*) FROM steps s WHERE s.run_id = r.run_id) AS step_rows
               FROM runs r"""
        ).to_pylist()
        span = store.query(
            "SELECT min(start_ns) AS a, max(start_ns::HUGEINT + step_ns) AS b FROM steps"
        ).to_pylist()[0]
    got = {r["run_id"]: (r["ranks_seen"], r["step_rows"]) for r in info["runs"]}
    assert got == {r["run_id"]: (r["ranks_seen"], r["step_rows"]) for r in oracle}
    assert got["multi"] == (4, 120) and got["single"] == (RANKS, 60)
    assert info["first_step_ns"] == span["a"] and info["last_step_end_ns"] == int(span["b"])
    assert info["runs_without_metadata"] == ["orphan"]


def test_a_live_segment_is_read_afresh_and_never_kept(small: tuple[Path, Listing]) -> None:
    from perfscope.store.live import LiveSegment
    from perfscope.store.schema import TABLES

    root, truth = small
    live = LiveSegment(root / "steps" / "run_id=r0" / "w-live.arrows", TABLES["steps"].arrow_schema)
    live.append(
        rows_to_table(
            "steps", [row("steps", rank=0, step=900 + k, start_ns=T0_NS, step_ns=MS) for k in range(4)]
        )
    )
    _forget()
    listing = list_store(root, save_manifest=True)
    assert (
        sum(s.num_rows for s in listing.segments["steps"])
        == sum(s.num_rows for s in truth.segments["steps"]) + 4
    )
    live.append(rows_to_table("steps", [row("steps", rank=0, step=950, start_ns=T0_NS, step_ns=MS)]))
    listing = list_store(root, save_manifest=True)
    assert (
        sum(s.num_rows for s in listing.segments["steps"])
        == sum(s.num_rows for s in truth.segments["steps"]) + 5
    )
    paths = _paths(root)
    assert len(paths) == 39 and all(p.endswith(".parquet") for p in paths)
    live.close()


def test_a_refresh_reads_again_only_the_live_segments_that_grew(
    small: tuple[Path, Listing], monkeypatch: pytest.MonkeyPatch
) -> None:
    from perfscope.store.live import LiveSegment
    from perfscope.store.schema import TABLES

    root, truth = small
    reads: list[str] = []
    real = store_mod._inspect_live

    def counting(path: Path, table: str) -> store_mod.Segment | store_mod.SkippedFile | None:
        reads.append(path.parent.name)
        return real(path, table)

    monkeypatch.setattr(store_mod, "_inspect_live", counting)
    lives = {
        r: LiveSegment(root / "steps" / f"run_id=r{r}" / "w-live.arrows", TABLES["steps"].arrow_schema)
        for r in (0, 1)
    }

    def append(r: int, n: int) -> None:
        data = [row("steps", rank=r, step=900 + k, start_ns=T0_NS, step_ns=MS) for k in range(n)]
        lives[r].append(rows_to_table("steps", data))

    def rows(store: Store) -> int:
        return int(store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py())

    base = sum(s.num_rows for s in truth.segments["steps"])
    append(0, 3)
    append(1, 4)
    with Store(root) as store:
        assert sorted(reads) == ["run_id=r0", "run_id=r1"] and rows(store) == base + 7
        reads.clear()
        store.refresh()
        assert reads == [] and rows(store) == base + 7  # nothing grew: nothing read
        append(1, 2)
        store.refresh()
        assert reads == ["run_id=r1"] and rows(store) == base + 9 and store.row_count("steps") == base + 9
        reads.clear()
        assert lives[0].seal()  # the twin renamed in, then the live segment removed
        lives[0].path.unlink()
        store.refresh()
        assert reads == [] and rows(store) == base + 9
        assert str(lives[0].path) not in store_mod._live_cache  # gone from the folder: forgotten
        assert str(lives[1].path) in store_mod._live_cache
    lives[1].close()


def test_a_file_turned_into_a_link_out_of_the_store_is_refused_despite_its_entry(
    small: tuple[Path, Listing], footer_reads: list[str]
) -> None:
    root, truth = small
    target = root / "steps" / "run_id=r1" / "w-003.parquet"
    outside = root.parent / "outside.parquet"
    shutil.copy2(target, outside)  # the same bytes, size and mtime
    target.unlink()
    target.symlink_to(outside)
    _forget()
    listing = list_store(root, save_manifest=False)
    assert [s.reason for s in listing.skipped if s.path == str(target)] == [
        f"a symbolic link to {outside}, outside the store"
    ]
    assert _facts(listing) == [f for f in _facts(truth) if f[0] != str(target)]
    assert footer_reads == []  # the folder's other files still came from their entries


def test_entries_out_of_order_are_not_used_and_the_listing_is_the_truth(
    small: tuple[Path, Listing], footer_reads: list[str]
) -> None:
    root, truth = small
    _rewrite(root, lambda t: t.take(list(range(len(t)))[::-1]))  # each folder's names reversed
    _forget()
    assert _facts(list_store(root, save_manifest=False)) == _facts(truth)
    assert footer_reads == []  # each folder's entries, out of order, looked up one by one
    _rewrite(
        root, lambda t: t.take([k for k in range(len(t)) if k % 2] + [k for k in range(len(t)) if not k % 2])
    )
    _forget()
    assert _facts(list_store(root, save_manifest=False)) == _facts(truth)
    assert (
        len(footer_reads) == 36
    )  # each steps folder's entries split in two: not used (a runs folder has one)


def test_an_entry_with_a_schema_version_from_the_future_refuses_the_store(
    small: tuple[Path, Listing],
) -> None:
    root, _ = small
    _rewrite(root, lambda t: _set(t, "version", _entry_of(root, "run_id=r2/w-005.parquet"), 99))
    _forget()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(root)


def test_an_entry_naming_a_column_its_file_lacks_breaks_no_query(tmp_path: Path) -> None:
    """A forged entry saying its file holds a column it lacks: the view would select a column no file
    has (a binder error, every query failing); the files' own footers are read instead."""
    root = tmp_path / "store"
    part = root / "steps" / "run_id=r0"
    part.mkdir(parents=True)
    for i in range(3):
        data = [row("steps", rank=i, step=k, start_ns=T0_NS + k * MS, step_ns=MS) for k in range(5)]
        write_segment(part / f"w-{i:03d}.parquet", rows_to_table("steps", data).drop_columns(["clock"]))
    (root / "runs" / "run_id=r0").mkdir(parents=True)
    _runs_segment(root / "runs" / "run_id=r0" / "w.parquet")
    list_store(root, save_manifest=True)

    def claim_clock(t: pa.Table) -> pa.Table:
        lists = [json.loads(v) for v in t.column("columns").to_pylist()]
        told = [json.dumps(sorted({*c, "clock"}) if "step" in c else c) for c in lists]
        return t.set_column(t.schema.get_field_index("columns"), "columns", pa.array(told))

    _rewrite(root, claim_clock)
    sql = "SELECT count(*) AS n, count(clock) AS c FROM steps"
    for run in (lambda s: s.query(sql), lambda s: s.read_only_query(sql)):
        _forget()
        with Store(root, warn=False) as store:
            assert run(store).to_pylist() == [{"n": 15, "c": 0}]


def test_entries_whose_ranges_end_before_their_rows_leave_info_to_the_rows(
    small: tuple[Path, Listing],
) -> None:
    """Forged step_ns ranges of 0: the file the ranges point at ends later than every range allows,
    so no file is left to read the last end from; the rows decide (no failing query)."""
    root, _ = small
    with Store(root) as store:
        truth = summary(store)["last_step_end_ns"]

    def zero(t: pa.Table) -> pa.Table:
        for name in ("step_ns_min", "step_ns_max"):
            values = [None if v is None else 0 for v in t.column(name).to_pylist()]
            t = t.set_column(t.schema.get_field_index(name), name, pa.array(values, pa.int64()))
        return t

    _rewrite(root, zero)
    _forget()
    with Store(root) as store:
        assert summary(store)["last_step_end_ns"] == truth


def _comm_study(root: Path) -> None:
    """Runs at 1, 2, 4 and 8 ranks whose exposed sync grows with N (communication-bound)."""
    for n in (1, 2, 4, 8):
        phases = {"data": 1 * MS, "forward": 10 * MS, "backward": 20 * MS, "sync_exposed": 4 * n * MS}
        make_run(root, f"n{n}", world_size=n, steps=40, phases=phases)


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> object:
    from perfscope.cli import main

    capsys.readouterr()
    assert main(list(args)) == 0
    out = json.loads(capsys.readouterr().out)
    if isinstance(out, dict):
        out.pop("store", None)
    return out


def test_a_manifest_with_forged_column_lists_changes_no_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22: the manifest's column lists edited (sizes and mtimes kept) to say no file holds
    sync_exposed_ns. The views are bound from the files, so analyze, sql and the rollups compact
    rebuilds read the files' values, not NULL."""
    root = tmp_path / "s"
    _comm_study(root)
    compact(root, grace_s=0)  # saves the manifest, writes the rollups
    query = "SELECT run_id, sum(sync_exposed_ns) AS s, count(sync_exposed_ns) AS n FROM steps GROUP BY 1"
    query += " ORDER BY 1"
    want_sql = _cli_json(capsys, "sql", str(root), query, "--format", "json")
    want = _cli_json(capsys, "analyze", str(root), "--json")
    assert all(int(r["s"]) > 0 for r in want_sql)  # type: ignore[index,union-attr]

    def forge(t: pa.Table) -> pa.Table:
        cols = [
            json.dumps([c for c in json.loads(v) if c != "sync_exposed_ns"]) for v in t["columns"].to_pylist()
        ]
        return t.set_column(t.schema.get_field_index("columns"), "columns", pa.array(cols))

    before = _read(root / MANIFEST_NAME)["columns"].to_pylist()
    _rewrite(root, forge)
    after = _read(root / MANIFEST_NAME)["columns"].to_pylist()
    assert sum("sync_exposed_ns" in c for c in before) > 0 and not any("sync_exposed_ns" in c for c in after)
    _forget()
    assert _cli_json(capsys, "sql", str(root), query, "--format", "json") == want_sql
    assert _cli_json(capsys, "analyze", str(root), "--json") == want
    # the manifest still forged (compact reads it too): the rollups it rebuilds hold the files' values
    shutil.rmtree(root / "_rollups")
    _rewrite(root, forge)
    _forget()
    compact(root, grace_s=0)
    assert (root / "_rollups" / "run_id=n8" / "by_window.parquet").is_file()
    _forget()
    assert _cli_json(capsys, "analyze", str(root), "--json") == want
