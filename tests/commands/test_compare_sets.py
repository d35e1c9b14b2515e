"""`perfscope compare` of experiments and scaling groups, world size by world size (issue 34): stores
written through the real StoreWriter (tests/storegen.py) with steps of known distributions; the
verdict per world size and overall, the gate naming the world size, what is on one side only, and
hostile picks refused in one line with the store left as it was."""

from __future__ import annotations

from perfscope.analysis.compare_sets import set_verdict


def test_the_set_verdict_and_the_world_size_that_decides() -> None:
    assert set_verdict({1: "no-change", 2: "slower", 4: "faster", 8: "slower"}) == ("slower", 8)
    assert set_verdict({1: "faster", 2: "faster", 4: "no-change"}) == ("faster", 2)
    assert set_verdict({1: "no-change", 4: "no-change"}) == ("no-change", 4)
