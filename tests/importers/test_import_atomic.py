"""An import is all or nothing (issue 22): its rows are staged where no reader looks and published in
one step at the end; a run id is claimed by one importer. Real files, real importer processes, real
signals: a failed import, a SIGTERM or a SIGKILL leaves nothing a reader sees (no `_rollups` either),
a re-import then works, and two imports of one run id at once give one run, whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perfscope.cli import main
from perfscope.importers.common import IMPORTS_DIR, Staging
from perfscope.store.compact import compact
from perfscope.store.open import open_store

START_US = 1_700_000_000_000_000
TENSORS = {"fc.weight": [256, 1024], "fc.bias": [1024], "conv1.weight": [64, 3, 7, 7]}

NCCL_HEADER = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 8(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#  Rank  0 Group  0 Pid  41001 on    node-a device  0 [0x07] NVIDIA A100-SXM4-80GB
#  Rank  1 Group  0 Pid  41002 on    node-b device  0 [0x07] NVIDIA A100-SXM4-80GB
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
"""  # noqa: E501 (the benchmark's own line width)


def nccl_log(rows: int, *, bad_root_at: int | None = None) -> str:
    lines = [NCCL_HEADER]
    for i in range(rows):
        root = "99999999999" if i == bad_root_at else "-1"
        size = 8 * (i + 1)
        lines.append(
            f"  {size}  {size // 4}  float  sum  {root}  31.20  0.00  0.00  0  30.85  0.00  0.00  0\n"
        )
    lines.append("# Avg bus bandwidth    : 16.2283\n")
    return "".join(lines)


def big_timeline(steps: int, ranks: int) -> str:
    """A Horovod timeline as horovod/common/timeline.cc writes it (see test_import_horovod), of
    `steps` steps of three negotiated and fused allreduces on `ranks` ranks."""
    ev: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": START_US}}
    ]
    pids = {t: i + 1 for i, t in enumerate(TENSORS)}
    ev += [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": t}} for t, p in pids.items()]
    for k in range(steps):
        t0 = k * 100_000
        for i, p in enumerate(pids.values()):
            r0 = t0 + 1000 * i
            ev.append({"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": r0, "pid": p})
            ev += [{"ph": "X", "name": str(r), "ts": r0 + 100 * r, "pid": p, "dur": 0} for r in range(ranks)]
            ev.append({"ph": "E", "ts": r0 + 100 * ranks, "pid": p})
        s = t0 + 8000
        ev += [{"ph": "B", "name": "ALLREDUCE", "ts": s, "pid": p} for p in pids.values()]
        ev += [{"ph": "B", "name": "NCCL_ALLREDUCE", "ts": s + 200, "pid": p} for p in pids.values()]
        ev += [{"ph": "E", "ts": s + 3200, "pid": p} for p in pids.values()]
        for t, shape in TENSORS.items():
            args = {"dtype": "float32", "shape": "[" + ", ".join(map(str, shape)) + "]"}
            ev.append({"ph": "E", "ts": s + 3400, "pid": pids[t], "args": args})
        ev.append({"ph": "i", "name": "CYCLE_START", "ts": s + 3500, "s": "g"})
    return "[\n" + ",\n".join(map(json.dumps, ev)) + "]"


def _cli(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "perfscope", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def _visible(store: Path) -> list[Path]:
    """What a reader of the store could see of any run: partition folders of tables and rollups."""
    return sorted(p for p in store.glob("*/run_id=*") if not p.parts[-2].startswith("."))


def _staged(store: Path) -> list[Path]:
    return sorted((store / IMPORTS_DIR).glob("*/steps/run_id=*/*"))


def _wait_for(cond, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the import ended before the signal: {proc.communicate()}"
        assert time.monotonic() < deadline, "nothing was staged in time"
        time.sleep(0.02)


def test_nccl_tests_bad_row_after_70000_good_ones_leaves_nothing(tmp_path, capsys):
    store = tmp_path / "s"
    log = tmp_path / "all_reduce_perf.txt"
    log.write_text(nccl_log(70_001, bad_root_at=70_000))
    assert main(["import", "nccl-tests", str(log), "--store", str(store), "--run-id", "ref"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "root" in err, err
    assert _visible(store) == []
    log.write_text(nccl_log(70_001))  # corrected: imports under the same id, whole
    assert main(["import", "nccl-tests", str(log), "--store", str(store), "--run-id", "ref"]) == 0
    with open_store(store) as st:
        assert st.query("SELECT count(*) AS n FROM reference_bw").to_pylist()[0]["n"] == 70_001
    assert not (store / IMPORTS_DIR).exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_nccl_tests_signal_while_writing_leaves_nothing(tmp_path, sig):
    """Killed while its rows are being written (the first 65,536 are on disk): none is seen."""
    store = tmp_path / "s"
    log = tmp_path / "all_reduce_perf.txt"
    log.write_text(nccl_log(400_000))
    proc = _cli("import", "nccl-tests", str(log), "--store", str(store), "--run-id", "ref")

    def seen() -> bool:
        return any(store.glob(".imports/*/reference_bw/run_id=*/*")) or any(store.glob("reference_bw/*/*"))

    _wait_for(seen, 120, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 128 + sig), err
    if sig == signal.SIGTERM:
        assert err.decode().strip() == "perfscope import: error: stopped by SIGTERM: nothing was imported"
        assert not (store / IMPORTS_DIR).exists()  # cleaned up on the way out
    assert _visible(store) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_horovod_signal_during_import_leaves_nothing_and_reimport_works(tmp_path, sig):
    store = tmp_path / "s"
    path = tmp_path / "timeline.json"
    path.write_text(big_timeline(3000, 8))
    proc = _cli("import", "horovod", str(path), "--store", str(store))
    _wait_for(lambda: bool(_staged(store)) or bool(_visible(store)), 120, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 128 + sig), err
    assert _visible(store) == [], "a killed import left rows a reader sees"
    # the same file again (same default run id): not "imported before", and whole
    again = _cli("import", "horovod", str(path), "--store", str(store))
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "8 ranks, 24000 steps" in out.decode()
    with open_store(store) as st:
        assert st.query("SELECT count(*) AS n FROM steps").to_pylist()[0]["n"] == 24_000
        assert st.query("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"] == 1
    # what the killed importer staged is gone, and so is every claim
    assert not (store / IMPORTS_DIR).exists()


def test_two_imports_of_one_run_id_at_once_one_wins_whole(tmp_path):
    store = tmp_path / "s"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(big_timeline(1500, 4))  # 6,000 step rows
    b.write_text(big_timeline(1000, 4))  # 4,000
    procs = [_cli("import", "horovod", str(p), "--store", str(store), "--run-id", "same") for p in (a, b)]
    done = [(p.returncode, *p.communicate(timeout=300)) for p in procs]
    done = [(p.returncode, out.decode(), err.decode()) for p, (_, out, err) in zip(procs, done, strict=True)]
    won = [d for d in done if d[0] == 0]
    lost = [d for d in done if d[0] != 0]
    assert len(won) == 1 and len(lost) == 1, done
    rc, _, err = lost[0]
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "another import of run same" in err or "imported before" in err, err
    steps = 6000 if "6000 steps" in won[0][1] else 4000
    assert f"{steps} steps" in won[0][1]
    with open_store(store) as st:
        assert st.query("SELECT count(*) AS n FROM steps").to_pylist()[0]["n"] == steps
        assert st.query("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"] == 1
    assert not (store / IMPORTS_DIR).exists()


def test_a_run_id_is_claimed_once(tmp_path, capsys):
    """While one importer holds a run id, another is refused in one line and deletes nothing."""
    store = tmp_path / "s"
    store.mkdir()
    first = Staging(store, "same")
    try:
        path = tmp_path / "t.json"
        path.write_text(big_timeline(20, 2))
        assert main(["import", "horovod", str(path), "--store", str(store), "--run-id", "same"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"perfscope import: error: another import of run same into {store} is running; " + (
            "wait for it, or give another --run-id"
        )
        assert first.path.is_dir()  # the holder's staging is untouched
    finally:
        first.discard()
    assert main(["import", "horovod", str(path), "--store", str(store), "--run-id", "same"]) == 0


def test_a_killed_importer_caught_publishing_is_rolled_back(tmp_path, capsys):
    """SIGKILL between two renames of the publish: the partitions already renamed go too, at the next
    import into the store (a reader may have seen them for that moment, never after)."""
    store = tmp_path / "s"
    path = tmp_path / "t.json"
    path.write_text(big_timeline(20, 2))
    script = (
        "import os, sys\n"
        "from perfscope.importers import common\n"
        "real = os.rename\n"
        "def rename(src, dst):\n"
        "    real(src, dst)\n"
        "    if '/steps/' in str(dst): os.kill(os.getpid(), 9)\n"
        "common.os.rename = rename\n"
        "from perfscope.cli import main\n"
        f"main(['import', 'horovod', {str(path)!r}, '--store', {str(store)!r}, '--run-id', 'r'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert (store / "steps" / "run_id=r").is_dir()  # caught between its renames
    other = tmp_path / "u.json"
    other.write_text(big_timeline(10, 2))
    assert main(["import", "horovod", str(other), "--store", str(store), "--run-id", "other"]) == 0
    assert [p.parent.name for p in _visible(store) if p.name == "run_id=r"] == []
    assert main(["import", "horovod", str(path), "--store", str(store), "--run-id", "r"]) == 0
    with open_store(store) as st:
        rows = st.query("SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id").to_pylist()
    assert rows == [{"run_id": "other", "n": 20}, {"run_id": "r", "n": 40}]


def test_compact_removes_what_a_killed_importer_staged(tmp_path: Path) -> None:
    store = tmp_path / "s"
    path = tmp_path / "timeline.json"
    path.write_text(big_timeline(20, 2))
    assert main(["import", "horovod", str(path), "--store", str(store), "--run-id", "kept"]) == 0
    (tmp_path / "big.json").write_text(big_timeline(3000, 8))
    proc = _cli("import", "horovod", str(tmp_path / "big.json"), "--store", str(store))
    _wait_for(lambda: bool(_staged(store)), 120, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert _staged(store)
    compact(store, grace_s=0)
    assert not (store / IMPORTS_DIR).exists()
    with open_store(store) as st:
        assert st.query("SELECT count(*) AS n FROM steps").to_pylist()[0]["n"] == 40
