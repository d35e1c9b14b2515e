"""Compare a candidate run with a base run: slower, faster or no change beyond the runs' own noise (a
confidence interval from a block bootstrap of the steady steps), and where the difference went: by
phase, by rank (the rank whose own work changed), by collective and by op type, with what changed in
the set-up listed first. --fail-if-slower PCT makes it a CI gate (exit 1).

--base-experiment / --base-group (and the candidate's) compare two sets of runs instead, world size by
world size (analysis/compare_sets.py): did a change make scaling worse?"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from typing import Any

from ..analysis.compare import DEFAULT_THRESHOLD, PHASE_LABELS, Comparison, compare, pick_run
from ..analysis.compare_sets import SetComparison, compare_sets, pick_set
from ..errors import PerfscopeError, shown
from ..store.open import open_store
from ..terminal import format_rows, heading, printable, terminal_width, use_colour, wrap

#: rows of the by-collective and by-op-type tables in the text output (--json has them all)
TEXT_ROWS = 10


def _pct(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {shown(text)}") from None
    if not math.isfinite(v) or v < 0 or v >= 1000:
        raise argparse.ArgumentTypeError(f"a percentage from 0 to 1000, not {shown(text)}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", metavar="BASE", help="the base run's store (folder or s3://)")
    p.add_argument("candidate", metavar="CANDIDATE", help="the candidate run's store (may be BASE itself)")
    p.add_argument("--base-run", metavar="ID", help="the base run in BASE (needed when it holds several)")
    p.add_argument("--candidate-run", metavar="ID", help="the candidate run in CANDIDATE")
    p.add_argument(
        "--base-experiment",
        metavar="NAME",
        help="compare the runs of experiment NAME in BASE with the candidate's set, world size by world size",
    )
    p.add_argument("--candidate-experiment", metavar="NAME", help="the candidate's experiment in CANDIDATE")
    p.add_argument(
        "--base-group",
        metavar="ID",
        help="compare the runs of scaling group ID in BASE (as `perfscope analyze` names it: "
        "experiment/cluster/backend/model/mode:batch) with the candidate's set",
    )
    p.add_argument("--candidate-group", metavar="ID", help="the candidate's scaling group in CANDIDATE")
    p.add_argument(
        "--fail-if-slower",
        metavar="PCT",
        type=_pct,
        help="exit 1 when the candidate's step time is more than PCT%% slower with confidence (the 95%% "
        "interval's lower end above 1 + PCT/100), with sets of runs at any world size, 0 otherwise; one "
        "line on stderr says why",
    )
    p.add_argument(
        "--threshold",
        metavar="PCT",
        type=_pct,
        default=DEFAULT_THRESHOLD * 100,
        help=f"practical threshold: an interval within ±PCT%% of no change is no change "
        f"(default {DEFAULT_THRESHOLD * 100:g})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _chosen(args: argparse.Namespace, side: str) -> tuple[str, str] | None:
    """The one option that picks `side`'s runs ("run" / "experiment" / "group" and its value), None for
    none; a PerfscopeError when several do."""
    given = [
        (kind, v)
        for kind in ("run", "experiment", "group")
        if (v := getattr(args, f"{side}_{kind}")) is not None
    ]
    if len(given) > 1:
        names = " and ".join(f"--{side}-{kind}" for kind, _ in given)
        raise PerfscopeError(
            f"{names}: pick {side.upper()}'s runs by one of --{side}-run, --{side}-experiment, --{side}-group"
        )
    return given[0] if given else None


def run(args: argparse.Namespace) -> int:
    if args.threshold >= 100:
        raise PerfscopeError(f"--threshold {args.threshold:g}: a percentage under 100")
    picks = {side: _chosen(args, side) for side in ("base", "candidate")}
    kinds = {side: p[0] if p else "run" for side, p in picks.items()}
    if (kinds["base"] == "run") != (kinds["candidate"] == "run"):
        one, other = ("base", "candidate") if kinds["base"] != "run" else ("candidate", "base")
        how = (
            f"--{other}-run picks one run"
            if picks[other]
            else f"{other.upper()} is one run without --{other}-experiment or --{other}-group"
        )
        raise PerfscopeError(
            f"--{one}-{kinds[one]} picks a set of runs but {how}: compare a set with a set, or a run with "
            "a run"
        )
    with contextlib.ExitStack() as stack:
        base_store = stack.enter_context(open_store(args.base, warn=False))
        same = args.candidate == args.base
        cand_store = base_store if same else stack.enter_context(open_store(args.candidate, warn=False))
        base_pick, cand_pick = picks["base"], picks["candidate"]
        if kinds["base"] != "run" and base_pick and cand_pick:
            sc = compare_sets(
                pick_set(base_store, *base_pick, "BASE"),
                pick_set(cand_store, *cand_pick, "CANDIDATE"),
                threshold=args.threshold / 100,
            )
            _print(sc.as_dict() if args.json else sets_text(sc, colour=use_colour(), width=terminal_width()))
            return 0 if args.fail_if_slower is None else sets_gate(sc, args.fail_if_slower)
        base = pick_run(base_store, args.base_run, "BASE", "--base-run")
        cand = pick_run(cand_store, args.candidate_run, "CANDIDATE", "--candidate-run")
        if same and base.run_id == cand.run_id:
            raise PerfscopeError(
                f"BASE and CANDIDATE are the same run ({shown(base.run_id)}): pick two with "
                "--base-run and --candidate-run"
            )
        c = compare(base, cand, threshold=args.threshold / 100)
        _print(c.as_dict() if args.json else text(c, colour=use_colour(), width=terminal_width()))
    if args.fail_if_slower is None:
        return 0
    return gate(c, args.fail_if_slower)


def _print(out: str | dict[str, Any]) -> None:
    """The text, or the JSON object (without NaN or infinity), on stdout."""
    if isinstance(out, str):
        print(out)
    else:
        json.dump(_finite(out), sys.stdout, indent=2)
        print()


def gate(c: Comparison, pct: float) -> int:
    """--fail-if-slower: 1 when slower by more than `pct` with confidence, else 0; says why on stderr."""
    ratio = _ratio_ci(c)
    if c.slower_beyond(pct):
        print(
            f"perfscope compare: FAIL: the candidate's step time is {ratio}, slower than +{pct:g}%",
            file=sys.stderr,
        )
        return 1
    why = "no interval (too few steady steps)" if c.ci is None else f"not above +{pct:g}% with confidence"
    print(f"perfscope compare: pass: the candidate's step time is {ratio}: {why}", file=sys.stderr)
    return 0


def sets_gate(sc: SetComparison, pct: float) -> int:
    """--fail-if-slower for sets: 1 when any world size is slower by more than `pct` with confidence
    (the largest such is named), else 0; says why on stderr in one line."""
    slow = sc.slower_beyond(pct)
    if slow:
        n = slow[0]
        more = f" (also at world size {', '.join(map(str, slow[1:]))})" if slow[1:] else ""
        print(
            f"perfscope compare: FAIL: at world size {n} the candidate's step time is "
            f"{_ratio_ci(sc.comparisons[n])}, slower than +{pct:g}%{more}",
            file=sys.stderr,
        )
        return 1
    n = sc.decided_by
    print(
        f"perfscope compare: pass: no world size of {', '.join(map(str, sorted(sc.comparisons)))} is slower "
        f"than +{pct:g}% with confidence (world size {n}: {_ratio_ci(sc.comparisons[n])})",
        file=sys.stderr,
    )
    return 0


def _ratio_ci(c: Comparison) -> str:
    return f"{_ratio(c.step_ratio)} (95% interval {_interval(c.ci)})"


def _finite(v: Any) -> Any:
    """JSON without NaN or infinity (None in their place)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _ratio(r: float | None) -> str:
    return "n/a" if r is None else f"x{r:.3f} ({(r - 1) * 100:+.1f}%)"


def _interval(ci: tuple[float, float] | None) -> str:
    return "n/a" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f}"


def _ms(ns: float | None, *, sign: bool = False) -> str:
    if ns is None:
        return "n/a"
    return f"{ns / 1e6:+.2f} ms" if sign else f"{ns / 1e6:.2f} ms"


def where_lines(c: Comparison) -> list[str]:
    """The difference in words: the phases that moved most, and the rank whose own work changed."""
    lines = []
    moved = sorted((p for p in c.by_phase if p["delta_ns"]), key=lambda p: -abs(p["delta_ns"]))[:3]
    if moved and c.verdict != "no-change":
        parts = ", ".join(f"{p['label']} {_ms(p['delta_ns'], sign=True)}" for p in moved)
        lines.append(f"where (per step, mean over ranks): {parts}")
    loader = [s["setting"] for s in c.setup_changes if s["setting"].startswith("loader_")]
    data = next((p for p in c.by_phase if p["phase"] == "data"), None)
    if loader and data is not None:
        lines.append(
            f"the loader's settings changed ({', '.join(loader)}): the data phase (loader wait) went "
            f"{_ms(data['base_ns'])} -> {_ms(data['candidate_ns'])} per step"
        )
    cul = c.culprit
    if cul and c.verdict != "no-change":
        if cul["every_rank"]:
            ph = f" ({PHASE_LABELS.get(cul['phase'], cul['phase'])})" if cul.get("phase") else ""
            lines.append(f"every rank's own work changed alike{ph}: no single rank is the cause")
        else:
            victims = cul.get("victims") or []
            waits = f"; rank(s) {', '.join(map(str, victims))} only wait for it" if victims else ""
            ph = PHASE_LABELS.get(cul["phase"], cul["phase"]) if cul.get("phase") else "its step"
            lines.append(
                f"culprit: rank {cul['rank']}, whose own work changed by "
                f"{_ms(cul['delta_own_ns'], sign=True)} per step, most in {ph}{waits}"
            )
    return lines


def _decides(sc: SetComparison) -> str:
    n = sc.decided_by
    if sc.verdict == "slower":
        return f"world size {n} decides, the largest slower beyond the noise"
    if sc.verdict == "faster":
        return f"world size {n} decides, the largest faster beyond the noise; none is slower"
    return f"no world size is slower or faster beyond the noise; world size {n}, the largest, is shown below"


def sets_text(sc: SetComparison, *, colour: bool = False, width: int | None = None) -> str:
    """The world sizes' table, what is on one side only, then the single-run section of the world size
    that decides."""
    out = [
        heading(f"compare: base {sc.base.what} ({sc.base.store.root})", colour=colour),
        heading(f"    candidate {sc.candidate.what} ({sc.candidate.store.root})", colour=colour),
        "",
        heading(f"verdict: {sc.verdict}", colour=colour),
        wrap(_decides(sc), width, hang="  "),
        format_rows(
            ["world size", "base run", "cand. run", "verdict", "step ratio", "95% interval", "base eff.",
             "cand. eff."],
            [
                [r["world_size"], printable(r["base_run_id"]), printable(r["candidate_run_id"]), r["verdict"],
                 r["step_ratio"], _interval(sc.comparisons[r["world_size"]].ci), r["base_efficiency"],
                 r["candidate_efficiency"]]
                for r in sc.by_world_size
            ],
            width=width,
        ),
    ]  # fmt: skip
    for label, sizes in (("BASE", sc.only_in_base), ("CANDIDATE", sc.only_in_candidate)):
        if sizes:
            out.append(f"only in {label}, not compared: world size {', '.join(map(str, sizes))}")
    out.extend(wrap(f"note: {n}", width, hang="  ") for n in sc.notes)
    out.append("")
    out.append(heading(f"world size {sc.decided_by}, base and candidate run compared", colour=colour))
    out.append(text(sc.comparisons[sc.decided_by], colour=colour, width=width))
    return "\n".join(out)


def text(c: Comparison, *, colour: bool = False, width: int | None = None) -> str:
    out: list[str] = []
    out.append(heading(f"compare: base {c.base.run_id} ({c.base.store.root})", colour=colour))
    out.append(heading(f"    candidate {c.candidate.run_id} ({c.candidate.store.root})", colour=colour))
    if c.setup_changes:
        out.append("")
        out.append(heading("set-up changes", colour=colour))
        out.append(
            format_rows(
                ["setting", "base", "candidate"],
                [
                    [f"{s['table']}.{s['setting']}", s["base"] or "(none)", s["candidate"] or "(none)"]
                    for s in c.setup_changes
                ],
                width=width,
            )
        )
    out.append("")
    out.append(heading(f"verdict: {c.verdict}", colour=colour))
    out.append(
        wrap(
            f"steady step time {_ms(c.base_step_ns)} -> {_ms(c.candidate_step_ns)}: {_ratio(c.step_ratio)}, "
            f"95% interval {_interval(c.ci)} (moving-block bootstrap over {c.base_steps} and "
            f"{c.candidate_steps} steady steps, blocks of {c.block_len} steps as steps are autocorrelated; "
            f"no change when the interval holds 1 or lies within ±{c.threshold * 100:g}%)",
            width,
            hang="  ",
        )
    )
    if c.throughput_ratio is not None:
        out.append(f"throughput: {_ratio(c.throughput_ratio)}, 95% interval {_interval(c.throughput_ci)}")
    out.extend(wrap(line, width, hang="  ") for line in where_lines(c))
    out.extend(wrap(f"note: {n}", width, hang="  ") for n in c.notes)
    out.append("")
    out.append(heading("by phase (steady step, mean over ranks)", colour=colour))
    out.append(
        format_rows(
            ["phase", "base ms", "candidate ms", "delta ms"],
            [
                [p["label"], p["base_ns"] / 1e6, p["candidate_ns"] / 1e6, p["delta_ns"] / 1e6]
                for p in c.by_phase
            ],
            width=width,
        )
    )
    out.append("")
    out.append(heading("by rank (own work = step less exposed communication waited)", colour=colour))
    out.append(
        format_rows(
            [
                "rank",
                "own base ms",
                "own cand. ms",
                "own delta ms",
                "wait delta ms",
                "most changed",
                "culprit",
            ],
            [
                [
                    r["rank"],
                    _div(r["base_own_ns"]),
                    _div(r["candidate_own_ns"]),
                    _div(r["delta_own_ns"]),
                    _div(r["delta_wait_ns"]),
                    r["phase"] or "",
                    "yes" if r["culprit"] else "",
                ]
                for r in c.by_rank
            ],
            width=width,
        )
    )
    if c.by_collective:
        out.append("")
        out.append(heading("by collective (per steady step)", colour=colour))
        out.append(
            format_rows(
                [
                    "op",
                    "group",
                    "bytes",
                    "change",
                    "base /step",
                    "cand. /step",
                    "base busbw GB/s",
                    "cand. busbw GB/s",
                    "delta ms/step",
                ],
                [
                    [
                        r["op"],
                        r["group_kind"],
                        r["bytes"],
                        r["change"],
                        r["base_per_step"],
                        r["candidate_per_step"],
                        r["base_busbw_gb_per_s"],
                        r["candidate_busbw_gb_per_s"],
                        r["delta_ns_per_step"] / 1e6,
                    ]
                    for r in c.by_collective[:TEXT_ROWS]
                ],
                width=width,
            )
        )
        if len(c.by_collective) > TEXT_ROWS:
            out.append(f"... {len(c.by_collective) - TEXT_ROWS} more (--json has them all)")
    ops = [r for r in c.by_op_type if r["change"] != "unchanged"]
    if c.by_op_type:
        out.append("")
        out.append(heading("by op type (per rank and steady step)", colour=colour))
        if not ops:
            out.append(f"{len(c.by_op_type)} op types, none added, removed, more frequent or slower")
        else:
            out.append(
                format_rows(
                    [
                        "op type",
                        "change",
                        "base calls",
                        "cand. calls",
                        "base mean ms",
                        "cand. mean ms",
                        "delta ms/step",
                    ],
                    [
                        [
                            printable(r["op_type"]),
                            r["change"],
                            r["base_calls_per_step"],
                            r["candidate_calls_per_step"],
                            _div(r["base_mean_ns"]),
                            _div(r["candidate_mean_ns"]),
                            r["delta_ns_per_step"] / 1e6,
                        ]
                        for r in ops[:TEXT_ROWS]
                    ],
                    width=width,
                )
            )
            if len(ops) > TEXT_ROWS:
                out.append(f"... {len(ops) - TEXT_ROWS} more (--json has them all)")
    return "\n".join(out)


def _div(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6
