"""A user query binds only the tables it names (issue 33, item 17): `perfscope sql STORE "SELECT 1"` on a
long run's 100,000 steps segments took 12.8 s, then, once the worker had its memory bound, was stopped
at 2.4 GB, as every table's view was bound to every file (and every file's path allowed) whatever the
query read. A table the query does not name is a view of the same columns that refuses to be read."""

from __future__ import annotations

import tempfile
from pathlib import Path

import duckdb
import pytest
from storegen import make_run

from perfscope import open_store
from perfscope.cli import main
from perfscope.store.listing import create_views
from perfscope.store.sql_worker import _connect, named_tables


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("named") / "store"
    make_run(root, "r1", world_size=2, steps=6)
    return root


def _allowed(con: duckdb.DuckDBPyConnection) -> str:
    (value,) = con.sql("SELECT value FROM duckdb_settings() WHERE name = 'allowed_paths'").fetchall()[0]
    return str(value)


def test_only_the_named_tables_are_bound_to_their_files(store: Path) -> None:
    with open_store(store) as s:
        listing = s.listing
        con = _connect(listing, tempfile.gettempdir(), "500MB", 1, query='SELECT count(*) FROM "RUNS"')
        try:
            allowed = _allowed(con)
            assert all(str(seg.path) in allowed for seg in listing.of("runs"))
            assert not any(str(seg.path) in allowed for seg in listing.of("steps"))
            assert con.sql('SELECT count(*) FROM "RUNS"').fetchone() == (1,)
            # every table is still there to DESCRIBE, with its columns
            shown = {r[0] for r in con.sql("SHOW TABLES").fetchall()}
            assert shown == set(listing.blocks)
            assert len(con.sql("DESCRIBE steps").fetchall()) == len(listing.of("steps")[0].columns) + 1
            with pytest.raises(Exception, match="reads table steps without naming it"):
                con.sql("SELECT count(*) FROM steps WHERE step > 1").fetchall()
        finally:
            con.close()


def test_a_query_of_every_table_reads_what_the_store_holds(store: Path) -> None:
    """Bound table by table or all at once, the answer is the same (the view without union_by_name
    reads files that each hold every column)."""
    with open_store(store) as s:
        for table in s.listing.blocks:
            con = _connect(s.listing, tempfile.gettempdir(), "500MB", 1, query=f"SELECT * FROM {table}")
            try:
                got = con.sql(f"SELECT count(*) FROM {table}").fetchone()
            finally:
                con.close()
            assert got == (s.row_count(table),), table


def test_named_tables_is_a_superset_of_what_a_query_reads(store: Path) -> None:
    with open_store(store) as s:
        listing = s.listing
    assert named_tables(listing, "SELECT 1") == []
    assert set(named_tables(listing, "select * from Steps join runs using (run_id)")) == {"runs", "steps"}
    assert named_tables(listing, "SELECT * FROM query_table('comm')") == ["comm"]
    assert named_tables(listing, "SELECT my_steps_x FROM t") == []  # a word, not a part of one
    assert set(named_tables(listing, None)) == set(listing.blocks)


def test_a_table_named_in_pieces_is_refused_in_one_line(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sql", str(store), "SELECT count(*) FROM query_table('st' || 'eps')"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reads table steps without naming it" in err[0], err
    assert main(["sql", str(store), "SELECT count(*) AS n FROM steps", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == str(6 * 2)


def test_views_of_every_table_still_bind_on_the_analysis_connection(store: Path) -> None:
    with open_store(store) as s:
        con = duckdb.connect()
        create_views(con, s.listing)
        assert con.sql("SELECT count(*) FROM steps").fetchone() == (12,)
