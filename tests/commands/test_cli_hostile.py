"""Hostile command lines for every verb (hypothesis): random flags of the verb with random values, paths
that are devices, FIFOs, files, foreign folders, missing folders or over-long names, unicode and NUL
bytes. Whatever comes in, the command never prints a traceback, and a refusal is a non-zero exit with
one error line on stderr. In-process through perfscope.cli.main for speed, plus a few real processes."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storegen import make_run

from perfscope.cli import VERBS, _parser, main

#: an error line of ours (`perfscope VERB: error: ...`) or of argparse (`perfscope VERB: error: ...`)
ERROR_LINE = re.compile(r"^perfscope(?: [\w-]+)?: error: \S")

#: verbs that start something long-lived or write a store when given a path they accept: their store
#: argument always comes from the refused targets, first on the line
REFUSED_STORE_FIRST = {"demo", "dashboard", "simulate"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Paths: a real store, and targets every writing command must refuse."""
    root = tmp_path_factory.mktemp("hostile")
    store = root / "store"
    for n in (1, 2):
        make_run(store, f"run-n{n}", world_size=n, steps=20, device=False, backend="gloo")
    (root / "file.txt").write_text("not a store\n")
    (root / "binary.json").write_bytes(b"\x00\xff\xfe\x80{[")
    (root / "deep.json").write_text("[" * 50_000 + "]" * 50_000)
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    os.mkfifo(root / "fifo")
    (root / "link").symlink_to(root / "file.txt")
    refused = [
        str(root / "file.txt"),
        str(root / "fifo"),
        str(root / "link"),
        str(foreign),
        str(root / "missing" / "dir" / "x"),
        str(root / ("n" * 300)),
        "/dev/null",
        "/proc/perfscope-hostile/x",
        str(root / "file.txt" / "below"),
        str(root / "missing" / "übung ✓ \u202e\n"),
    ]
    return {
        "store": [str(store)],
        "refused": refused,
        "configs": [str(root / "binary.json"), str(root / "deep.json"), "/dev/zero", str(root / "fifo")],
    }


def _options(verb: str) -> list[tuple[str, bool]]:
    """(option string, takes a value) of every optional argument of `verb`, read from its parser."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for action in sub.choices[verb]._actions:
        for opt in action.option_strings:
            if opt not in ("-h", "--help"):
                out.append((opt, action.nargs != 0))
    return out


NUMBERS = st.sampled_from(
    ["nan", "inf", "-inf", "-1", "0", "1e309", "1" * 40, "0x10", "1_000", "-0", "2.5", "65536", "1,2,,x"]
)


def _values(world: dict[str, list[str]], *, with_store: bool) -> st.SearchStrategy[str]:
    paths = world["refused"] + world["configs"] + (world["store"] if with_store else [])
    return st.one_of(
        st.sampled_from(paths),
        NUMBERS,
        st.integers(min_value=-(10**30), max_value=10**30).map(str),
        st.text(min_size=0, max_size=24),
        st.sampled_from(["\udcff", "..", "/", "-", "--", "SELECT 1", "{}", "a=b", "base.coord_us=1e999"]),
    )


def _argv(verb: str, world: dict[str, list[str]]) -> st.SearchStrategy[list[str]]:
    # the store verbs also meet the real store: then random flags reach the queries and analyses
    with_store = verb in {"info", "sql", "compact", "analyze"}
    values = _values(world, with_store=with_store)
    options = _options(verb)
    if verb == "run":  # its --store stays the file below: the command after it is never started
        options = [(o, v) for o, v in options if not o.startswith("--s")]
    flag = st.sampled_from(options).flatmap(
        lambda ov: values.map(lambda v: [ov[0], v]) if ov[1] else st.just([ov[0]])
    )
    token = st.one_of(flag, values.map(lambda v: [v]))
    body = st.lists(token, max_size=6).map(lambda parts: [t for p in parts for t in p])
    if verb in REFUSED_STORE_FIRST:
        return st.tuples(st.sampled_from(world["refused"]), body).map(lambda sb: [verb, sb[0], *sb[1]])
    if verb == "run":
        return body.map(lambda b: [verb, "--store", world["refused"][0], *b])
    positional = st.sampled_from(world["refused"] + (world["store"] if with_store else []))
    return st.tuples(positional, body).map(lambda pb: [verb, pb[0], *pb[1]])


@contextlib.contextmanager
def _nothing_runs_elsewhere(tmp: Path) -> Iterator[None]:
    """An empty PATH (no command a random word names can start) and a scratch working folder."""
    here = os.getcwd()
    os.chdir(tmp)
    try:
        with mock.patch.dict(os.environ, {"PATH": str(tmp / "no-bin")}):
            yield
    finally:
        os.chdir(here)


def _run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _check(argv: list[str], rc: int, err: str) -> None:
    assert "Traceback" not in err, (argv, err)
    assert "internal error" not in err, (argv, err)
    if rc != 0:
        lines = [ln for ln in err.splitlines() if ln and not ln.startswith("warning: ")]
        assert len(lines) == 1, (argv, err)
        assert ERROR_LINE.match(lines[0]), (argv, err)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_no_traceback_for_any_arguments(
    verb: str, world: dict[str, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    scratch = tmp_path_factory.mktemp(f"cwd-{verb}")

    @settings(
        max_examples=15,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(argv=_argv(verb, world))
    def check(argv: list[str]) -> None:
        with _nothing_runs_elsewhere(scratch):
            rc, _, err = _run_in_process(argv)
        if verb in REFUSED_STORE_FIRST or verb == "run":
            assert rc != 0, (argv, err)  # nothing these lines name may be written or started
        _check(argv, rc, err)

    check()


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_nul_bytes_are_refused_in_one_line(verb: str) -> None:
    rc, out, err = _run_in_process([verb, "a\x00b", "--x=\x00"])
    assert rc == 2 and out == ""
    assert err.strip() == "perfscope: error: argument 2 (a\\x00b) contains a NUL byte"


def test_usage_errors_are_one_line_with_a_pointer_to_help() -> None:
    rc, _, err = _run_in_process(["sql", "--limit", "many\nlines"])
    assert rc == 2
    assert err.count("\n") == 1 and "(usage: perfscope sql --help)" in err
    assert "many\\nlines" in err  # the newline the user typed is shown, not obeyed


def test_an_unexpected_error_is_one_line_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfscope.commands.info as info

    def broken(args: argparse.Namespace) -> int:
        raise ZeroDivisionError("a bug\nof ours")

    monkeypatch.setattr(info, "run", broken)
    rc, _, err = _run_in_process(["info", "x"])
    assert rc == 70
    assert err.count("\n") == 1 and "internal error: ZeroDivisionError: a bug\\nof ours" in err
    monkeypatch.setenv("PERFSCOPE_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        _run_in_process(["info", "x"])


# ---- a few real processes: what a shell really passes (bytes, not str) ---------------------------


def _process(*args: str | bytes, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "perfscope", *args], capture_output=True, timeout=120, cwd=cwd, check=False
    )


@pytest.mark.parametrize(
    "args",
    [
        ("info", b"/tmp/\xff\xfe-not-utf8"),
        ("info", b"OUT/\xff-store"),
        ("sql", "STORE", "SELECT 1", "-o", "/"),
        ("sql", "STORE", "SELECT [1] AS l, INTERVAL 1 DAY AS i", "--format", "csv", "-o", b"\xff.csv"),
        ("report", "STORE", "-o", "/dev/null"),
        ("compact", "STORE", "--grace", "nan"),
        ("simulate", "OUT", "--config", "/dev/zero"),
        ("demo", "/etc/passwd", "--quick"),
    ],
)
def test_real_processes_never_print_a_traceback(
    args: tuple[str | bytes, ...], world: dict[str, list[str]], tmp_path: Path
) -> None:
    argv = [world["store"][0] if a == "STORE" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    if args[0] == "info" and args[1].startswith(b"OUT/"):  # a real store in a folder not named in UTF-8
        folder = os.fsencode(tmp_path) + args[1][3:]
        shutil.copytree(world["store"][0], os.fsdecode(folder))
        argv = ["info", folder]
    proc = _process(*argv, cwd=tmp_path)
    err = proc.stderr.decode("utf-8", "replace")
    assert b"Traceback" not in proc.stderr, err
    if args[0] == "sql" and args[-1] == b"\xff.csv":  # a name that is not UTF-8 is still a fine name
        assert proc.returncode == 0, err
        assert (tmp_path / os.fsdecode(b"\xff.csv")).read_text() == "l,i\n[1],1 day\n"  # quoted where needed
        return
    assert proc.returncode != 0
    assert len(err.strip().splitlines()) == 1 and ERROR_LINE.match(err), err
    if args[0] == "info":  # DuckDB takes only UTF-8 paths: said as the user's mistake to fix
        assert proc.returncode == 2 and "not valid UTF-8" in err, err
    assert stat_is_char_device("/dev/null")


def stat_is_char_device(path: str) -> bool:
    import stat

    return stat.S_ISCHR(os.stat(path).st_mode)


#: what a trace may carry in a string: a colour change, clear-screen, a bell, a right-to-left override
HOSTILE_TEXT = "nc\x1b[31mcl\x1b[2J\x07\u202elx"


def _imported_with_escapes(tmp_path: Path) -> Path:
    """A store holding one Kineto trace whose distributedInfo.backend is HOSTILE_TEXT."""
    from hostile.corpus import kineto

    trace = tmp_path / "k.json"
    trace.write_bytes(kineto(info={"backend": HOSTILE_TEXT, "rank": 0, "world_size": 1}))
    store = tmp_path / "store"
    proc = _process("import", "kineto", str(trace), "--store", str(store), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    return store


@pytest.mark.parametrize("verb", ["info", "analyze"])
def test_strings_from_a_file_are_escaped_not_obeyed(tmp_path: Path, verb: str) -> None:
    """issue 22: info and analyze printed distributedInfo.backend raw, ESC included. On a real
    terminal (a pty) and through a pipe, every string from the store is shown escaped."""
    import pexpect

    store = _imported_with_escapes(tmp_path)
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("FORCE_COLOR", None)
    piped = subprocess.run(
        [sys.executable, "-m", "perfscope", verb, str(store)], capture_output=True, timeout=120, env=env
    )
    assert piped.returncode == 0, piped.stderr.decode()
    child = pexpect.spawn(
        sys.executable, ["-m", "perfscope", verb, str(store)], env=env, timeout=120, dimensions=(50, 200)
    )
    on_tty = child.read()
    child.close()
    assert child.exitstatus == 0, on_tty
    for out in (piped.stdout.decode(), on_tty.decode()):
        assert "nc\\x1b[31mcl\\x1b[2J\\x07\\u202elx" in out, out
        assert not any(c in out for c in "\x1b\x07\u202e"), out
