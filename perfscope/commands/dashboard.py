"""Serve the dashboard: runs, scaling curves and findings of a store (default: the bundled sample traces)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from perfscope import dashboard
from perfscope.dashboard import ENV_STORE

from ..errors import PerfscopeError

LOCALHOST = "127.0.0.1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", help="store folder (default: the bundled sample traces)")
    p.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    p.add_argument(
        "--host",
        default=LOCALHOST,
        help=f"address to bind (default {LOCALHOST}: this machine only). The dashboard has no "
        "authentication: anyone who can reach the address can read the store, and any other store "
        "this user can read",
    )


def _store(given: str | None) -> Path:
    if given is None:
        import perfscope.sample_traces as sample_traces

        try:
            return sample_traces.path(sample_traces.DEFAULT)
        except KeyError as exc:
            raise PerfscopeError(f"no store given and {exc.args[0]}; give a store folder") from None
    from ..objectstore import is_s3_url, sync_mirror

    if is_s3_url(given):  # the app opens the mirror folder, which it reads as the store at `given`
        return sync_mirror(given)
    path = Path(given).expanduser().resolve()
    if not path.exists():
        raise PerfscopeError(
            f"{path} does not exist. Give the folder a run was recorded into (perfscope.profile('traces/') "
            "writes one), or leave STORE out to open the bundled sample traces."
        )
    if not path.is_dir():
        raise PerfscopeError(f"{path} is a file; a store is a folder with runs/, steps/ ... inside")
    return path


def command(store: Path, host: str, port: int) -> list[str]:
    """The `streamlit run` command line: headless, no usage statistics, no file watcher."""
    app = Path(dashboard.__file__).resolve().parent / "app.py"
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(app),
        "--server.headless=true",
        f"--server.address={host}",
        f"--server.port={port}",
        "--browser.gatherUsageStats=false",
        # nothing to reload in an installed app; watching site-packages costs CPU and inotify handles
        "--server.fileWatcherType=none",
        "--server.runOnSave=false",
        "--client.toolbarMode=minimal",
        "--theme.base=light",
    ]


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise PerfscopeError(f"--port must be between 1 and 65535, not {args.port}")
    try:
        import streamlit  # noqa: F401
    except ImportError:
        raise PerfscopeError(
            "the dashboard needs streamlit and altair: pip install 'perfscope[dashboard]'"
        ) from None
    store = _store(args.store)
    if args.host != LOCALHOST:
        print(
            f"warning: serving on {args.host}: the dashboard has no authentication, so anyone who can "
            f"reach {args.host}:{args.port} can read the store {store}, and any other store folder this "
            "user can read (the sidebar opens another store)",
            file=sys.stderr,
        )
    print(
        f"perfscope dashboard: http://{args.host}:{args.port}  (store {store}; Ctrl-C stops it)", flush=True
    )
    env = dict(os.environ, **{ENV_STORE: str(store), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"})
    child = subprocess.Popen(command(store, args.host, args.port), env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    # `kill PID` of this process must not leave the server running on its own
    signal.signal(signal.SIGTERM, forward)
    try:
        return child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached both processes; let streamlit finish its shutdown
        try:
            return child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            return 130
