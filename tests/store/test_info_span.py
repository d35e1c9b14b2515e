"""`perfscope info` on a store nobody has opened before, as another tool writes it (issue 26): one long
run of many small pyarrow-written segments (benchmarks/store_listing.py's shape). Its time span comes
from the listing's column ranges and the one or few files they point at, never from a query over
every file (which binds every footer: 107 s and 5.7 GB at 100,000 segments); `perfscope analyze` on
more segments than it can answer within a minute says in one line to run `perfscope compact` first."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from perfscope.cli import main
from perfscope.commands.info import summary
from perfscope.store.open import open_store
from perfscope.store.schema import TABLES

REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000_000_000


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("store_listing", REPO / "benchmarks" / "store_listing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _segment(path: Path, rows: dict[str, list[int | None]], **write: object) -> None:
    """A steps segment as another tool writes it: pyarrow, the store's schema, its other columns NULL."""
    schema = TABLES["steps"].arrow_schema
    n = len(next(iter(rows.values())))
    arrays = [pa.array(rows[f.name], f.type) if f.name in rows else pa.nulls(n, f.type) for f in schema]
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path, **write)  # type: ignore[arg-type]


def _views(store: object) -> set[str]:
    """The views the store's connection has made so far (a query naming no table makes none)."""
    rows = store.query("SELECT view_name FROM duckdb_views() WHERE NOT internal").to_pylist()  # type: ignore[attr-defined]
    return {r["view_name"] for r in rows}


@pytest.fixture(scope="module")
def one_long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 segments of 10 steps of one rank (4 ranks), plus what a foreign writer leaves: a step that
    started and never ended (no step_ns: no range for it), a segment written without statistics and
    one whose last step is the run's longest (it ends last though it starts before others)."""
    root = tmp_path_factory.mktemp("long") / "store"
    _benchmark().build_one_run(root, 400)
    part = root / "steps" / "run_id=long"
    last = 400 // 4 * 10  # the first step after the benchmark's
    _segment(part / "zz-inflight.parquet", {"rank": [0], "step": [last], "start_ns": [T0 + last * 10**7]})
    early = {"rank": [1], "step": [5], "start_ns": [T0 - 10**9], "step_ns": [10**6]}
    _segment(part / "zz-nostats.parquet", early, write_statistics=False)
    longest = {"rank": [2], "step": [last - 2], "start_ns": [T0 + (last - 2) * 10**7], "step_ns": [10**10]}
    _segment(part / "zz-long.parquet", longest)
    return root


def test_info_takes_the_span_from_the_listing_and_a_few_files(one_long_run: Path) -> None:
    with open_store(one_long_run, warn=False) as store:
        info = summary(store)
        assert "steps" not in _views(store)  # no query bound the run's 403 files
        truth = store.query(
            "SELECT min(start_ns) AS a, max(start_ns::HUGEINT + step_ns) AS b, count(*) AS n FROM steps"
        ).to_pylist()[0]
    assert info["first_step_ns"] == truth["a"] == T0 - 10**9  # the segment without statistics
    assert info["last_step_end_ns"] == int(truth["b"]) == T0 + (400 // 4 * 10 - 2) * 10**7 + 10**10
    assert info["rows"]["steps"] == truth["n"] == 4003
    assert [(r["run_id"], r["ranks_seen"]) for r in info["runs"]] == [("long", 4)]


def test_a_live_segment_is_read_as_the_listing_holds_it(tmp_path: Path) -> None:
    """A running job's `.arrows` segment (its rows may grow past any range): its rows as the listing
    read them decide its part of the span, and the sealed files still stay unread."""
    from perfscope.store.live import LiveSegment
    from perfscope.store.writer import rows_to_table

    root = tmp_path / "store"
    _benchmark().build_one_run(root, 40)
    late = T0 + 10**12
    names = TABLES["steps"].column_names
    values = {"rank": 3, "step": 99, "start_ns": late, "step_ns": 5, "clock": "host"}
    live = LiveSegment(root / "steps" / "run_id=long" / "w-live.arrows", TABLES["steps"].arrow_schema)
    try:
        live.append(rows_to_table("steps", [tuple(values.get(c) for c in names)]))
        with open_store(root, warn=False) as store:
            info = summary(store)
            assert "steps" not in _views(store)
    finally:
        live.close()
    assert (info["first_step_ns"], info["last_step_end_ns"]) == (T0, late + 5)


def test_analyze_on_too_many_segments_says_to_compact_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from perfscope.commands import info

    root = tmp_path / "store"
    _benchmark().build_one_run(root, 60)
    monkeypatch.setattr(info, "ANALYZE_MAX_SEGMENTS", 50)  # 60 steps segments and a runs segment
    code = main(["analyze", "--json", str(root)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert "61 segments" in line and f"perfscope compact {root.resolve()}" in line and "minute" in line
    with open_store(root, warn=False) as store:  # another run's analysis is not held back by these files
        assert info.compact_first(store, ("other",)) is None
        assert info.compact_first(store, ("long",)) == line.partition("error: ")[2]
    # compacted, the same store is analysed
    assert main(["compact", "--grace", "0", str(root)]) == 0
    capsys.readouterr()
    assert main(["analyze", "--json", str(root)]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["run_id"] == "long" and run["step_ns"] == pytest.approx(10**7, rel=1e-3)
