"""Advice for the hardware, backend and topology in the store (explain/hardware.py): no GPU or NCCL
words for CPU runs, no NCCL advice for an MPI group, no across-nodes advice for a one-host job."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run, ring_transfer_ns

from perfscope import Store, open_store
from perfscope.explain import Evidence, Finding, explain
from perfscope.explain.root_causes import root_causes
from perfscope.sample_traces import bundled

pytestmark = pytest.mark.filterwarnings("error::perfscope.errors.PerfscopeWarning")

#: Words that belong to GPUs or to NCCL and its fabrics, never to a CPU run's findings.
GPU_WORDS = re.compile(r"GPU|NCCL|InfiniBand|NVLink|RoCE|nvml|CUDA|DALI", re.IGNORECASE)


def _said(f: Finding) -> list[str]:
    """Everything a finding shows a reader: title, text, advice and evidence labels, symptoms and
    repeats on other groups included."""
    out = []
    for g in f.flatten():
        out += [g.title, g.text, g.recommendation, *g.evidence.analyses, *map(str, g.numbers)]
    return out


def _all_said(findings: list[Finding]) -> str:
    return "\n".join(s for f in findings for s in _said(f))


@pytest.mark.parametrize("name", ["demo-cpu", "patterns-cpu"])
def test_a_cpu_store_speaks_of_cores_ranks_and_cpu_time(name: str) -> None:
    with open_store(bundled()[name]) as store:
        findings = explain(store)
    assert findings
    said = _all_said(findings)
    assert not GPU_WORDS.findall(said), GPU_WORDS.findall(said)[:5]
    if name == "demo-cpu":
        assert "CPU time lost per step" in said and "per rank" in said


@pytest.fixture(scope="module")
def gloo_one_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A gloo job of CPU ranks on one 8-core host: one small allreduce per step whose time is nearly
    all per-hop latency, and exposed sync that grows with N (communication-bound, latency-bound)."""
    root = tmp_path_factory.mktemp("gloo-one-host")
    for n in (1, 2, 3, 4, 6):
        make_run(
            root,
            f"n{n}",
            world_size=n,
            backend="gloo",
            device_model="cpu",
            device=False,
            cpu_count=8,
            gpus_per_node=8,
            phases={**DEFAULT_PHASES, "sync_exposed": 0 if n == 1 else 3 * MS * n},
            comm=None
            if n == 1
            else Comm([64 << 10], lambda nb, n=n: ring_transfer_ns(n, nb, 300e-6, 1 / 1e9)),
        )
    with open_store(root) as store:
        yield store


def test_a_gloo_job_on_one_host_gets_no_nccl_or_across_nodes_advice(gloo_one_host: Store) -> None:
    findings = explain(gloo_one_host)
    rules = {g.rule for f in findings for g in f.flatten()}
    assert {"communication-bound", "latency-bound"} <= rules
    said = _all_said(findings)
    assert not GPU_WORDS.findall(said), GPU_WORDS.findall(said)[:5]
    for word in ("NCCL_ALGO", "hierarchical", "across nodes", "HOROVOD"):
        assert word.lower() not in said.lower()
    latency = next(g for f in findings for g in f.flatten() if g.rule == "latency-bound")
    # one message per step: the advice for a CPU job on one host is fewer ranks, more threads each
    assert "fewer ranks with more threads each" in latency.recommendation
    comm = next(g for f in findings for g in f.flatten() if g.rule == "communication-bound")
    assert "of CPU time lost per step" in comm.text and "more work per step (a larger batch per rank)" in (
        comm.recommendation
    )


@pytest.fixture(scope="module")
def horovod_mpi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A Horovod-over-MPI group on GPU nodes of 4: a knee where the ranks start crossing nodes, and
    one run whose collectives are far slower than the others' fit predicts."""
    root = tmp_path_factory.mktemp("horovod-mpi")
    for n in (1, 2, 3, 4, 8, 12, 16):
        inside = n <= 4
        slow = 6.0 if n == 12 else 1.0
        make_run(
            root,
            f"n{n}",
            world_size=n,
            backend="horovod-mpi",
            gpus_per_node=4,
            phases={
                **DEFAULT_PHASES,
                "sync_exposed": 0 if n == 1 else (1 * MS if inside else 10 * MS * slow),
            },
            comm=None
            if n == 1
            else Comm(
                [4 << 20] * 2,
                lambda nb, n=n, i=inside, s=slow: (
                    s * ring_transfer_ns(n, nb, 2e-6 if i else 20e-6, 1 / (10e9 if i else 1e9))
                ),
            ),
        )
    with open_store(root) as store:
        yield store


def test_a_horovod_mpi_group_is_never_told_to_check_nccl(horovod_mpi: Store) -> None:
    findings = explain(horovod_mpi)
    flat = [g for f in findings for g in f.flatten()]
    rules = {g.rule for g in flat}
    assert "node-boundary-knee" in rules and "network-under-delivering" in rules
    said = _all_said(findings)
    assert "nccl" not in said.lower()
    knee = next(g for g in flat if g.rule == "node-boundary-knee")
    assert "MPI library" in knee.recommendation and "HOROVOD_HIERARCHICAL_ALLREDUCE=1" in knee.recommendation
    slow = next(g for g in flat if g.rule == "network-under-delivering")
    assert "ompi_info" in slow.recommendation and "bad node" in slow.text


def test_an_nccl_group_across_nodes_keeps_its_nccl_advice(tmp_path: Path) -> None:
    for n in (1, 2, 4, 8, 12):
        inside = n <= 4
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            backend="nccl",
            gpus_per_node=4,
            phases={**DEFAULT_PHASES, "sync_exposed": 0 if n == 1 else (1 * MS if inside else 10 * MS)},
        )
    with open_store(tmp_path) as store:
        flat = [g for f in explain(store) for g in f.flatten()]
    knee = next(g for g in flat if g.rule == "node-boundary-knee")
    assert "NCCL uses InfiniBand/RoCE" in knee.recommendation
    assert "gloo" not in knee.recommendation and "HOROVOD" not in knee.recommendation


def test_a_rule_collapsed_across_groups_keeps_each_groups_own_advice() -> None:
    def found(group: str, advice: str, share: float) -> Finding:
        return Finding(
            id=f"node-boundary-knee:{group}",
            rule="node-boundary-knee",
            severity="alarm",
            category="cause",
            title="Knee at the node boundary",
            text="A knee.",
            evidence=Evidence((group,), ("scaling",)),
            recommendation=advice,
            confidence=0.8,
            explained_loss=share,
            group_id=group,
        )

    mpi, nccl = "exp/c1/horovod-mpi/m/weak:b8", "exp/c1/horovod-nccl/m/weak:b8"
    (one,) = root_causes([found(mpi, "Check the MPI transport.", 0.5), found(nccl, "Check NCCL_DEBUG.", 0.4)])
    assert (
        one.recommendation == "For horovod-mpi: Check the MPI transport. For horovod-nccl: Check NCCL_DEBUG."
    )
    (same,) = root_causes([found(mpi, "Fill whole nodes.", 0.5), found(nccl, "Fill whole nodes.", 0.4)])
    assert same.recommendation == "Fill whole nodes."
