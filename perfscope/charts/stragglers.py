"""Stragglers: wait at collective as a rank × step heat map, and how often each rank is last."""

from __future__ import annotations

import altair as alt
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .rows import Row, data, rows
from .style import PANEL_HEIGHT, THRESHOLD_COLOUR, WIDTH, ChartLike, finish, no_data

_STRAGGLER_COLUMNS = (
    "run_id",
    "source",
    "world_size",
    "rank",
    "hostname",
    "instances",
    "last_count",
    "last_share",
    "wait_per_step_ns",
    "wait_share_of_step",
    "is_straggler",
    "wait_source",
)


def _pick_run(values: list[Row], run_id: str | None, *, prefer: set[str] | None = None) -> str | None:
    """The run to draw: the one asked for, else a run with a straggler, else the largest world size
    (the most ranks seen when the table has no world size)."""
    ranks: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    for r in values:
        ranks.setdefault(r["run_id"], set()).add(r["rank"])
        if r.get("world_size"):
            size[r["run_id"]] = int(r["world_size"])
    if run_id is not None:
        return run_id if run_id in ranks else None
    ids = set(ranks)
    if prefer:
        ids = (ids & prefer) or ids
    return max(sorted(ids), key=lambda i: size.get(i, len(ranks[i]))) if ids else None


#: Step bins of the heat map: enough to see a pattern, few enough to keep the chart small.
STEP_BINS = 120


def _run_of(table: pa.Table | None, run_id: str | None) -> pa.Table | None:
    """The rows of the run to draw (asked for, else the one with most ranks), picked in Arrow: a
    large store has millions of rows here, too many to turn into Python objects."""
    if table is None or table.num_rows == 0:
        return None
    if run_id is None:
        counts = table.group_by("run_id").aggregate([("rank", "count_distinct")]).to_pylist()
        run_id = max(sorted(counts, key=lambda r: r["run_id"]), key=lambda r: r["rank_count_distinct"])[
            "run_id"
        ]
    return table.filter(pc.equal(table["run_id"], run_id))


def _binned(run: pa.Table) -> list[Row]:
    """Mean wait (ms) per rank and step bin."""
    run = run.filter(pc.is_valid(run["wait_ns"]))
    if run.num_rows == 0:
        return []
    step = run["step"].to_numpy().astype(np.int64)
    rank = run["rank"].to_numpy().astype(np.int64)
    wait_ms = run["wait_ns"].to_numpy().astype(np.float64) / 1e6
    lo, hi = int(step.min()), int(step.max()) + 1
    edges = np.unique(np.linspace(lo, hi, min(STEP_BINS, hi - lo) + 1).round().astype(np.int64))
    b = np.clip(np.searchsorted(edges, step, side="right") - 1, 0, len(edges) - 2)
    ranks = np.unique(rank)
    r = np.searchsorted(ranks, rank)
    total = np.zeros((len(ranks), len(edges) - 1))
    count = np.zeros_like(total)
    np.add.at(total, (r, b), wait_ms)
    np.add.at(count, (r, b), 1)
    out = []
    for i, j in zip(*np.nonzero(count), strict=True):
        out.append(
            {
                "rank": int(ranks[i]),
                "step_from": int(edges[j]),
                "step_to": int(edges[j + 1]),
                "wait_ms": float(total[i, j] / count[i, j]),
            }
        )
    return out


def wait_heatmap(collective_wait: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """Wait at collective (ms per step) per rank and step for one run (default: the one with most ranks)."""
    title = "Wait at collective, rank × step"
    run = _run_of(collective_wait, run_id)
    values = _binned(run) if run is not None else []
    if not values or run is None:
        why = (
            f"run {run_id} has no collectives" if run_id else "no collectives between ranks in this selection"
        )
        return no_data(title, why)
    chosen = run["run_id"][0].as_py()
    ranks = sorted({r["rank"] for r in values})
    chart = (
        alt.Chart(data(values))
        .mark_rect()
        .encode(
            x=alt.X(
                "step_from:Q",
                title="step",
                scale=alt.Scale(zero=False, nice=False),
                axis=alt.Axis(tickCount=10, labelOverlap=True, format="d"),
            ),
            x2="step_to:Q",
            y=alt.Y("rank:O", title="rank", sort=ranks),
            color=alt.Color("wait_ms:Q", title="wait (ms/step)", scale=alt.Scale(scheme="orangered")),
            tooltip=[
                alt.Tooltip("rank:O"),
                alt.Tooltip("step_from:Q", title="from step"),
                alt.Tooltip("step_to:Q", title="to step (excl.)"),
                alt.Tooltip("wait_ms:Q", title="mean wait ms", format=".3f"),
            ],
        )
        .properties(width=WIDTH, height=max(120, min(PANEL_HEIGHT * 2, 16 * len(ranks))))
    )
    subtitle = [
        f"run {chosen}; w_i = max_j(enter_j) − enter_i, summed over the step's collectives",
        "a rank that rarely waits is the one the others wait for",
    ]
    return finish(chart, title, subtitle)


def last_rank_chart(stragglers: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """How often each rank is the last to enter a collective, for one run (default: one with a
    straggler, else the largest), against the 1/n an even spread gives."""
    title = "Last rank to enter the collective"
    values = rows(stragglers, _STRAGGLER_COLUMNS)
    chosen = _pick_run(values, run_id, prefer={r["run_id"] for r in values if r["is_straggler"]})
    values = [r for r in values if r["run_id"] == chosen and r["last_share"] is not None]
    if not values:
        why = (
            f"run {run_id} has no collectives" if run_id else "no collectives between ranks in this selection"
        )
        return no_data(title, why)
    n = int(values[0]["world_size"] or len(values))
    for r in values:
        r["status"] = "straggler" if r["is_straggler"] else "rank"
    even = [{"y": 1 / n, "label": f"even spread 1/n = {1 / n:.0%}"}]
    bars = (
        alt.Chart(data(values))
        .mark_bar()
        .encode(
            x=alt.X("rank:O", title="rank"),
            y=alt.Y("last_share:Q", title="share of collectives entered last", axis=alt.Axis(format="%")),
            color=alt.Color(
                "status:N",
                title=None,
                scale=alt.Scale(domain=["rank", "straggler"], range=["#4C78A8", THRESHOLD_COLOUR]),
                # below the plot: at its right it covered the 1/n label when 1/n is high (N = 2, issue 34)
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[
                alt.Tooltip("rank:O"),
                alt.Tooltip("hostname:N"),
                alt.Tooltip("last_share:Q", format=".1%"),
                alt.Tooltip("wait_share_of_step:Q", title="wait share of step", format=".1%"),
                alt.Tooltip("wait_source:N", title="from"),
            ],
        )
    )
    rule = alt.Chart(data(even)).mark_rule(strokeDash=[4, 3], color="#555").encode(y="y:Q")
    text = (
        alt.Chart(data(even))
        .mark_text(align="left", x=WIDTH + 4, fontSize=10, color="#555")
        .encode(y="y:Q", text="label:N")
    )
    chart = alt.layer(bars, rule, text).properties(width=WIDTH, height=PANEL_HEIGHT + 40)
    source = values[0].get("source") or "measured"
    subtitle = [f"run {chosen} (N = {n}, {source})"]
    return finish(chart, title, subtitle)
