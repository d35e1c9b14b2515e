"""Renders a report as Markdown (GitHub-flavoured tables) with its charts as PNG files beside it."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

from ..charts import to_png
from .model import (
    REFERENCE,
    ChartBlock,
    FindingsBlock,
    Num,
    Ref,
    Report,
    Section,
    TableBlock,
    format_value,
)
from .text import literal_gfm

StepFn = Callable[[str], None]

#: PNG scale: 2 keeps charts sharp on high-density screens and in print.
PNG_SCALE = 2.0


_CODE_SPAN = re.compile(r"(`[^`\n]+`)")


def _md(text: Any) -> str:
    """Text from the store (names, ids, messages) as Markdown that shows it literally (report/text.py)."""
    return literal_gfm(text)


def _inline(text: str) -> str:
    """Like `_md`, but `code` spans stay code (Markdown shows their content literally anyway)."""
    return "".join(p if _CODE_SPAN.fullmatch(p) else _md(p) for p in _CODE_SPAN.split(text))


def _cell(text: Any) -> str:
    return _md(text)  # `|` is escaped too: it cannot end a cell


def _anchor(text: str) -> str:
    return html.escape(text, quote=True)


def _para(frags: list[Any]) -> str:
    out = []
    for f in frags:
        if isinstance(f, Num):
            out.append(f"**{_md(f.text())}**")
        elif isinstance(f, Ref):
            out.append(f"[{_md(f.text)}](#{_anchor(f.anchor)})")
        else:  # a paragraph's words may quote store names: literal, like every other store text
            out.append(_md(f))
    return "".join(out)


class _Markdown:
    def __init__(self, report: Report, folder: str, step: StepFn) -> None:
        self.r = report
        self.folder = folder
        self.step = step
        self.images: dict[str, bytes] = {}

    def defs_line(self, analyses: tuple[str, ...]) -> str:
        parts = []
        for a in analyses:
            keys = [k for k in self.r.analysis_definitions.get(a, ()) if k in self.r.definitions]
            refs = ", ".join(f"[{_md(k)}](#def-{_anchor(k)})" for k in keys)
            parts.append(f"`{a}` ({_md(self.r.analysis_titles.get(a, a))}): {refs}")
        return f"<sub>From analysis {'; '.join(parts)}.</sub>"

    def chart(self, b: ChartBlock) -> str:
        n = len(self.images) + 1
        self.step(f"chart {b.name}")
        name = f"{n:02d}-{b.name.replace('_', '-')}.png"
        self.images[name] = to_png(b.chart, PNG_SCALE)
        caption = _md(b.title) + (f" — {_md(b.caption)}" if b.caption else "")
        image = f"![Figure {n}. {caption}]({self.folder}/{name})"
        return f"{image}\n\n*Figure {n}. {caption}*  \n{self.defs_line(b.analyses)}"

    def table(self, t: TableBlock) -> str:
        head = "| " + " | ".join(_cell(c.header) for c in t.columns) + " |"
        align = (
            "|"
            + "|".join(
                "---:"
                if any(
                    isinstance(r.get(c.name), (int, float)) and not isinstance(r.get(c.name), bool)
                    for r in t.rows
                )
                else "---"
                for c in t.columns
            )
            + "|"
        )
        lines = [f"**{_md(t.caption)}**", "", head, align]
        for row in t.rows:
            lines.append(
                "| " + " | ".join(_cell(format_value(c.name, row.get(c.name))) for c in t.columns) + " |"
            )
        lines += ["", self.defs_line((t.analysis,))]
        return "\n".join(lines)

    def findings(self, b: FindingsBlock) -> str:
        out = []
        for f in b.findings:
            loss = (
                f"; explains {f.explained_loss * 100:.0f}% of the lost time"
                if f.explained_loss is not None
                else ""
            )
            group = f" (group {_md(f.group_label)})" if f.group_label else ""
            symptoms = (
                "**Symptoms of this cause** (their shares overlap its share):\n\n"
                + "".join(f"- *{_md(t)}.* {_md(x)}\n" for t, x in f.symptoms)
                + "\n"
                if f.symptoms
                else ""
            )
            out.append(
                f'<a id="finding-{f.rank}"></a>\n### {f.rank}. {_md(f.title)}\n\n'
                f"*{_md(f.severity)}, {_md(f.category)}, confidence {_md(f.confidence_label)} "
                f"({f.confidence:.2f}){loss}*{group}\n\n"
                f"{_md(f.text)}\n\n{symptoms}**Recommendation.** {_md(f.recommendation)}\n\n"
                f"<sub>Evidence: analyses {_md(', '.join(f.analyses))}; "
                f"runs {_md(', '.join(f.run_ids))}.</sub>"
            )
        return "\n\n".join(out)

    def section(self, s: Section) -> str:
        parts = [f'<a id="{_anchor(s.id)}"></a>\n## {_md(s.heading)}']
        for b in s.blocks:
            if isinstance(b, ChartBlock):
                parts.append(self.chart(b))
            elif isinstance(b, TableBlock):
                parts.append(self.table(b))
            elif isinstance(b, FindingsBlock):
                parts.append(self.findings(b))
            else:
                parts.append(_para(b))
        return "\n\n".join(parts)

    def document(self) -> str:
        head = [f"# {_md(self.r.title)}", "", *(f"{_md(line)}  " for line in self.r.subtitle), ""]
        if self.r.simulated_runs:
            every = self.r.simulated_runs == self.r.runs
            who = "Every run" if every else f"{self.r.simulated_runs} of {self.r.runs} runs"
            head.append(
                f"> **Simulated data.** {who} in this report {'was' if every else 'were'} simulated by "
                "`perfscope simulate`, not measured on hardware. Charts draw simulated runs as hollow "
                "triangles; tables say *simulated*.\n"
            )
        toc = " · ".join(f"[{_md(s.heading)}](#{_anchor(s.id)})" for s in self.r.sections)
        head.append(toc + " · [Definitions](#definitions)\n")
        body = [self.section(s) for s in self.r.sections]
        defs = [
            '<a id="definitions"></a>\n## Definitions',
            "",
            f"Every number above follows one of these; {REFERENCE}.",
        ]
        defs += [
            f'- <a id="def-{_anchor(k)}"></a>**{_md(k)}**: {_inline(v)}'
            for k, v in self.r.definitions.items()
        ]
        return "\n".join(head) + "\n" + "\n\n".join(body) + "\n\n" + "\n".join(defs) + "\n"


def render(report: Report, folder: str, *, step: StepFn | None = None) -> tuple[str, dict[str, bytes]]:
    """The Markdown text (images linked as `folder/NN-name.png`) and the PNG files by name."""
    md = _Markdown(report, folder, step or (lambda what: None))
    text = md.document()
    return text, md.images
