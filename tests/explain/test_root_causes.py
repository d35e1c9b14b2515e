"""Root causes, not symptoms: one cause said once, with its symptoms inside it, and confidence that
follows the evidence (explain/root_causes.py, explain/rulebook.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run, ring_transfer_ns

from perfscope import Store, open_store
from perfscope.analysis import Selection, run_analysis
from perfscope.explain import Evidence, Finding, explain
from perfscope.explain.context import Context
from perfscope.explain.root_causes import root_causes
from perfscope.explain.rulebook import THIN_FIT_CONFIDENCE, thin_fits
from perfscope.explain.words import dur
from perfscope.report import collect
from perfscope.report.model import Section
from perfscope.sample_traces import bundled

pytestmark = pytest.mark.filterwarnings("error::perfscope.errors.PerfscopeWarning")


@pytest.fixture(scope="module")
def seed_findings() -> list[Finding]:
    with open_store(bundled()["seed-study"]) as store:
        return explain(store)


@pytest.fixture(scope="module")
def many_small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """Sync that grows with N, 50 small allreduces per step, none overlapped with compute."""
    root = tmp_path_factory.mktemp("many-small")
    for n in (2, 3, 4, 6, 8):
        make_run(
            root,
            f"n{n}",
            world_size=n,
            phases={**DEFAULT_PHASES, "sync_exposed": 2 * MS * n},
            comm=Comm([16 << 10] * 50, lambda nb, n=n: ring_transfer_ns(n, nb, 20e-6, 1 / 10e9)),
        )
    make_run(root, "n1", world_size=1)
    with open_store(root) as store:
        yield store


def test_seed_study_is_a_handful_of_distinct_findings(seed_findings: list[Finding]) -> None:
    assert 1 <= len(seed_findings) <= 8
    titles = [f.title for f in seed_findings]
    assert len(set(titles)) == len(titles)
    # one finding per rule: the six groups' "Per-GPU work too small" are one finding naming them
    rules = [f.rule for f in seed_findings]
    assert len(set(rules)) == len(rules)
    small = next(f for f in seed_findings if f.rule == "small-per-gpu-work")
    assert len(small.groups) == 6 and ", in 6 places" in small.title
    for label in ("gpu2/horovod-nccl", "hpdlf/horovod-mpi", "alpha/horovod-mpi"):
        assert label in small.text
    # nothing the rules said is lost: all 33 firings are still inside the findings
    assert sum(len(f.flatten()) for f in seed_findings) >= 30


def test_communication_overlap_and_latency_are_one_cause(many_small: Store) -> None:
    findings = explain(many_small)
    comm = [f for f in findings if {"communication-bound", "overlap-failure", "latency-bound"} & {f.rule}]
    assert len(comm) == 1
    (root,) = comm
    assert root.rule == "communication-bound" and root.severity == "alarm"
    assert [s.rule for s in root.symptoms] == ["overlap-failure", "latency-bound"]
    # the symptoms keep their own numbers
    latency = root.symptoms[1]
    assert latency.numbers["collectives_per_step"] == 50
    assert "bucket_cap_mb" in latency.recommendation
    # the root claims its own share only: the shares do not add up past the lost time
    assert root.explained_loss == pytest.approx(1.0)
    assert sum(f.explained_loss or 0.0 for f in findings if f.category == "cause") <= 1.0 + 1e-9
    # the JSON nests the symptoms under their root cause
    d = root.to_dict()
    assert [s["rule"] for s in d["symptoms"]] == ["overlap-failure", "latency-bound"]


def test_a_rule_repeated_across_groups_is_one_finding_naming_them(tmp_path) -> None:
    for cluster in ("c1", "c2"):
        for n in (1, 2, 4, 8):
            make_run(
                tmp_path,
                f"{cluster}-n{n}",
                world_size=n,
                cluster=cluster,
                phases={**DEFAULT_PHASES, "sync_exposed": 2.0 * MS * n},
            )
    with open_store(tmp_path) as store:
        findings = explain(store)
    (comm,) = [f for f in findings if f.rule == "communication-bound"]
    assert set(comm.groups) == {"exp/c1/nccl/mlp/weak:b32", "exp/c2/nccl/mlp/weak:b32"}
    assert len(comm.also_in) == 1 and comm.also_in[0].rule == "communication-bound"
    assert "in 2 places" in comm.title and "c1 (100%)" in comm.text and "c2 (100%)" in comm.text
    assert {g.group_id for g in comm.flatten()} == set(comm.groups)


@pytest.fixture(scope="module")
def thin_fit_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A knee at the node boundary whose alpha-beta fits have 3 (inside) and 2 (across) points."""
    root = tmp_path_factory.mktemp("thin-fit")
    for n in (1, 2, 3, 4, 8, 12):
        inside = n <= 4
        make_run(
            root,
            f"n{n}",
            world_size=n,
            gpus_per_node=4,
            phases={**DEFAULT_PHASES, "sync_exposed": 0 if n == 1 else (1 * MS if inside else 10 * MS)},
            comm=None
            if n == 1
            else Comm(
                [4 << 20] * 2,
                lambda nb, n=n, i=inside: ring_transfer_ns(
                    n, nb, 2e-6 if i else 20e-6, 1 / (10e9 if i else 1e9)
                ),
            ),
        )
    with open_store(root) as store:
        yield store


def _thin_fit_findings(store: Store) -> list[Finding]:
    ctx = Context(store, Selection())
    return [
        g
        for f in explain(store)
        for g in f.flatten()
        if "allreduce_fit" in g.evidence.analyses and thin_fits(ctx, g.evidence.run_ids)
    ]


def test_a_fit_with_too_few_points_never_supports_high_confidence(thin_fit_store: Store) -> None:
    thin = _thin_fit_findings(thin_fit_store)
    knee = [f for f in thin if f.rule == "node-boundary-knee"]
    assert knee, "the knee quotes both fits: it must be among the findings resting on a thin fit"
    for f in thin:
        assert f.confidence <= THIN_FIT_CONFIDENCE and f.confidence_label != "high"
    # a finding held down says why, and what would raise it: two more world sizes across nodes
    assert "too few to trust" in knee[0].text
    assert "rests on 2 points at N = 8, 12" in knee[0].text and "measure N = 24 and 48" in knee[0].text


def test_seed_study_never_says_high_on_a_thin_fit() -> None:
    with open_store(bundled()["seed-study"]) as store:
        thin = _thin_fit_findings(store)
    assert thin  # the seed's intra-node fits of hpdlf have 2 points
    assert all(f.confidence_label != "high" for f in thin)


@pytest.fixture(scope="module")
def superlinear(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A contaminated baseline: the N=1 run's step is 30 ms slower than the larger runs' steps."""
    root = tmp_path_factory.mktemp("superlinear")
    for n in (1, 2, 4, 8):
        extra = 30 * MS if n == 1 else 0.0
        make_run(
            root,
            f"n{n}",
            world_size=n,
            phases={**DEFAULT_PHASES, "data": DEFAULT_PHASES["data"] + extra, "sync_exposed": 0.5 * MS * n},
        )
    with open_store(root) as store:
        yield store


def _section_text(section: Section) -> str:
    return " ".join(str(x) for b in section.blocks if isinstance(b, list) for x in b if isinstance(x, str))


def test_a_superlinear_step_is_named_not_shown_as_negative_lost_time(superlinear: Store) -> None:
    lost = run_analysis("scaling", superlinear).to_pylist()
    # the store does show the effect: named in the table, never as a negative lost time
    assert any((r["lost_note"] or "").startswith("superlinear") for r in lost)
    for table in ("scaling", "lost_time"):
        for r in run_analysis(table, superlinear).to_pylist():
            assert all(
                v >= 0 for k, v in r.items() if k.startswith("lost") and k.endswith("_ns") and v is not None
            )
    report = collect(superlinear, Selection()).report
    (section,) = [s for s in report.sections if s.id == "lost-time"]
    words = _section_text(section)
    assert "superlinear" in words and "contaminated" in words
    assert "is lost per step" not in words


def test_a_scaling_model_has_efficiency_one_at_its_baseline(superlinear: Store) -> None:
    pred = run_analysis("scaling_prediction", superlinear).to_pylist()
    at_n0 = [r for r in pred if r["world_size"] == 1]
    # the contaminated baseline sits far off the fitted curve; E(N0) stays 1 all the same
    assert at_n0 and abs(at_n0[0]["model_step_ns"] - at_n0[0]["measured_step_ns"]) > 1 * MS
    assert all(r["model_efficiency"] == pytest.approx(1.0, abs=1e-9) for r in at_n0)


def test_no_duration_is_written_as_zero_nanoseconds(seed_findings: list[Finding]) -> None:
    assert dur(0) == "0" and dur(400) == "400 ns" and dur(2_500) == "2 µs"
    for f in seed_findings:
        for g in f.flatten():
            assert " 0 ns" not in g.text and "= 0 µs" not in g.text


def _cause(rule: str, group: str, share: float) -> Finding:
    return Finding(
        id=f"{rule}:{group}",
        rule=rule,
        severity="alarm",
        category="cause",
        title=f"{rule} on {group}",
        text=f"{rule} explains {share:.0%}.",
        evidence=Evidence(("r1",), ("scaling",)),
        recommendation="",
        confidence=0.8,
        explained_loss=share,
        group_id=group,
    )


def test_causes_whose_shares_add_past_the_loss_say_they_overlap() -> None:
    found = root_causes(
        [
            _cause("communication-bound", "g1", 0.8),
            _cause("input-bound", "g1", 0.5),
            _cause("straggler", "g2", 0.6),
        ]
    )
    by_rule = {f.rule: f for f in found}
    assert "overlaps that of input-bound on g1" in by_rule["communication-bound"].text
    assert "overlaps that of communication-bound on g1" in by_rule["input-bound"].text
    assert "overlaps" not in by_rule["straggler"].text  # alone on its group: nothing to overlap
    assert [f.rule for f in found] == ["communication-bound", "straggler", "input-bound"]


def _one_run(rule: str, loss: float) -> Finding:
    return Finding(
        id=f"{rule}-r1",
        rule=rule,
        severity="warning",
        category="cause",
        title=rule,
        text=rule,
        evidence=Evidence(("r1",), ("steps",)),
        recommendation="",
        confidence=0.8,
        explained_loss=loss,
    )


@pytest.mark.parametrize(("slow_worker", "merged"), [(0.10, False), (0.30, True)])
def test_a_what_if_cause_takes_the_runs_wait_only_when_it_explains_most_of_it(
    slow_worker: float, merged: bool
) -> None:
    # a slow worker costing 10% of a step beside a 45% wait on a big allreduce: the wait is the
    # allreduce's own and leads; at 30% the slow worker explains most of the wait, which is its symptom
    out = root_causes([_one_run("what-if", slow_worker), _one_run("communication-share", 0.45)])
    if merged:
        assert [f.rule for f in out] == ["what-if"]
        assert [s.rule for s in out[0].symptoms] == ["communication-share"]
    else:
        assert [f.rule for f in out] == ["communication-share", "what-if"]
        assert all(not f.symptoms for f in out)


def test_on_an_oversubscribed_host_the_wait_on_peers_is_the_oversubscriptions() -> None:
    # 4 ranks on 2 cores wait in their collectives for peers the scheduler took off a core: one cause,
    # the placement, with the wait its symptom (a CI run of the tensor-parallel job read 34% of its
    # step as a communication warning on a job without a cause)
    over = replace(_one_run("oversubscription", 1.0), severity="alarm")
    out = root_causes([_one_run("communication-share", 0.34), over])
    assert [f.rule for f in out] == ["oversubscription"]
    assert [s.rule for s in out[0].symptoms] == ["communication-share"]
    # another run's wait stays its own
    other = replace(_one_run("communication-share", 0.34), id="cs-r2", evidence=Evidence(("r2",), ("steps",)))
    assert all(not f.symptoms for f in root_causes([other, over]))
