"""Renders a report as Markdown (GitHub-flavoured tables) with its charts as PNG files beside it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .charts import to_png
from .report_model import ChartBlock, FindingsBlock, Num, Ref, Report, Section, TableBlock, format_value

StepFn = Callable[[str], None]

#: PNG scale: 2 keeps charts sharp on high-density screens and in print.
PNG_SCALE = 2.0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _para(frags: list[Any]) -> str:
    out = []
    for f in frags:
        if isinstance(f, Num):
            out.append(f"**{f.text()}**")
        elif isinstance(f, Ref):
            out.append(f"[{f.text}](#{f.anchor})")
        else:
            out.append(f)
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
            refs = ", ".join(f"[{k}](#def-{k})" for k in keys)
            parts.append(f"`{a}` ({self.r.analysis_titles.get(a, a)}): {refs}")
        return f"<sub>From analysis {'; '.join(parts)}.</sub>"

    def chart(self, b: ChartBlock) -> str:
        n = len(self.images) + 1
        self.step(f"chart {b.name}")
        name = f"{n:02d}-{b.name.replace('_', '-')}.png"
        self.images[name] = to_png(b.chart, PNG_SCALE)
        caption = b.title + (f" — {b.caption}" if b.caption else "")
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
        lines = [f"**{t.caption}**", "", head, align]
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
            group = f" (group {f.group_label})" if f.group_label else ""
            out.append(
                f'<a id="finding-{f.rank}"></a>\n### {f.rank}. {f.title}\n\n'
                f"*{f.severity}, {f.category}, confidence {f.confidence_label} ({f.confidence:.2f})"
                f"{loss}*{group}\n\n"
                f"{f.text}\n\n**Recommendation.** {f.recommendation}\n\n"
                f"<sub>Evidence: analyses {', '.join(f.analyses)}; runs {', '.join(f.run_ids)}.</sub>"
            )
        return "\n\n".join(out)

    def section(self, s: Section) -> str:
        parts = [f'<a id="{s.id}"></a>\n## {s.heading}']
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
        head = [f"# {self.r.title}", "", *(f"{line}  " for line in self.r.subtitle), ""]
        if self.r.simulated_runs:
            every = self.r.simulated_runs == self.r.runs
            who = "Every run" if every else f"{self.r.simulated_runs} of {self.r.runs} runs"
            head.append(
                f"> **Simulated data.** {who} in this report {'was' if every else 'were'} simulated by "
                "`perfscope simulate`, not measured on hardware. Charts draw simulated runs as hollow "
                "triangles; tables say *simulated*.\n"
            )
        toc = " · ".join(f"[{s.heading}](#{s.id})" for s in self.r.sections)
        head.append(toc + " · [Definitions](#definitions)\n")
        body = [self.section(s) for s in self.r.sections]
        defs = ['<a id="definitions"></a>\n## Definitions', "", "Every number above follows one of these."]
        defs += [f'- <a id="def-{k}"></a>**{k}**: {v}' for k, v in self.r.definitions.items()]
        return "\n".join(head) + "\n" + "\n\n".join(body) + "\n\n" + "\n".join(defs) + "\n"


def render(report: Report, folder: str, *, step: StepFn | None = None) -> tuple[str, dict[str, bytes]]:
    """The Markdown text (images linked as `folder/NN-name.png`) and the PNG files by name."""
    md = _Markdown(report, folder, step or (lambda what: None))
    text = md.document()
    return text, md.images
