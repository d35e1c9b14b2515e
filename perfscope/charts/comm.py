"""Communication beyond DDP: time per step by op type and phase (total and exposed), and per rank
by role (compute, point-to-point wait, collective wait) for pipelines and parameter servers."""

from __future__ import annotations

import altair as alt
import pyarrow as pa

from .rows import Row, data, rows
from .style import SERIES_SCHEME, WIDTH, ChartLike, finish, no_data

_OPS_COLUMNS = (
    "run_id",
    "world_size",
    "op",
    "phase",
    "kind",
    "calls_per_step",
    "total_ns_per_step",
    "exposed_ns_per_step",
    "bytes_median",
)
_ROLE_COLUMNS = (
    "run_id",
    "world_size",
    "rank",
    "role",
    "steps",
    "compute_ns",
    "p2p_wait_ns",
    "collective_wait_ns",
)
_ROLE_PARTS = {
    "compute_ns": "compute",
    "p2p_wait_ns": "point-to-point wait",
    "collective_wait_ns": "collective wait",
}


def _band_height(bands: int, per_band: int) -> int:
    """A bar chart tall enough to read with one or two bars (Vega-Lite's default band is 20 px)."""
    return max(140, per_band * bands)


def _one_run(values: list[Row], run_id: str | None) -> list[Row]:
    """The rows of `run_id`, else of the run with the largest world size."""
    if not values:
        return []
    if run_id is None:
        run_id = max(
            sorted({r["run_id"] for r in values}),
            key=lambda i: max((r["world_size"] or 0) for r in values if r["run_id"] == i),
        )
    return [r for r in values if r["run_id"] == run_id]


def comm_ops_chart(comm_ops: pa.Table | None, *, run_id: str | None = None) -> ChartLike:
    """Per op and phase of one run: total and exposed time per rank-step (ms)."""
    title = "Communication by op type and phase"
    values = _one_run(rows(comm_ops, _OPS_COLUMNS), run_id)
    if not values:
        return no_data(title)
    long = []
    for r in values:
        label = f"{r['op']} in {r['phase']}"
        for col, measure in (("total_ns_per_step", "total"), ("exposed_ns_per_step", "exposed (waited)")):
            if r[col] is not None:
                long.append(
                    {
                        "call": label,
                        "kind": r["kind"],
                        "measure": measure,
                        "ms": r[col] / 1e6,
                        "calls": r["calls_per_step"],
                        "bytes": r["bytes_median"],
                    }
                )
    chart = (
        alt.Chart(data(long))
        .mark_bar()
        .encode(
            y=alt.Y("call:N", title=None, sort="-x"),
            yOffset=alt.YOffset("measure:N"),
            x=alt.X("ms:Q", title="ms per rank and step"),
            color=alt.Color("measure:N", title=None, scale=alt.Scale(scheme=SERIES_SCHEME)),
            tooltip=[
                "call:N",
                "kind:N",
                "measure:N",
                alt.Tooltip("ms:Q", format=".3f"),
                alt.Tooltip("calls:Q", format=".1f", title="calls per step"),
                alt.Tooltip("bytes:Q", format=",.0f", title="median bytes"),
            ],
        )
        .properties(width=WIDTH, height=_band_height(len({r["call"] for r in long}), 40))
    )
    return finish(chart, title, f"run {values[0]['run_id']} (steady steps)")


def comm_roles_chart(comm_by_role: pa.Table | None, *, run_id: str | None = None) -> ChartLike:
    """Per rank of one run, labelled with its role: compute, point-to-point and collective wait per
    step (ms), stacked. Ranks without steps (a parameter server) have no bar."""
    title = "Per rank and role: compute and waiting"
    values = [r for r in _one_run(rows(comm_by_role, _ROLE_COLUMNS), run_id) if r["steps"]]
    if not values:
        return no_data(title)
    long = [
        {"rank": f"rank {r['rank']} ({r['role']})", "part": name, "ms": (r[col] or 0) / 1e6}
        for r in values
        for col, name in _ROLE_PARTS.items()
    ]
    chart = (
        alt.Chart(data(long))
        .mark_bar()
        .encode(
            y=alt.Y("rank:N", title=None),
            x=alt.X("ms:Q", title="ms per step", stack="zero"),
            color=alt.Color(
                "part:N", title=None, sort=list(_ROLE_PARTS.values()), scale=alt.Scale(scheme=SERIES_SCHEME)
            ),
            order=alt.Order("part:N"),
            tooltip=["rank:N", "part:N", alt.Tooltip("ms:Q", format=".3f")],
        )
        .properties(width=WIDTH, height=_band_height(len({r["rank"] for r in long}), 28))
    )
    return finish(chart, title, f"run {values[0]['run_id']} (steady steps)")
