"""Threads and cores as recorded facts: each rank's torch threads, OMP/MKL settings and affinity in
`ranks`; the `threads` analysis; and the threads confound stated before any timing verdict."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from collect_helpers import ddp_worker, results_ok, run_ranks
from storegen import MS, make_run

from perfscope.analysis import run_analysis
from perfscope.explain import Finding, explain
from perfscope.store.open import open_store

CPU = {"device": False, "device_model": "cpu", "backend": "gloo", "cpu_count": 2, "gpus_per_node": 2}


def _cpu_pair(root: Path, *, threads: tuple[int, int], cores: tuple[int, int] = (2, 2)) -> None:
    """N=1 and N=2 on one 2-core host; N=2 communicates a little, so timing rules have a verdict."""
    make_run(root, "n1", world_size=1, torch_threads=threads[0], affinity_cores=cores[0], **CPU)
    make_run(
        root,
        "n2",
        world_size=2,
        torch_threads=threads[1],
        affinity_cores=cores[1],
        phases={"forward": 10 * MS, "backward": 20 * MS, "sync_exposed": 25 * MS, "optimizer": 2 * MS},
        **CPU,
    )


def _threads_after_the_causes(findings: list[Finding]) -> Finding:
    """The threads confound, listed after every cause it qualifies (DESIGN.md, "The cost of a cause, and
    the order of findings"), which carry its caveat."""
    (threads,) = [f for f in findings if f.rule == "threads"]
    causes = [f for f in findings if f.category == "cause" and f.rule not in ("threads", "contention")]
    assert all(findings.index(f) < findings.index(threads) for f in causes), [f.id for f in findings]
    return threads


def test_threads_that_differ_between_world_sizes_qualify_the_causes(tmp_path: Path) -> None:
    _cpu_pair(tmp_path, threads=(2, 1))
    with open_store(tmp_path) as store:
        rows = {r["world_size"]: r for r in run_analysis("threads", store).to_pylist()}
        findings = explain(store)
    assert rows[1]["threads_per_rank"] == 2 and rows[2]["threads_per_rank"] == 1
    assert rows[2]["threads_on_host"] == 2 and rows[2]["cpu_count"] == 2
    assert all(
        r["threads_differ"] and not r["cores_differ"] and not r["threads_oversubscribed"]
        for r in rows.values()
    )
    first = _threads_after_the_causes(findings)
    assert set(first.evidence.run_ids) == {"n1", "n2"}
    assert "OMP_NUM_THREADS=1 for every N" in first.recommendation
    assert "GPU" not in first.text + first.title + first.recommendation
    # timing verdicts on the same runs carry the caveat and lose half their confidence
    timing = [f for f in findings if f.category in ("cause", "comparison") and "n2" in f.evidence.run_ids]
    assert timing, [f.id for f in findings]
    assert all("different threads or cores per rank" in f.text and f.confidence <= 0.5 for f in timing)


def test_more_threads_than_cores_is_flagged_even_when_equal(tmp_path: Path) -> None:
    _cpu_pair(tmp_path, threads=(2, 2))
    with open_store(tmp_path) as store:
        rows = {r["world_size"]: r for r in run_analysis("threads", store).to_pylist()}
        findings = explain(store)
    assert (
        not rows[2]["threads_differ"]
        and rows[2]["threads_oversubscribed"]
        and rows[2]["threads_on_host"] == 4
    )
    assert not rows[1]["threads_oversubscribed"]
    assert _threads_after_the_causes(findings).evidence.run_ids == ("n2",)


def test_cores_allowed_that_differ_are_flagged(tmp_path: Path) -> None:
    _cpu_pair(tmp_path, threads=(1, 1), cores=(2, 1))
    with open_store(tmp_path) as store:
        rows = run_analysis("threads", store).to_pylist()
        findings = explain(store)
    assert all(r["cores_differ"] and not r["threads_differ"] for r in rows)
    assert "cores per rank differ" in _threads_after_the_causes(findings).title


@pytest.mark.parametrize("threads", [None, 1])
def test_equal_threads_within_the_cores_or_none_recorded_is_silent(
    tmp_path: Path, threads: int | None
) -> None:
    make_run(tmp_path, "n1", world_size=1, torch_threads=threads, affinity_cores=threads and 2, **CPU)
    make_run(tmp_path, "n2", world_size=2, torch_threads=threads, affinity_cores=threads and 2, **CPU)
    with open_store(tmp_path) as store:
        rows = run_analysis("threads", store).to_pylist()
        findings = explain(store)
    assert not any(r["threads_differ"] or r["cores_differ"] or r["threads_oversubscribed"] for r in rows)
    assert [f.id for f in findings if f.rule == "threads"] == []


def test_a_real_gloo_job_records_threads_and_gets_the_confound_first(tmp_path: Path) -> None:
    """What a newcomer's torchrun job does: N=1 keeps the default threads, N=2 gets OMP_NUM_THREADS=1."""
    # 40 steps: the CPU time per rank is read from host samples inside the steady window, which 12 steps
    # left too short for a 20 Hz poller on a loaded machine (CI: no sample in it, no CPU time said)
    one = {"steps": 40, "threads": 2, "env": {"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": "2"}}
    results_ok(run_ranks(ddp_worker, 1, str(tmp_path), one))
    results_ok(
        run_ranks(ddp_worker, 2, str(tmp_path), {"steps": 40, "threads": 1, "env": {"MKL_NUM_THREADS": None}})
    )
    with open_store(tmp_path) as store:
        ranks = store.query(
            "SELECT r.rank, u.world_size, r.torch_threads, r.omp_num_threads, r.mkl_num_threads, "
            "r.affinity_cores, r.cpu_count FROM ranks r JOIN runs u USING (run_id) "
            "ORDER BY u.world_size, r.rank"
        ).to_pylist()
        findings = explain(store)
    cores, cpus = len(os.sched_getaffinity(0)), os.cpu_count()
    assert ranks == [
        {"rank": 0, "world_size": 1, "torch_threads": 2, "omp_num_threads": None, "mkl_num_threads": "2",
         "affinity_cores": cores, "cpu_count": cpus},
        {"rank": 0, "world_size": 2, "torch_threads": 1, "omp_num_threads": "1", "mkl_num_threads": None,
         "affinity_cores": cores, "cpu_count": cpus},
        {"rank": 1, "world_size": 2, "torch_threads": 1, "omp_num_threads": "1", "mkl_num_threads": None,
         "affinity_cores": cores, "cpu_count": cpus},
    ]  # fmt: skip
    first = _threads_after_the_causes(findings)
    assert "threads per rank differ" in first.title
    # the CPU time each rank used comes from the host samples, in cores
    assert re.search(r"N=1 \(run [^)]+\) ran 2 torch threads per rank \(OMP_NUM_THREADS unset\)", first.text)
    assert "(OMP_NUM_THREADS=1)" in first.text
    assert "cores of CPU time per rank" in first.text, first.text


def test_thread_facts_keep_the_environment_as_given_and_bounded() -> None:
    import torch

    from perfscope.collectors.run_metadata import thread_facts

    threads, omp, mkl, cores = thread_facts({"OMP_NUM_THREADS": "4,2" + "x" * 1000})
    assert omp is not None and omp.startswith("4,2") and len(omp) == 64  # nested OpenMP syntax, cut
    assert mkl is None  # unset stays NULL, not a guess
    assert cores == len(os.sched_getaffinity(0))
    assert threads == torch.get_num_threads()  # torch is imported: its intra-op threads
