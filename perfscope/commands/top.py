"""A live terminal view of a store while a job writes it: per rank the current step time and its
phase shares, the communication share, the slowest rank, and the findings so far. Plain ANSI text
(works over SSH on a login node, no curses); Ctrl-C leaves it. `--once`, or an output that is not
a terminal, prints one frame."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..analysis import Selection
from ..errors import PerfscopeError, StoreError
from ..explain import explain
from ..store.open import open_store
from ..store.reader import Store
from ..terminal import format_rows, heading, style, terminal_width, use_colour, wrap
from ..words import joined, known

PHASES = ("data", "forward", "backward", "sync_exposed", "optimizer", "other")
#: a rank is named slowest when its compute exceeds the fastest rank's by more than this factor
SLOWEST_MARGIN = 1.05
#: ANSI: cursor home and clear the screen below it, so a frame overwrites the previous one
CLEAR = "\x1b[H\x1b[J"

#: the run that wrote a step last, and how many runs have steps (so the screen can say it chose)
_LATEST_RUN_SQL = """
SELECT run_id, count(*) OVER () AS runs
FROM (SELECT run_id, max(start_ns + step_ns) AS last_end FROM steps GROUP BY run_id)
ORDER BY last_end DESC, run_id LIMIT 1
"""

# The last `window` steps of each rank: the 'current' step time is their median; the shares are of
# their summed time. The slowest rank is the one with the most compute (step minus exposed sync):
# the others wait for it in their sync.
_RANKS_SQL = """
WITH recent AS (
    SELECT *, row_number() OVER (PARTITION BY rank ORDER BY step DESC) AS age
    FROM steps WHERE run_id = ?
)
SELECT rank, max(step) AS last_step, count(*) AS steps_seen_in_window,
       median(step_ns)::DOUBLE AS step_ns, sum(step_ns)::DOUBLE AS total_ns,
       sum(data_ns)::DOUBLE AS data_ns, sum(forward_ns)::DOUBLE AS forward_ns,
       sum(backward_ns)::DOUBLE AS backward_ns, sum(sync_exposed_ns)::DOUBLE AS sync_exposed_ns,
       sum(optimizer_ns)::DOUBLE AS optimizer_ns, sum(other_ns)::DOUBLE AS other_ns,
       sum(comm_total_ns)::DOUBLE AS comm_total_ns,
       sum(samples)::DOUBLE AS samples
FROM recent WHERE age <= ? GROUP BY rank ORDER BY rank
"""


@dataclass
class Frame:
    """What one refresh shows: data only; `render` formats it."""

    store: str
    run_id: str | None = None
    experiment: str | None = None
    world_size: int | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)
    slowest_rank: int | None = None
    findings: list[tuple[str, str]] = field(default_factory=list)  # (severity, title)
    #: runs with steps in the store when top chose the run itself (no --run), else None
    chosen_of: int | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store folder (the one a job is writing)")
    p.add_argument("--run", metavar="RUN_ID", help="this run (default: the one that wrote a step last)")
    p.add_argument(
        "--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (default 2)"
    )
    p.add_argument(
        "--window", type=int, default=20, metavar="STEPS", help="recent steps per rank (default 20)"
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="print one frame and exit (the default when output is not a terminal)",
    )
    p.add_argument("--no-findings", action="store_true", help="skip the findings (cheaper refreshes)")


def frame(store: Store, *, run_id: str | None, window: int, findings: bool = True) -> Frame:
    """The current state of `run_id` (default: the run that wrote a step last)."""
    f = Frame(store=str(store.root))
    if run_id is None:
        latest = store.query(_LATEST_RUN_SQL).to_pylist()
        if not latest:
            return f
        run_id = str(latest[0]["run_id"])
        f.chosen_of = int(latest[0]["runs"])
    f.run_id = run_id
    meta = store.query("SELECT experiment, world_size FROM runs WHERE run_id = ?", [run_id]).to_pylist()
    if meta:
        f.experiment, f.world_size = meta[0]["experiment"], meta[0]["world_size"]
    for row in store.query(_RANKS_SQL, [run_id, window]).to_pylist():
        total = row["total_ns"] or 0
        row["shares"] = {p: (row[f"{p}_ns"] or 0) / total if total else 0.0 for p in PHASES}
        row["comm_share"] = (row["comm_total_ns"] or 0) / total if total else 0.0
        row["compute_ns"] = total - (row["sync_exposed_ns"] or 0)
        f.ranks.append(row)
    if len(f.ranks) > 1:
        slowest = max(f.ranks, key=lambda r: r["compute_ns"])
        fastest = min(r["compute_ns"] for r in f.ranks)
        if slowest["compute_ns"] > SLOWEST_MARGIN * fastest:  # ranks alike within noise: nobody is
            f.slowest_rank = slowest["rank"]
    if findings and f.ranks:
        f.findings = [(x.severity, x.title) for x in explain(store, Selection(run_ids=(run_id,)))]
    return f


def render(f: Frame, *, colour: bool, width: int | None = None) -> str:
    """One frame as text, fitted to `width` columns (None: a file or pipe, tables whole)."""
    lines = [heading(f"perfscope top  {f.store}", colour=colour)]
    if f.run_id is None:
        lines.append("no steps recorded yet; waiting for the job to write its first segment ...")
        return "\n".join(lines)
    about = [
        f"run {f.run_id}",
        f"experiment {f.experiment}" if known(f.experiment) else None,
        f"world size {f.world_size}" if known(f.world_size) else None,
    ]
    lines.append(wrap(joined(about, "  "), width))
    if f.chosen_of is not None:  # say which run was picked, and how to see another
        lines.append(
            wrap(
                "the only run in the store"
                if f.chosen_of == 1
                else f"the run that wrote a step last, of {f.chosen_of} runs in the store; "
                "--run RUN_ID shows another",
                width,
            )
        )
    lines.append("")
    header = [
        "rank",
        "step",
        "step ms",
        *[p.replace("_exposed", "") + " %" for p in PHASES],
        "comm %",
        "note",
    ]
    rows = []
    for r in f.ranks:
        mark = "slowest" if r["rank"] == f.slowest_rank else ""
        rows.append(
            [
                r["rank"],
                r["last_step"],
                round((r["step_ns"] or 0) / 1e6, 2),
                *[round(100 * r["shares"][p]) for p in PHASES],
                round(100 * r["comm_share"]),
                style(mark, "1;31", enabled=colour) if mark else "",
            ]
        )
    lines.append(format_rows(header, rows, colour=colour, width=width))
    lines.append("")
    lines.append(
        wrap(
            "step ms: median of the last steps of each rank; shares of their summed time; comm %: all "
            "communication (overlapped or not) over step time; slowest: most compute, the rank others "
            "wait for",
            width,
        )
    )
    lines.append("")
    lines.append(heading(f"findings so far ({len(f.findings)})", colour=colour))
    severity = {"alarm": "1;31", "warning": "1;33", "info": "1;34"}
    for sev, title in f.findings[:8] or [("", "none yet")]:
        tag = f"[{sev.upper()}] " if sev else ""
        text = wrap(tag + title, width, indent="  ", hang="    ")  # wrapped before the tag is coloured
        if tag:
            text = text.replace(tag, style(tag[:-1], severity[sev], enabled=colour) + " ", 1)
        lines.append(text)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise PerfscopeError("--interval must be a positive number of seconds")
    if args.window < 1:
        raise PerfscopeError("--window must be at least 1 step")
    colour = use_colour()
    if args.once or not sys.stdout.isatty():  # piped or captured: one frame, never an endless stream
        with open_store(args.store, allow_empty=True, warn=False) as store:
            print(
                render(
                    frame(store, run_id=args.run, window=args.window, findings=not args.no_findings),
                    colour=colour,
                    width=terminal_width(),
                )
            )
        return 0
    try:
        while True:
            try:
                with open_store(args.store, allow_empty=True, warn=False) as store:
                    text = render(
                        frame(store, run_id=args.run, window=args.window, findings=not args.no_findings),
                        colour=colour,
                        width=terminal_width(),
                    )
            except StoreError as exc:  # started before the job: wait for its first segment
                text = f"perfscope top: waiting for {args.store}: {exc.message}"
            sys.stdout.write(CLEAR + text + "\n\n(Ctrl-C to leave)\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 0
