"""Stores at s3:// against bad luck and hostile input (issue 22, "S3:"), on a real S3 server (moto's,
on 127.0.0.1): a key no path can hold, credentials in the endpoint's address, the staging folders of
SIGKILLed writers, and `perfscope run` when every upload fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from collect_helpers import free_port
from test_s3_store import _upload_store, client, endpoint, s3env, small_store

from perfscope.errors import PerfscopeWarning, StoreError
from perfscope.store import objectstore
from perfscope.store.open import open_store

#: test_s3_store's fixtures, used here by name: its moto server, a fresh bucket, a small real store
FIXTURES = (endpoint, s3env, small_store)

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: credentials typed into the endpoint's address: neither may appear in any message
USER, SECRET = "AKIDUSER77", "s3cr3tPassW0rd"


def _env(s3env: dict[str, str], **extra: str) -> dict[str, str]:
    """A child's environment: the test's S3 settings, perfscope importable, no inherited perfscope
    settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFSCOPE_")}
    env.update({k: v for k, v in s3env.items() if k != "BUCKET"})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# -- 1. a key no path can hold --------------------------------------------------------------------
def test_a_key_holding_a_nul_is_skipped_and_named_and_every_other_object_reads(
    s3env: dict[str, str], small_store: Path
) -> None:
    bucket = s3env["BUCKET"]
    n = _upload_store(small_store, bucket, "nul")
    # XML 1.0 cannot carry these: a listing that is not URL-encoded fails to parse as a whole
    for key in ("nul/steps/run_id=x/a\x00b.parquet", "nul/steps/run_id=x/bell\x07.parquet"):
        client().put_object(Bucket=bucket, Key=key, Body=b"PAR1 not really")
    url = f"s3://{bucket}/nul"
    with pytest.warns(PerfscopeWarning) as caught:
        store = open_store(url)
    said = [str(w.message) for w in caught if issubclass(w.category, PerfscopeWarning)]
    assert len(said) == 1, said
    assert "skipped 2 objects" in said[0] and "a\\x00b.parquet" in said[0] and "bell\\x07" in said[0]
    assert "\x00" not in said[0] and "\x07" not in said[0] and "\n" not in said[0]
    with store, open_store(small_store) as local:
        assert store.row_count("steps") == local.row_count("steps") > 0
    mirror = objectstore.mirror_dir(objectstore.parse_url(url))
    assert len(list(mirror.rglob("*.parquet"))) == n


def test_the_url_encoded_listing_is_signed_as_the_aws_sdk_signs() -> None:
    """The listing that carries such keys is signed by perfscope itself (pyarrow's SDK cannot ask for
    it): the same signature botocore makes, with and without a session token."""
    auth = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    query = "encoding-type=url&list-type=2&prefix=a%20b%2F%C3%A9%2Bx%2F"
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    for token in (None, "session-token"):
        request = AWSRequest(
            method="GET", url=f"http://127.0.0.1:9000/bkt?{query}", headers={"x-amz-content-sha256": empty}
        )
        auth.S3SigV4Auth(Credentials("AKID", "SECRET", token), "s3", "eu-west-1").add_auth(request)
        ours = objectstore._signed_headers(
            "127.0.0.1:9000",
            "/bkt",
            query,
            "eu-west-1",
            ("AKID", "SECRET", token),
            request.headers["X-Amz-Date"],
        )
        assert ours["authorization"] == request.headers["Authorization"]


# -- 2. credentials in the endpoint's address -----------------------------------------------------
def _no_secret(text: str) -> None:
    assert USER not in text and SECRET not in text and "tok3nValue" not in text, text


@pytest.mark.parametrize("what", ["dead endpoint", "missing bucket", "address with a user"])
def test_credentials_in_the_endpoint_are_never_printed_by_info(
    what: str, s3env: dict[str, str], endpoint: str, tmp_path: Path
) -> None:
    port = endpoint.rsplit(":", 1)[1] if what != "dead endpoint" else str(free_port())
    with_user = f"http://{USER}:{SECRET}@127.0.0.1:{port}/?X-Amz-Security-Token=tok3nValue"
    url = {
        "dead endpoint": f"s3://{s3env['BUCKET']}/p",
        "missing bucket": "s3://no-such-bucket-here/p",
        "address with a user": f"s3://{USER}:{SECRET}@{s3env['BUCKET']}/p",
    }[what]
    out = subprocess.run(
        [str(BIN / "perfscope"), "info", url],
        env=_env(s3env, AWS_ENDPOINT_URL=with_user),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    _no_secret(out.stderr)
    if what == "dead endpoint":
        assert "***@127.0.0.1" in out.stderr  # the endpoint is still named, its user info masked
    # nor is a folder of the cache named after them
    cache = Path(s3env[objectstore.CACHE_ENV])
    _no_secret(" ".join(str(p) for p in cache.rglob("*")) if cache.exists() else "")


def test_redact_masks_user_info_and_query_strings_and_the_endpoint_user_info_anywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"https://{USER}:{SECRET}@minio.example:9000")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    text = objectstore.redact(
        f"cannot reach https://{USER}:{SECRET}@minio.example:9000/b?X-Amz-Signature=abc def; "
        f"host {USER}:{SECRET}@minio.example said no; user {USER}"
    )
    _no_secret(text)
    assert "abc" not in text and "minio.example:9000" in text
    assert objectstore.shown_endpoint() == "https://***@minio.example:9000"
    # the SDK is never handed the user info as part of a host name
    assert objectstore.filesystem().__reduce__()[1][0]["endpoint_override"] == "minio.example:9000"
    with pytest.raises(StoreError) as refused:
        objectstore.parse_url(f"s3://{USER}:{SECRET}@bucket/p")
    _no_secret(str(refused.value))


# -- 3. the staging folders of SIGKILLed writers ---------------------------------------------------
WRITER = """
import os, sys, time
from pathlib import Path
from perfscope.store import objectstore
import perfscope
if sys.argv[3] == "never":  # a writer killed before its first upload pass
    objectstore.UPLOAD_INTERVAL_S = 3600.0
with perfscope.profile(sys.argv[1], poll_hz=0, gpu_telemetry=False, batch_size=2) as prof:
    for i in prof.steps(range(10**9)):
        with prof.phase("forward"):
            time.sleep(0.005)
        if i == 40:
            prof.flush()
            Path(sys.argv[2]).write_text(str(prof._uploader.staging))
"""


def _writer(
    script: Path, url: str, marker: Path, upload: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(script), url, str(marker), upload], env=env)


def _staging_of(proc: subprocess.Popen[bytes], marker: Path) -> Path:
    deadline = time.monotonic() + 180
    while not marker.exists() or not marker.read_text():
        assert proc.poll() is None, "the writer ended before it recorded"
        assert time.monotonic() < deadline, "the writer recorded nothing in time"
        time.sleep(0.2)
    return Path(marker.read_text())


def _files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _uploadable(folder: Path) -> list[str]:
    """The store files of a staging folder an upload sends (not hidden, not temporary, not the one
    process's rollups, which are never uploaded), relative to it."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and p.relative_to(folder).parts[0] != "_rollups"
        and not p.name.endswith(".tmp")
    )


def _run_id(folder: Path) -> str:
    return next((folder / "steps").iterdir()).name.removeprefix("run_id=")


def test_a_killed_writers_staging_folder_is_uploaded_and_removed_and_a_live_ones_is_untouched(
    s3env: dict[str, str], tmp_path: Path
) -> None:
    import perfscope

    bucket = s3env["BUCKET"]
    url = f"s3://{bucket}/kill"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = _env(s3env)
    # A: killed before it uploaded anything; B: killed after (here: its files are put on S3 by hand,
    # marked, so a second upload would show); L: alive throughout
    procs = {name: _writer(script, url, tmp_path / f"{name}.txt", "never", env) for name in "ABL"}
    try:
        staging = {name: _staging_of(p, tmp_path / f"{name}.txt") for name, p in procs.items()}
        for name in "AB":
            procs[name].send_signal(signal.SIGKILL)
            procs[name].wait(30)
        assert client().list_objects_v2(Bucket=bucket, Prefix="kill/").get("KeyCount", 0) == 0
        with open_store(staging["A"]) as a:
            rows_a = a.query("SELECT count(*) AS n, max(step) AS last FROM steps").to_pylist()[0]
        assert rows_a["n"] >= 40
        on_s3_b = {}
        for rel in _uploadable(staging["B"]):
            key = f"kill/{rel}"
            client().upload_file(
                str(staging["B"] / rel), bucket, key, ExtraArgs={"Metadata": {"by-hand": "yes"}}
            )
            on_s3_b[key] = client().head_object(Bucket=bucket, Key=key)["ETag"]
        run_ids = {name: _run_id(folder) for name, folder in staging.items()}
        live_before = _files(staging["L"])

        # a writer that starts (and ends): it cleans up A and B before its first upload pass
        with perfscope.profile(url, poll_hz=0, gpu_telemetry=False, batch_size=2) as prof:
            for _ in prof.steps(range(5)):
                with prof.phase("forward"):
                    time.sleep(0.002)

        assert not staging["A"].exists() and not staging["B"].exists()
        after = _files(staging["L"])  # its owner record and lock files included
        assert set(live_before) <= set(after), "a live writer's file was removed"
        for key, etag in on_s3_b.items():  # already there: not sent again
            head = client().head_object(Bucket=bucket, Key=key)
            assert head["ETag"] == etag and head["Metadata"] == {"by-hand": "yes"}
        with open_store(url) as store:
            got = store.query(
                f"SELECT count(*) AS n, max(step) AS last FROM steps WHERE run_id = '{run_ids['A']}'"
            ).to_pylist()[0]
            assert got == rows_a  # every row the killed writer wrote, read from S3
            runs = store.query("SELECT DISTINCT run_id FROM steps").column("run_id").to_pylist()
        assert run_ids["B"] in runs and run_ids["L"] not in runs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(30)


def test_an_owner_is_dead_only_when_its_pid_is_gone_or_a_later_process_has_it() -> None:
    import socket

    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": objectstore._process_start(os.getpid()),
    }
    assert me["started"] and not objectstore._owner_dead(me)
    assert objectstore._owner_dead({**me, "started": "another-boot:12345"})  # the pid reused
    assert not objectstore._owner_dead({**me, "host": "another-host", "started": "x"})  # not ours to judge
    assert not objectstore._owner_dead({**me, "started": None})  # in doubt: alive
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(30)
    assert objectstore._owner_dead({**me, "pid": ended.pid})


# -- 4. `perfscope run` when every upload fails ---------------------------------------------------
JOB = """
import sys
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for i in range(6):
    loss = model(torch.randn(5, 16)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
sys.exit(3)
"""


def test_perfscope_run_says_when_the_upload_failed_and_keeps_the_jobs_status(
    s3env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    dead = f"http://{USER}:{SECRET}@127.0.0.1:{free_port()}"
    url = f"s3://{s3env['BUCKET']}/runs"
    out = subprocess.run(
        [str(BIN / "perfscope"), "run", "--store", url, "--poll-hz", "0", "--", sys.executable, "job.py"],
        env={k: v for k, v in _env(s3env, AWS_ENDPOINT_URL=dead).items() if k != "PYTHONUNBUFFERED"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 3, out.stderr  # the job's own status, not a failure of perfscope's
    assert out.stdout == "trained\n"
    _no_secret(out.stderr)
    assert "recorded into" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"perfscope run: the recording did not all reach {url}"), out.stderr
    kept = [p for p in (Path(s3env[objectstore.CACHE_ENV]) / "s3-staging").iterdir()]
    assert len(kept) == 1 and str(kept[0]) in last
    files = _uploadable(kept[0])
    assert f"{len(files)} file" in last and len(files) > 0
    with open_store(kept[0]) as store:  # the local copy is the whole recording
        assert store.row_count("steps") == 6
