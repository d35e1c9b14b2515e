"""Record a training command with no change to its script: `perfscope run [options] -- CMD ARGS...`.

Every Python process CMD starts (the script itself, or the workers of torchrun, `python -m
torch.distributed.run`, srun or mpirun, which inherit the environment) records its steps and phases
into the store once it imports torch: an environment variable and an interpreter start-up hook
(collectors/bootstrap/sitecustomize.py) hand over to perfscope.collectors.auto. CMD's exit status
is perfscope run's; its output is left untouched (perfscope's notes go to stderr)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import PerfscopeError

#: where a run is recorded when --store is not given
DEFAULT_STORE = "perfscope-traces"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=DEFAULT_STORE, help=f"store folder (default {DEFAULT_STORE})")
    p.add_argument("--experiment", default="default", help="experiment name of the run (default 'default')")
    p.add_argument(
        "--batch-size", type=int, metavar="N", help="samples per rank and step, when not inferable"
    )
    p.add_argument("--run-id", metavar="ID", help="run id shared by all ranks (default: agreed at start)")
    p.add_argument(
        "--poll-hz", type=float, metavar="HZ", help="telemetry sampling rate, 0 turns it off (default 10)"
    )
    p.add_argument("--timing", choices=("auto", "host", "cuda"), help="timing clock (default auto)")
    p.add_argument("--no-gpu-telemetry", action="store_true", help="do not sample the GPUs through NVML")
    p.add_argument("--no-nvtx", action="store_true", help="do not emit NVTX ranges")
    p.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run tag or runs column (repeatable)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")


def profile_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of perfscope.profile that the flags ask for."""
    options: dict[str, Any] = {"experiment": args.experiment}
    for tag in args.tag:
        key, sep, value = tag.partition("=")
        if not sep or not key.strip().isidentifier():
            raise PerfscopeError(f"--tag {tag!r}: expected KEY=VALUE with a name for KEY")
        options[key.strip()] = value
    if args.batch_size is not None:
        if args.batch_size <= 0:
            raise PerfscopeError("--batch-size must be a positive number of samples")
        options["batch_size"] = args.batch_size
    if args.poll_hz is not None:
        if not args.poll_hz >= 0 or args.poll_hz > 1000:
            raise PerfscopeError("--poll-hz must be between 0 and 1000")
        options["poll_hz"] = args.poll_hz
    if args.timing is not None:
        options["timing"] = args.timing
    if args.no_gpu_telemetry:
        options["gpu_telemetry"] = False
    if args.no_nvtx:
        options["nvtx"] = False
    if args.run_id is not None:
        options["run_id"] = args.run_id
    return options


def environment(
    store: Path | str, options: dict[str, Any], base: dict[str, str] | None = None
) -> dict[str, str]:
    """CMD's environment: the settings for perfscope.collectors.auto, and the start-up hook's folder
    first on PYTHONPATH (ahead of any sitecustomize already there, which the hook then runs)."""
    from ..collectors.auto import AUTO_ENV, BOOTSTRAP_DIR

    env = dict(os.environ if base is None else base)
    env[AUTO_ENV] = json.dumps({"store": str(store), "options": options})
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(BOOTSTRAP_DIR) + (os.pathsep + rest if rest else "")
    return env


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise PerfscopeError("no command to run: perfscope run [--store S] -- CMD ARGS...")
    if shutil.which(command[0]) is None:
        raise PerfscopeError(f"command not found: {command[0]!r}", exit_code=127)
    from ..collectors.profiler import DISABLE_ENV
    from ..objectstore import is_s3_url, parse_url

    if is_s3_url(args.store):  # each process uploads its own staging folder; checked before the job
        parse_url(args.store)
        env = environment(args.store, profile_options(args))
        return _wait(command, env, args.store, None)
    store = Path(args.store).expanduser().resolve()
    if store.exists() and not store.is_dir():
        raise PerfscopeError(f"--store {args.store!r} is a file, not a store folder")
    env = environment(store, profile_options(args))
    if env.get(DISABLE_ENV, "").strip() in ("", "0"):
        _writable(store, args.store)
    return _wait(command, env, args.store, store)


def _wait(command: list[str], env: dict[str, str], given: str, store: Path | None) -> int:
    """Run the job to its end; its exit status, as a shell gives it."""
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise PerfscopeError(f"could not start {command[0]!r}: {exc.strerror or exc}", exit_code=126) from exc
    try:
        code = child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group: let the job shut down
        try:
            code = child.wait(timeout=30)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            child.kill()
            code = child.wait()
        code = code if code > 0 else 130
    if code < 0:  # killed by a signal: the shell's convention
        code = 128 - code
    if store is None or (store.is_dir() and any(store.iterdir())):
        where = store or given
        print(f"perfscope run: recorded into {where}; next: perfscope analyze {given}", file=sys.stderr)
    return code


def _writable(store: Path, given: str) -> None:
    """Fail before a long job starts, not in its first second; only the last folder is made."""
    try:
        store.mkdir(exist_ok=True)
    except OSError as exc:
        raise PerfscopeError(f"cannot create the store folder {given!r}: {exc.strerror or exc}") from exc
    if not os.access(store, os.W_OK | os.X_OK):
        raise PerfscopeError(f"the store folder {given!r} is not writable")
