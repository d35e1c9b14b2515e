"""Stragglers: wait at collective as a rank × step heat map, and how often each rank is last."""

from __future__ import annotations

import altair as alt
import pyarrow as pa

from .rows import Row, data, rows
from .style import PANEL_HEIGHT, THRESHOLD_COLOUR, WIDTH, ChartLike, finish, no_data

_WAIT_COLUMNS = ("run_id", "rank", "step", "steps_in_bucket", "wait_ns")
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
    """The run to draw: the one asked for, else a run with a straggler, else the largest world size."""
    ids = {r["run_id"] for r in values}
    if run_id is not None:
        return run_id if run_id in ids else None
    if prefer:
        ids = (ids & prefer) or ids
    size = {
        r["run_id"]: r.get("world_size") or len({q["rank"] for q in values if q["run_id"] == r["run_id"]})
        for r in values
    }
    return max(sorted(ids), key=lambda i: size[i]) if ids else None


def wait_heatmap(collective_wait: pa.Table | None, run_id: str | None = None) -> ChartLike:
    """Wait at collective (ms per step) per rank and step for one run (default: the largest)."""
    title = "Wait at collective, rank × step"
    values = rows(collective_wait, _WAIT_COLUMNS)
    chosen = _pick_run(values, run_id)
    values = [r for r in values if r["run_id"] == chosen and r["wait_ns"] is not None]
    if not values:
        why = (
            f"run {run_id} has no collectives" if run_id else "no collectives between ranks in this selection"
        )
        return no_data(title, why)
    for r in values:
        r["wait_ms"] = r["wait_ns"] / 1e6
    ranks = sorted({int(r["rank"]) for r in values})
    chart = (
        alt.Chart(data(values))
        .mark_rect()
        .encode(
            x=alt.X(
                "step:Q",
                bin=alt.Bin(maxbins=120),
                title="step",
                axis=alt.Axis(tickCount=10, labelOverlap=True, format="d"),
            ),
            y=alt.Y("rank:O", title="rank", sort=ranks),
            color=alt.Color(
                "mean(wait_ms):Q",
                title="wait (ms/step)",
                scale=alt.Scale(scheme="orangered"),
            ),
            tooltip=[
                alt.Tooltip("rank:O"),
                alt.Tooltip("step:Q", bin=True),
                alt.Tooltip("mean(wait_ms):Q", title="mean wait ms", format=".3f"),
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
