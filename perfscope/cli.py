"""The `perfscope` command: dispatches to one module per verb in perfscope.commands."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from typing import NoReturn

from .errors import PerfscopeError, PerfscopeWarning, one_line
from .memory_guard import EXIT as MEMORY_EXIT
from .memory_guard import MemoryGuard, guard_for

#: set to 1 to see the traceback of an unexpected error instead of its one-line summary
TRACEBACK_ENV = "PERFSCOPE_TRACEBACK"
#: exit status of an unexpected error (EX_SOFTWARE of sysexits.h)
INTERNAL_ERROR_EXIT = 70

#: verb -> (module under perfscope.commands, one-line help). A verb is listed only once it works.
VERBS: dict[str, tuple[str, str]] = {
    "info": ("info", "summarise a store: runs, ranks, steps, time span, skipped files"),
    "sql": ("sql", "run a read-only SQL query over a store's tables"),
    "compact": ("compact", "merge a store's small segments into large files"),
    "analyze": ("analyze", "explain a store's scaling: speedup, efficiency, lost time and ranked findings"),
    "simulate": ("simulate", "write simulated runs: the seed study, a JSON study, or a fit's predictions"),
    "demo": ("demo", "record a real DDP training job at world sizes 1, 2, 4 into a store"),
    "run": ("run", "record a training command with no change to its script: perfscope run -- CMD ARGS..."),
    "top": ("top", "a live terminal view of a store while a job writes it: per rank, slowest rank, findings"),
    "dashboard": ("dashboard", "open a store in the browser: runs, scaling curves, findings, SQL"),
    "report": ("report", "write the scaling study as one self-contained HTML file (or Markdown with PNGs)"),
    "import": ("import_", "import existing traces (torch.profiler, ...) into a store as a measured run"),
    "export": ("export", "export a run for another tool: Perfetto / chrome://tracing JSON"),
    "compare": (
        "compare",
        "did a change make training slower? a candidate run against a base, with a CI gate",
    ),
}


#: other spellings a verb answers to (the help's own British "analyse" included)
ALIASES: dict[str, str] = {"analyse": "analyze"}


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line that says where the usage is (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (usage: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _ArgumentParser(
        prog="perfscope",
        description="Explains why a data-parallel training job does not scale.",
    )
    p.add_argument("--version", action="version", version=f"perfscope {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, (module, help_text) in VERBS.items():
        mod = importlib.import_module(f"perfscope.commands.{module}")
        aliases = [a for a, v in ALIASES.items() if v == verb]
        sp = sub.add_parser(verb, aliases=aliases, help=help_text, description=mod.__doc__)
        mod.add_arguments(sp)
    return p


def _verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each verb's own parser, by verb and alias."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {one_line(str(message))}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(args_list, start=1):
        if "\x00" in arg:  # only possible in-process: no system call takes such a name
            print(f"perfscope: error: argument {i} ({one_line(arg)}) contains a NUL byte", file=sys.stderr)
            return 2
    parser = _parser()
    if not args_list:
        # a newcomer's first try: show what perfscope does (exit 0, like pip or docker), not an error
        parser.print_help()
        return 0
    try:
        args, unknown = parser.parse_known_args(args_list)
        if unknown:  # said by the verb's own parser, so the usage it points to is the verb's
            _verb_parsers(parser)[args.verb].error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # argparse already printed what was wrong
        return int(exc.code or 0)
    args.verb = ALIASES.get(args.verb, args.verb)
    module = importlib.import_module(f"perfscope.commands.{VERBS[args.verb][0]}")
    try:
        guard = guard_for(args.verb)
    except PerfscopeError as exc:  # a mistyped PERFSCOPE_MEMORY_LIMIT: nothing has started
        print(f"perfscope {args.verb}: error: {one_line(exc.message)}", file=sys.stderr)
        return exc.exit_code
    with warnings.catch_warnings(), guard or contextlib.nullcontext(), _footers_shown(args.verb):
        warnings.simplefilter("always", PerfscopeWarning)
        warnings.showwarning = _show_warning
        try:
            code = int(module.run(args))
            if stopped := _memory_stop(guard, args.verb):  # the stop met code that carried on
                return stopped
            if argv is None and hasattr(module, "end_as_job"):  # the command line, not in-process
                code = module.end_as_job(args, code)  # `run`: die of the job's signal, as timeout does
            return code
        except PerfscopeError as exc:
            if stopped := _memory_stop(guard, args.verb):
                return stopped
            print(f"perfscope {args.verb}: error: {one_line(exc.message)}", file=sys.stderr)
            if exc.detail:
                print(exc.detail.rstrip("\n"), file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            if stopped := _memory_stop(guard, args.verb):
                return stopped
            print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return 0
        except OSError as exc:  # the system refused something no check foresaw: still one line
            if stopped := _memory_stop(guard, args.verb):
                return stopped
            print(f"perfscope {args.verb}: error: {one_line(str(exc))}", file=sys.stderr)
            return 1
        except Exception as exc:
            if stopped := _memory_stop(guard, args.verb):
                return stopped
            if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
                raise
            print(
                f"perfscope {args.verb}: internal error: {type(exc).__name__}: {one_line(str(exc))} "
                f"(a bug in perfscope; {TRACEBACK_ENV}=1 shows the traceback, please report it)",
                file=sys.stderr,
            )
            return INTERNAL_ERROR_EXIT


#: the commands that open a store: a first open of a foreign store (every segment's footer to read)
#: shows its progress on a terminal
OPENS_A_STORE = frozenset({"analyze", "report", "sql", "info", "compact", "export", "simulate"})


def _footers_shown(verb: str) -> contextlib.AbstractContextManager[None]:
    """While `verb` runs, a long first open of a store shows the footers it reads as one line on
    stderr, when stderr is a terminal (perfscope.store.listing.footer_progress)."""
    if verb not in OPENS_A_STORE:  # DuckDB and Arrow are not imported for `run` or `--help`
        return contextlib.nullcontext()
    from .store.listing import footer_progress
    from .terminal import footer_progress_line

    report = footer_progress_line(sys.stderr)
    return footer_progress(report) if report is not None else contextlib.nullcontext()


def _memory_stop(guard: MemoryGuard | None, verb: str) -> int:
    """The exit status of a command stopped at PERFSCOPE_MEMORY_LIMIT (0 when it was not), said in one
    line: the stop arrives as a KeyboardInterrupt, or as whatever the native code it interrupted made
    of it (DuckDB: "Query interrupted")."""
    if guard is None or not guard.tripped:
        return 0
    print(f"perfscope {verb}: {guard.said}", file=sys.stderr)
    return MEMORY_EXIT


if __name__ == "__main__":
    sys.exit(main())
