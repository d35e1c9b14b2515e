"""The hostile corpus (tests/hostile/corpus.py) through the real CLI, one process per case: each file
is refused with exit status 2 and one line that names what is wrong, never a traceback, never the
internal-error exit 70, never a line about disks or training; and the store keeps nothing of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile.corpus import CASES, Case, horovod, kineto, nccl, nsys_export

WRONG_WORDS = ("training continues", "writable", "disk", "internal error", "Traceback")


def _cli(
    tmp_path: Path, fmt: str, name: bytes, content: bytes, *args: str
) -> subprocess.CompletedProcess[bytes]:
    path = tmp_path / os.fsdecode(name)
    path.write_bytes(content)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    env.pop("PERFSCOPE_TRACEBACK", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "perfscope",
            "import",
            fmt,
            os.fsencode(path),
            "--store",
            str(tmp_path / "store"),
            *args,
        ],
        capture_output=True,
        timeout=240,
        env=env,
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_is_refused_in_one_line_with_exit_2(tmp_path: Path, case: Case) -> None:
    res = _cli(tmp_path, case.format, case.name, case.content(), *case.args)
    err = res.stderr.decode("utf-8", "replace")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert res.returncode == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("perfscope import: error: ") and case.says in lines[0], lines[0]
    assert not any(w in err for w in WRONG_WORDS), err
    assert "\x1b" not in err and len(lines[0]) < 400  # no raw escapes, no 5000-digit echo
    assert not list((tmp_path / "store").glob("*/run_id=*"))  # nothing of the run is left


@pytest.mark.parametrize(
    ("fmt", "name", "make"),
    [
        ("kineto", b"k.json", kineto),
        ("horovod", b"h.json", horovod),
        ("nccl-tests", b"all_reduce_perf.txt", nccl),
        ("nsys", b"n.sqlite", nsys_export),
        # '#', '?' and '%' in a name are no URI syntax (rank#0.sqlite opened "rank" and created it)
        ("nsys", b"rank#0.sqlite", nsys_export),
        ("nsys", b"rank%3F.sqlite", nsys_export),
        ("nsys", b"what?.sqlite", nsys_export),
    ],
    ids=["kineto", "horovod", "nccl-tests", "nsys", "nsys-hash", "nsys-percent", "nsys-question"],
)
def test_the_corpus_templates_import(tmp_path: Path, fmt: str, name: bytes, make) -> None:
    """What each hostile case changes is all that makes it hostile: the template itself imports."""
    extra = ("--rank", "0", "--world-size", "1") if fmt == "nsys" else ()
    res = _cli(tmp_path, fmt, name, make(), *extra)
    assert res.returncode == 0, res.stderr.decode()
    assert b"imported" in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.fsdecode(name), "store"])  # nothing made


def test_a_run_id_is_bounded_in_bytes_and_echoed_short() -> None:
    """150 'é' are 300 bytes: more than a folder name takes once its prefix is added; the error line
    names a long id by its start and length, not whole."""
    from perfscope import PerfscopeError
    from perfscope.importers.common import check_run_id

    assert check_run_id("é" * 100) == "é" * 100
    with pytest.raises(PerfscopeError, match="200 bytes") as err:
        check_run_id("é" * 150)
    assert len(err.value.message) < 200 and "150 characters" in err.value.message
