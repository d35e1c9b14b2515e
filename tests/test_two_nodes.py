"""Two nodes for real (issue 24): a gloo DDP job launched with `perfscope run -- torchrun` on two
namespaced nodes (tests/nodes.py: own network, hostname and, on node b, a monotonic clock an hour
ahead), joined by a 100 Mbit/s link, recording into one shared store folder: N=1, N=2 on one node and
N=2 with one rank on each node, the study a team makes when the second node disappoints."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from nodes import BIN, Nodes, job_script, record, unavailable

from perfscope.store import open_store
from perfscope.writer import host_tag

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "nodes available")

TIMEOUT_S = 300
STEPS = 24
#: what the link carries each way: tbf at 100 Mbit/s
LINK_BYTES_PER_S = 100e6 / 8


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
    assert "communication-bound" in [s["rule"] for s in knee["symptoms"]]
    # the scaling table shows each placement, and says N=2 ran in two
    text = subprocess.run(
        [str(BIN / "perfscope"), "analyze", str(study)], capture_output=True, text=True, check=True
    ).stdout
    assert "ranks/node" in text and "N=2 ran in 2 placements" in text
