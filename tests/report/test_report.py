"""`perfscope report`: the numbers in the HTML and Markdown equal the analysis results, the files are
complete and valid (HTML, Markdown, PNG, CSV, Parquet), the dashboard's bytes are the CLI's file, and
user errors are clear."""

from __future__ import annotations

import io
import json
import re
import struct
import zipfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from test_report_store import build_study

from perfscope.analysis import Selection, run_analysis
from perfscope.charts import CHARTS
from perfscope.cli import main
from perfscope.report import PDF_REFUSAL, Progress, render_report
from perfscope.report.model import format_value
from perfscope.report.sections import ANALYSES_USED
from perfscope.store.open import open_store

SECTION_IDS = (
    "overview",
    "setup",
    "speedup",
    "lost-time",
    "sync",
    "backends",
    "utilisation",
    "stragglers",
    "batch",
    "prediction",
    "findings",
    "definitions",
)


@dataclass
class Parsed:
    tables: list[dict[str, Any]] = field(default_factory=list)  # analysis, key column, rows of {col: value}
    nums: list[dict[str, str]] = field(default_factory=list)
    figures: list[dict[str, str]] = field(default_factory=list)
    external: list[str] = field(default_factory=list)  # src/href pointing outside the file
    scripts: int = 0


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.out = Parsed()
        self.row: dict[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table" and "data-analysis" in a:
            self.out.tables.append({"analysis": a["data-analysis"], "key": a["data-key-column"], "rows": []})
        elif tag == "tr" and "data-key" in a:
            self.row = {}
            self.out.tables[-1]["rows"].append(self.row)
        elif tag == "td" and self.row is not None and "data-column" in a:
            self.row[a["data-column"]] = a["data-value"]
        elif tag == "span" and "data-analysis" in a:
            self.out.nums.append(a)
        elif tag == "figure":
            self.out.figures.append(a)
        elif tag == "script":
            self.out.scripts += 1
        for k in ("src", "href", "xlink:href"):
            v = a.get(k, "")
            if v and not v.startswith("#") and not v.startswith("data:"):
                self.out.external.append(v)


def parse(html: str) -> Parsed:
    p = _Parser()
    p.feed(html)
    return p.out


def same(shown: str, value: Any) -> bool:
    """A data-value equals the analysis value exactly (floats are written in repr)."""
    if value is None or (isinstance(value, float) and value != value):
        return shown == ""
    if isinstance(value, bool):
        return shown == ("true" if value else "false")
    if isinstance(value, float):
        return shown != "" and float(shown) == value
    return shown == str(value)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_study(tmp_path_factory.mktemp("study"))


@pytest.fixture(scope="module")
def analyses(study: Path) -> dict[str, list[dict[str, Any]]]:
    with open_store(study) as store:
        return {n: run_analysis(n, store, Selection()).to_pylist() for n in ANALYSES_USED}


@pytest.fixture(scope="module")
def html_report(study: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("html")
    rc = main([
        "report", str(study), "-o", str(out / "study.html"), "--title", "Study <&> test",
        "--tables", str(out / "tables"),
    ])  # fmt: skip
    assert rc == 0
    return out / "study.html", out / "tables"


@pytest.fixture(scope="module")
def md_report(study: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("md")
    rc = main([
        "report", str(study), "-o", str(out / "study.md"), "--tables", str(out / "tables"),
        "--table-format", "parquet",
    ])  # fmt: skip
    assert rc == 0
    return out / "study.md", out / "tables"


def test_html_tables_are_rows_of_the_analyses(html_report: tuple[Path, Path], analyses: dict) -> None:
    parsed = parse(html_report[0].read_text())
    checked = 0
    for t in parsed.tables:
        source = analyses[t["analysis"]]
        assert t["rows"], f"empty table from {t['analysis']}"
        for shown in t["rows"]:
            cols = [c for c in shown if source and c in source[0]]
            if not cols:
                continue  # a summary derived from the rows (the setups table)
            match = [r for r in source if all(same(shown[c], r[c]) for c in cols)]
            assert match, f"{t['analysis']}: row {shown} is not a row of the analysis"
            checked += len(cols)
    assert checked > 200


def test_html_numbers_in_the_text_equal_the_analyses(html_report: tuple[Path, Path], analyses: dict) -> None:
    nums = parse(html_report[0].read_text()).nums
    assert len(nums) >= 6
    for n in nums:
        source = analyses[n["data-analysis"]]
        rows = [r for r in source if n["data-key"] in (r.get("run_id"), r.get("group_id"))] or source
        assert any(same(n["data-value"], r[n["data-column"]]) for r in rows), n
        assert n["title"].startswith(f"{n['data-column']} from analysis {n['data-analysis']}.")


def test_html_is_self_contained_and_complete(html_report: tuple[Path, Path]) -> None:
    text = html_report[0].read_text()
    parsed = parse(text)
    assert parsed.external == []
    assert parsed.scripts == 0
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert "<title>Study &lt;&amp;&gt; test</title>" in text  # the title, escaped
    charts = [f["data-chart"] for f in parsed.figures]
    assert charts.count("speedup") == 2 and charts.count("efficiency") == 2  # runs only, then predicted
    assert set(charts) == set(CHARTS)
    for section in SECTION_IDS:
        assert f'<section id="{section}">' in text
    assert 'id="simulated-banner"' in text and "3 of 9 runs" in text
    for key in ("speedup", "busbw", "alpha-beta", "lost-time", "wait-at-collective", "utilisation"):
        assert f'id="def-{key}"' in text


def test_findings_are_ranked_and_linked(study: Path, html_report: tuple[Path, Path]) -> None:
    from perfscope.explain import explain

    with open_store(study) as store:
        found = explain(store, Selection())
    text = html_report[0].read_text()
    ids = re.findall(r'data-finding="([^"]+)"', text)
    assert ids == [f.id for f in found]
    assert any(f.rule == "straggler" for f in found)
    for f in found:
        assert f.recommendation.split(".")[0][:40] in text.replace("&#x27;", "'")


def test_tables_export_every_analysis_used(
    html_report: tuple[Path, Path], md_report: tuple[Path, Path], study: Path
) -> None:
    csv_dir, parquet_dir = html_report[1], md_report[1]
    with open_store(study) as store:
        for name in ANALYSES_USED:
            expected = run_analysis(name, store, Selection())
            from_parquet = pq.read_table(parquet_dir / f"{name}.parquet")
            assert from_parquet.replace_schema_metadata(None).equals(
                expected.replace_schema_metadata(None)
            ), name
            assert from_parquet.schema.metadata[b"perfscope.analysis"] == name.encode()
            from_csv = pacsv.read_csv(csv_dir / f"{name}.csv")
            assert from_csv.num_rows == expected.num_rows, name
            assert from_csv.column_names == expected.column_names, name
    findings = json.loads((csv_dir / "findings.json").read_text())
    assert findings and {"id", "title", "recommendation", "evidence"} <= set(findings[0])


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def test_markdown_report_and_pngs(md_report: tuple[Path, Path], analyses: dict) -> None:
    md_path = md_report[0]
    text = md_path.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) == 23  # the charts, communication's two and what-if's five included
    for rel in images:
        assert rel.startswith("study_files/")
        w, h = _png_size((md_path.parent / rel).read_bytes())
        assert w >= 400 and h >= 150, rel
    assert sorted(p.name for p in (md_path.parent / "study_files").iterdir()) == sorted(
        Path(r).name for r in images
    )
    assert "> **Simulated data.** 3 of 9 runs" in text
    # the "largest world size" table: each cell is the analysis value as the report formats it
    block = text.split("**Scaling at the largest world size of each group**")[1].split("\n\n")[1]
    lines = [ln for ln in block.splitlines() if ln.startswith("|")][2:]
    largest = {
        r["backend"]: r for r in analyses["scaling"] if r["experiment"] == "study" and r["world_size"] == 4
    }
    assert len(lines) == len(largest) == 2
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        r = largest[cells[0]]
        assert cells[4:] == [
            format_value(c, r[c]) for c in ("speedup", "ideal_speedup", "per_gpu_speedup", "efficiency")
        ]
        assert float(cells[4]) == pytest.approx(r["speedup"], abs=0.005)


def test_download_bytes_are_the_cli_file(study: Path, html_report: tuple[Path, Path]) -> None:
    with open_store(study) as store:
        html = render_report(store, Selection(), title="Study <&> test").decode()
        zipped = render_report(store, Selection(), fmt="md")
    stamp = re.compile(r"generated \d{4}-\d\d-\d\d \d\d:\d\d UTC")
    assert stamp.sub("", html) == stamp.sub("", html_report[0].read_text())
    with zipfile.ZipFile(io.BytesIO(zipped)) as z:
        names = z.namelist()
        assert "report.md" in names
        pngs = [n for n in names if n.endswith(".png")]
        assert len(pngs) == 23
        assert all(_png_size(z.read(n))[0] > 0 for n in pngs)
        assert "report_files/" in z.read("report.md").decode()


def test_selection_narrows_the_report(study: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.html"
    assert main(["report", str(study), "-o", str(out), "--experiment", "sweep"]) == 0
    text = out.read_text()
    assert "Scaling study: sweep" in text
    assert 'id="simulated-banner"' not in text  # the sweep is measured
    assert "study-nccl-n4" not in text
    assert '<section id="batch">' in text


def test_empty_selection_is_a_clear_error(
    study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(study), "-o", str(out), "--experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no runs in" in err and "experiments=nope" in err and "perfscope info" in err
    assert not out.exists()
    assert main(["report", str(study), "-o", str(out), "--runs", "no-such-run"]) == 2


def test_missing_store_and_unwritable_output(
    study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "missing"), "-o", str(tmp_path / "r.html")]) == 2
    assert "error" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert main(["report", str(study), "-o", str(tmp_path / "a-file" / "r.html")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["report", str(study), "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_pdf_is_refused_with_the_reason(
    study: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(study), "-o", str(tmp_path / "r.pdf")]) == 2
    assert PDF_REFUSAL in capsys.readouterr().err
    assert main(["report", str(study), "--format", "pdf", "-o", str(tmp_path / "r.x")]) == 2
    assert not list(tmp_path.iterdir())


def test_progress_bar_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = Progress(4, stream)
        for what in ("a", "b", "c", "d"):
            p.step(what)
        p.close()
    assert pipe.getvalue() == ""
    frames = tty.getvalue().split("\r")
    assert any("[" + "#" * 28 + "] 4/4 d" in f for f in frames)
    assert any("1/4 a" in f for f in frames)
    assert tty.getvalue().endswith("\r")  # the bar clears itself


def test_a_cpu_store_without_collectives_still_reports(tmp_path: Path) -> None:
    from storegen import make_run

    for n in (1, 2):
        make_run(tmp_path / "cpu", f"cpu-n{n}", world_size=n, steps=20, device=False, backend="gloo")
    out = tmp_path / "cpu.html"
    assert main(["report", str(tmp_path / "cpu"), "-o", str(out)]) == 0
    text = out.read_text()
    parsed = parse(text)
    # two world sizes make no prediction: the prediction section draws no figure again
    assert len(parsed.figures) >= 11 and parsed.external == []
    assert "No group has a model that predicts" in text
    # the charts without data say why instead of drawing nothing
    assert "no GPU samples in this selection" in text
    assert '<section id="batch">' not in text  # no sweep, no section
