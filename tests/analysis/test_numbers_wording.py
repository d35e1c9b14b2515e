"""Wording and tables (issue 11, item 9): one crowding said once, no "a rank died" for a rank that
only recorded more steps, and the experiment column in the report's batch-sweep and time tables."""

from __future__ import annotations

import re
from pathlib import Path

from storegen import make_run

from perfscope.analysis import Selection, run_analysis
from perfscope.cli import main
from perfscope.explain import explain
from perfscope.store.open import open_store


def test_the_same_crowding_is_said_once(tmp_path: Path) -> None:
    for n in (1, 3):
        for rep in ("a", "b"):
            make_run(tmp_path, f"n{n}{rep}", world_size=n, cpu_count=2, device=False, device_model="cpu")
    with open_store(tmp_path) as store:
        (over,) = [f for f in explain(store, Selection()) if f.rule == "oversubscription"]
    assert over.title == "Oversubscribed host: 3 ranks on 2 cores (2 runs)"


def test_a_rank_with_more_steps_is_not_called_dead(tmp_path: Path) -> None:
    # rank 1 runs 5 extra steps (an uneven loader): the other rank lacks them, nobody died
    make_run(tmp_path, "uneven", world_size=2, steps=40, ranks_present={0, 1})
    make_run(tmp_path, "uneven", world_size=2, steps=45, ranks_present={1}, write_runs_row=False)
    with open_store(tmp_path) as store:
        quality = run_analysis("quality", store, Selection()).to_pylist()
    (q,) = [q for q in quality if q["kind"] == "missing_ranks"]
    assert "died" not in q["message"] and "ran extra steps" in q["message"]


def test_report_tables_carry_the_experiment(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for exp in ("lr-linear", "lr-sqrt"):
        for b in (16, 64):
            make_run(
                store,
                f"{exp}-b{b}",
                experiment=exp,
                batch_size_per_rank=b,
                metrics={"loss": lambda s: 1 / (1 + s)},
            )
    out = tmp_path / "r.html"
    assert main(["report", str(store), "-o", str(out)]) == 0
    html = out.read_text()
    for caption in ("Batch-size sweep", "Time to a metric target"):
        table = html[html.index(caption) :]
        table = table[: table.index("</table>")]
        headers = re.findall(r"<th[^>]*>([^<]*)</th>", table)
        assert "experiment" in headers, (caption, headers)
        assert "lr-linear" in table and "lr-sqrt" in table
