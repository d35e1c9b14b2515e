"""Stores at s3://: written by a real gloo job, read by info/analyze/report, against a real S3 server
(moto's standalone server on 127.0.0.1), with hostile keys, a SIGKILL mid-write and dead endpoints."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")

from collect_helpers import ddp_worker, free_port, results_ok, run_ranks  # noqa: E402
from pyarrow import fs  # noqa: E402

from perfscope.cli import main  # noqa: E402
from perfscope.errors import PerfscopeWarning, StoreError  # noqa: E402
from perfscope.store import objectstore  # noqa: E402
from perfscope.store.open import open_store  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def _start_moto(log: Path, extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server on a free port of 127.0.0.1; its request log goes to a file (a pipe nobody
    reads would fill and stall the server)."""
    env = dict(os.environ, **(extra_env or {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"Running on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"moto's server did not start: {log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = _start_moto(tmp_path_factory.mktemp("moto") / "server.log")
    try:
        yield url
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def s3env(endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of one test: credentials, endpoint, a cache folder of its own, a fresh bucket."""
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        objectstore.CACHE_ENV: str(tmp_path / "cache"),
        "BUCKET": f"b-{uuid.uuid4().hex[:12]}",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    client().create_bucket(Bucket=env["BUCKET"])
    return env


def client() -> Any:
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def download(url: str, dest: Path) -> Path:
    """The objects under `url`, copied with pyarrow alone (not through perfscope's mirror)."""
    loc = objectstore.parse_url(url)
    fs.copy_files(loc.base, str(dest), source_filesystem=objectstore.filesystem())
    return dest


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _analysis(capsys: pytest.CaptureFixture[str], store: str) -> dict[str, Any]:
    code, out, err = cli(capsys, "analyze", store, "--json")
    assert code == 0, err
    found = json.loads(out)
    found.pop("store")  # the folder read: the mirror's, or the copy's
    return found


def _numbers(store: Any) -> list[dict[str, Any]]:
    return store.query(
        "SELECT rank, count(*), min(step), max(step), median(step_ns), sum(step_ns) FROM steps "
        "GROUP BY rank ORDER BY rank"
    ).to_pylist()


def _same(a: object, b: object) -> bool:
    """Equal, floats within a relative 1e-9 (two readers may sum the same rows in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-9, abs=1e-12, nan_ok=True)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_gloo_job_writes_to_s3_and_every_reader_gets_the_local_numbers(
    s3env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3env['BUCKET']}/team/study"
    # forkserver children do not see this process's later environment changes: hand them over
    env = {k: v for k, v in s3env.items() if k != "BUCKET"}
    results = results_ok(run_ranks(ddp_worker, 2, url, {"steps": 8, "env": env}))
    assert results[0]["run_id"] == results[1]["run_id"]
    # every rank's staging folder was uploaded, then removed
    staging = tmp_path / "cache" / "s3-staging"
    assert not staging.exists() or not any(staging.iterdir())

    local = download(url, tmp_path / "copy")
    with open_store(url) as remote, open_store(local) as copy:
        assert remote.root != copy.root and str(remote.root).startswith(str(tmp_path / "cache" / "s3"))
        rows = _numbers(remote)
        assert [r["rank"] for r in rows] == [0, 1] and all(r["count_star()"] == 8 for r in rows)
        assert rows == _numbers(copy)
        assert remote.skipped == []
    remote_json, local_json = _analysis(capsys, url), _analysis(capsys, str(local))
    assert _same(remote_json, local_json), (remote_json, local_json)

    code, out, err = cli(capsys, "info", url, "--json")
    assert code == 0, err
    assert len(json.loads(out)["runs"]) == 1
    report = tmp_path / "study.html"
    code, _, err = cli(capsys, "report", url, "-o", str(report))
    assert code == 0, err
    assert report.stat().st_size > 10_000

    # a second read downloads nothing that did not change, and drops files whose objects are gone
    mirror = objectstore.mirror_dir(objectstore.parse_url(url))
    steps = sorted((mirror / "steps").rglob("*.parquet"))
    before = {p: p.stat().st_mtime_ns for p in mirror.rglob("*.parquet")}
    gone = steps[0].relative_to(mirror).as_posix()
    client().delete_object(Bucket=s3env["BUCKET"], Key=f"team/study/{gone}")
    with open_store(url) as again:
        assert not (mirror / gone).exists()
        assert {p: p.stat().st_mtime_ns for p in mirror.rglob("*.parquet")} == {
            p: t for p, t in before.items() if p != mirror / gone
        }
        assert again.row_count("steps") < sum(r["count_star()"] for r in rows)


KILL_JOB = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import perfscope
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
t = torch.ones(64)
with perfscope.profile(sys.argv[1], poll_hz=5, gpu_telemetry=False, batch_size=4) as prof:
    for i in prof.steps(range(10**9)):
        with prof.phase("forward"):
            time.sleep(0.01)
        with prof.phase("sync"):
            dist.all_reduce(t)
"""


def _step_objects(bucket: str) -> int:
    found = client().list_objects_v2(Bucket=bucket, Prefix="killed/steps/").get("Contents", [])
    return len(found)


def test_sigkill_during_a_write_leaves_a_store_with_no_partial_or_doubled_rows(
    s3env: dict[str, str], tmp_path: Path
) -> None:
    url = f"s3://{s3env['BUCKET']}/killed"
    script = tmp_path / "job.py"
    script.write_text(KILL_JOB)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        procs.append(subprocess.Popen([sys.executable, str(script), url], env=env))
    try:
        deadline = time.monotonic() + 240
        while _step_objects(s3env["BUCKET"]) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "the job ended before it was killed"
            time.sleep(0.5)
        assert _step_objects(s3env["BUCKET"]) >= 2, "the job uploaded no steps in time"
        # a few upload passes of growing live segments, then a moment inside a pass or a write
        time.sleep(random.uniform(5.0, 9.0))
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(30)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerfscopeWarning)  # no truncated or foreign object on S3
        store = open_store(url)
    with store:
        rows = store.query(
            "SELECT rank, count(*) AS n, count(DISTINCT step) AS distinct_steps, min(step) AS first, "
            "max(step) AS last, count(*) FILTER (WHERE step_ns IS NULL OR step_ns <= 0) AS broken "
            "FROM steps GROUP BY rank ORDER BY rank"
        ).to_pylist()
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["n"] == r["distinct_steps"], f"doubled rows: {r}"
        assert r["n"] > 0 and r["broken"] == 0
        assert r["last"] - r["first"] + 1 == r["n"], f"a hole in the steps: {r}"


def _upload_store(src: Path, bucket: str, prefix: str) -> int:
    n = 0
    for path in src.rglob("*.parquet"):
        client().upload_file(str(path), bucket, f"{prefix}/{path.relative_to(src).as_posix()}")
        n += 1
    return n


@pytest.fixture
def small_store(tmp_path: Path) -> Path:
    """One run of the bundled seed study: a real store of a few files."""
    import shutil

    import perfscope.sample_traces as sample_traces

    src = sample_traces.path(sample_traces.DEFAULT)
    run = sorted((src / "steps").iterdir())[0].name
    for part in src.glob(f"*/{run}"):
        shutil.copytree(part, tmp_path / "local" / part.parent.name / run)
    return tmp_path / "local"


def test_hostile_keys_never_leave_the_mirror_and_are_named(
    s3env: dict[str, str], small_store: Path, tmp_path: Path
) -> None:
    bucket = s3env["BUCKET"]
    n = _upload_store(small_store, bucket, "st")
    evil = [
        "st/../escaped.parquet",
        "st/steps/../../../escaped2.parquet",
        "st//absolute.parquet",
        "st/steps/run_id=x/.hidden.parquet",
        "st/a/b/c/d/too-deep.parquet",
        "st/steps/run_id=x/sp ace;rm.parquet",
    ]
    for key in evil:
        client().put_object(Bucket=bucket, Key=key, Body=b"PAR1 not really")
    url = f"s3://{bucket}/st"
    with pytest.warns(PerfscopeWarning, match=r"skipped 6 objects"):
        store = open_store(url)
    with store, open_store(small_store) as local:
        assert store.row_count("steps") == local.row_count("steps") > 0
    mirror = objectstore.mirror_dir(objectstore.parse_url(url))
    assert len(list(mirror.rglob("*.parquet"))) == n
    assert not list(tmp_path.rglob("escaped*")) and not list(tmp_path.rglob("absolute*"))
    assert not list(mirror.rglob("*too-deep*")) and not list(mirror.rglob(".hidden*"))
    for rel in ["a\x00b", "/etc/passwd", "x/../../y", "steps/run_id=1/" + "n" * 300]:
        assert objectstore.key_problem(rel)


def test_a_prefix_beyond_the_caps_is_one_line_and_the_flag_raises_them(
    s3env: dict[str, str],
    small_store: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = s3env["BUCKET"]
    _upload_store(small_store, bucket, "big")
    client().put_object(Bucket=bucket, Key="big/steps/run_id=x/huge.parquet", Body=b"\0" * 3_000_000)
    url = f"s3://{bucket}/big"
    monkeypatch.setenv(objectstore.MAX_BYTES_ENV, "2000000")
    code, out, err = cli(capsys, "info", url)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and objectstore.MAX_BYTES_ENV in err and "Traceback" not in err
    mirror = objectstore.mirror_dir(objectstore.parse_url(url))
    assert not list(mirror.rglob("*.parquet"))  # nothing was fetched
    monkeypatch.setenv(objectstore.MAX_OBJECTS_ENV, "3")
    monkeypatch.setenv(objectstore.MAX_BYTES_ENV, "10000000000")
    code, _, err = cli(capsys, "info", url)
    assert code == 2 and objectstore.MAX_OBJECTS_ENV in err and err.count("\n") == 1
    monkeypatch.setenv(objectstore.MAX_OBJECTS_ENV, "100000")
    code, out, err = cli(capsys, "info", url)
    assert code == 0, err
    assert "huge.parquet" in out  # not a Parquet file: skipped and named, never fatal


@pytest.mark.parametrize("what", ["dead endpoint", "missing bucket", "bad url", "empty prefix"])
def test_unreachable_or_wrong_stores_are_one_line(
    what: str, s3env: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3env['BUCKET']}/nothing-here"
    if what == "dead endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    elif what == "missing bucket":
        url = "s3://no-such-bucket-here/p"
    elif what == "bad url":
        url = "s3://Bad_Bucket/../p"
    for verb in ("info", "analyze", "report", "sql"):
        argv = [verb, url] + (["SELECT 1"] if verb == "sql" else [])
        code, _, err = cli(capsys, *argv)
        assert code == 2, (verb, err)
        assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
        assert f"perfscope {verb}: error:" in err


def test_wrong_credentials_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # this server checks signatures against its known access keys: ours is unknown to it
    proc, endpoint = _start_moto(tmp_path / "server.log", {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv(objectstore.CACHE_ENV, str(tmp_path / "cache"))
        code, _, err = cli(capsys, "info", "s3://some-bucket/p")
    finally:
        proc.kill()
        proc.wait(10)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "some-bucket" in err


def test_a_dead_endpoint_while_recording_is_one_warning_and_the_recording_is_kept(
    s3env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import perfscope

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    done = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with perfscope.profile(f"s3://{s3env['BUCKET']}/p", poll_hz=0, gpu_telemetry=False) as prof:
            for _ in prof.steps(range(30)):
                with prof.phase("forward"):
                    time.sleep(0.002)
                done += 1
    assert done == 30
    ours = [w for w in caught if issubclass(w.category, PerfscopeWarning) and "s3://" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    kept = list((tmp_path / "cache" / "s3-staging").iterdir())
    assert len(kept) == 1 and str(kept[0]) in str(ours[0].message)
    with open_store(kept[0]) as store:  # what could not be uploaded is a store of its own
        assert store.row_count("steps") == 30


def test_uploader_replaces_a_grown_file_and_deletes_a_removed_one_after_its_replacement(
    s3env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3env["BUCKET"]
    staging = tmp_path / "staging"
    part = staging / "steps" / "run_id=r1"
    part.mkdir(parents=True)
    said: list[tuple[str, str]] = []
    up = objectstore.Uploader(f"s3://{bucket}/up", staging, interval_s=3600, warn=lambda *kw: said.append(kw))
    (part / "a.arrows").write_bytes(b"x" * 10)
    (part / ".b.parquet.1234.tmp").write_bytes(b"temporary")
    (part / "odd name;.parquet").write_bytes(b"never a writer's name")
    assert up.sync_once()
    assert [kind for kind, _ in said] == ["s3_upload_skipped"] and "odd name;" in said[0][1]
    (part / "odd name;.parquet").unlink()

    def objects() -> dict[str, int]:
        got = client().list_objects_v2(Bucket=bucket, Prefix="up/").get("Contents", [])
        # pyarrow leaves an empty folder marker ("key/") where it deleted a folder's last object
        return {o["Key"]: o["Size"] for o in got if not o["Key"].endswith("/")}

    assert objects() == {"up/steps/run_id=r1/a.arrows": 10}
    with open(part / "a.arrows", "ab") as f:
        f.write(b"y" * 5)
    assert up.sync_once()
    assert objects() == {"up/steps/run_id=r1/a.arrows": 15}
    (part / "a.parquet").write_bytes(b"sealed")
    (part / "a.arrows").unlink()
    assert up.sync_once()
    assert objects() == {"up/steps/run_id=r1/a.parquet": 6}
    unicode_part = staging / "steps" / "run_id=étude-日本"  # a run id keeps letters of any script
    unicode_part.mkdir()
    (unicode_part / "c.parquet").write_bytes(b"c")
    up.close()
    assert not staging.exists()
    assert objects() == {"up/steps/run_id=r1/a.parquet": 6, "up/steps/run_id=étude-日本/c.parquet": 1}


def test_parse_url_and_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    loc = objectstore.parse_url("s3://my-bucket/a/b/")
    assert (loc.bucket, loc.prefix, loc.url, loc.base) == (
        "my-bucket",
        "a/b",
        "s3://my-bucket/a/b",
        "my-bucket/a/b",
    )
    assert objectstore.parse_url("S3://my-bucket").prefix == ""
    for bad in ("s3://x/p", "s3://my-bucket/../p", "s3://my-bucket/a/.hidden", "/local/path"):
        with pytest.raises(StoreError):
            objectstore.parse_url(bad)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://one:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://two:2")
    assert objectstore.endpoint_url() == "http://two:2"
    assert objectstore.mirror_dir(loc).parts[-4:] == ("two_2", "my-bucket", "a", "b")


def _dashboard(store: str) -> None:
    # AppTest runs this function's body as the script: it imports what it needs itself.
    from perfscope.dashboard.app import main

    main(store=store, page="overview")


def test_the_dashboard_opens_an_s3_store_and_switches_to_one(
    s3env: dict[str, str],
    small_store: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from perfscope.commands.dashboard import _store

    bucket = s3env["BUCKET"]
    _upload_store(small_store, bucket, "dash")
    url = f"s3://{bucket}/dash"
    with open_store(small_store) as local:
        steps = local.row_count("steps")
    # `perfscope dashboard s3://...` syncs first (a dead endpoint fails there, in one line) and hands
    # the app the mirror folder, which open_store reads as the store at `url`
    at = AppTest.from_function(_dashboard, args=(str(_store(url)),), default_timeout=120).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    shown = [c.value for c in at.sidebar.code]
    assert url in shown
    assert any(f"{steps:,} step rows" in c.value for c in at.sidebar.caption)

    # the sidebar's "Open another store" takes an s3:// address under an s3:// root (perfscope
    # dashboard --root s3://bucket); one outside it is one line
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_ROOT", f"s3://{bucket}")
    at = AppTest.from_function(_dashboard, args=(str(small_store),), default_timeout=120).run()
    at.sidebar.text_input(key="store_switch").input("s3://no-such-bucket-x/p").run()
    shown = [re.sub(r"\\(.)", r"\1", e.value) for e in at.sidebar.error]  # the Markdown, unescaped
    assert shown == [f"only stores under s3://{bucket} can be opened here"]
    at.sidebar.text_input(key="store_switch").input(url).run()
    assert not at.exception and not at.sidebar.error
    assert url in [c.value for c in at.sidebar.code]


def test_perfscope_run_records_an_unchanged_script_to_s3(
    s3env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_run_command import ACCUMULATING, BIN, _launch, _script

    script = _script(tmp_path, "accum.py", ACCUMULATING, UPDATES=4)
    url = f"s3://{s3env['BUCKET']}/runs"
    env = {k: v for k, v in s3env.items() if k != "BUCKET"}
    perfscope_run = [str(BIN / "perfscope"), "run", "--store", url, "--poll-hz", "0", "--"]
    out = _launch([*perfscope_run, sys.executable, script.name], tmp_path, **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "trained\n" and "warning" not in out.stderr.lower(), out.stderr
    assert f"next: perfscope analyze {url}" in out.stderr
    with open_store(url) as store:
        assert store.query("SELECT step FROM steps ORDER BY step").column("step").to_pylist() == [0, 1, 2, 3]
    bad = _launch([*perfscope_run[:3], "s3://Not_A_Bucket/x", "--", sys.executable, script.name], tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Not_A_Bucket" in bad.stderr
    assert bad.stdout == ""  # the command never ran


@pytest.mark.parametrize(
    "argv",
    [
        ["compact", "URL"],
        ["simulate", "URL"],
        ["demo", "URL"],
        ["import", "kineto", "--store", "URL", "trace.json"],
    ],
)
def test_commands_that_write_a_local_folder_refuse_s3_in_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.json").write_text("{}")
    code, out, err = cli(capsys, *[a.replace("URL", "s3://some-bucket/p") for a in argv])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "needs a local folder" in err and "aws s3 sync" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # no ./s3: folder made


def test_a_cache_folder_that_cannot_be_written_stages_in_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv(objectstore.CACHE_ENV, str(blocked))
    staging = objectstore.staging_dir(objectstore.parse_url("s3://some-bucket/p"))
    try:
        assert staging.is_dir() and not staging.is_relative_to(blocked)
    finally:
        staging.rmdir()


@pytest.mark.parametrize(
    "prefix, words",
    [
        ("aws_secret_access_key=SeCrEt", "looks like it holds a credential"),
        ("x/AKIAABCDEFGHIJKLMNOP/y", "looks like it holds a credential"),
        ("/".join(f"d{i}" for i in range(50)), "folders deep"),
        ("no-such-store/here", "holds no perfscope store files"),  # listed, and empty
    ],
)
def test_an_address_that_cannot_be_read_leaves_nothing_in_the_cache(
    prefix: str, words: str, s3env: dict[str, str], small_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Typed into the dashboard's "open another store" box (issue 25): one line, nothing written under
    the cache, and a secret is neither a folder name nor echoed back."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    cache = Path(s3env[objectstore.CACHE_ENV])
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_ROOT", f"s3://{s3env['BUCKET']}")
    at = AppTest.from_function(_dashboard, args=(str(small_store),), default_timeout=120).run()
    at.sidebar.text_input(key="store_switch").input(f"s3://{s3env['BUCKET']}/{prefix}").run()
    assert not at.exception
    errors = [re.sub(r"\\(.)", r"\1", e.value) for e in at.sidebar.error]  # the Markdown, unescaped
    assert len(errors) == 1 and words in errors[0] and "\n" not in errors[0], errors
    assert "SeCrEt" not in errors[0] and "AKIAABCDEFGHIJKLMNOP" not in errors[0]
    left = [str(p.relative_to(cache)) for p in cache.rglob("*")] if cache.exists() else []
    assert left == [], left
    with pytest.raises(StoreError):  # the CLI alike, before anything is made
        open_store(f"s3://{s3env['BUCKET']}/{prefix}")
    assert not cache.exists() or list(cache.rglob("*")) == []
