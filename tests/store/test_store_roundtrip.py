"""Every table round-trips through the writer and the reader with its columns, types and values."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfscope import SCHEMA_VERSION, open_store
from perfscope.store.process_groups import COMM_MEMBERS_SQL, group_id
from perfscope.store.schema import META_VERSION, TABLES
from perfscope.store.writer import StoreWriter

_LIMITS = {pa.int16(): 2**15 - 1, pa.int32(): 2**31 - 1, pa.int64(): 2**63 - 1}


def _value(typ: pa.DataType) -> st.SearchStrategy[Any]:
    if typ in _LIMITS:
        lim = _LIMITS[typ]
        return st.one_of(st.none(), st.integers(-lim - 1, lim))
    if typ == pa.float32():
        return st.one_of(st.none(), st.floats(width=32, allow_nan=False))
    if typ == pa.float64():
        return st.one_of(st.none(), st.floats(allow_nan=False))
    if typ == pa.bool_():
        return st.one_of(st.none(), st.booleans())
    return st.one_of(st.none(), st.text(max_size=20))


def _rows(name: str) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    cols = TABLES[name].columns
    return st.lists(st.tuples(*[_value(c.type) for c in cols]), min_size=1, max_size=30)


@pytest.mark.parametrize("name", list(TABLES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_table_round_trips(name: str, data: st.DataObject) -> None:
    rows = data.draw(_rows(name))
    with tempfile.TemporaryDirectory() as tmp:
        # a short roll interval so rows land in several segments
        with StoreWriter(tmp, "run-1", roll_interval_s=0.05) as w:
            for i, row in enumerate(rows):
                w.append(name, row)
                if i == len(rows) // 2:
                    w.flush()
        with open_store(tmp, warn=False) as store:
            # comm keeps each group's members once (process_groups): read back with them
            got = store.query(
                f"SELECT * FROM ({COMM_MEMBERS_SQL}) comm" if name == "comm" else f"SELECT * FROM {name}"
            )
        if name == "comm":  # a row's members name its group's id
            at, gid = (
                TABLES["comm"].column_names.index("group_ranks"),
                TABLES["comm"].column_names.index("group_id"),
            )
            rows = [(*r[:gid], group_id(r[at]), *r[gid + 1 :]) if r[at] is not None else r for r in rows]
        # run_id is the partition key, the rest the schema's columns with the schema's types
        expected_schema = TABLES[name].arrow_schema
        for field in expected_schema:
            assert got.schema.field(field.name).type == field.type, field.name
        assert got.column("run_id").to_pylist() == ["run-1"] * (len(rows) if name != "runs" else 1)
        if name == "runs":
            return  # the runs view keeps one row per run; checked in test_runs_view_keeps_latest
        key = [c.name for c in TABLES[name].columns]
        got_rows = sorted(
            (tuple(r[k] for k in key) for r in got.to_pylist()), key=lambda r: [repr(v) for v in r]
        )
        want = sorted(rows, key=lambda r: [repr(v) for v in r])
        assert len(got_rows) == len(want)
        for g, w_ in zip(got_rows, want, strict=True):
            for gv, wv, col in zip(g, w_, TABLES[name].columns, strict=True):
                if col.type == pa.float32() and wv is not None:
                    assert gv == pytest.approx(wv, rel=1e-6) or (math.isinf(wv) and gv == wv)
                else:
                    assert gv == wv, col.name


def test_runs_view_keeps_latest(tmp_path: Path) -> None:
    width = len(TABLES["runs"].columns)
    ended = [c.name for c in TABLES["runs"].columns].index("ended_ns")
    exp = [c.name for c in TABLES["runs"].columns].index("experiment")
    first = [None] * width
    first[exp] = "start"
    last = list(first)
    last[exp], last[ended] = "final", 123
    with StoreWriter(tmp_path, "r") as w:
        w.append("runs", tuple(first))
        w.flush()
        w.append("runs", tuple(last))
    with open_store(tmp_path) as store:
        assert store.query("SELECT experiment, ended_ns FROM runs").to_pylist() == [
            {"experiment": "final", "ended_ns": 123}
        ]


def test_segments_carry_schema_metadata(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    with StoreWriter(tmp_path, "r") as w:
        w.append("metrics", (0, 1, 2, "loss", 0.5))
    (seg,) = list((tmp_path / "metrics" / "run_id=r").glob("*.parquet"))
    meta = pq.read_metadata(seg).metadata
    assert meta[META_VERSION] == str(SCHEMA_VERSION).encode()
    assert meta[b"perfscope.table"] == b"metrics"


def test_schema_doc_is_generated_from_code() -> None:
    from perfscope.store.schema import markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "schema.md"
    assert doc.read_text() == markdown(), "run `make schema` to regenerate docs/schema.md"
