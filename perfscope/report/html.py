"""Renders a report as one self-contained HTML file: inline CSS, charts as inline SVG drawn by
vl-convert; no script, font, image or style is fetched from anywhere.

Why SVG and not the Vega JavaScript bundle: the file then runs no code at all, so it opens the same
in a browser with JavaScript off, in a mail client or an intranet wiki, prints and saves to PDF
faithfully, and shows exactly the pictures the Markdown report's PNGs show. Interaction (tooltips,
zoom) is the dashboard's job; the exact numbers are in the tables under each chart.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterable
from typing import Any

from ..charts import to_svg
from ..words import counted
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

StepFn = Callable[[str], None]

_CSS = """
:root { --fg:#1d1d1f; --muted:#5f6368; --line:#e3e3e3; --accent:#0b5cad; --alarm:#b3261e;
        --warning:#a05a00; --info:#2b6cb0; --sim:#6b4fa3; }
* { box-sizing: border-box; }
body { font: 15px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--fg);
       margin: 0; background: #fafafa; }
main { max-width: 1120px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 28px; margin: 8px 0 4px; }
h2 { font-size: 21px; margin: 40px 0 8px; padding-top: 8px; border-top: 2px solid var(--line); }
h3 { font-size: 16px; margin: 20px 0 6px; }
.meta { color: var(--muted); font-size: 13px; margin: 0; }
.banner { border-radius: 6px; padding: 10px 14px; margin: 16px 0; }
.banner.sim { background: #f1ecfa; border: 1px solid #d5c8ef; color: #3d2a66; }
nav.toc { margin: 16px 0; padding: 10px 14px; background: #f5f7fa; border-radius: 6px; font-size: 14px; }
nav.toc a { display: inline-block; margin-right: 14px; color: var(--accent); text-decoration: none; }
.counts span { display: inline-block; margin-right: 14px; }
.num { font-variant-numeric: tabular-nums; font-weight: 600; }
figure.chart { margin: 18px 0; overflow-x: auto; }
figure.chart svg { max-width: 100%; height: auto; overflow: visible; }
figcaption { color: var(--muted); font-size: 13px; }
table.data { border-collapse: collapse; font-size: 13px; margin: 8px 0; font-variant-numeric: tabular-nums; }
table.data th, table.data td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: left; }
table.data th { background: #f5f7fa; font-weight: 600; }
table.data td.n { text-align: right; white-space: nowrap; }
.tablewrap { overflow-x: auto; }
details > summary { cursor: pointer; color: var(--accent); margin: 8px 0; }
p.defs, div.defs { color: var(--muted); font-size: 12.5px; margin: 4px 0 12px; }
div.defs dt { font-weight: 600; color: var(--fg); }
div.defs dd { margin: 0 0 6px 0; }
a { color: var(--accent); }
.src-simulated { color: var(--sim); font-weight: 600; }
article.finding { border-left: 4px solid var(--line); padding: 6px 14px; margin: 14px 0; }
article.finding.sev-alarm { border-color: var(--alarm); }
article.finding.sev-warning { border-color: var(--warning); }
article.finding.sev-info { border-color: var(--info); }
article.finding h3 { margin: 4px 0; }
.badge { display: inline-block; font-size: 11.5px; padding: 1px 7px; border-radius: 9px; margin-right: 6px;
         background: #eef1f5; color: var(--muted); }
.badge.alarm { background: #fbe9e7; color: var(--alarm); }
.badge.warning { background: #fff3e0; color: var(--warning); }
.badge.info { background: #e8f0fb; color: var(--info); }
.rec { background: #f6faf6; border-radius: 4px; padding: 6px 10px; }
code { background: #f1f3f4; padding: 0 4px; border-radius: 3px; font-size: 13px; }
@media print { body { background: #fff; } main { padding: 0; } details { display: block; }
               h2 { break-before: auto; } figure.chart, table.data { break-inside: avoid; } }
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _inline(text: str) -> str:
    """Escape, then `code` spans."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))


def data_value(value: Any) -> str:
    """A value as a data attribute: floats in repr (they read back exactly), None as ''."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _num(n: Num, definition: str) -> str:
    return (
        f'<span class="num" data-analysis="{_e(n.analysis)}" data-column="{_e(n.column)}" '
        f'data-key="{_e(n.key)}" data-value="{_e(data_value(n.value))}" '
        f'title="{_e(n.column)} from analysis {_e(n.analysis)}. {_e(definition)}">{_e(n.text())}</span>'
    )


def _prefix_ids(svg: str, prefix: str) -> str:
    """Inline SVGs share one id space, and vl-convert numbers its gradients per process: rename each
    chart's ids to prefix + order of appearance, so ids are unique and the file is reproducible."""
    names: dict[str, str] = {}
    for m in re.finditer(r'\bid="([^"]+)"', svg):
        names.setdefault(m.group(1), f"{prefix}{len(names)}")
    if not names:
        return svg
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{names[m.group(1)]}"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{names.get(m.group(1), m.group(1))})", svg)
    return re.sub(r'href="#([^"]+)"', lambda m: f'href="#{names.get(m.group(1), m.group(1))}"', svg)


class _Html:
    def __init__(self, report: Report, step: StepFn) -> None:
        self.r = report
        self.step = step
        self.chart_no = 0
        self.section_of: dict[str, str] = {}
        for s in report.sections:
            for b in s.blocks:
                for a in _analyses_of(b):
                    self.section_of.setdefault(a, s.id)

    def definition_of(self, analysis: str) -> str:
        keys = self.r.analysis_definitions.get(analysis, ())
        return " ".join(self.r.definitions.get(k, "") for k in keys)

    def defs_line(self, analyses: Iterable[str]) -> str:
        return f'<p class="defs">{self.defs_text(analyses)}</p>'

    def defs_text(self, analyses: Iterable[str]) -> str:
        """The analysis the numbers come from and the definitions they follow (full text on hover)."""
        links = []
        for a in analyses:
            keys = self.r.analysis_definitions.get(a, ())
            refs = ", ".join(
                f'<a href="#def-{_e(k)}" title="{_e(self.r.definitions.get(k, ""))}">{_e(k)}</a>'
                for k in keys
                if k in self.r.definitions
            )
            links.append(f"<code>{_e(a)}</code> ({_e(self.r.analysis_titles.get(a, a))}): {refs}")
        return f"From analysis {'; '.join(links)}."

    def para(self, frags: list[Any]) -> str:
        parts = []
        for f in frags:
            if isinstance(f, Num):
                parts.append(_num(f, self.definition_of(f.analysis)))
            elif isinstance(f, Ref):
                parts.append(f'<a href="#{_e(f.anchor)}">{_e(f.text)}</a>')
            else:
                parts.append(_inline(f))
        return f"<p>{''.join(parts)}</p>"

    def chart(self, b: ChartBlock) -> str:
        self.chart_no += 1
        self.step(f"chart {b.name}")
        svg = _prefix_ids(to_svg(b.chart), f"c{self.chart_no}-")
        caption = f"{_e(b.title)}" + (f" — {_e(b.caption)}" if b.caption else "")
        return (
            f'<figure class="chart" id="chart-{self.chart_no}" data-chart="{_e(b.name)}" '
            f'data-analyses="{_e(" ".join(b.analyses))}">{svg}'
            f"<figcaption>Figure {self.chart_no}. {caption}. {self.defs_text(b.analyses)}</figcaption>"
            "</figure>"
        )

    def table(self, t: TableBlock) -> str:
        head = "".join(f'<th title="column {_e(c.name)}">{_e(c.header)}</th>' for c in t.columns)
        body = []
        for row in t.rows:
            cells = []
            for c in t.columns:
                v = row.get(c.name)
                numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
                cls = ' class="n"' if numeric else ""
                text = _e(format_value(c.name, v))
                if c.name == "source" and v == "simulated":
                    text = f'<span class="src-simulated">{text}</span>'
                cells.append(
                    f'<td{cls} data-column="{_e(c.name)}" data-value="{_e(data_value(v))}">{text}</td>'
                )
            body.append(f'<tr data-key="{_e(row.get(t.key, ""))}">{"".join(cells)}</tr>')
        table = (
            f'<div class="tablewrap"><table class="data" data-analysis="{_e(t.analysis)}" '
            f'data-key-column="{_e(t.key)}"><caption hidden>{_e(t.caption)}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
        )
        title = f"<h3>{_e(t.caption)}</h3>"
        if t.collapsed:
            table = (
                f"<details><summary>{_e(t.caption)}: {counted(len(t.rows), 'row')}</summary>{table}</details>"
            )
            title = ""
        return title + table + self.defs_line([t.analysis])

    def findings(self, b: FindingsBlock) -> str:
        out = []
        for f in b.findings:
            loss = (
                f'<span class="badge">explains {f.explained_loss * 100:.0f}% of the lost time</span>'
                if f.explained_loss is not None
                else ""
            )
            analyses = ", ".join(
                f'<a href="#{self.section_of[a]}">{_e(a)}</a>' if a in self.section_of else _e(a)
                for a in f.analyses
            )
            runs = ", ".join(_e(r) for r in f.run_ids)
            group = f'<p class="meta">group {_e(f.group_label)}</p>' if f.group_label else ""
            badges = (
                f'<span class="badge {_e(f.severity)}">{_e(f.severity)}</span>'
                f'<span class="badge">{_e(f.category)}</span>'
                f'<span class="badge">confidence {_e(f.confidence_label)} ({f.confidence:.2f})</span>{loss}'
            )
            symptoms = (
                "<p><strong>Symptoms of this cause</strong> (their shares overlap its share):</p><ul>"
                + "".join(f"<li><em>{_e(t)}.</em> {_inline(x)}</li>" for t, x in f.symptoms)
                + "</ul>"
                if f.symptoms
                else ""
            )
            evidence = f"Evidence: analyses {analyses}"
            if runs:
                evidence += f"<details><summary>{counted(len(f.run_ids), 'run')}</summary>{runs}</details>"
            out.append(
                f'<article class="finding sev-{_e(f.severity)}" id="finding-{f.rank}" '
                f'data-finding="{_e(f.id)}">'
                f"<h3>{f.rank}. {_e(f.title)}</h3>{group}<p>{badges}</p><p>{_inline(f.text)}</p>{symptoms}"
                f'<p class="rec"><strong>Recommendation.</strong> {_inline(f.recommendation)}</p>'
                f'<div class="defs">{evidence}</div></article>'
            )
        return "".join(out)

    def section(self, s: Section) -> str:
        parts = [f'<section id="{_e(s.id)}"><h2>{_e(s.heading)}</h2>']
        if s.id == "overview":
            parts.append(self.counts())
        for b in s.blocks:
            if isinstance(b, ChartBlock):
                parts.append(self.chart(b))
            elif isinstance(b, TableBlock):
                parts.append(self.table(b))
            elif isinstance(b, FindingsBlock):
                parts.append(self.findings(b))
            else:
                parts.append(self.para(b))
        if s.id == "overview":
            links = "".join(
                f'<li><a href="#finding-{f.rank}">{_e(f.title)}</a></li>'
                for f in self.r.findings
                if f.severity != "info"
            )
            parts.append(
                f"<details><summary>every finding</summary><ol>{links}</ol></details>" if links else ""
            )
        parts.append("</section>")
        return "".join(parts)

    def counts(self) -> str:
        sev = {k: sum(1 for f in self.r.findings if f.severity == k) for k in ("alarm", "warning", "info")}
        return (
            '<p class="counts">'
            f"<span>runs <strong>{self.r.runs}</strong></span>"
            f"<span>simulated <strong>{self.r.simulated_runs}</strong></span>"
            + "".join(f'<span class="badge {k}">{v} {k}</span>' for k, v in sev.items())
            + "</p>"
        )

    def document(self) -> str:
        toc = "".join(f'<a href="#{_e(s.id)}">{_e(s.heading)}</a>' for s in self.r.sections)
        toc += '<a href="#definitions">Definitions</a>'
        banner = ""
        if self.r.simulated_runs:
            every = self.r.simulated_runs == self.r.runs
            banner = (
                '<div class="banner sim" id="simulated-banner"><strong>Simulated data.</strong> '
                + ("Every run" if every else f"{self.r.simulated_runs} of {self.r.runs} runs")
                + " in this report "
                + ("was" if every else "were")
                + " simulated by <code>perfscope simulate</code>, not measured on hardware. Charts draw "
                "simulated runs as hollow triangles; tables say <em>simulated</em>.</div>"
            )
        body = "".join(self.section(s) for s in self.r.sections)
        defs = "".join(
            f'<dt id="def-{_e(k)}">{_e(k)}</dt><dd>{_e(v)}</dd>' for k, v in self.r.definitions.items()
        )
        meta = "".join(f'<p class="meta">{_e(line)}</p>' for line in self.r.subtitle)
        return (
            "<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
            "style-src 'unsafe-inline'; img-src data:\">"
            f'<meta name="generator" content="perfscope {_e(self.r.perfscope_version)}">'
            f"<title>{_e(self.r.title)}</title><style>{_CSS}</style></head>"
            f"<body><main><header><h1>{_e(self.r.title)}</h1>{meta}</header>{banner}"
            f'<nav class="toc">{toc}</nav>{body}'
            f'<section id="definitions"><h2>Definitions</h2>'
            f"<p>Every number above follows one of these; {_e(REFERENCE)}.</p>"
            f'<div class="defs"><dl>{defs}</dl></div>'
            "</section></main></body></html>\n"
        )


def _analyses_of(b: Any) -> tuple[str, ...]:
    if isinstance(b, ChartBlock):
        return b.analyses
    if isinstance(b, TableBlock):
        return (b.analysis,)
    if isinstance(b, list):
        return tuple(f.analysis for f in b if isinstance(f, Num))
    return ()


def render(report: Report, *, step: StepFn | None = None) -> bytes:
    """The report as a UTF-8 HTML document."""
    return _Html(report, step or (lambda what: None)).document().encode("utf-8")
