"""One story: the phase that lost most always has a finding (explain/biggest_loss.py), and a table
and a finding quote the same number for the same thing (the stragglers table's others' wait)."""

from __future__ import annotations

from pathlib import Path

import pytest
from storegen import DEFAULT_PHASES, MS, Comm, make_run

from perfscope import open_store
from perfscope.analysis import run_analysis
from perfscope.explain import explain
from perfscope.explain.words import pct

pytestmark = pytest.mark.filterwarnings("error::perfscope.errors.PerfscopeWarning")


def test_the_phase_that_lost_most_has_a_finding_even_below_the_rules_thresholds(tmp_path: Path) -> None:
    """Exposed sync is the largest part of the loss (43%) but under the communication rule's half;
    forward, optimizer and data loading grow too."""
    for n in (1, 2, 4, 8):
        grow = 0 if n == 1 else 1
        make_run(
            tmp_path,
            f"n{n}",
            world_size=n,
            phases={
                **DEFAULT_PHASES,
                "sync_exposed": 1.5 * MS * n * grow,
                "forward": DEFAULT_PHASES["forward"] + 1.0 * MS * n * grow,
                "optimizer": DEFAULT_PHASES["optimizer"] + 0.5 * MS * n * grow,
                "data": DEFAULT_PHASES["data"] + 0.5 * MS * n * grow,
            },
        )
    with open_store(tmp_path) as store:
        findings = explain(store)
        (top,) = [r for r in run_analysis("scaling", store).to_pylist() if r["world_size"] == 8]
    rules = {g.rule for f in findings for g in f.flatten()}
    assert "communication-bound" not in rules  # under its threshold ...
    (f,) = [f for f in findings if f.rule == "biggest-loss"]  # ... and still said
    share = top["lost_sync_exposed_ns"] / top["lost_ns"]
    assert 0.2 < share < 0.5
    assert f.numbers["phase"] == "sync_exposed"
    assert f.explained_loss == pytest.approx(share)
    assert "exposed gradient sync" in f.title and pct(share) in f.title
    assert "needs efficiency under 0.80 and exposed sync over half of the lost time" in f.text


def test_a_covered_loss_gets_no_extra_finding(tmp_path: Path) -> None:
    for n in (1, 2, 4, 8):
        make_run(tmp_path, f"n{n}", world_size=n, phases={**DEFAULT_PHASES, "sync_exposed": 3.0 * MS * n})
    with open_store(tmp_path) as store:
        rules = [f.rule for f in explain(store)]
    assert "communication-bound" in rules and "biggest-loss" not in rules


def test_the_straggler_finding_quotes_the_stragglers_table(tmp_path: Path) -> None:
    make_run(tmp_path, "n1", world_size=1)
    make_run(
        tmp_path,
        "n4",
        world_size=4,
        comm=Comm([1 << 20], lambda nb: 1e5, delay_ns=lambda r, s: 4e6 if r == 2 else 0),
    )
    with open_store(tmp_path) as store:
        table = run_analysis("stragglers", store).to_pylist()
        step_ns = next(
            r["step_ns"] for r in run_analysis("run_summary", store).to_pylist() if r["run_id"] == "n4"
        )
        (f,) = [g for f in explain(store) for g in f.flatten() if g.rule == "straggler"]
    (last,) = [r for r in table if r["is_straggler"]]
    others = [r for r in table if r["run_id"] == last["run_id"] and r["rank"] != last["rank"]]
    mean_wait = sum(r["wait_per_step_ns"] for r in others) / len(others)
    # one definition: the other ranks' mean wait per step for the straggler, as a share of the step
    assert last["others_wait_per_step_ns"] == pytest.approx(mean_wait, rel=1e-9)
    assert last["others_wait_share"] == pytest.approx(mean_wait / step_ns, rel=1e-9)
    assert last["others_wait_share"] > 0.05  # rank 2 arrives 4 ms late in a step of about 40 ms
    assert f.numbers["wait_share"] == pytest.approx(last["others_wait_share"], rel=1e-9)
    assert f"waited {pct(last['others_wait_share'])} of the step" in f.text
