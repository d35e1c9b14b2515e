"""The explainer on a real measured store: DDP on gloo with 1, 2 and 4 processes on this host,
recorded by perfscope.profile. With fewer than 4 cores the 4-rank run oversubscribes the host,
and that must be the top finding, with the host's real core count in its words."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from perfscope.analysis import run_analysis
from perfscope.explain import explain
from perfscope.explain.finding import CONFOUND_RULES
from perfscope.store.open import open_store

pytest.importorskip("torch")
from collect_helpers import ddp_worker, run_ranks


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("measured")
    for n in (1, 2, 4):
        results = run_ranks(ddp_worker, n, str(root), {"steps": 40})
        assert all(status == "ok" for status, _ in results.values()), results
    return root


def test_measured_gloo_store_is_explained(measured):
    cores = os.cpu_count() or 1
    with open_store(measured) as store:
        scaling = {r["world_size"]: r for r in run_analysis("scaling", store).to_pylist()}
        placement = {r["world_size"]: r for r in run_analysis("placement", store).to_pylist()}
        findings = explain(store)
    assert sorted(scaling) == [1, 2, 4]
    assert {r["source"] for r in scaling.values()} == {"measured"}
    assert placement[4]["cpu_count"] == cores
    over = [f for f in findings if f.rule == "oversubscription"]
    if cores < 4:
        # a confound: it follows the causes it qualifies, first of the confounds after them (DESIGN.md,
        # "The cost of a cause, and the order of findings")
        causes = [f for f in findings if f.category == "cause" and f.rule not in CONFOUND_RULES]
        assert all(findings.index(f) < findings.index(over[0]) for f in causes), [f.id for f in findings]
        assert over[0].evidence.run_ids == (scaling[4]["run_id"],)
        assert f"4 ranks share {cores} logical CPUs" in over[0].text
        assert over[0].numbers[f"cap_{scaling[4]['run_id']}"] == pytest.approx(cores / 4)
    else:
        assert not over
