"""The store verbs of the `perfscope` command: info, sql, compact; help and errors for every verb."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from perfscope.cli import VERBS, main
from perfscope.store.schema import TABLES
from perfscope.store.writer import StoreWriter

README = Path(__file__).resolve().parents[2] / "README.md"


def _runs_row(experiment: str, world: int) -> tuple[object, ...]:
    row: list[object] = [None] * len(TABLES["runs"].columns)
    names = TABLES["runs"].column_names
    row[names.index("experiment")] = experiment
    row[names.index("source")] = "measured"
    row[names.index("world_size")] = world
    row[names.index("backend")] = "gloo"
    return tuple(row)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    for world in (1, 2):
        with StoreWriter(root, f"run-w{world}") as w:
            w.append("runs", _runs_row("exp-a", world))
            for rank in range(world):
                for step in range(5):
                    w.append(
                        "steps",
                        (rank, step, 10**18 + step * 10**9, 10**9, 1, 2, 3, 4, 5, 6, 7, 1, 8, "host"),
                    )
    return root


def test_info_json(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(store), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["experiments"] == ["exp-a"]
    assert [(r["run_id"], r["ranks_seen"], r["step_rows"]) for r in info["runs"]] == [
        ("run-w1", 1, 5),
        ("run-w2", 2, 10),
    ]
    assert info["rows"]["steps"] == 15
    assert info["last_step_end_ns"] - info["first_step_ns"] == 5 * 10**9
    assert info["skipped"] == []


def test_info_names_skipped_files(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (store / "steps" / "run_id=run-w1" / "broken.parquet").write_bytes(b"nope")
    assert main(["info", str(store)]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 file\n" in out and "broken.parquet" in out and "run-w2" in out


def test_sql_formats(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = "SELECT run_id, count(*) AS n FROM steps GROUP BY 1 ORDER BY 1"
    assert main(["sql", str(store), q, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["run_id,n", "run-w1,5", "run-w2,10"]  # minimal quoting
    assert main(["sql", str(store), q, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"run_id": "run-w1", "n": 5},
        {"run_id": "run-w2", "n": 10},
    ]
    assert main(["sql", str(store), q]) == 0
    table = capsys.readouterr().out.splitlines()
    assert re.match(r"run_id\s+n$", table[0]) and re.match(r"run-w2\s+10$", table[-1])
    out = tmp_path / "out.parquet"
    assert main(["sql", str(store), q, "--format", "parquet", "-o", str(out)]) == 0
    assert pq.read_table(out).to_pylist() == [{"run_id": "run-w1", "n": 5}, {"run_id": "run-w2", "n": 10}]


def test_sql_refuses_writes_and_bad_sql(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sql", str(store), "DELETE FROM steps"]) == 2
    assert "only reading queries" in capsys.readouterr().err
    assert main(["sql", str(store), "SELEC nonsense"]) != 0
    assert "error" in capsys.readouterr().err
    assert main(["sql", str(store), "SELECT 1", "--format", "parquet"]) == 2
    assert "needs -o" in capsys.readouterr().err


def test_compact_verb(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a second segment for one partition (a writer merges its host's segments at close: not this one)
    with StoreWriter(store, "run-w1", merge_at_close=False) as w:
        w.append("steps", (0, 5, 10**18, 10**9, 1, 2, 3, 4, 5, 6, 7, 1, 8, "host"))
    assert main(["compact", str(store), "--dry-run"]) == 0
    assert "would merge 2 segments in 1 partition " in capsys.readouterr().out
    assert main(["compact", str(store), "--grace", "0"]) == 0
    assert "merged 2 segments" in capsys.readouterr().out
    assert len(list((store / "steps" / "run_id=run-w1").glob("*.parquet"))) == 1


def test_missing_store_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for verb in ("info", "compact"):
        assert main([verb, str(tmp_path / "missing")]) == 2
        err = capsys.readouterr().err
        assert "does not exist" in err and "Traceback" not in err


def test_wrong_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--no-such-flag"]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_has_help_and_is_documented(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([verb, "--help"]) == 0
    assert len(capsys.readouterr().out) > 100
    assert f"perfscope {verb}" in README.read_text(), f"README.md does not document `perfscope {verb}`"


def test_console_script_runs() -> None:
    exe = Path(sys.executable).with_name("perfscope")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert all(verb in out for verb in VERBS)
