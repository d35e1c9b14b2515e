"""The contention confound (issue 11, item 8): other processes' CPU on the job's hosts (system CPU
minus the job's ranks) is stated before any timing verdict and halves the confidence of the timing
findings resting on those runs; a quiet host changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from storegen import MS, Host, make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.explain import explain
from perfscope.explain.finding import Finding
from perfscope.store.open import open_store

CPUS = 8


def _straggler(rank: int, step: int) -> dict[str, float]:
    return {"forward": 16 * MS} if rank == 1 else {}


def _study(root: Path, sys_cpu_pct: float) -> None:
    for n in (1, 2, 4):
        make_run(
            root,
            f"n{n}",
            world_size=n,
            cpu_count=CPUS,
            phase_fn=_straggler,
            # the job's ranks use one core each; the host's busy share is the test's knob
            host=Host(proc_cpu_pct=100.0 * n, sys_cpu_pct=sys_cpu_pct),
        )


def _findings(root: Path) -> list[Finding]:
    with open_store(root) as store:
        return explain(store, Selection())


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("busy")
    _study(root, sys_cpu_pct=100.0)  # 8 busy cores, the job uses n of them
    return root


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quiet")
    _study(root, sys_cpu_pct=100.0 * 4 / CPUS)  # 4 busy cores: only the 4-rank job's own
    return root


def test_other_processes_cpu_is_system_minus_the_job(busy: Path, quiet: Path) -> None:
    with open_store(busy) as store:
        rows = {r["run_id"]: r for r in run_analysis("contention", store, Selection()).to_pylist()}
    for n in (1, 2, 4):
        r = rows[f"n{n}"]
        assert r["other_cores"] == pytest.approx(CPUS - n, rel=1e-3)
        assert r["other_cores_per_rank"] == pytest.approx((CPUS - n) / n, rel=1e-3)
        assert r["contended"] and r["saturated"]
    with open_store(quiet) as store:
        rows = {r["run_id"]: r for r in run_analysis("contention", store, Selection()).to_pylist()}
    assert rows["n4"]["other_cores"] == pytest.approx(0, abs=1e-3) and not rows["n4"]["contended"]
    # n1: other processes took 3 cores, but 4 of the 8 stayed idle: nothing came out of the job's share
    assert rows["n1"]["other_cores_per_rank"] == pytest.approx(3, rel=1e-3)
    assert rows["n1"]["spare_cores"] == pytest.approx(4, rel=1e-3) and not rows["n1"]["contended"]


def test_contention_follows_the_causes_it_qualifies_and_lowers_timing_confidence(
    busy: Path, quiet: Path
) -> None:
    """DESIGN.md, "The cost of a cause, and the order of findings": confounds qualify the causes they
    touch (a caveat in each cause's text, half its confidence) and follow them."""
    noisy, calm = _findings(busy), _findings(quiet)
    (confound,) = [f for f in noisy if f.id == "contention:other-processes"]
    assert set(confound.evidence.run_ids) == {"n1", "n2", "n4"}
    causes = [f for f in noisy if f.category == "cause" and f.rule not in ("contention", "oversubscription")]
    assert causes and noisy.index(confound) > max(noisy.index(f) for f in causes)
    calm_by_id = {f.id: f for f in calm}
    timing = [f for f in noisy if f.category in ("cause", "comparison")]
    assert any(f.rule == "straggler" for f in timing), [f.id for f in noisy]
    for f in timing:
        before = calm_by_id[f.id]
        hit = {"n1", "n2", "n4"} & set(f.evidence.run_ids)
        assert "other processes took CPU" in f.text
        assert f.confidence == pytest.approx(before.confidence * 0.5, abs=0.01), (f.id, hit)


def test_a_quiet_host_names_no_contention(tmp_path: Path) -> None:
    for n in (1, 2):  # the host is busy with the job's ranks plus 0.1 core of noise
        host = Host(proc_cpu_pct=100.0 * n, sys_cpu_pct=100.0 * (n + 0.1) / CPUS)
        make_run(tmp_path, f"q{n}", world_size=n, cpu_count=CPUS, host=host)
    findings = _findings(tmp_path)
    assert not [f for f in findings if f.rule == "contention"]
    assert not [f for f in findings if "other processes took CPU" in f.text]
