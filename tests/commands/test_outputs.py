"""Files a user names (report, --tables, sql -o, the store of demo and simulate) are written only as
regular files, whole, never through a device, FIFO, folder or link and never into a folder that does
not exist; store-provided strings cannot inject HTML or Markdown into a report; and the CLI attacks of
issue 10 item 8 end in one line and a non-zero exit."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import stat
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from storegen import make_run
from test_report import parse

from perfscope.cli import main
from perfscope.errors import PerfscopeError
from perfscope.output import check_output_file, output_folder, store_target, write_output

HOSTILE = "<script>alert(1)</script> [x](javascript:alert(2)) ![t](http://example.invalid/t.png) *e* _u_"


def _only_error(capsys: pytest.CaptureFixture[str], *says: str) -> str:
    """stderr is one error line saying all of `says`, and no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err, err
    for s in says:
        assert s in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("outputs") / "store"
    for n in (1, 2):
        make_run(root, f"run-n{n}", world_size=n, steps=20, device=False, backend="gloo", experiment=HOSTILE)
    return root


def _no_temp_left(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# ---- the shared writer ---------------------------------------------------------------------------


def test_writes_a_regular_file_whole_and_replaces_one(tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    write_output(target, b"first")
    target.chmod(0o600)
    write_output(target, b"second")
    assert target.read_bytes() == b"second"
    assert stat.S_ISREG(target.lstat().st_mode)
    mode = stat.S_IMODE(target.stat().st_mode)
    assert mode & 0o044 == 0o644 & ~_umask() & 0o044  # readable by others, as the umask allows
    _no_temp_left(tmp_path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_refuses_a_fifo_and_leaves_it_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(PerfscopeError, match=r"FIFO .*only regular files"):
        write_output(fifo, b"x")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    _no_temp_left(tmp_path)


def test_refuses_a_symbolic_link_and_leaves_its_target_alone(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "link.html"
    link.symlink_to(victim)
    with pytest.raises(PerfscopeError, match="symbolic link"):
        write_output(link, b"x")
    assert link.is_symlink() and victim.read_text() == "precious"


def test_refuses_a_folder_a_missing_folder_and_a_file_as_folder(tmp_path: Path) -> None:
    with pytest.raises(PerfscopeError, match="is a folder"):
        check_output_file(tmp_path)
    with pytest.raises(PerfscopeError, match="is a folder"):
        check_output_file("/")
    with pytest.raises(PerfscopeError, match=r"folder .*missing/dir does not exist .*creates no folders"):
        check_output_file(tmp_path / "missing" / "dir" / "x.html")
    assert not (tmp_path / "missing").exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(PerfscopeError, match="a-file is a file, not a folder"):
        check_output_file(tmp_path / "a-file" / "x.html")


def test_refuses_over_long_names_and_nul_bytes(tmp_path: Path) -> None:
    with pytest.raises(PerfscopeError, match="is 300 bytes long, longer than the 255"):
        write_output(tmp_path / ("a" * 300), b"x")
    with pytest.raises(PerfscopeError, match="NUL byte"):
        write_output(str(tmp_path / "a\x00b"), b"x")
    # a name just under the limit is fine, although its temporary file's name is longer
    write_output(tmp_path / ("b" * 250), b"x")
    assert (tmp_path / ("b" * 250)).read_bytes() == b"x"


def test_output_folder_makes_one_level_only(tmp_path: Path) -> None:
    assert output_folder(tmp_path / "tables").is_dir()
    with pytest.raises(PerfscopeError, match="does not exist"):
        output_folder(tmp_path / "no" / "tables")
    (tmp_path / "f").write_text("")
    with pytest.raises(PerfscopeError, match="it is a file, not a folder"):
        output_folder(tmp_path / "f")


def test_store_target(tmp_path: Path, store: Path) -> None:
    assert store_target(store) == store  # an existing store
    assert store_target(tmp_path / "new", create=True).is_dir()  # a new folder
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PerfscopeError, match="not empty and not a perfscope store"):
        store_target(tmp_path)
    with pytest.raises(PerfscopeError, match="is a file, not a store"):
        store_target(tmp_path / "notes.txt")
    with pytest.raises(PerfscopeError, match="does not exist"):
        store_target(tmp_path / "no" / "store")


# ---- every command that writes goes through it ---------------------------------------------------


def test_report_to_dev_null_does_not_replace_the_device(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = os.stat("/dev/null")
    assert stat.S_ISCHR(before.st_mode)
    assert main(["report", str(store), "-o", "/dev/null"]) == 2
    _only_error(capsys, "/dev/null", "character device", "only regular files")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-o", "FIFO"], ["FIFO", "only regular files"]),
        (["-o", "TMP/missing/dir/x.html"], ["missing/dir does not exist", "choose another -o"]),
        (["-o", "TMP/" + "r" * 300 + ".html"], ["bytes long"]),
        (["-o", "TMP/r.html", "--tables", "TMP/missing/tables"], ["does not exist", "--tables"]),
        (["-o", "TMP/r.html", "--tables", "FIFO"], ["FIFO", "not a folder"]),
        (["-o", "TMP/r.md", "--tables", "TMP/r.md"], []),
    ],
)
def test_report_refuses_bad_outputs_before_the_work(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: list[str]
) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "r.md").write_text("mine")
    args = [a.replace("TMP", str(tmp_path)).replace("FIFO", str(tmp_path / "fifo")) for a in args]
    assert main(["report", str(store), *args]) == 2
    _only_error(capsys, *says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "r.md"]
    assert stat.S_ISFIFO((tmp_path / "fifo").lstat().st_mode)
    assert (tmp_path / "r.md").read_text() == "mine"


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("/", "is a folder"),
        ("TMP/missing/dir/x.csv", "missing/dir does not exist"),
        ("TMP/" + "q" * 300, "bytes long"),
        ("FIFO", "FIFO"),
    ],
)
@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_sql_output_refusals(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, says: str, fmt: str
) -> None:
    os.mkfifo(tmp_path / "fifo")
    target = target.replace("TMP", str(tmp_path)).replace("FIFO", str(tmp_path / "fifo"))
    assert main(["sql", str(store), "SELECT 1 AS a", "--format", fmt, "-o", target]) == 2
    _only_error(capsys, says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


_NESTED_SQL = (
    "SELECT [1, 2] AS l, {'a': 1, 'b': 'x'} AS s, INTERVAL 3 DAY AS i, MAP {'k': 1} AS m, "
    "'infinity'::TIMESTAMP AS t, '\\xFF'::BLOB AS b, 'a'::ENUM('a', 'b') AS e, "
    "DATE '2024-02-29' AS d, 7 AS n"
)


def test_sql_writes_nested_and_odd_columns_as_text(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.csv"
    assert main(["sql", str(store), _NESTED_SQL, "--format", "csv", "-o", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert rows == [
        {
            "l": "[1, 2]",
            "s": "{'a': 1, 'b': x}",
            "i": "3 days",
            "m": "{k=1}",
            "t": "infinity",
            "b": "\\xFF",
            "e": "a",
            "d": "2024-02-29",
            "n": "7",
        }
    ]
    assert main(["sql", str(store), _NESTED_SQL, "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["l"] == [1, 2] and row["s"] == {"a": 1, "b": "x"}  # JSON keeps what it can hold
    assert row["i"] == "3 days" and row["t"] == "infinity" and row["n"] == 7
    assert main(["sql", str(store), _NESTED_SQL]) == 0
    table = capsys.readouterr().out
    assert "3 days" in table and "infinity" in table and "[1, 2]" in table


def test_sql_parquet_of_a_type_parquet_lacks_is_one_line(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "u.parquet"
    assert (
        main(["sql", str(store), "SELECT union_value(n := 1) AS u", "--format", "parquet", "-o", str(out)])
        == 2
    )
    _only_error(capsys, "cannot write this result as Parquet")
    assert list(tmp_path.iterdir()) == []
    assert main(["sql", str(store), "SELECT 1 AS a", "--format", "parquet", "-o", str(out)]) == 0
    assert pq.read_table(out).to_pylist() == [{"a": 1}]


# ---- the other attacks of item 8 -----------------------------------------------------------------


@pytest.mark.parametrize("grace", ["nan", "inf", "-1", "-inf"])
def test_compact_grace_must_be_finite(store: Path, capsys: pytest.CaptureFixture[str], grace: str) -> None:
    assert main(["compact", str(store), f"--grace={grace}"]) == 2
    _only_error(capsys, "--grace must be a finite number of seconds")


def test_demo_refuses_a_store_that_is_a_file_or_a_foreign_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0::/root:/bin/sh\n")
    assert main(["demo", str(passwd), "--quick"]) == 2
    _only_error(capsys, "is a file, not a store")
    assert passwd.read_text() == "root:x:0:0::/root:/bin/sh\n"
    if os.path.exists("/etc/passwd"):
        assert main(["demo", "/etc/passwd", "--quick"]) == 2
        _only_error(capsys, "is a file, not a store")
    assert main(["demo", str(tmp_path), "--quick"]) == 2  # holds passwd: not empty, not a store
    _only_error(capsys, "not empty and not a perfscope store")
    assert main(["demo", str(tmp_path / "no" / "store"), "--quick"]) == 2
    _only_error(capsys, "does not exist")


def _simulate(capsys: pytest.CaptureFixture[str], store: Path, *args: str) -> str:
    assert main(["simulate", str(store), *args]) == 2
    return _only_error(capsys)


_STUDY = {
    "experiments": [
        {
            "name": "x",
            "partitions": ["hpdlf"],
            "backends": ["horovod-nccl"],
            "world_sizes": [1, 2],
            "steps": 20,
        }
    ]
}


def test_simulate_hostile_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x00\xff\xfe\x80{")
    assert "is not UTF-8 text" in _simulate(capsys, out, "--config", str(binary))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    assert "nested too deeply" in _simulate(capsys, out, "--config", str(deep))
    assert "larger than 1 MiB" in _simulate(capsys, out, "--config", "/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes to it: the command must not wait for ever
    assert "not valid JSON" in _simulate(capsys, out, "--config", str(fifo))
    assert "it is a folder" in _simulate(capsys, out, "--config", str(tmp_path))
    late = tmp_path / "late.json"
    late.write_text(json.dumps({**_STUDY, "start": "9999-12-31T23:00:00Z"}))
    assert "start: must be from 1970 to 2200" in _simulate(capsys, out, "--config", str(late))
    early = tmp_path / "early.json"
    early.write_text(json.dumps({**_STUDY, "start": "1900-01-01T00:00:00Z"}))
    assert "start: must be from 1970" in _simulate(capsys, out, "--config", str(early))
    assert not out.exists()


def test_simulate_into_proc_or_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.path.isdir("/proc"):
        assert "cannot write store /proc/sim" in _simulate(capsys, Path("/proc/sim"), "--world-sizes", "1")
    (tmp_path / "f").write_text("")
    assert "is a file, not a store" in _simulate(capsys, tmp_path / "f")
    assert "does not exist" in _simulate(capsys, tmp_path / "no" / "store")


# ---- store strings in reports --------------------------------------------------------------------


def test_markdown_report_escapes_store_strings(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    assert main(["report", str(store), "-o", str(out), "--title", "T <b>bold</b> [l](javascript:x)"]) == 0
    text = out.read_text()
    assert HOSTILE not in text  # it is there, but escaped (backslashes: CommonMark shows it as written)
    assert "\\<script\\>alert(1)\\</script\\>" in text
    # no raw HTML from the store a renderer would run (the report's own <a id> and <sub> aside)
    assert not re.search(r"(?<!\\)<(script|/?b>)", text.lower())
    assert not re.search(r"(?<!\\)\]\((javascript|http)", text)  # no link or image a reader could follow
    assert "\\[x\\](javascript:alert(2))" in text  # shown literally, not a link
    assert "T \\<b\\>bold\\</b\\> \\[l\\](javascript:x)" in text


def test_html_report_escapes_store_strings(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(store), "-o", str(out)]) == 0
    text = out.read_text()
    parsed = parse(text)
    assert parsed.scripts == 0 and parsed.external == []
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
