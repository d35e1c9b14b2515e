"""Serve the dashboard: runs, scaling curves and findings of a store (default: the bundled sample traces)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from perfscope import dashboard
from perfscope.dashboard import ENV_HOSTS, ENV_ROOT, ENV_STORE, ENV_TOKEN
from perfscope.dashboard.guard import allowed_hosts

from ..errors import PerfscopeError

LOCALHOST = "127.0.0.1"
#: Streamlit's --server.baseUrlPath, set from the environment
ENV_BASE_PATH = "STREAMLIT_SERVER_BASE_URL_PATH"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", help="store folder (default: the bundled sample traces)")
    p.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    p.add_argument(
        "--host",
        default=LOCALHOST,
        help=f"address to bind (default {LOCALHOST}: this machine, every user of it; the access token "
        "keeps the others out). Requests naming another Host are refused",
    )
    p.add_argument(
        "--no-token",
        action="store_true",
        help="serve without the access token (printed in the URL at start): anyone who can reach the "
        "address, any user of this machine included, can then read the stores under --root",
    )
    p.add_argument(
        "--root",
        help="the sidebar's 'open another store' box opens stores under this folder (or s3:// prefix) "
        "only (default: the store the dashboard was started with)",
    )


def _store(given: str | None) -> Path:
    if given is None:
        import perfscope.sample_traces as sample_traces

        try:
            return sample_traces.path(sample_traces.DEFAULT)
        except KeyError as exc:
            raise PerfscopeError(f"no store given and {exc.args[0]}; give a store folder") from None
    from ..store.objectstore import is_s3_url, sync_mirror

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


def _root(given: str | None, store_arg: str | None, store: Path) -> str:
    """The folder (or s3:// prefix) the sidebar may open stores under."""
    from ..store.objectstore import is_s3_url

    if given is None:
        return store_arg if store_arg is not None and is_s3_url(store_arg) else str(store)
    if is_s3_url(given):
        return given
    path = Path(given).expanduser().resolve()
    if not path.is_dir():
        raise PerfscopeError(f"--root {path} is not a folder")
    return str(path)


def _display_host(host: str) -> str:
    """The address a browser on this machine uses (a wildcard bind is not one)."""
    if host in ("0.0.0.0", "::", ""):
        return "localhost"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def command(store: Path, host: str, port: int) -> list[str]:
    """The `streamlit run` command line: the app behind its access guard (serve.py), headless, no usage
    statistics, no file watcher, and nothing fetched from the internet: Streamlit's banner, which looks
    up the machine's external IP address on a wildcard bind, is off (the CLI prints the address)."""
    app = Path(dashboard.__file__).resolve().parent / "serve.py"
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
        "--logger.hideWelcomeMessage=true",
        f"--browser.serverAddress={_display_host(host)}",
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
    root = _root(args.root, args.store, store)
    token = None if args.no_token else secrets.token_urlsafe(24)
    if token is None:
        print(
            f"warning: --no-token: anyone who can reach {args.host}:{args.port}, any user of this machine "
            f"included, can read the store {store} and every store under {root}",
            file=sys.stderr,
        )
    url = f"http://{_display_host(args.host)}:{args.port}"
    # the token is the path Streamlit serves under: a URL is sent to its own port only, where a cookie
    # went to every server on the host (another local user's too)
    shown = f"{url}/{token}/" if token else url
    print(f"perfscope dashboard: {shown}  (store {store}; Ctrl-C stops it)", flush=True)
    hosts = allowed_hosts(args.host, args.port)
    env = dict(
        os.environ,
        **{
            ENV_STORE: str(store),
            ENV_ROOT: root,
            ENV_HOSTS: ",".join(sorted(hosts)) if hosts is not None else "*",
            "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
        },
    )
    env.pop(ENV_TOKEN, None)
    env.pop(ENV_BASE_PATH, None)
    if token:  # in the environment, which only this user can read; a command line `ps` shows to all
        env[ENV_TOKEN] = token
        env[ENV_BASE_PATH] = token
    child = subprocess.Popen(command(store, args.host, args.port), env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    # `kill PID` of this process must not leave the server running on its own
    signal.signal(signal.SIGTERM, forward)
    try:
        return child.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached both processes: streamlit finishes its shutdown. The memory guard's stop
        # reached this one alone: the server is ended here, within the guard's grace (5 s)
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            child.terminate()
        try:
            return child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return 130
