"""Two nodes for real (issue 24): a gloo DDP job launched with `perfscope run -- torchrun` on two
namespaced nodes (tests/nodes.py: own network, hostname and, on node b, a monotonic clock an hour
ahead), joined by a 100 Mbit/s link, recording into one shared store folder: N=1, N=2 on one node and
N=2 with one rank on each node, the study a team makes when the second node disappoints. And a job of
hand-written allreduces of 16 KB to 4 MB across the link, for the inter-node alpha-beta fit. And the
DDP job with two ranks on each node recording into an S3 store served from node a (moto), read back
there."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from nodes import (
    ALLREDUCE_BYTES,
    BIN,
    S3_TEST_ENV,
    Node,
    Nodes,
    allreduce_script,
    job_script,
    on_node,
    record,
    s3_server,
    unavailable,
)

from perfscope.analysis import run_analysis
from perfscope.store.open import open_store
from perfscope.store.rollups import ROLLUP_DIR, rollup_index
from perfscope.store.writer import host_tag

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "nodes available")

TIMEOUT_S = 300
STEPS = 24
#: what the link carries each way: tbf at 100 Mbit/s
LINK_BYTES_PER_S = 100e6 / 8
#: the shaper's bucket for the allreduce job: two full-size packets
LINK_BURST = "3kb"
#: steps of the allreduce job: 10 warm-up steps dropped, 10 steady ones (one allreduce of each size a step)
ALLREDUCE_STEPS = 20
#: the fit's bandwidth against the job's own clock for its largest message: they agreed within 1.5% in
#: eight runs here at load 6-14 (the same transfers, timed two ways)
OWN_CLOCK_TOLERANCE = 0.15
#: the most a clock exchange over the link may claim as its error on a loaded 2-core machine: measured
#: 40-60 us here at load 6 (half a TCPStore barrier's round trip across the veth pair)
MAX_CLOCK_ERROR_NS = 50_000_000


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("two-nodes")
    script = job_script(tmp, STEPS)
    store = tmp / "S"
    with Nodes(2, rate="100mbit", offsets=(0, 3600)) as (a, b):
        record(store, script, [(a, 1)], "n1", TIMEOUT_S)
        record(store, script, [(a, 2)], "n2-one-node", TIMEOUT_S)
        record(store, script, [(a, 1), (b, 1)], "n2-two-nodes", TIMEOUT_S)
    return store


@pytest.fixture(scope="module")
def allreduce_sizes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The allreduce job with one rank on each node: its store and each rank's own timings."""
    tmp = tmp_path_factory.mktemp("allreduce-sizes")
    store = tmp / "S"
    script = allreduce_script(tmp, store, ALLREDUCE_STEPS)
    # a burst of two packets, as a wire has: tbf's default 64 KB of credit lets a message after an idle
    # gap pass at memory speed, which a fit reads as negative latency
    with Nodes(2, rate="100mbit", offsets=(0, 3600), burst=LINK_BURST) as (a, b):
        record(None, script, [(a, 1), (b, 1)], "sizes", TIMEOUT_S)
    return store, [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_job_across_two_nodes_is_one_run_on_two_hosts_with_aligned_clocks(study: Path) -> None:
    with open_store(study) as s:
        runs = s.query("SELECT run_id, world_size FROM runs WHERE nodes = 2").to_pylist()
        assert len(runs) == 1 and runs[0]["world_size"] == 2
        run = runs[0]["run_id"]
        ranks = s.query(f"SELECT rank, hostname FROM ranks WHERE run_id = '{run}' ORDER BY rank").to_pylist()
        sampled = s.query(f"SELECT DISTINCT hostname FROM host_samples WHERE run_id = '{run}' ORDER BY 1")
        # the same step starts on both nodes within a few ms in a synchronous job (node b's monotonic
        # clock is an hour ahead: only the wall clock and the measured offset may place its steps)
        skew = s.query(
            "SELECT median(abs(a.start_ns - b.start_ns)) AS mid FROM steps a JOIN steps b "
            "ON a.run_id = b.run_id AND a.step = b.step AND a.rank = 0 AND b.rank = 1 "
            f"WHERE a.run_id = '{run}' AND a.step > 2"
        ).to_pylist()[0]
    assert [r["hostname"] for r in ranks] == ["nodea", "nodeb"]
    assert sampled.column(0).to_pylist() == ["nodea", "nodeb"]  # one poller per host, on its own node
    assert skew["mid"] < 20e6, skew
    # each host's writers leave their own files, named by the host's tag, merged per host at close
    tags = {host_tag("nodea"), host_tag("nodeb")}
    for table in ("steps", "host_samples"):
        names = [f.name for f in (study / table / f"run_id={run}").glob("*.parquet")]
        by_host = {t: [n for n in names if n.startswith((f"{t}-", f"c-{t}-"))] for t in tags}
        assert all(len(files) == 1 for files in by_host.values()), names
        assert sorted(n for files in by_host.values() for n in files) == sorted(names)


def test_the_node_boundary_is_the_first_cause_with_the_measured_link(study: Path) -> None:
    """N=2 across two nodes against N=2 on one: the node boundary is named first (a measurement caveat
    such as other processes' CPU may come before it, never another cause), with the inter-node bus
    bandwidth the collectives measured, within 30% of what the link carries; no straggler is blamed for it
    (on a loaded machine a straggler verdict may stand, with the contention caveat)."""
    out = subprocess.run(
        [str(BIN / "perfscope"), "analyze", str(study), "--json"], capture_output=True, text=True, check=True
    )
    findings = json.loads(out.stdout)["findings"]
    causes = [f for f in findings if f["category"] == "cause"]
    knees = [f for f in causes if f["rule"] == "node-boundary-knee"]
    assert knees, [f["title"] for f in findings]
    knee = knees[0]
    # first: on a quiet machine nothing comes before it; on a loaded one (other processes took CPU, as
    # under CI's neighbours) a timing verdict may, but only with the contention caveat that DESIGN
    # says comes before any straggler verdict: never blamed outright
    for f in causes[: causes.index(knee)]:
        assert "other processes took CPU" in f["text"], f["title"]
    assert knee["numbers"]["same_world_size"] == 1
    busbw = knee["numbers"]["busbw_inter_gb_per_s"] * 1e9
    assert 0.7 * LINK_BYTES_PER_S < busbw < 1.3 * LINK_BYTES_PER_S, busbw
    assert knee["numbers"]["busbw_intra_gb_per_s"] > 3 * knee["numbers"]["busbw_inter_gb_per_s"]
    # the exposed sync that grew with the boundary is its symptom, as communication-bound or, when the
    # loaded machine's steps leave it under that rule's threshold, as sync that did not overlap compute
    # (CI at load 9: overlap-failure alone)
    symptoms = {s["rule"] for s in knee["symptoms"]}
    assert {"communication-bound", "overlap-failure"} & symptoms, symptoms
    # the scaling table shows each placement, and says N=2 ran in two
    text = subprocess.run(
        [str(BIN / "perfscope"), "analyze", str(study)], capture_output=True, text=True, check=True
    ).stdout
    assert "ranks/node" in text and "N=2 ran in 2 placements" in text


def test_each_rank_records_its_clock_offset_and_its_error(study: Path) -> None:
    """Node b's monotonic clock is an hour ahead, its wall clock the machine's: the true offset of its
    rank to rank 0's clock is 0, and the recorded offset misses it by no more than the recorded error.
    Ranks on rank 0's node share its clock: exactly 0 and 0."""
    with open_store(study) as s:
        rows = s.query(
            "SELECT r.nodes, k.rank, k.hostname, k.clock_offset_ns, k.clock_error_ns FROM ranks k "
            "JOIN runs r USING (run_id) ORDER BY r.nodes, k.run_id, k.rank"
        ).to_pylist()
    assert len(rows) == 5, rows  # N=1, N=2 on node a, N=2 across both
    for row in rows:
        if row["hostname"] == "nodea":
            assert (row["clock_offset_ns"], row["clock_error_ns"]) == (0, 0), row
    (b,) = [row for row in rows if row["hostname"] == "nodeb"]
    assert b["nodes"] == 2 and 0 < b["clock_error_ns"] < MAX_CLOCK_ERROR_NS, b
    assert abs(b["clock_offset_ns"]) <= b["clock_error_ns"], b


def test_the_inter_node_alpha_beta_fit_agrees_with_the_link_and_the_jobs_own_clock(
    allreduce_sizes: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Allreduces of 16 KB to 4 MB across the 100 Mbit/s link: perfscope's inter-node fit gives a
    bandwidth within 30% of what the link carries and within 15% of what the job's own clock measured
    for its largest message (busbw = bytes·2(p−1)/p over the median time), and a positive latency α
    no larger than what the smallest message took per ring hop."""
    store, own = allreduce_sizes
    with open_store(store) as s:
        fits = [r for r in run_analysis("allreduce_fit", s).to_pylist() if r["scope"] == "inter-node"]
    assert len(fits) == 1, fits
    fit = fits[0]
    assert fit["points"] == len(ALLREDUCE_BYTES) and fit["world_sizes"] == "2" and not fit["too_few_points"]
    fitted = fit["bandwidth_gb_per_s"] * 1e9
    p = own[0]["world_size"]
    # the collective ends when its last rank does: the slower rank's median
    seconds = max(statistics.median(r["own_ns"][10:]) for r in own) / 1e9
    measured = own[0]["bytes"] * 2 * (p - 1) / p / seconds
    assert 0.7 * LINK_BYTES_PER_S < measured < 1.3 * LINK_BYTES_PER_S, measured
    assert 0.7 * LINK_BYTES_PER_S < fitted < 1.3 * LINK_BYTES_PER_S, fitted
    assert fitted == pytest.approx(measured, rel=OWN_CLOCK_TOLERANCE), (fitted, measured)
    # α is the intercept of a line the 4 MB point dominates: on this shared machine it came out 44-754 µs
    # over runs, and 0 (clamped) once in CI at load 9; β, the link, is what the issue checks against it
    assert fit["alpha_s"] is None or 0 <= fit["alpha_s"] <= fit["alpha_ceiling_s"], fit


#: steps of the DDP job on the S3 store
S3_STEPS = 12
S3_BUCKET = "two-nodes"
S3_URL = f"s3://{S3_BUCKET}/team/study"

MAKE_BUCKET = """
import os, sys
import boto3
boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=sys.argv[1])
"""

#: run on node a, the only place the server can be reached from: every object under the prefix copied
#: as it is (pyarrow alone, keys kept as file names), then the store read through perfscope's own S3
#: reader: its steps per rank
READ_BACK = """
import json, sys
from pyarrow import fs
import perfscope
from perfscope.store import objectstore
url, dest = sys.argv[1:]
fs.copy_files(objectstore.parse_url(url).base, dest, source_filesystem=objectstore.filesystem())
with perfscope.open_store(url) as s:
    rows = s.query("SELECT rank, count(DISTINCT step) AS n FROM steps GROUP BY rank ORDER BY rank")
    print(json.dumps(rows.to_pylist()))
"""


@pytest.fixture(scope="module")
def s3_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], dict[str, Path]]:
    """The DDP job with two ranks on each node, `perfscope run --store s3://...` on both, the S3 server
    on node a: the objects as they are on S3, the steps per rank perfscope read from there, and each
    node's cache folder (where its processes stage what they upload)."""
    pytest.importorskip("moto")
    tmp = tmp_path_factory.mktemp("two-nodes-s3")
    script = job_script(tmp, S3_STEPS)
    caches: dict[str, Path] = {}
    # no shaping: what is checked here is where the files go, not the link's rate
    with Nodes(2, rate=None, offsets=(0, 3600)) as (a, b), s3_server(a, tmp / "moto.log") as endpoint:

        def env(node: Node) -> Mapping[str, str]:
            # each node its own cache, as hosts have: its processes' staging folders and its mirrors
            caches[node.hostname] = tmp / f"cache-{node.hostname}"
            return {
                **S3_TEST_ENV,
                "AWS_ENDPOINT_URL": endpoint,
                "PERFSCOPE_CACHE_DIR": str(caches[node.hostname]),
            }

        on_node(a, [sys.executable, "-c", MAKE_BUCKET, S3_BUCKET], env=env(a))
        record(S3_URL, script, [(a, 2), (b, 2)], "on-s3", TIMEOUT_S, env=env)
        read = json.loads(
            on_node(a, [sys.executable, "-c", READ_BACK, S3_URL, str(tmp / "copy")], env=env(a))
        )
    return tmp / "copy", read, caches


def test_on_an_s3_store_each_host_leaves_its_own_objects_and_one_poller(
    s3_study: tuple[Path, list[dict[str, Any]], dict[str, Path]],
) -> None:
    copy, read, caches = s3_study
    # every process uploaded all it recorded, then removed its staging folder
    for cache in caches.values():
        staging = cache / "s3-staging"
        assert not staging.exists() or not any(staging.iterdir()), list(staging.iterdir())
    # perfscope's S3 reader on node a: all steps of all four ranks
    assert read == [{"rank": r, "n": S3_STEPS} for r in range(4)], read
    with open_store(copy) as s:
        runs = s.query("SELECT run_id, world_size, nodes FROM runs").to_pylist()
        assert len(runs) == 1 and runs[0]["world_size"] == 4 and runs[0]["nodes"] == 2, runs
        run = runs[0]["run_id"]
        host_of = {r["rank"]: r["hostname"] for r in s.query("SELECT rank, hostname FROM ranks").to_pylist()}
        steps = s.query("SELECT rank, count(*) AS n, count(DISTINCT step) AS d FROM steps GROUP BY rank")
        clocks = s.query("SELECT rank, clock_offset_ns, clock_error_ns FROM ranks").to_pylist()
        first_b = min(r for r, h in host_of.items() if h == "nodeb")
        skew = s.query(
            "SELECT median(abs(a.start_ns - b.start_ns)) AS mid FROM steps a JOIN steps b "
            f"ON a.step = b.step AND a.rank = 0 AND b.rank = {first_b} WHERE a.step > 2"
        ).to_pylist()[0]["mid"]
        usable = rollup_index(s)
    # a rollup on S3 covers the whole run, or there is none: never one process's rows, which every
    # process's upload would put at the same key in turn
    assert {p.name for p in (copy / ROLLUP_DIR).glob("run_id=*")} <= {f"run_id={r}" for r in usable}
    assert sorted(host_of.values()) == ["nodea", "nodea", "nodeb", "nodeb"] and host_of[0] == "nodea", host_of
    # no object replaced another: every step of every rank, once
    assert sorted((r["rank"], r["n"], r["d"]) for r in steps.to_pylist()) == [
        (r, S3_STEPS, S3_STEPS) for r in range(4)
    ]
    # node b's monotonic clock is an hour ahead: its steps still start with rank 0's
    assert skew < 20e6, skew
    for c in clocks:
        if host_of[c["rank"]] == "nodea":
            assert (c["clock_offset_ns"], c["clock_error_ns"]) == (0, 0), c
        else:
            assert (
                0 < c["clock_error_ns"] < MAX_CLOCK_ERROR_NS
                and abs(c["clock_offset_ns"]) <= c["clock_error_ns"]
            ), c

    tag = {h: host_tag(h) for h in ("nodea", "nodeb")}

    def objects(table: str) -> dict[str, list[set[Any]]]:
        """Per host, what each of its objects of `table` holds (ranks, or hostnames sampled)."""
        column = "rank" if table == "steps" else "hostname"
        found: dict[str, list[set[Any]]] = {h: [] for h in tag}
        for f in sorted((copy / table / f"run_id={run}").iterdir()):
            (host,) = [h for h, t in tag.items() if f.name.startswith((f"{t}-", f"c-{t}-"))] or [f.name]
            found.setdefault(host, []).append(set(pq.read_table(f, columns=[column]).column(0).to_pylist()))
        return found

    # each process uploads its own staging folder, merged at its close: one object per rank, named by
    # its host's tag, holding that rank's steps alone
    by_host = objects("steps")
    assert by_host.keys() == tag.keys(), by_host
    for host, held in by_host.items():
        assert sorted(held, key=min) == [{r} for r in sorted(host_of) if host_of[r] == host], (host, held)
    # one poller per host (local rank 0): one process's object of samples per host, of that host alone
    assert objects("host_samples") == {"nodea": [{"nodea"}], "nodeb": [{"nodeb"}]}
