"""Analyse a store: the runs, the scaling table of every group, and the ranked findings in words."""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from typing import Any

import pyarrow as pa

from .. import __version__
from ..analysis import DEFINITIONS, Selection, run_analysis
from ..analysis.groups import group_name
from ..errors import PerfscopeError
from ..explain import Finding, explain
from ..store.open import open_store
from ..store.reader import Store
from ..terminal import (
    format_rows,
    heading,
    printable,
    prose_width,
    style,
    terminal_width,
    use_colour,
    wrap,
)
from ..words import counted
from .info import compact_first

#: Bump only when a key is renamed or removed or changes meaning; adding keys keeps the version.
#: 2: step_ns is elapsed time per step (was the median); mfu, batch_sweep, time_to_metric and
#: evidence (every analysis a finding cites) added. what_if added (3D-parallel what-if, issue 23).
JSON_FORMAT_VERSION = 2
#: Analyses shown as their own sections and JSON keys, besides runs and scaling.
SECTIONS = ("mfu", "batch_sweep", "time_to_metric", "what_if")

SEVERITY_STYLE = {"alarm": "1;31", "warning": "1;33", "info": "1;34"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder")
    p.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="NAME",
        help="only this experiment (repeat for several)",
    )
    p.add_argument("--run", action="append", default=[], metavar="RUN_ID", help="only this run (repeatable)")
    p.add_argument("--cluster", action="append", default=[], help="only this cluster/partition (repeatable)")
    p.add_argument("--backend", action="append", default=[], help="only this backend (repeatable)")
    p.add_argument("--source", choices=["measured", "simulated"], help="only measured or only simulated runs")
    p.add_argument(
        "--warmup",
        type=int,
        metavar="STEPS",
        help="warm-up steps to drop per run (default: max(10, 5%% of the run))",
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="METRIC=VALUE",
        help="time-to-metric target, e.g. loss=0.5 or accuracy=0.8 (repeatable; default: the best "
        "value most runs that did not diverge reached)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (format in docs/analysis.md)")


def parse_targets(values: list[str]) -> tuple[tuple[str, float], ...]:
    """'loss=0.5' -> (('loss', 0.5),); a malformed one is a one-line error."""
    out = []
    for v in values:
        name, sep, number = v.partition("=")
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not sep or not name.strip() or not math.isfinite(value):
            raise PerfscopeError(f"--target {v!r}: expected METRIC=NUMBER, e.g. loss=0.5 or accuracy=0.8")
        out.append((name.strip(), value))
    return tuple(out)


def selection_from(args: argparse.Namespace) -> Selection:
    if args.warmup is not None and args.warmup < 0:
        raise PerfscopeError("--warmup must be 0 or more steps")
    return Selection(
        targets=parse_targets(getattr(args, "target", [])),
        experiments=tuple(args.experiment),
        run_ids=tuple(args.run),
        clusters=tuple(args.cluster),
        backends=tuple(args.backend),
        source=args.source,
        warmup_steps=args.warmup,
    )


def report(store: Store, sel: Selection) -> dict[str, Any]:
    """The analysis behind both outputs: runs, scaling rows and ranked findings."""
    runs = run_analysis("run_summary", store, sel)
    if runs.num_rows == 0:
        raise PerfscopeError(
            f"no runs in {store.root} match the selection {_describe(sel)}; "
            "`perfscope info STORE` lists the experiments and runs it holds."
        )
    findings = explain(store, sel)
    cited = sorted({a for f in findings for a in f.evidence.analyses} - {"run_summary", "scaling", *SECTIONS})
    return {
        "runs": runs,
        "scaling": run_analysis("scaling", store, sel),
        **{name: run_analysis(name, store, sel) for name in SECTIONS},
        "findings": findings,
        "evidence": {name: run_analysis(name, store, sel) for name in cited},
    }


def to_json(store: Store, sel: Selection, rep: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": "perfscope-analyze",
        "format_version": JSON_FORMAT_VERSION,
        "perfscope_version": __version__,
        "store": str(store.root),
        "selection": sel.as_dict(),
        "runs": _rows(rep["runs"]),
        "scaling": _rows(rep["scaling"]),
        **{name: _rows(rep[name]) for name in SECTIONS},
        "findings": [f.to_dict() for f in rep["findings"]],
        "evidence": {name: _rows(table) for name, table in rep["evidence"].items()},
        "definitions": DEFINITIONS,
    }


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        for row in table.to_pylist()
    ]


def _describe(sel: Selection) -> str:
    parts = [f"{k}={v}" for k, v in sel.as_dict().items() if v not in ((), [], {}, None)]
    return "(" + ", ".join(parts) + ")" if parts else "(everything)"


def _ms(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


def render_runs(runs: pa.Table, colour: bool, width: int | None = None) -> str:
    rows = [
        [
            r["run_id"],
            r["source"],
            r["experiment"],
            r["cluster"],
            r["backend"],
            r["world_size"],
            r["nodes"],
            r["batch_size_per_rank"],
            r["steady_steps"],
            _ms(r["step_ns"]),
            _ms(r["step_p10_ns"]),
            _ms(r["step_p90_ns"]),
            r["throughput_samples_per_s"],
        ]
        for r in runs.to_pylist()
    ]
    header = [
        "run",
        "source",
        "experiment",
        "cluster",
        "backend",
        "N",
        "nodes",
        "batch/rank",
        "steady steps",
        "step ms",
        "p10 ms",
        "p90 ms",
        "samples/s",
    ]
    return format_rows(header, rows, colour=colour, width=width)


def _placements(rows: list[dict[str, Any]]) -> str:
    """A note for each N the group ran in several placements (nodes × ranks per node): each is its own
    setup, compared as placements, never averaged as repeats of one."""
    by_n: dict[int, set[tuple[Any, Any]]] = {}
    for r in rows:
        by_n.setdefault(r["world_size"], set()).add((r["nodes"], r["gpus_per_node"]))
    notes = [
        f"N={n} ran in {len(ps)} placements ("
        + "; ".join(f"{counted(a or 1, 'node')} × {counted(b or n, 'rank')}" for a, b in sorted(ps, key=str))
        + ")"
        for n, ps in sorted(by_n.items())
        if len(ps) > 1
    ]
    if not notes:
        return ""
    return "; ".join(notes) + ": each placement is a setup of its own, compared as such, not as repeats."


def render_scaling(scaling: pa.Table, colour: bool, width: int | None = None) -> str:
    out = []
    groups: dict[str, list[dict[str, Any]]] = {}
    singles = 0
    for r in scaling.to_pylist():
        groups.setdefault(r["group_id"], []).append(r)
    for gid, rows in groups.items():
        if rows[0]["scaling_mode"] == "single":
            singles += 1
            continue
        first = rows[0]
        note = f"  MIXED: {first['mode_note']}" if first["mixed"] else ""
        # every known part of the group, never '-' for an unknown one
        mode = f"{first['scaling_mode']} scaling, baseline N0={first['baseline_world_size']}"
        title = f"{group_name(gid)}  ({mode}){note}"
        out.append(heading(wrap(title, width, hang="    "), colour=colour))
        table = []
        for r in rows:
            phases = {
                p: r[f"lost_{p}_ns"] or 0.0
                for p in ("data", "forward", "backward", "sync_exposed", "optimizer", "other", "imbalance")
            }
            top = max(phases, key=lambda p: phases[p]) if (r["lost_ns"] or 0) > 0 else ""
            table.append(
                [
                    r["world_size"],
                    r["nodes"],
                    r["gpus_per_node"],
                    r["run_id"],
                    r["source"],
                    _ms(r["step_ns"]),
                    r["throughput_samples_per_s"],
                    r["speedup"],
                    r["efficiency"],
                    r["per_gpu_speedup"],
                    r["sync_share"],
                    _ms(r["lost_ns"]),
                    top,
                ]
            )
        out.append(
            format_rows(
                [
                    "N",
                    "nodes",
                    "ranks/node",
                    "run",
                    "source",
                    "step ms",
                    "samples/s",
                    "speedup",
                    "efficiency",
                    "per-GPU speedup",
                    "sync share",
                    "lost GPU·ms/step",
                    "most lost in",
                ],
                table,
                colour=colour,
                width=width,
            )
        )
        placements = _placements(rows)
        if placements:
            out.append(wrap(placements, width))
        out.append("")
    if singles:
        out.append(
            wrap(
                f"({counted(singles, 'group')} with a single world size, such as batch-size sweeps, "
                f"{'is' if singles == 1 else 'are'} in the runs table.)",
                width,
            )
        )
        out.append("")
    return "\n".join(out)


def render_mfu(mfu: pa.Table, colour: bool, width: int | None = None) -> str:
    rows = [
        [r["run_id"], r["world_size"], r["device_model"], r["flops_per_step"], r["achieved_flops_per_s"],
         r["device_peak_flops"], r["mfu"]]
        for r in mfu.to_pylist()
    ]  # fmt: skip
    header = ["run", "N", "device", "FLOPs/step", "achieved FLOP/s", "peak FLOP/s", "MFU"]
    return (
        format_rows(header, rows, colour=colour, width=width)
        if rows
        else "(no run recorded its FLOPs per step)"
    )


def render_batch_sweep(sweep: pa.Table, colour: bool, width: int | None = None) -> str:
    rows = [
        [r["experiment"], r["world_size"], r["batch_size_per_rank"], r["run_id"], _ms(r["step_ns"]),
         r["throughput_samples_per_s"], r["throughput_vs_smallest"], r["epoch_s"]]
        for r in sweep.to_pylist()
    ]  # fmt: skip
    header = ["experiment", "N", "batch/rank", "run", "step ms", "samples/s", "vs smallest batch", "epoch s"]
    return (
        format_rows(header, rows, colour=colour, width=width)
        if rows
        else "(no runs differ only in batch size)"
    )


def render_time_to_metric(ttm: pa.Table, colour: bool, width: int | None = None) -> str:
    rows = [
        [r["experiment"], r["variant"], r["metric"], f"{r['target']:.4g} ({r['target_source']})",
         r["run_id"], r["world_size"], r["batch_size_per_rank"],
         "diverged" if r["diverged"] else ("yes" if r["reached"] else "no"), r["time_to_target_s"],
         r["steps_to_target"], r["best_value"]]
        for r in ttm.to_pylist()
    ]  # fmt: skip
    header = ["experiment", "variant", "metric", "target", "run", "N", "batch/rank", "reached", "time s",
              "steps", "best"]  # fmt: skip
    return format_rows(header, rows, colour=colour, width=width) if rows else "(no run logged a metric)"


def _explained(f: Finding) -> str:
    return f"explains {f.explained_loss:.0%} of the lost time" if f.explained_loss is not None else ""


class _Wrapper(textwrap.TextWrapper):
    """Fills a paragraph of a finding, whose words quote names from the store (run ids, clusters,
    backends, hosts): escaped, so a name from a trace cannot drive the terminal."""

    def fill(self, text: str) -> str:
        return super().fill(printable(text))


def render_findings(findings: list[Finding], colour: bool, width: int | None) -> str:
    """Ranked root causes, each with its symptoms; the same cause on other groups one line each."""
    if not findings:
        return "No findings: nothing in the selected runs needs explaining."
    out = []
    lines = prose_width(width)
    para = _Wrapper(width=lines, initial_indent="   ", subsequent_indent="   ", break_long_words=False)
    also = _Wrapper(width=lines, initial_indent="   - ", subsequent_indent="     ", break_long_words=False)
    for i, f in enumerate(findings, 1):
        tag = style(f"[{f.severity.upper()}]", SEVERITY_STYLE[f.severity], enabled=colour)
        explained = ", " + _explained(f) if f.explained_loss is not None else ""
        # wrapped before it is styled, so the escape codes do not count as width
        prefix = f"{i}. [{f.severity.upper()}] "
        title = wrap(prefix + f.title, width, hang="   ").split("\n")
        out.append(f"{i}. {tag} {style(title[0][len(prefix) :], '1', enabled=colour)}")
        out += [style(t, "1", enabled=colour) for t in title[1:]]
        out.append(para.fill(f"({f.category}, confidence {f.confidence_label}{explained})"))
        out.append(para.fill(f.text))
        if f.symptoms:  # one line each here; their full words are in --json and the report
            out.append(
                para.fill("Symptoms of this cause (their shares overlap its share, they do not add to it):")
            )
            for s in f.symptoms:
                note = f" ({_explained(s)}, confidence {s.confidence_label})"
                out.append(also.fill(s.title + (note if s.explained_loss is not None else "")))
        if f.recommendation:
            out.append(para.fill("What to do: " + f.recommendation))
        runs = f.evidence.run_ids
        ev = (
            f"{counted(len(runs), 'run')}; "
            if len(runs) > 3
            else (f"runs {', '.join(runs)}; " if runs else "")
        )
        names = ", ".join(f.evidence.analyses)
        out.append(
            para.fill(f"Evidence: {ev}{'analysis' if len(f.evidence.analyses) == 1 else 'analyses'} {names}")
        )
        if f.also_in and f.group_id is None:  # a group finding's text already names its groups
            out.append(f"   The same in {counted(len(f.also_in), 'more place')}:")
            for g in f.also_in:
                where = g.group_id or g.id.split(":", 1)[-1]
                note = f" ({_explained(g)})" if g.explained_loss is not None else ""
                out.append(also.fill(f"{g.title} — {where}{note}"))
        out.append("")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    sel = selection_from(args)
    with open_store(args.store) as store:
        too_many = compact_first(store, sel.run_ids)  # 100,000 small files: minutes per query
        if too_many:
            raise PerfscopeError(too_many)
        rep = report(store, sel)
        if args.json:
            json.dump(to_json(store, sel, rep), sys.stdout, indent=2, allow_nan=False, default=str)
            print()
            return 0
        colour = use_colour()
        width = terminal_width()
        print(heading(f"perfscope analyze {store.root}", colour=colour))
        print(wrap(f"selection: {_describe(sel)}", width))
        print()
        sections = (
            ("Runs (steady state, warm-up dropped; step = the window's wall clock / steps)", render_runs,
             "runs"),
            ("Scaling (speedup = X(N)/X(N0), efficiency = speedup·N0/N, lost = N·T(N) − N0·T(N0)·G(N)/G(N0))",
             render_scaling, "scaling"),
            ("MFU (achieved FLOP/s per device / peak)", render_mfu, "mfu"),
            ("Batch-size sweep (one world size, several batches)", render_batch_sweep, "batch_sweep"),
            ("Time to metric target (smoothed over 10 steps; variants side by side)", render_time_to_metric,
             "time_to_metric"),
        )  # fmt: skip
        for title, render, key in sections:
            print(heading(wrap(title, width), colour=colour))
            print(render(rep[key], colour, width))
            print()
        title = f"Findings ({len(rep['findings'])}), most lost efficiency explained first"
        print(heading(wrap(title, width), colour=colour))
        print(render_findings(rep["findings"], colour, width))
    return 0
