"""Record a training command with no change to its script: `perfscope run [options] -- CMD ARGS...`.

Every Python process CMD starts (the script itself, or the workers of torchrun, `python -m
torch.distributed.run`, srun or mpirun, which inherit the environment) records its steps and phases
into the store once it imports torch: an environment variable and an interpreter start-up hook
(collectors/bootstrap/sitecustomize.py) hand over to perfscope.collectors.auto. CMD's exit status
is perfscope run's; its output is left untouched (perfscope's notes go to stderr).

perfscope run is a transparent wrapper, as `timeout`, `torchrun` and `srun` are: CMD runs in a
session and process group of its own, every catchable signal perfscope run gets (TERM, INT, HUP,
QUIT, USR1, USR2; Ctrl-C on the terminal included) is passed on to that whole group once, Ctrl-Z
stops the job with perfscope run and `fg` resumes both, and perfscope run waits for the job and
ends as it ended: with its exit status, or killed by the same signal."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import PerfscopeError, one_line

#: where a run is recorded when --store is not given
DEFAULT_STORE = "perfscope-traces"

#: the signals perfscope run passes on to the job's process group (every catchable one that asks a
#: process to stop or to act: what a terminal, a scheduler or a user sends)
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

#: the run id a job's ranks share when the user sets one (collectors/identity.py reads it)
RUN_ID_ENV = "PERFSCOPE_RUN_ID"

#: exit status when CMD exists but cannot be started (a shell's), and when it is not found
CANNOT_START_EXIT = 126
NOT_FOUND_EXIT = 127


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


def _utf8(flag: str, value: str) -> str:
    """`value` when it is valid UTF-8 text; an undecodable argument (lone surrogates) is refused: every
    row recorded under it would be dropped (Arrow, DuckDB and Parquet take only UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        shown = os.fsencode(value).decode("utf-8", "backslashreplace")  # the bytes as given (st\xff)
        at = len(os.fsencode(value[: exc.start])) + 1
        raise PerfscopeError(
            f"{flag} {one_line(shown)} is not valid UTF-8 (byte {at}); perfscope records names and "
            "paths as UTF-8 text: give a UTF-8 name"
        ) from None
    return value


def _run_id(value: str, flag: str = "--run-id") -> str:
    """A run id the store can hold (`--run-id`, or PERFSCOPE_RUN_ID from the environment, which the
    job's profile() would take), refused here, before the job starts, when it cannot."""
    from ..store.schema import run_id_size_problem

    if problem := run_id_size_problem(_utf8(flag, value)):
        raise PerfscopeError(f"{flag}: {problem}")
    if not value.strip():
        raise PerfscopeError(f"{flag} is empty; give a name or leave it out")
    return value


def profile_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of perfscope.profile that the flags ask for."""
    options: dict[str, Any] = {"experiment": _utf8("--experiment", args.experiment)}
    for tag in args.tag:
        key, sep, value = _utf8("--tag", tag).partition("=")
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
        options["run_id"] = _run_id(args.run_id)
    elif os.environ.get(RUN_ID_ENV, "").strip():  # the job's profile() reads it: refused before it starts
        _run_id(os.environ[RUN_ID_ENV].strip(), RUN_ID_ENV)
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


def _startable(program: str) -> None:
    """Refuse, as a shell would, a command that is not there (127) or that cannot be run (126)."""
    if os.sep in program:  # a path: run as it is, never looked up
        if not os.path.lexists(program):
            raise PerfscopeError(f"command not found: {program!r} (no such file)", exit_code=NOT_FOUND_EXIT)
        if os.path.isdir(program):
            raise PerfscopeError(f"cannot run {program!r}: it is a folder", exit_code=CANNOT_START_EXIT)
        if not os.access(program, os.X_OK):
            raise PerfscopeError(
                f"cannot run {program!r}: it is not executable (chmod +x, or name its interpreter)",
                exit_code=CANNOT_START_EXIT,
            )
        return
    if shutil.which(program) is None:
        raise PerfscopeError(f"command not found: {program!r}", exit_code=NOT_FOUND_EXIT)


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise PerfscopeError("no command to run: perfscope run [--store S] -- CMD ARGS...")
    _utf8("--store", args.store)
    options = profile_options(args)  # every flag checked before anything is made or started
    _startable(command[0])
    from ..collectors.profiler import DISABLE_ENV
    from ..store.objectstore import RUN_TAG_ENV, is_s3_url, parse_url

    if is_s3_url(args.store):  # each process uploads its own staging folder; checked before the job
        parse_url(args.store)
        env = environment(args.store, options)
        # the job's staging folders carry this tag: those still there at its end hold what it could
        # not upload (a clean close removes its folder once all of it is on S3)
        env[RUN_TAG_ENV] = secrets.token_hex(8)
        return _wait(args, command, env, args.store, None)
    store = Path(args.store).expanduser().resolve()
    if store.exists() and not store.is_dir():
        raise PerfscopeError(f"--store {args.store!r} is a file, not a store folder")
    env = environment(store, options)
    if env.get(DISABLE_ENV, "").strip() in ("", "0"):
        _writable(store, args.store)
    return _wait(args, command, env, args.store, store)


class _Forwarder:
    """While the job runs: each forwarded signal perfscope run gets goes to the job's process group;
    Ctrl-Z (SIGTSTP) stops the job, then perfscope run, and SIGCONT resumes both."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.pending: list[int] = []
        self._old: dict[int, Any] = {}
        self.active = threading.current_thread() is threading.main_thread()  # signal.signal's rule

    def __enter__(self) -> _Forwarder:
        if self.active:
            for sig in FORWARDED_SIGNALS:
                # one ignored stays ignored, for perfscope run and (inherited) for the job: nohup's
                # SIGHUP, a background job's SIGINT and SIGQUIT in a non-interactive shell
                if signal.getsignal(sig) != signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._forward)
            if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN:
                self._old[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, self._stop)
            self._old[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._resume)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def started(self, pid: int) -> None:
        self.pgid = pid  # the job leads its own session, so its process group id is its pid
        while self.pending:
            self._send(self.pending.pop(0))

    def _send(self, sig: int) -> None:
        if self.pgid is None:
            self.pending.append(sig)
            return
        with contextlib.suppress(ProcessLookupError):  # the whole group has already ended
            os.killpg(self.pgid, sig)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        self._send(sig)

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        self._send(signal.SIGSTOP)  # SIGTSTP may be caught by the job; a stop asked for is a stop
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here; `fg` or `bg` continues past this line
        signal.signal(signal.SIGTSTP, self._stop)
        # past it also when the stop was discarded (an orphaned process group: no shell to resume it)
        self._send(signal.SIGCONT)

    def _resume(self, sig: int, frame: FrameType | None) -> None:
        self._send(signal.SIGCONT)


def _wait(
    args: argparse.Namespace, command: list[str], env: dict[str, str], given: str, store: Path | None
) -> int:
    """Run the job to its end; its exit status, as a shell gives it (128 + N when signal N killed it,
    and then args.job_signal is N, so that the command line can end by the same signal)."""
    with _Forwarder() as forwarder:
        try:
            # its own session, as torchrun starts its workers: a signal perfscope run gets reaches the
            # job once (from perfscope run), never twice (from the terminal, then from perfscope run)
            child = subprocess.Popen(command, env=env, start_new_session=forwarder.active)
        except OSError as exc:
            code = NOT_FOUND_EXIT if isinstance(exc, FileNotFoundError) else CANNOT_START_EXIT
            raise PerfscopeError(
                f"could not start {command[0]!r}: {exc.strerror or exc}", exit_code=code
            ) from exc
        if forwarder.active:
            forwarder.started(child.pid)
            code = _wait_awake(child)
        else:
            code = child.wait()
    args.job_signal = -code if code < 0 else None
    if code < 0:  # killed by a signal: the shell's convention
        code = 128 - code
    if store is None:
        print(_s3_outcome(given, env), file=sys.stderr)
    elif store.is_dir() and any(store.iterdir()):
        print(f"perfscope run: recorded into {store}; next: perfscope analyze {given}", file=sys.stderr)
    return code


def _s3_outcome(url: str, env: dict[str, str]) -> str:
    """The last line for a job recorded to `url`: where it went, or, when some of its processes could
    not upload all they recorded, how much is left and where (the job's status is not changed)."""
    from ..store.objectstore import RUN_TAG_ENV, kept_staging
    from ..words import counted

    kept = [(folder, n) for folder, n in kept_staging(env[RUN_TAG_ENV]) if n]
    if not kept:
        return f"perfscope run: recorded into {url}; next: perfscope analyze {url}"
    files = sum(n for _, n in kept)
    where = str(kept[0][0]) if len(kept) == 1 else f"{len(kept)} folders under {kept[0][0].parent}"
    return (
        f"perfscope run: the recording did not all reach {url} (its upload failed): "
        f"{counted(files, 'file')} of it kept in {one_line(where)} (upload them with any S3 tool, e.g. "
        f"aws s3 sync FOLDER {url}, or read them there with perfscope analyze FOLDER)"
    )


def _wait_awake(child: subprocess.Popen[bytes]) -> int:
    """Wait for the job while staying able to forward signals at once. A signal may be delivered to
    any thread of this process (pyarrow's and jemalloc's among them), and a Python handler runs only
    when the main thread runs bytecode: a main thread blocked in waitpid() would never see it. So
    the main thread waits in select() on the job's pidfd and on the signal wake-up fd, which the
    C-level handler writes on whatever thread the signal arrives."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): poll, each poll runs the handlers
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return child.wait(timeout=0.05)
    wake_r, wake_w = os.pipe()
    try:
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        old = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        try:
            while child.poll() is None:
                select.select([pidfd, wake_r], [], [])
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
        finally:
            signal.set_wakeup_fd(old)
    finally:
        for fd in (pidfd, wake_r, wake_w):
            os.close(fd)
    return int(child.returncode)


def end_as_job(args: argparse.Namespace, code: int) -> int:
    """End this process as the job ended, as `timeout` does: killed by the same signal (so a shell
    running a loop of jobs sees a Ctrl-C it must stop on), with no core file of perfscope's own; the
    status when the signal does not end it. Only for the `perfscope` command, never in-process."""
    sig = getattr(args, "job_signal", None)
    if not sig or sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGCONT):
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig != signal.SIGKILL:  # the one signal whose disposition cannot be set (nor blocked)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):  # not a signal this process may send itself: the status says it
        pass
    return code


def _writable(store: Path, given: str) -> None:
    """Fail before a long job starts, not in its first second; only the last folder is made."""
    try:
        store.mkdir(exist_ok=True)
    except OSError as exc:
        raise PerfscopeError(f"cannot create the store folder {given!r}: {exc.strerror or exc}") from exc
    if not os.access(store, os.W_OK | os.X_OK):
        raise PerfscopeError(f"the store folder {given!r} is not writable")
