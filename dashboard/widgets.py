"""Small pieces every page uses: charts, definition notes, the simulated-data notice, tables with units."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import altair as alt
import pyarrow as pa
import pyarrow.compute as pc
import streamlit as st

from perfscope.analysis import ANALYSES, DEFINITIONS, META_DEFINITION, META_TITLE
from perfscope.charts.rows import rows
from perfscope.report.model import REFERENCE, device_unit


def chart(c: Any, key: str | None = None) -> None:
    """Draw a shared chart builder's result as the report draws it: its own size and theme.

    Streamlit fits a chart into its width, titles and legends included, which squeezes the plot of
    a chart with a long subtitle; "pad" keeps the builder's plot size and grows the view instead.
    """
    st.altair_chart(
        c.properties(autosize=alt.AutoSizeParams(type="pad")), theme=None, key=key, width="content"
    )


def wide_chart(c: Any, key: str | None = None) -> None:
    """Draw a timeline's chart (its builder makes it twice a chart's width, as the report prints it)
    as wide as the page and never wider: Streamlit fits it, title and legends included, into the
    container, so a narrower window does not cut it off at the right edge (issue 34)."""
    st.altair_chart(c, theme=None, key=key, width="stretch")


def charts(*cs: Any) -> None:
    """Charts side by side while they fit the page, the next row when they do not.

    Page columns would cut a chart wider than half the page (faceted panels, long legends).
    """
    with st.container(horizontal=True, wrap=True, gap="large"):
        for c in cs:
            chart(c)


def tabbed(key: str, sections: Mapping[str, Callable[[], None]]) -> None:
    """Tabs bound to the query parameter `key` (a link can open one); only the open tab is drawn."""
    tabs = st.tabs(list(sections), key=key, bind="query-params")
    for draw, tab in zip(sections.values(), tabs, strict=True):
        with tab:
            if tab.open:
                draw()


def definition_of(table: pa.Table) -> tuple[str, str]:
    """(title, definition in words) that the analysis registry stamped on its table."""
    meta = table.schema.metadata or {}
    return meta.get(META_TITLE, b"").decode(), meta.get(META_DEFINITION, b"").decode()


def definition_note(*names: str, popover: bool = False) -> None:
    """Say which definitions (docs/analysis.md) the numbers above follow, from the analysis registry.

    `popover` for places inside an expander, where another expander may not go.
    """
    keys: list[str] = []
    for name in names:
        a = ANALYSES.get(name)
        for k in a.definition if a else ():
            if k not in keys and k != "raw":
                keys.append(k)
    if not keys:
        return
    label = "Definitions used: " + ", ".join(keys)
    box = (
        st.popover(label, icon=":material/menu_book:")
        if popover
        else st.expander(label, icon=":material/menu_book:")
    )
    with box:
        for k in keys:
            st.markdown(f"**{k}**: {DEFINITIONS[k]}")
        st.caption(REFERENCE[0].upper() + REFERENCE[1:] + ".")


def simulated_notice(summary: pa.Table) -> None:
    """Simulated runs are never shown without saying so."""
    if summary.num_rows == 0 or "source" not in summary.column_names:
        return
    sources = summary.column("source").to_pylist()
    sim = sum(1 for s in sources if s == "simulated")
    if sim:
        st.info(
            f"**Simulated data**: {sim} of {len(sources)} runs in this selection were written by "
            "`perfscope simulate`, not measured. Charts draw them as hollow triangles; tables say "
            "`simulated` in the source column.",
            icon=":material/science:",
        )


def source_label(source: str | None) -> str:
    return "simulated" if source == "simulated" else "measured"


def ms(ns: float | None, digits: int = 2) -> str:
    return "n/a" if ns is None else f"{ns / 1e6:,.{digits}f} ms"


def pct(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{digits}%}"


def num(x: float | None, fmt: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, fmt)


def filter_rows(table: pa.Table, column: str, values: Sequence[Any]) -> pa.Table:
    """The rows whose `column` is one of `values` (a table without the column stays as it is)."""
    if table.num_rows == 0 or column not in table.column_names:
        return table
    return table.filter(
        pc.is_in(table.column(column), value_set=pa.array(list(values), table.column(column).type))
    )


def relabel(table: pa.Table, column: str, labels: Mapping[Any, str]) -> pa.Table:
    """The table with `column`'s values replaced by their short labels (e.g. group ids)."""
    if table.num_rows == 0 or column not in table.column_names:
        return table
    values = [labels.get(v, v) for v in table.column(column).to_pylist()]
    return table.set_column(table.column_names.index(column), column, pa.array(values, pa.string()))


def one_row(table: pa.Table, column: str, value: Any) -> dict[str, Any] | None:
    found = rows(filter_rows(table, column, [value]))
    return found[0] if found else None


#: what a table shows for a missing value (Streamlit's own is the word "None")
EMPTY_CELL = "—"


@dataclass(frozen=True)
class Col:
    """A column to show: its title, the factor to its display unit and the number format."""

    title: str
    scale: float = 1.0
    fmt: str | None = None
    help: str | None = None


def device_unit_of(summary: pa.Table) -> str:
    """ "GPU", or "rank" when every run of the selection ran on CPU: the word the labels use."""
    models = summary.column("device_model").to_pylist() if "device_model" in summary.column_names else []
    return device_unit(models)


def for_unit(columns: Mapping[str, Col], unit: str) -> dict[str, Col]:
    """The columns with "GPU" in their titles and help said as `unit` (per-rank speedup on CPU jobs)."""
    if unit == "GPU":
        return dict(columns)
    return {
        k: replace(c, title=c.title.replace("GPU", unit), help=c.help and c.help.replace("GPU", unit))
        for k, c in columns.items()
    }


def show_table(table: pa.Table, columns: Mapping[str, Col], *, height: int | str = "auto") -> None:
    """The chosen columns of an analysis table, in display units with their titles and formats."""
    present = [c for c in columns if c in table.column_names]
    if table.num_rows == 0 or not present:
        st.caption("no rows in this selection")
        return
    out = {}
    config = {}
    for c in present:
        spec = columns[c]
        col = table.column(c)
        if pa.types.is_string(col.type):  # an empty name (no cluster) reads as a missing value
            col = pc.if_else(pc.equal(col, ""), pa.scalar(None, col.type), col)
        if spec.scale != 1.0:
            col = pc.multiply(col.cast(pa.float64()), spec.scale)
        out[spec.title] = col
        if spec.fmt is not None:
            config[spec.title] = st.column_config.NumberColumn(spec.title, format=spec.fmt, help=spec.help)
        elif spec.help is not None:
            config[spec.title] = st.column_config.Column(spec.title, help=spec.help)
    st.dataframe(
        pa.table(out),
        hide_index=True,
        column_config=config,
        height=height,  # type: ignore[arg-type]
        placeholder=EMPTY_CELL,
    )


def no_runs() -> None:
    st.info(
        "No runs match the selection in the sidebar. Widen it (clear a filter), or pick another store.",
        icon=":material/filter_alt_off:",
    )
