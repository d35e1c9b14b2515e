"""A store as an attacker leaves it: every attack of issue 10 (items 1, 2, 4-7) on a copy of the demo store.

Each test builds its malicious files itself; each failed on the perfscope before the issue was fixed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfscope import PerfscopeError, PerfscopeWarning, open_store
from perfscope.cli import main
from perfscope.store.compact import compact
from perfscope.store.reader import Store
from perfscope.store.schema import META_REPLACES, META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES
from perfscope.store.user_sql import UserSql
from perfscope.store.writer import StoreWriter

DEMO = Path(__file__).resolve().parents[2] / "sample_traces" / "demo-cpu"


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(DEMO, root)
    return root


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        yield


def _count(root: Path, table: str = "steps") -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        with open_store(root) as s:
            return int(s.query(f"SELECT count(*) AS n FROM {table}").column("n")[0].as_py())


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.parquet")}


def _partition(root: Path) -> Path:
    """A partition of `steps` with two segments: the demo store's are compacted to one each."""
    part = sorted((root / "steps").glob("run_id=*"))[0]
    if len(_segments(part)) < 2:
        with StoreWriter(root, part.name.split("=", 1)[1]) as w:
            for i in range(5):
                w.append("steps", (7, 1000 + i, 10**18 + i, 10, 1, 2, 3, 1, 1, 2, 1, 1, 8, "host"))
    return part


def _segments(part: Path) -> list[Path]:
    return sorted(p for p in part.glob("*.parquet") if not p.name.startswith("."))


def _rewrite(src: Path, dst: Path, table: pa.Table | None = None, **meta: bytes) -> None:
    """`src`'s rows (or `table`) written to `dst` with `meta` merged into its key-value metadata."""
    t = table if table is not None else pq.read_table(src, partitioning=None)
    kv = dict(pq.read_metadata(src).metadata or {})
    kv.update({k.encode() if isinstance(k, str) else k: v for k, v in meta.items()})
    pq.write_table(t.replace_schema_metadata(kv), dst)


# ---- 1 and 2: user SQL changes nothing, and poisons nothing --------------------------------------


WRITE_ATTEMPTS = [
    "EXPLAIN ANALYZE COPY (SELECT 1 AS a, 1 AS b) TO '{root}/spans' "
    "(FORMAT parquet, PARTITION_BY (b), OVERWRITE)",
    "EXPLAIN ANALYZE CREATE OR REPLACE VIEW steps AS SELECT 1 AS x",
    "EXPLAIN (ANALYZE) CREATE OR REPLACE VIEW steps AS SELECT 1 AS x",
    "EXPLAIN CREATE OR REPLACE VIEW steps AS SELECT 1 AS x",
    "COPY (SELECT 1 AS a) TO '{seg}' (FORMAT parquet)",
    "CREATE OR REPLACE VIEW steps AS SELECT 1 AS x",
    "CREATE TEMP TABLE t AS SELECT 1",
    "ATTACH '{root}/x.db' AS x",
    "SET threads = 1",
    "SELECT 1; DROP VIEW steps",
    "/* hi */ EXPLAIN ANALYZE SELECT 1",
]


@pytest.mark.parametrize("attempt", WRITE_ATTEMPTS)
def test_write_attempts_through_the_cli_change_nothing(
    demo: Path, attempt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seg = _segments(_partition(demo))[0]
    before = _files(demo)
    spans, steps = _count(demo, "spans"), _count(demo)
    assert main(["sql", str(demo), attempt.format(root=demo, seg=seg)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert _files(demo) == before
    assert (_count(demo, "spans"), _count(demo)) == (spans, steps)


def test_a_session_cannot_change_what_another_sees(demo: Path, quiet: None) -> None:
    with open_store(demo) as store, UserSql(store) as mine, UserSql(store) as theirs:
        steps = theirs.fetch("SELECT count(*) AS n FROM steps").table.to_pylist()
        seg = _segments(_partition(demo))[0]
        for attempt in WRITE_ATTEMPTS:
            with pytest.raises(PerfscopeError):
                mine.fetch(attempt.format(root=demo, seg=seg))
        # reading a valid segment as CSV fails for that query only: the segment is not marked bad
        with pytest.raises(PerfscopeError, match=r"query failed|only the store's tables"):
            mine.fetch(f"SELECT * FROM read_csv('{seg}')")
        with pytest.raises(PerfscopeError, match=r"query failed|only the store's tables"):
            mine.fetch(f"SELECT * FROM read_json('{seg}')")
        assert theirs.fetch("SELECT count(*) AS n FROM steps").table.to_pylist() == steps
        assert store.query("SELECT count(*) AS n FROM steps").to_pylist() == steps
        assert store.skipped == []


def test_read_csv_of_a_segment_through_the_store_does_not_poison_it(demo: Path, quiet: None) -> None:
    steps = _count(demo)
    with open_store(demo) as store:
        seg = _segments(_partition(demo))[0]
        with pytest.raises(PerfscopeError):
            store.read_only_query(f"SELECT * FROM read_csv('{seg}')")
        assert store.skipped == []
        assert store.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == steps


def test_reading_outside_the_store_is_refused(demo: Path, tmp_path: Path, quiet: None) -> None:
    outside = tmp_path / "secret.csv"
    outside.write_text("a\n1\n")
    with open_store(demo) as store, UserSql(store) as session:
        for q in (f"SELECT * FROM read_csv('{outside}')", "SELECT * FROM glob('/etc/*')"):
            with pytest.raises(PerfscopeError, match="only the store's tables may be read"):
                session.fetch(q)


# ---- 5: bounds -----------------------------------------------------------------------------------


def test_sql_timeout_stops_the_query_with_one_line(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = "SELECT sum(a * b) FROM range(1000000000) t(a), range(1000) u(b)"
    assert main(["sql", str(demo), slow, "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "time limit of 0.5 s" in err[0]


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon"])
def test_sql_timeout_must_be_a_positive_number(
    demo: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sql", str(demo), "SELECT 1", "--timeout", bad]) == 2
    assert "--timeout" in capsys.readouterr().err


def test_sql_memory_limit_bounds_the_query(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a list aggregate cannot spill to disk: past the limit DuckDB stops it instead of growing
    greedy = "SELECT list(range) AS l FROM range(50000000)"
    out = demo.parent / "greedy.csv"
    assert main(["sql", str(demo), greedy, "--memory-limit", "64MB", "--format", "csv", "-o", str(out)]) != 0
    err = capsys.readouterr().err
    assert "Out of Memory" in err and "Traceback" not in err
    assert main(["sql", str(demo), "SELECT 1", "--memory-limit", "plenty"]) == 2
    assert "memory limit" in capsys.readouterr().err


def test_a_huge_result_streams_to_the_file(demo: Path, tmp_path: Path) -> None:
    out = tmp_path / "big.csv"
    assert (
        main(["sql", str(demo), "SELECT range AS i FROM range(300000)", "--format", "csv", "-o", str(out)])
        == 0
    )
    lines = out.read_text().splitlines()
    assert lines[0] == "i" and len(lines) == 300001 and lines[-1] == "299999"
    out = tmp_path / "big.parquet"
    assert (
        main(
            ["sql", str(demo), "SELECT range AS i FROM range(300000)", "--format", "parquet", "-o", str(out)]
        )
        == 0
    )
    assert pq.read_metadata(out).num_rows == 300000


def test_a_new_query_stops_the_one_still_running_on_its_session(demo: Path, quiet: None) -> None:
    # a dashboard user who runs another query while one is running: the newer wins, nothing waits for
    # the old one to finish (it would run for minutes)
    failures: list[str] = []
    with open_store(demo) as store, UserSql(store) as session:

        def slow() -> None:
            try:
                session.fetch("SELECT sum(a * b) FROM range(100000000000) t(a), range(1000) u(b)")
            except PerfscopeError as exc:
                failures.append(exc.message)

        t = threading.Thread(target=slow)
        t.start()
        while not session._lock.locked():
            time.sleep(0.01)
        assert session.fetch("SELECT count(*) AS n FROM steps").table.to_pylist() == [{"n": _count(demo)}]
        t.join(60)
    assert not t.is_alive() and len(failures) == 1 and "a newer query of this session" in failures[0]


def test_only_the_rows_asked_for_are_fetched(demo: Path, quiet: None) -> None:
    with open_store(demo) as store, UserSql(store) as session:
        got = session.fetch("SELECT * FROM range(150000000)", max_rows=10_000)
        assert got.table.num_rows == 10_000 and not got.complete
        small = session.fetch("SELECT * FROM range(5)", max_rows=10_000)
        assert small.table.num_rows == 5 and small.complete


# ---- 4: forged compaction ------------------------------------------------------------------------


def _forge(part: Path, claim: bytes, rows: pa.Table | None = None) -> Path:
    segs = _segments(part)
    forged = part / "c-forged.parquet"
    t = rows if rows is not None else pq.read_table(segs[0], partitioning=None).slice(0, 1)
    _rewrite(segs[0], forged, table=t, **{META_REPLACES.decode(): claim})
    return forged


def _honest_claim(segs: list[Path]) -> list[dict[str, object]]:
    from perfscope.store.segments import content_digest

    return [
        {
            "name": p.name,
            "rows": pq.read_metadata(p).num_rows,
            "size_bytes": p.stat().st_size,
            "blake2b": content_digest(p),
        }
        for p in segs
    ]


def _claims(part: Path) -> list[tuple[str, bytes]]:
    segs = _segments(part)
    names = [p.name for p in segs]
    honest = _honest_claim(segs)
    wrong_rows = [dict(e, rows=int(e["rows"]) + 1) for e in honest]  # type: ignore[call-overload]
    wrong_hash = [dict(e, blake2b="0" * 32) for e in honest]
    return [
        ("names only", json.dumps(names).encode()),
        ("not JSON", b"{this is not json"),
        ("wrong row counts", json.dumps(wrong_rows).encode()),
        ("right counts, wrong hashes", json.dumps(wrong_hash).encode()),
        ("a number", b"42"),
        ("all right, other rows", json.dumps(honest).encode()),
    ]


@pytest.mark.parametrize("which", range(6))
def test_a_forged_compaction_neither_hides_nor_deletes(demo: Path, which: int) -> None:
    part = _partition(demo)
    total = _count(demo)
    kind, claim = _claims(part)[which]
    originals = {p.name: p.read_bytes() for p in _segments(part)}
    # for the hashes case the forged file holds exactly as many rows as it claims, all of them bogus
    rows = None
    if kind in ("right counts, wrong hashes", "all right, other rows"):
        src = pq.read_table(_segments(part)[0], partitioning=None)
        n = sum(pq.read_metadata(p).num_rows for p in _segments(part))
        rows = pa.concat_tables([src] * (n // src.num_rows + 1)).slice(0, n)
    forged = _forge(part, claim, rows)
    added = pq.read_metadata(forged).num_rows
    with pytest.warns(PerfscopeWarning, match="c-forged.parquet"), open_store(demo) as s:
        assert s.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == total + added
        assert [Path(d.path).name for d in s.doubtful] == ["c-forged.parquet"]
    # info names it; compact keeps every original row (it merges them itself) and deletes nothing else
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        compact(demo, grace_s=0)
    assert _count(demo) == total + added
    with open_store(demo) as s:
        merged = s.query(
            f"SELECT * EXCLUDE (run_id) FROM steps WHERE run_id = '{part.name.split('=', 1)[1]}'"
        )
    for data in originals.values():
        t = pq.read_table(pa.BufferReader(data))
        for row in t.to_pylist():
            mask = pc.and_(pc.equal(merged["rank"], row["rank"]), pc.equal(merged["step"], row["step"]))
            assert pc.any(mask).as_py(), row


def test_an_honest_compaction_claim_is_honoured(demo: Path, quiet: None) -> None:
    part = _partition(demo)
    segs = _segments(part)
    total = _count(demo)
    merged = pa.concat_tables([pq.read_table(p, partitioning=None) for p in segs])
    _forge(part, json.dumps(_honest_claim(segs)).encode(), merged)
    with open_store(demo) as s:
        assert s.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == total
        assert s.doubtful == [] and len(s.listing.superseded) == len(segs)
    compact(demo, grace_s=0)  # finishes it: the replaced segments hold nothing the merged file lacks
    assert not any(p.exists() for p in segs)
    assert _count(demo) == total


# ---- 6: files that broke every command -----------------------------------------------------------


def test_symlink_to_a_segment_outside_the_store_is_skipped_and_named(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    part = _partition(demo)
    target = outside / "elsewhere.parquet"
    shutil.copy(_segments(part)[0], target)
    target.write_bytes(target.read_bytes())
    (part / "link.parquet").symlink_to(target)
    # and a whole partition folder leading out
    other = outside / "run_id=evil"
    other.mkdir()
    shutil.copy(_segments(part)[1], other / "x.parquet")
    (demo / "steps" / "run_id=evil").symlink_to(other, target_is_directory=True)
    total = _count(demo)
    assert main(["info", str(demo)]) == 0
    out = capsys.readouterr().out
    assert "link.parquet: a symbolic link to" in out and "run_id=evil: a folder leading to" in out
    assert main(["sql", str(demo), "SELECT count(*) AS n FROM steps", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == str(total)
    assert main(["compact", str(demo), "--grace", "0"]) == 0
    assert target.exists() and (other / "x.parquet").exists()


def test_wrong_column_types_are_skipped_and_named(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    part = _partition(demo)
    total = _count(demo)
    src = _segments(part)[0]
    t = pq.read_table(src, partitioning=None)
    i = t.column_names.index("step_ns")
    t = t.set_column(i, pa.field("step_ns", pa.string()), pc.cast(t.column("step_ns"), pa.string()))
    _rewrite(src, part / "typed.parquet", table=t)
    assert main(["info", str(demo)]) == 0
    assert "typed.parquet: column 'step_ns' has type string" in capsys.readouterr().out
    assert (
        main(["sql", str(demo), "SELECT count(*) AS n, sum(step_ns) > 0 AS ok FROM steps", "--format", "csv"])
        == 0
    )
    assert capsys.readouterr().out.splitlines()[1] == f"{total},true"
    assert main(["compact", str(demo), "--grace", "0"]) == 0
    assert (part / "typed.parquet").exists() and _count(demo) == total


def test_a_run_id_column_inside_a_file_is_skipped(demo: Path, quiet: None) -> None:
    part = _partition(demo)
    src = _segments(part)[0]
    t = pq.read_table(src, partitioning=None)
    t = t.append_column("run_id", pa.array(["other"] * t.num_rows))
    _rewrite(src, part / "keyed.parquet", table=t)
    with open_store(demo) as s:
        assert any(Path(x.path).name == "keyed.parquet" and "'run_id'" in x.reason for x in s.skipped)


def test_info_survives_null_and_extreme_step_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = TABLES["steps"].column_names
    row = dict.fromkeys(names)
    row.update(rank=0, clock="host")
    nulls, extreme = tmp_path / "nulls", tmp_path / "extreme"
    with StoreWriter(nulls, "r") as w:
        for i in range(3):
            w.append("steps", tuple({**row, "step": i, "start_ns": i}[n] for n in names))
    big = 2**63 - 1
    with StoreWriter(extreme, "r") as w:
        for i, (start, dur) in enumerate([(big, big), (-(2**63), big), (0, -(2**63))]):
            w.append("steps", tuple({**row, "step": i, "start_ns": start, "step_ns": dur}[n] for n in names))
    for root in (nulls, extreme):
        assert main(["info", str(root)]) == 0
    capsys.readouterr()
    assert main(["info", str(nulls), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["last_step_end_ns"] is None and got["rows"]["steps"] == 3
    assert main(["info", str(extreme), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["last_step_end_ns"] == 2 * big and got["first_step_ns"] == -(2**63)


# ---- 7: identical segments -----------------------------------------------------------------------


def test_a_copied_segment_is_counted_once_and_named(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    part = _partition(demo)
    total = _count(demo)
    seg = _segments(part)[0]
    shutil.copy(seg, part / "zz-copy.parquet")
    assert _count(demo) == total
    assert main(["info", str(demo)]) == 0
    assert f"zz-copy.parquet: identical copy of {seg.name}" in capsys.readouterr().out
    # after compaction the copy is recognised by the hash the merged file records
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        compact(demo, grace_s=0)
        assert (part / "zz-copy.parquet").exists()
        with open_store(demo) as s:
            assert s.query("SELECT count(*) AS n FROM steps").column("n")[0].as_py() == total
            assert any("already merged into c-" in x.reason for x in s.skipped)


# ---- property: any metadata, any column types: a clear outcome, never a traceback ----------------

_META_BYTES = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"steps", b"runs", b"1", str(SCHEMA_VERSION).encode(), b"99", b"-1", b"[]", b"null"]),
    st.lists(st.text(max_size=8), max_size=3).map(lambda x: json.dumps(x).encode()),
    st.lists(
        st.fixed_dictionaries(
            {"name": st.text(max_size=8), "rows": st.integers(-3, 10**12), "size_bytes": st.integers(-1, 99)},
            optional={"blake2b": st.text(max_size=4)},
        ),
        max_size=3,
    ).map(lambda x: json.dumps(x).encode()),
)
_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_(), pa.binary(), pa.date32()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    table=st.one_of(st.none(), _META_BYTES),
    version=st.one_of(st.none(), _META_BYTES),
    replaces=st.one_of(st.none(), _META_BYTES),
    retype=st.dictionaries(
        st.sampled_from(TABLES["steps"].column_names), st.sampled_from(_TYPES), max_size=3
    ),
)
def test_any_segment_metadata_and_types_give_a_clear_outcome(
    tmp_path_factory: pytest.TempPathFactory,
    table: bytes | None,
    version: bytes | None,
    replaces: bytes | None,
    retype: dict[str, pa.DataType],
) -> None:
    root = tmp_path_factory.mktemp("prop")
    with StoreWriter(root, "good") as w:
        for i in range(10):
            w.append("steps", (0, i, i * 10, 10, 1, 2, 3, 1, 1, 2, 1, 1, 8, "host"))
    good = _segments(root / "steps" / "run_id=good")[0]
    t = pq.read_table(good, partitioning=None)
    for name, typ in retype.items():
        i = t.column_names.index(name)
        t = t.set_column(i, pa.field(name, typ), pa.nulls(t.num_rows, typ))
    kv = {}
    for key, value in ((META_TABLE, table), (META_VERSION, version), (META_REPLACES, replaces)):
        if value is not None:
            kv[key] = value
    pq.write_table(t.replace_schema_metadata(kv), good.with_name("hostile.parquet"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerfscopeWarning)
        try:
            store = Store(root)
        except PerfscopeError as exc:  # a schema version this perfscope cannot read: said in words
            assert "schema version" in exc.message
            return
        with store:
            n = store.query("SELECT count(*) AS n, sum(step_ns) AS t FROM steps").to_pylist()[0]
            # the good rows always count; the hostile file's only when it is a valid steps segment
            assert n["n"] in (10, 20)
            names = {Path(x.path).name for x in store.skipped}
            assert (n["n"] == 10) == ("hostile.parquet" in names)
        compact(root, grace_s=0)
    assert _count(root) == n["n"]


def test_fifo_and_folder_named_like_segments_are_skipped(demo: Path, quiet: None) -> None:
    part = _partition(demo)
    os.mkfifo(part / "pipe.parquet")
    (part / "dir.parquet").mkdir()
    with open_store(demo) as s:
        names = {Path(x.path).name: x.reason for x in s.skipped}
    assert names == {"pipe.parquet": "not a regular file", "dir.parquet": "not a regular file"}


def test_every_command_survives_every_hostile_file_at_once(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    part = _partition(demo)
    segs = _segments(part)
    outside = tmp_path / "outside.parquet"
    shutil.copy(segs[0], outside)
    (part / "link.parquet").symlink_to(outside)
    _forge(part, b"{not json")
    t = pq.read_table(segs[0], partitioning=None)
    i = t.column_names.index("step_ns")
    _rewrite(
        segs[0], part / "typed.parquet", table=t.set_column(i, "step_ns", pc.cast(t["step_ns"], pa.string()))
    )
    shutil.copy(segs[1], part / "zz-copy.parquet")
    (part / "garbage.parquet").write_bytes(b"PAR1 nothing here PAR1")
    for argv in (
        ["info", str(demo)],
        ["info", str(demo), "--json"],
        ["analyze", str(demo), "--json"],
        ["sql", str(demo), "SELECT run_id, sum(step_ns) AS t FROM steps GROUP BY 1", "--format", "json"],
        ["report", str(demo), "-o", str(tmp_path / "report.html")],
        ["compact", str(demo), "--dry-run"],
    ):
        assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and "internal error" not in err, (argv, err)


@pytest.mark.parametrize("value", ["a=b", "a%3Db", "a\\b", "NULL", "null", ""])
def test_a_partition_folder_duckdb_cannot_read_back_is_skipped_and_named(
    demo: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One copied segment in a foreign folder `run_id=a=b` broke every query on its table ('Hive
    partition mismatch'), `analyze` (exit 70) and `info`; `%3D`, a backslash and NULL made DuckDB read
    another run id than the folder's. Such a folder is skipped and named, like any foreign file."""
    before = {t: _count(demo, t) for t in ("steps", "runs", "metrics")}
    for table in ("steps", "runs", "metrics"):
        src = sorted((demo / table).glob("run_id=*"))[0]
        foreign = demo / table / f"run_id={value}"
        foreign.mkdir()
        for seg in _segments(src):
            shutil.copy(seg, foreign / seg.name)
    assert {t: _count(demo, t) for t in before} == before
    assert main(["info", str(demo)]) == 0
    out = capsys.readouterr()
    assert f"run_id={value}: a foreign folder" in out.out + out.err
    assert main(["analyze", str(demo), "--json"]) == 0
