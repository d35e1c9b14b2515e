"""A store nobody has opened before (issue 26): its footers are read in threads, a footer in one read
of the file's end, and the listing is the one a serial read of every footer gives, hostile files
included; `perfscope info` shows its progress on a terminal, and nowhere else.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import test_manifest
from test_manifest import _entry_of, _facts, _forget, _rewrite, _set, _steps_segment

from perfscope.store import listing as listing_mod
from perfscope.store import manifest as manifest_mod
from perfscope.store.listing import Listing, list_store
from perfscope.store.manifest import MANIFEST_NAME
from perfscope.store.schema import META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES

T0 = 1_700_000_000_000_000_000
#: test_manifest's fixtures: a small store with its manifest saved, and the footers read
small = test_manifest.small
footer_reads = test_manifest.footer_reads


def _steps(first: int, n: int = 5, rank: int = 0) -> pa.Table:
    """`n` steps of one rank in the store's schema, as another tool writes them (plain pyarrow)."""
    schema = TABLES["steps"].arrow_schema
    step = np.arange(first, first + n, dtype=np.int64)
    cols = {
        "rank": pa.array(np.full(n, rank, np.int32)),
        "step": pa.array(step),
        "start_ns": pa.array(T0 + step * 10**7 + rank * 1000),
        "step_ns": pa.array(np.full(n, 10**7 - 5000, np.int64)),
    }
    arrays = [cols[f.name].cast(f.type) if f.name in cols else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _one_run(root: Path, segments: int, run: str = "long") -> Path:
    part = root / "steps" / f"run_id={run}"
    part.mkdir(parents=True)
    for i in range(segments):
        pq.write_table(_steps(i * 5, rank=i % 4), part / f"part-{i:06d}.parquet")
    runs = root / "runs" / f"run_id={run}"
    runs.mkdir(parents=True)
    row = {c: None for c in TABLES["runs"].column_names} | {"experiment": "long", "world_size": 4}
    pq.write_table(pa.Table.from_pylist([row], schema=TABLES["runs"].arrow_schema), runs / "part-0.parquet")
    return part


def _hostile(root: Path, part: Path, outside: Path) -> None:
    """Every kind of file a listing refuses, or reads only the slow way, among the segments."""
    good = (part / "part-000000.parquet").read_bytes()
    (part / "a-truncated.parquet").write_bytes(good[: len(good) // 2])
    (part / "a-garbage.parquet").write_bytes(b"not parquet at all" * 10)
    (part / "a-empty.parquet").write_bytes(b"")
    (part / "a-magic-only.parquet").write_bytes(b"PAR1")
    (part / "a-tiny.parquet").write_bytes(b"PAR1\x00\x00\x00\x00PAR1")  # a footer of 0 bytes
    # a footer length reaching into the leading magic, and one beyond the file
    (part / "a-long-footer.parquet").write_bytes(b"PAR1" + b"x" * 20 + (26).to_bytes(4, "little") + b"PAR1")
    (part / "a-huge-footer.parquet").write_bytes(
        b"PAR1" + b"x" * 20 + (1 << 30).to_bytes(4, "little") + b"PAR1"
    )
    # the right magic and length, a footer of garbage
    (part / "a-bad-thrift.parquet").write_bytes(
        b"PAR1" + b"\xff" * 100 + (100).to_bytes(4, "little") + b"PAR1"
    )
    os.mkfifo(part / "a-fifo.parquet")
    (part / "a-folder.parquet").mkdir()
    pq.write_table(pa.table({"rank": [1]}), outside)
    (part / "a-link-out.parquet").symlink_to(outside)
    (part / "a-link-in.parquet").symlink_to(part / "part-000001.parquet")
    (part / "a-loop.parquet").symlink_to(part / "a-loop.parquet")
    (part / "a-copy.parquet").write_bytes(good)  # an identical copy: counted once
    pq.write_table(pa.table({"x": [1]}), part / "a-foreign.parquet")  # no perfscope metadata
    meta = {META_TABLE: b"steps", META_VERSION: str(SCHEMA_VERSION).encode()}
    wrong_type = pa.table({"rank": pa.array(["zero"])}).replace_schema_metadata(meta)
    pq.write_table(wrong_type, part / "a-wrong-type.parquet")
    other_table = _steps(0).replace_schema_metadata({**meta, META_TABLE: b"runs"})
    pq.write_table(other_table, part / "a-other-table.parquet")
    # metadata of 100 KB: the footer is longer than the first read of the file's end
    big = _steps(10**6).replace_schema_metadata({**_steps(0).schema.metadata, b"note": b"n" * 100_000})
    pq.write_table(big, part / "a-big-footer.parquet")
    # a step that started and never ended: no step_ns statistics
    open_step = _steps(2 * 10**6, n=1).set_column(3, "step_ns", pa.nulls(1, pa.int64()))
    pq.write_table(open_step, part / "a-open-step.parquet")
    # two row groups, one without statistics
    pq.write_table(
        _steps(3 * 10**6, n=10), part / "a-groups.parquet", row_group_size=5, write_statistics=["rank"]
    )
    (root / "steps" / "stray.parquet").write_bytes(good)  # outside any run_id= folder


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each listing starts as a new process does: nothing cached."""
    monkeypatch.setattr(listing_mod, "_inspect_cache", {})
    monkeypatch.setattr(listing_mod, "_schema_cache", {})
    yield


def _everything(listing: Listing) -> tuple[object, ...]:
    segs = [
        (s.file, s.table, s.version, tuple(sorted(s.columns)), s.num_rows, s.footprint, s.ranges, s.replaces)
        for segs in listing.segments.values()
        for s in segs
    ]
    return (segs, listing.skipped, listing.doubtful, listing.superseded, listing.sealed_live)


def test_the_parallel_read_lists_what_a_serial_read_lists(
    tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    part = _one_run(root, 300)
    _hostile(root, part, tmp_path / "outside.parquet")
    _one_run(root, 80, run="other")

    threads: set[str] = set()
    real = listing_mod._inspect_uncached

    def recorded(path: Path, table: str) -> object:
        threads.add(threading.current_thread().name)
        return real(path, table)

    monkeypatch.setattr(listing_mod, "_inspect_uncached", recorded)
    monkeypatch.setattr(listing_mod, "FOOTER_READERS", 1)
    serial = list_store(root, save_manifest=False)
    assert threads == {threading.current_thread().name}

    threads.clear()
    monkeypatch.setattr(listing_mod, "_inspect_cache", {})
    monkeypatch.setattr(listing_mod, "_schema_cache", {})
    monkeypatch.setattr(listing_mod, "FOOTER_READERS", 4)
    parallel = list_store(root, save_manifest=False)
    assert len(threads) > 1 and all(t.startswith("perfscope-footers") for t in threads)

    assert _everything(parallel) == _everything(serial)
    # the big footer, the open step, the two row groups; the link inside is read and the file it
    # leads to counted once (an identical copy), as part-000000 beside its copy
    assert parallel.count("steps") == 300 + 80 + 3
    reasons = {Path(s.path).name: s.reason for s in parallel.skipped}
    for name in ("a-truncated", "a-garbage", "a-empty", "a-magic-only", "a-tiny", "a-long-footer",
                 "a-huge-footer", "a-bad-thrift"):  # fmt: skip
        assert reasons[f"{name}.parquet"].startswith("not a readable Parquet file"), name
    assert reasons["a-fifo.parquet"] == reasons["a-folder.parquet"] == "not a regular file"
    assert "outside the store" in reasons["a-link-out.parquet"]
    assert reasons["part-000000.parquet"] == "identical copy of a-copy.parquet: counted once"
    assert reasons["part-000001.parquet"] == "identical copy of a-link-in.parquet: counted once"
    assert reasons["a-foreign.parquet"] == "foreign Parquet file: no perfscope metadata"
    assert "has type string" in reasons["a-wrong-type.parquet"]
    assert reasons["a-other-table.parquet"].startswith("holds table 'runs'")
    assert reasons["stray.parquet"].startswith("not inside a run_id=")
    by_name = {s.name: s for s in parallel.of("steps")}
    assert by_name["a-big-footer.parquet"].range_of("rank") == (0, 0)
    assert by_name["a-big-footer.parquet"].range_of("start_ns") == (
        T0 + 10**6 * 10**7,
        T0 + (10**6 + 4) * 10**7,
    )
    assert by_name["a-open-step.parquet"].range_of("step_ns") is None
    assert by_name["a-open-step.parquet"].range_of("start_ns") is not None
    assert by_name["a-groups.parquet"].range_of("start_ns") is None  # no statistics in its row groups
    assert by_name["a-groups.parquet"].range_of("rank") == (0, 0)


def test_one_read_of_the_end_gives_what_the_footer_read_gave(
    tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file's facts (or the reason it is skipped, word for word) as read before issue 26: the
    footer through pyarrow's own file reader, the footprint from a second open."""
    root = tmp_path / "store"
    part = _one_run(root, 3)
    _hostile(root, part, tmp_path / "outside.parquet")
    files = [
        p for p in sorted(part.iterdir()) if p.is_file() and not p.is_symlink() and p.suffix == ".parquet"
    ]
    assert len(files) == 18
    quick = [listing_mod._inspect_uncached(p, "steps") for p in files]
    listing_mod._schema_cache.clear()
    monkeypatch.setattr(listing_mod, "_read_footer", lambda path: None)  # the reads before issue 26
    slow = [listing_mod._inspect_uncached(p, "steps") for p in files]
    assert quick == slow
    assert [getattr(s, "ranges", None) for s in quick] == [getattr(s, "ranges", None) for s in slow]
    assert sum(isinstance(s, listing_mod.Segment) for s in quick) == 7  # 3, the copy, the big, open, groups


@pytest.fixture(scope="module")
def cold_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A foreign store of more footers than PROGRESS_MIN_FOOTERS."""
    root = tmp_path_factory.mktemp("cold") / "store"
    _one_run(root, listing_mod.PROGRESS_MIN_FOOTERS + 100)
    return root


def _info(root: Path, *, stderr_tty: bool, verb: str = "info") -> tuple[str, str, int]:
    """`perfscope info --json` (or another `verb`) in a fresh process, stdout a pipe and stderr a
    terminal (or a pipe): stdout, what stderr showed, and the exit status."""
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "perfscope", verb, "--json", str(root)]
    if not stderr_tty:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        return proc.stdout, proc.stderr, proc.returncode
    master, slave = pty.openpty()
    shown = bytearray()

    def drain() -> None:  # the terminal is read while the command writes, so it never blocks
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=300)
    finally:
        os.close(slave)
        reader.join(30)
        os.close(master)
    return proc.stdout, shown.decode(errors="replace"), proc.returncode


def test_info_shows_the_footers_read_on_a_terminal_only(cold_store: Path) -> None:
    total = listing_mod.PROGRESS_MIN_FOOTERS + 101  # and the runs file
    (cold_store / MANIFEST_NAME).unlink(missing_ok=True)
    out, err, rc = _info(cold_store, stderr_tty=False)
    assert rc == 0 and err == ""
    assert json.loads(out)["files"]["steps"] == total - 1

    (cold_store / MANIFEST_NAME).unlink()
    out, shown, rc = _info(cold_store, stderr_tty=True)
    assert rc == 0
    info = json.loads(out)  # stdout is the JSON alone
    assert info["files"]["steps"] == total - 1 and info["skipped"] == []
    assert "reading" not in out
    last = shown.rsplit("\r", 2)
    assert f"/ {total:,} segment footers (first open of this store; later opens use its manifest)" in shown
    assert shown.startswith(f"\rreading 0 / {total:,} segment footers")  # at once, however fast the read
    assert last[-1] == "" and last[-2].strip() == ""  # the line is cleared
    lines = [ln for ln in shown.split("\r") if ln.strip()]
    assert all(len(ln) < 120 for ln in lines)
    assert [int(ln.split()[1].replace(",", "")) for ln in lines] == sorted(
        int(ln.split()[1].replace(",", "")) for ln in lines
    )

    assert (cold_store / MANIFEST_NAME).exists()
    out, shown, rc = _info(cold_store, stderr_tty=True)  # the manifest saved: nothing to read
    assert rc == 0 and shown == "" and json.loads(out)["files"]["steps"] == total - 1


def test_every_command_that_opens_a_store_shows_the_footers_it_reads(cold_store: Path) -> None:
    """Not only `info`: `analyze` (and the other commands that open a store, perfscope.cli's
    OPENS_A_STORE) show the same line on a first open, and its JSON stays alone on stdout."""
    total = listing_mod.PROGRESS_MIN_FOOTERS + 101
    (cold_store / MANIFEST_NAME).unlink(missing_ok=True)
    out, shown, rc = _info(cold_store, stderr_tty=True, verb="analyze")
    assert rc == 0, shown[-2000:]
    assert shown.startswith(f"\rreading 0 / {total:,} segment footers")
    assert "reading" not in out and "findings" in json.loads(out)


def test_progress_is_reported_only_for_a_long_read(
    tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _one_run(root, 50)
    calls: list[tuple[int, int]] = []
    with listing_mod.footer_progress(lambda done, total: calls.append((done, total))):
        list_store(root, save_manifest=False)
    assert calls == []  # 51 footers: no line for a store that opens at once

    monkeypatch.setattr(listing_mod, "PROGRESS_MIN_FOOTERS", 40)
    monkeypatch.setattr(listing_mod, "_inspect_cache", {})
    with listing_mod.footer_progress(lambda done, total: calls.append((done, total))):
        list_store(root, save_manifest=False)
    assert calls[0] == (0, 51) and calls[-1] == (51, 51)  # at once, and done
    assert [c[1] for c in calls] == [51] * len(calls) and [c[0] for c in calls] == sorted(c[0] for c in calls)
    calls.clear()
    monkeypatch.setattr(listing_mod, "_inspect_cache", {})
    list_store(root, save_manifest=False)  # the same read outside footer_progress: nobody is told
    assert calls == []


def test_a_file_added_since_the_manifest_leaves_the_others_to_their_entries(
    small: tuple[Path, Listing], footer_reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool still writing the run adds segments after each open: the folder no longer matches its
    entries as a whole, and its other files are taken from them at once, not one at a time."""
    root, _ = small
    part = root / "steps" / "run_id=r1"
    _steps_segment(part / "w-100.parquet", 100, rows=5)
    made: list[int] = []
    real = manifest_mod.Entries.segments

    def counted(self: manifest_mod.Entries) -> list[listing_mod.Segment]:
        made.append(len(self))
        return real(self)

    monkeypatch.setattr(manifest_mod.Entries, "segments", counted)
    monkeypatch.setattr(listing_mod, "_KNOWN_MIN", 1)
    _forget()
    listing = list_store(root, save_manifest=False)
    assert made == [12]  # the folder's 12 entries at once; the other folders whole, untouched
    assert footer_reads == [str(part / "w-100.parquet")]
    (root / MANIFEST_NAME).rename(root / "kept")
    _forget()
    truth = _facts(list_store(root, save_manifest=False))
    assert _facts(listing) == truth and len(truth) == 3 * 12 + 1 + 3
    (root / "kept").rename(root / MANIFEST_NAME)

    # an entry of that folder without a name (no save of ours writes one): each file on its own
    _rewrite(root, lambda t: _set(t, "name", _entry_of(root, "r1/w-005.parquet"), None))
    footer_reads.clear()
    _forget()
    assert _facts(list_store(root, save_manifest=False)) == truth
    assert sorted(footer_reads) == [str(part / "w-005.parquet"), str(part / "w-100.parquet")]
