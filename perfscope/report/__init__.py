"""The scaling-study report: runs the analyses and the explainer for a selection, and writes one
self-contained HTML file (or Markdown with PNG charts beside it), plus the tables it used.

    from perfscope.report import render_report, write_report
    html = render_report(store, Selection(experiments=("resnet",)), title="ResNet on 1-16 GPUs")
    write_report(store, sel, "study.md", fmt="md", tables_dir="tables/")

`render_report` returns the bytes the dashboard's download button serves: the HTML file, or a ZIP of
the Markdown file and its PNGs (`fmt="md"`). `fmt="pdf"` is refused with the reason (PDF_REFUSAL).
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import pyarrow as pa

from .. import __version__
from ..analysis import ANALYSES, DEFINITIONS, Selection, run_analysis
from ..analysis.compare import Comparison
from ..errors import PerfscopeError
from ..explain import explain
from ..output import check_output_file, csv_text, output_folder, write_output
from ..store.reader import Store
from .model import Finding, Report
from .sections import ANALYSES_USED, build_sections, context

FORMATS: dict[str, str] = {"html": ".html", "md": ".md", "pdf": ".pdf"}
TABLE_FORMATS = ("csv", "parquet")

#: Why there is no PDF: a whole-report PDF needs a layout engine. The well-kept pure-Python ones
#: (reportlab, fpdf2) would be a new dependency and still need a Unicode TTF font found on the system
#: for α, β, −, ·, ²; WeasyPrint needs Pango; Chromium's print-to-PDF needs a browser.
PDF_REFUSAL = (
    "--format pdf is not supported: perfscope ships no PDF layout engine and downloads no browser. "
    "Open the HTML report in a browser and print it to PDF (its print style keeps every chart and "
    "table whole), or convert the Markdown report with pandoc."
)


class Progress:
    """A one-line progress bar on a terminal; silent when the stream is not a terminal."""

    WIDTH = 28

    def __init__(self, total: int, stream: TextIO | None = None, *, label: str = "report") -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream
        self.label = label
        self.enabled = stream is not None and hasattr(stream, "isatty") and stream.isatty()
        self.started = time.monotonic()

    def add(self, n: int) -> None:
        """More work than first thought (e.g. the charts, once the sections are known)."""
        self.total += n

    def step(self, what: str) -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled or self.stream is None:
            return
        filled = round(self.WIDTH * self.done / self.total)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        line = f"\r{self.label} [{bar}] {self.done}/{self.total} {what}"
        self.stream.write(line[:100].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.stream is not None:
            self.stream.write(f"\r{' ' * 100}\r")
            self.stream.flush()


StepFn = Callable[[str], None]


def _no_progress(what: str) -> None:
    return None


@dataclass
class Collected:
    report: Report
    tables: dict[str, pa.Table] = field(default_factory=dict)
    findings_json: list[dict[str, object]] = field(default_factory=list)


def describe_selection(sel: Selection) -> str:
    parts = [
        f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in sel.as_dict().items() if v
    ]
    return " ".join(parts) or "(everything)"


def collect(
    store: Store,
    sel: Selection | None = None,
    *,
    title: str | None = None,
    step: StepFn = _no_progress,
    compare: Comparison | None = None,
) -> Collected:
    """Run every analysis the report uses and the explainer; build the report's sections (with
    `compare`, first the section that compares the selected run with a base run)."""
    sel = sel or Selection()
    tables: dict[str, pa.Table] = {}
    for name in ANALYSES_USED:
        step(f"analysis {name}")
        tables[name] = run_analysis(name, store, sel)
        if name == "run_summary" and tables[name].num_rows == 0:
            raise PerfscopeError(
                f"no runs in {store.root} match the selection {describe_selection(sel)}; "
                "`perfscope info STORE` lists the experiments and runs it holds."
            )
    step("findings")
    found = explain(store, sel)
    findings = [
        Finding(
            id=f.id,
            rank=i,
            severity=f.severity,
            category=f.category,
            title=f.title,
            text=f.text,
            recommendation=f.recommendation,
            confidence=f.confidence,
            confidence_label=f.confidence_label,
            explained_loss=f.explained_loss,
            run_ids=f.evidence.run_ids,
            analyses=f.evidence.analyses,
            group_id=f.group_id,
            symptoms=tuple((s.title, s.text) for s in f.symptoms),
            also_in=tuple(a.title for a in f.also_in),
        )
        for i, f in enumerate(found, start=1)
    ]
    ctx = context(tables, findings, found)
    for f in findings:
        f.group_label = ctx.label(f.group_id) if f.group_id else ""
    sections = build_sections(ctx)
    titles = {n: ANALYSES[n].title for n in ANALYSES_USED}
    if compare is not None:
        from .compare import ANALYSIS, TITLE, compare_section

        step("compare")
        sections.insert(0, compare_section(compare))
        titles[ANALYSIS] = TITLE
    runs = tables["run_summary"]
    sources = runs.column("source").to_pylist()
    experiments = sorted({e for e in runs.column("experiment").to_pylist() if e})
    keys: list[str] = []
    for s in sections:
        keys += [k for k in s.definitions if k not in keys]
    for name in ANALYSES_USED:
        keys += [k for k in ANALYSES[name].definition if k not in keys]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = Report(
        title=title or f"Scaling study: {', '.join(experiments) or 'all runs'}",
        subtitle=[
            f"store {store.root}",
            f"selection {describe_selection(sel)}",
            f"generated {now} by perfscope {__version__}",
        ],
        generated_utc=now,
        store=str(store.root),
        selection=sel.as_dict(),
        perfscope_version=__version__,
        runs=runs.num_rows,
        simulated_runs=sum(1 for s in sources if s == "simulated"),
        sections=sections,
        findings=findings,
        definitions={k: DEFINITIONS[k] for k in keys if k in DEFINITIONS and k != "raw"},
        analysis_titles=titles,
        analysis_definitions={n: ANALYSES[n].definition for n in ANALYSES_USED},
    )
    return Collected(report, tables, [f.to_dict() for f in found])


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise PerfscopeError(f"unknown report format {fmt!r}; use html or md")
    if fmt == "pdf":
        raise PerfscopeError(PDF_REFUSAL)


def _markdown_zip(report: Report, step: StepFn) -> bytes:
    from .markdown import render as render_md

    text, images = render_md(report, "report_files", step=step)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("report.md", text)
        for name, png in images.items():
            z.writestr(f"report_files/{name}", png)
    return buf.getvalue()


def _render(report: Report, fmt: str, step: StepFn) -> bytes:
    if fmt == "html":
        from .html import render as render_html

        return render_html(report, step=step)
    return _markdown_zip(report, step)


def render_report(
    store: Store,
    sel: Selection | None = None,
    *,
    title: str | None = None,
    fmt: str = "html",
    progress: Progress | None = None,
) -> bytes:
    """The report as one file's bytes: HTML (self-contained) or a ZIP of report.md + report_files/*.png
    (`fmt="md"`). Raises PerfscopeError for an empty selection or an unknown (or pdf) format."""
    _check_format(fmt)
    step = progress.step if progress else _no_progress
    collected = collect(store, sel, title=title, step=step)
    if progress:
        progress.add(len(collected.report.charts()))
    return _render(collected.report, fmt, step)


# ---- writing files ------------------------------------------------------------------------------


def export_tables(
    collected: Collected, folder: Path, table_format: str = "csv", step: StepFn = _no_progress
) -> list[Path]:
    """Every analysis table the report used, one file each, plus findings.json."""
    if table_format not in TABLE_FORMATS:
        raise PerfscopeError(f"unknown table format {table_format!r}; use csv or parquet")
    output_folder(folder, what="tables folder", flag="--tables")
    written = []
    for name, table in collected.tables.items():
        step(f"table {name}")
        path = folder / f"{name}.{table_format}"
        buf = io.BytesIO()
        if table_format == "csv":
            buf.write(csv_text(table).encode())  # quoted only where needed, as DuckDB and psql write CSV
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, buf)
        write_output(path, buf.getvalue(), what="table", flag="--tables")
        written.append(path)
    path = folder / "findings.json"
    write_output(path, (json.dumps(collected.findings_json, indent=2) + "\n").encode(), flag="--tables")
    written.append(path)
    return written


@dataclass
class Written:
    report: Path
    files: list[Path]  # everything written, the report first
    charts: int
    findings: int
    runs: int


def infer_format(output: Path, fmt: str | None) -> str:
    if fmt:
        _check_format(fmt)
        return fmt
    for name, ext in FORMATS.items():
        if output.suffix.lower() == ext or (name == "md" and output.suffix.lower() == ".markdown"):
            return name
    return "html"


def write_report(
    store: Store,
    sel: Selection | None,
    output: str | os.PathLike[str],
    *,
    fmt: str | None = None,
    title: str | None = None,
    tables_dir: str | os.PathLike[str] | None = None,
    table_format: str = "csv",
    stream: TextIO | None = None,
    compare: Comparison | None = None,
) -> Written:
    """Write the report to `output` (Markdown: PNGs in `<stem>_files/` beside it) and, with
    `tables_dir`, every analysis table it used. A progress bar goes to `stream` when it is a terminal."""
    out = Path(output)
    fmt = infer_format(out, fmt)
    check_output_file(out, what="report")
    if tables_dir is not None:
        output_folder(tables_dir, what="tables folder", flag="--tables", create=False)
    if table_format not in TABLE_FORMATS:
        raise PerfscopeError(f"unknown table format {table_format!r}; use csv or parquet")
    progress = Progress(len(ANALYSES_USED) + 2, stream)
    try:
        collected = collect(store, sel, title=title, step=progress.step, compare=compare)
        report = collected.report
        progress.add(len(report.charts()) + (len(collected.tables) + 1 if tables_dir else 0))
        files: list[Path] = [out]
        if fmt == "md":
            from .markdown import render as render_md

            folder = out.with_name(f"{out.stem}_files")
            text, images = render_md(report, folder.name, step=progress.step)
            output_folder(folder, what="charts folder")
            for name, png in images.items():
                files.append(write_output(folder / name, png, what="chart"))
            write_output(out, text.encode(), what="report")
        else:
            write_output(out, _render(report, fmt, progress.step), what="report")
        if tables_dir is not None:
            files += export_tables(collected, Path(tables_dir), table_format, progress.step)
        progress.step("done")
    finally:
        progress.close()
    return Written(out, files, len(report.charts()), len(report.findings), report.runs)


def default_output(fmt: str) -> Path:
    return Path(f"perfscope-report{FORMATS[fmt]}")


__all__ = [
    "FORMATS",
    "PDF_REFUSAL",
    "TABLE_FORMATS",
    "Collected",
    "Progress",
    "Written",
    "collect",
    "default_output",
    "export_tables",
    "infer_format",
    "render_report",
    "write_report",
]
