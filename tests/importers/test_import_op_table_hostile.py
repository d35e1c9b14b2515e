"""`perfscope import op-table` on mistyped tables and layouts (issue 33, items 9 and 16), through the
real CLI: each is refused with one line and exit status 2 (it was exit 70, or accepted with a wrong
meaning: a boolean duration read as 1 s, a timestamp start_ts as seconds since 1970, a size 0 as 1);
a table in microseconds read as seconds is imported with one warning that says so."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from test_what_if import _cli, _hostile, _with, synthetic

LAYOUT = ("--dp", "2", "--pp", "2")


def _good() -> pa.Table:
    return synthetic(2, 2, steps=2)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("csv-optype-not-utf8", "column optype must be UTF-8 text"),
        ("parquet-optype-binary", "column optype must be UTF-8 text"),
        ("duration-bool", "column duration must hold numbers (seconds), not values of type bool"),
        ("start-timestamp", "column start_ts must hold numbers (seconds), not values of type timestamp"),
        ("meta-superscript", "dp_size must be a whole number"),
        ("dp-0", "the dp size (--dp, or dp_size in the meta file) is 0"),
        ("vpp-0", "the vpp size (--vpp, or vpp_size in the meta file) is 0"),
        ("meta-vpp-0", "every size must be 1 or more"),
    ],
)
def test_mistyped_tables_and_sizes_are_one_line(tmp_path, case: str, says: str) -> None:
    good = _good()
    n = good.num_rows
    meta = tmp_path / "meta.yaml"
    if case == "csv-optype-not-utf8":
        path = tmp_path / "t.csv"
        import pyarrow.csv as pacsv

        pacsv.write_csv(good, path)
        raw = path.read_bytes().replace(b"forward-compute", b"forward-\xff\xfe", 1)
        path.write_bytes(raw)
        res = _cli("import", "op-table", path, "--store", tmp_path / "store", *LAYOUT)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        line = lines[0]
    elif case == "parquet-optype-binary":
        names = [o.encode() for o in good.column("optype").to_pylist()]
        names[0] = b"\x80\x81 not text"
        line = _hostile(tmp_path, _with(good, "optype", pa.array(names, pa.binary()).to_pylist()), *LAYOUT)
    elif case == "duration-bool":
        line = _hostile(tmp_path, _with(good, "duration", [True] * n), *LAYOUT)
    elif case == "start-timestamp":
        micros = [round(v * 1e6) for v in good.column("start_ts").to_pylist()]
        stamps = pa.array(micros, pa.int64()).cast(pa.timestamp("us"))
        i = good.column_names.index("start_ts")
        line = _hostile(tmp_path, good.set_column(i, "start_ts", stamps), *LAYOUT)
    elif case == "meta-superscript":
        meta.write_text("dp_size: \u00b2\npp_size: 2\n")
        line = _hostile(tmp_path, good, "--meta", str(meta))
    elif case == "dp-0":
        line = _hostile(tmp_path, good, "--dp", "0", "--pp", "2")
    elif case == "vpp-0":
        line = _hostile(tmp_path, good, *LAYOUT, "--vpp", "0")
    else:
        meta.write_text("dp_size: 2\npp_size: 2\nvpp_size: 0\n")
        line = _hostile(tmp_path, good, "--meta", str(meta))
    assert line.startswith("perfscope import: error: ") and says in line, line


def test_a_binary_optype_that_is_utf8_text_imports(tmp_path) -> None:
    """A Parquet BYTE_ARRAY column without a string annotation is still text when its bytes are."""
    good = _good()
    names = pa.array([o.encode() for o in good.column("optype").to_pylist()], pa.binary())
    path = tmp_path / "t.parquet"
    pq.write_table(good.set_column(good.column_names.index("optype"), "optype", names), path)
    res = _cli("import", "op-table", path, "--store", tmp_path / "store", *LAYOUT)
    assert res.returncode == 0, res.stderr


def test_a_world_size_that_is_no_number_is_ignored(tmp_path) -> None:
    """world_size is only a check of the sizes: '²' (a digit to str.isdigit, exit 70 in int()) is
    ignored like any world_size that is not a whole number."""
    meta = tmp_path / "meta.yaml"
    meta.write_text("dp_size: 2\npp_size: 2\nworld_size: \u00b2\n")
    path = tmp_path / "t.parquet"
    pq.write_table(_good(), path)
    res = _cli("import", "op-table", path, "--store", tmp_path / "store", "--meta", meta)
    assert res.returncode == 0, res.stderr


def _warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


def test_a_table_in_microseconds_is_warned_about(tmp_path) -> None:
    """The same table with start_ts and duration in microseconds: its steps come out 10^6 times too
    long (hours); one warning names the step and the units."""
    good = _good()
    micro = good
    for name in ("start_ts", "duration"):
        micro = micro.set_column(micro.column_names.index(name), name, pc.multiply(good.column(name), 1e6))
    path = tmp_path / "us.parquet"
    pq.write_table(micro, path)
    res = _cli("import", "op-table", path, "--store", tmp_path / "store-us", *LAYOUT)
    assert res.returncode == 0, res.stderr
    (warning,) = [w for w in _warnings(res.stderr) if "no training step" in w]
    assert "read as seconds" in warning and "microseconds" in warning and "\n" not in warning

    path = tmp_path / "s.parquet"
    pq.write_table(good, path)
    res = _cli("import", "op-table", path, "--store", tmp_path / "store-s", *LAYOUT)
    assert res.returncode == 0, res.stderr
    assert not [w for w in _warnings(res.stderr) if "no training step" in w]
