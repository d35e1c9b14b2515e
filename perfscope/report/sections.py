"""The story a report tells, section by section, built from analysis tables and findings only: the
sections in reading order (each built by its group's module: scaling, comm, hardware, ranks, what_if,
judgement), the analyses they read, and the context they are built from."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..charts.rows import group_labels, rows
from ..explain.finding import Finding as ExplainFinding
from .comm import backends, communication, sync
from .context import Context, Tables
from .hardware import utilisation
from .judgement import findings, quality
from .model import Finding, Section, device_unit
from .ranks import batch, stragglers
from .scaling import lost_time, overview, prediction, setup, speedup
from .settings import settings
from .what_if import what_if

#: The sections in reading order; a builder returning None leaves its section out (no such data).
SECTIONS: tuple[Callable[[Context], Section | None], ...] = (
    overview,
    setup,
    settings,
    speedup,
    lost_time,
    sync,
    backends,
    utilisation,
    stragglers,
    communication,
    what_if,
    batch,
    prediction,
    findings,
    quality,
)

#: Every analysis the sections read (the report runs exactly these; --tables exports them).
ANALYSES_USED: tuple[str, ...] = (
    "run_summary",
    "run_settings",
    "scaling",
    "placement",
    "threads",
    "phase_breakdown",
    "lost_time",
    "pop",
    "sync",
    "allreduce_fit",
    "reference_busbw",
    "backend_compare",
    "utilisation",
    "mfu",
    "stragglers",
    "collective_wait",
    "comm_ops",
    "comm_by_role",
    "what_if",
    "what_if_timeline",
    "batch_sweep",
    "metric_curves",
    "time_to_metric",
    "scaling_model",
    "scaling_prediction",
    "quality",
)


def build_sections(ctx: Context) -> list[Section]:
    out = []
    for fn in SECTIONS:
        section = fn(ctx)
        if section is not None:
            out.append(section)
    return out


def context(tables: Tables, findings: list[Finding], found: Iterable[ExplainFinding] = ()) -> Context:
    """The sections' context; `found`: the explainer's findings, in the order of `findings`."""
    group_ids = set()
    for name in ("scaling", "sync", "utilisation", "pop", "scaling_model", "scaling_prediction"):
        group_ids |= {r["group_id"] for r in rows(tables.get(name), ["group_id"]) if r["group_id"]}
    labels = group_labels(group_ids, rows(tables.get("scaling"), ["group_id", "world_size", "mixed"]))
    unit = device_unit(r["device_model"] for r in rows(tables.get("run_summary"), ["device_model"]))
    fired = [(rank, f) for rank, top in enumerate(found, start=1) for f in top.flatten()]
    return Context(tables, findings, labels, unit, fired)
