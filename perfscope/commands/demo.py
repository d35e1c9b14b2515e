"""Run a real PyTorch DDP training job at world sizes 1, 2 and 4 and two per-rank batch sizes, and
record it into a store (gloo on the CPU, NCCL when there is a GPU per rank)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import PerfscopeError
from ..output import store_target
from ..simulate import existing_run_ids
from ..words import counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "store", nargs="?", default="perfscope-demo", help="store folder (default: perfscope-demo)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny version for tests: world sizes 1 and 2, batch 8 and 32, 12 steps per run",
    )
    p.add_argument(
        "--pattern",
        choices=("ddp", "fsdp", "pipeline", "ps", "paramavg"),
        default="ddp",
        help="what to record: DDP at several world sizes (default), or one job of FSDP2, a 2-stage "
        "send/recv pipeline, a parameter server, or parameter averaging every 4 steps",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PerfscopeError(
            "perfscope demo trains a real model and needs torch: pip install 'perfscope[torch]'"
        ) from None
    from ..demo import plan, progress_bar, run_demo

    store = store_target(args.store, create=True)
    if args.pattern != "ddp":
        return _run_pattern(store, args.pattern, args.quick)
    the_plan = plan(quick=args.quick)
    started = time.monotonic()
    before = existing_run_ids(store)
    labels = run_demo(store, the_plan, progress_bar(sys.stderr))
    recorded = len(existing_run_ids(store) - before)
    if recorded < len(the_plan.runs):  # the collector only warns, so that a training job goes on
        raise PerfscopeError(
            f"recorded {recorded} of {counted(len(the_plan.runs), 'run')} into {store}; the warnings "
            "above say what could not be written",
            exit_code=1,
        )
    worlds = ", ".join(map(str, the_plan.world_sizes))
    batches = ", ".join(map(str, the_plan.batch_sizes))
    print(
        f"recorded {counted(len(the_plan.runs), 'run')} of experiment {labels['experiment']!r} into "
        f"{store} in {time.monotonic() - started:.0f} s: world sizes {worlds} x batch {batches} per rank, "
        f"{counted(the_plan.steps, 'step')} each, {labels['backend']} on {labels['device']}"
    )
    _next_steps(store)
    return 0


def _run_pattern(store: Path, pattern: str, quick: bool) -> int:
    from ..demo_patterns import run_pattern

    started = time.monotonic()
    before = existing_run_ids(store)
    world, options = run_pattern(str(store), pattern, quick=quick)
    if not existing_run_ids(store) - before:
        raise PerfscopeError(
            f"recorded nothing into {store}; the warnings above say what could not be written", exit_code=1
        )
    print(
        f"recorded a {pattern} job of {counted(world, 'rank')}, {counted(options['steps'], 'step')}, "
        f"into {store} in {time.monotonic() - started:.0f} s (gloo on the CPU)"
    )
    _next_steps(store)
    return 0


def _next_steps(store: Path) -> None:
    print("next:")
    commands = [
        (f"perfscope {verb} {store}", what)
        for verb, what in (
            ("info", "summarise what was recorded"),
            ("analyze", "explain how it scales"),
            ("dashboard", "open the dashboard"),
        )
    ]
    width = max(len(c) for c, _ in commands) + 2
    for command, what in commands:
        print(f"  {command.ljust(width)}{what}")
