"""The dashboard's Compare page shows `perfscope compare`'s verdict on B against A (issue 34): the same
analysis as the command, with its two charts."""

from __future__ import annotations

from pathlib import Path

from test_dashboard_app import charts, clean, open_page, seed  # noqa: F401  (seed: the fixture)

from perfscope.analysis.compare import Side, compare
from perfscope.store.open import open_store


def test_compare_page_shows_the_commands_verdict(seed: Path) -> None:  # noqa: F811
    a = "sim-seed-scaling-hpdlf-horovod-nccl-n012-b75-s2022"
    b = "sim-seed-scaling-hpdlf-horovod-mpi-n012-b75-s2022"
    at = clean(open_page(seed, "compare"))
    at.selectbox(key="compare_a").set_value(a)
    at.selectbox(key="compare_b").set_value(b).run()
    clean(at)
    with open_store(seed) as store:
        c = compare(Side(store, a, "A"), Side(store, b, "B"))
    said = [m.value for m in at.markdown if "Verdict for B against A" in m.value]
    assert said and f"Verdict for B against A: {c.verdict}" in said[0]
    assert f"×{c.step_ratio:.3f}" in said[0]
    assert len(charts(at)) >= 3  # the distributions, the waterfall and the phase chart
