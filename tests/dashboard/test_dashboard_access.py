"""The dashboard on a shared server (issue 25): an access token by default, the Host header checked on
HTTP and the websocket, the "open another store" box kept under a root, and no external IP lookup."""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from storegen import make_run
from test_dashboard_browser import dashboard_server, free_port, settle

from perfscope.commands.dashboard import command


def printed_token(log: Path) -> str:
    found = re.search(r"perfscope dashboard: http://[^/\s]+/([\w-]+)/ ", log.read_text())
    assert found, log.read_text()
    return found.group(1)


def get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """One plain HTTP GET (no redirects followed, no proxy): status, headers, body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode(errors="replace")
    finally:
        conn.close()


def websocket_status(url: str, headers: dict[str, str], prefix: str = "") -> int:
    """The status line's code of a websocket handshake on Streamlit's stream (101: accepted)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lines = [
        f"GET {prefix}/_stcore/stream HTTP/1.1",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = s.recv(4096).decode(errors="replace")
    return int(head.split()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("access")
    make_run(root / "store", "r1", world_size=2)
    with dashboard_server(root / "store", root / "server.log", token=True) as (url, _):
        yield url, printed_token(root / "server.log")


def test_a_token_is_needed_by_default(served: tuple[str, str]) -> None:
    url, token = served
    host = url.removeprefix("http://")
    status, _, body = get(url, "/")
    assert status == 403 and "token" in body.lower() and body.count("\n") == 1, body
    assert get(url, "/?token=wrong")[0] == 403
    assert get(url, f"/{token}x/")[0] == 403 and get(url, f"/x{token}/")[0] == 403
    assert get(url, "/_stcore/health")[0] == 200  # a liveness probe says nothing about the store
    # the printed URL is the page: the token is its path, and no cookie is set
    status, headers, _ = get(url, f"/{token}/")
    assert status == 200 and "set-cookie" not in headers and headers["referrer-policy"] == "no-referrer"
    # the form printed before: a redirect to the token's path, without a cookie
    status, headers, _ = get(url, f"/run?token={token}&run=r1")
    assert status == 302 and headers["location"] == f"/{token}/run?run=r1" and "set-cookie" not in headers
    same_origin = {"Host": host, "Origin": url}
    assert websocket_status(url, same_origin) == 403  # no token: no session
    assert websocket_status(url, same_origin, prefix="/wrong") == 403
    assert websocket_status(url, same_origin, prefix=f"/{token}") == 101


def test_another_host_header_is_refused_on_http_and_the_websocket(served: tuple[str, str]) -> None:
    """DNS rebinding: a page at evil.example that resolves to 127.0.0.1 names its own Host."""
    url, token = served
    port = int(url.rsplit(":", 1)[1])
    evil = f"evil.example:{port}"
    status, _, body = get(url, f"/{token}/", {"Host": evil})
    assert status == 403 and "Host" in body, body
    assert get(url, f"/?token={token}", {"Host": evil})[0] == 403
    assert websocket_status(url, {"Host": evil, "Origin": f"http://{evil}"}, prefix=f"/{token}") == 403
    assert get(url, f"/{token}/", {"Host": f"localhost:{port}"})[0] == 200  # this machine's own names


class _Collector(http.server.BaseHTTPRequestHandler):
    """Another local user's server on another port: it keeps the Cookie header browsers send it."""

    cookies: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).cookies.append(self.headers.get("Cookie", ""))
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html><body>hello</body></html>")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.browser
def test_what_the_owners_browser_sends_another_port_opens_nothing(served: tuple[str, str]) -> None:
    """Browsers scope cookies by host, not port: the owner's browser sent `perfscope_token_<port>` to
    any server on 127.0.0.1, and another local user's listener replayed it for HTTP 200 (issue 33).
    The owner opens the printed URL in Chromium and uses the page; then the browser visits a listener
    on another port of 127.0.0.1; whatever it sent there, replayed to the dashboard by a client that
    never saw the URL, is refused, on HTTP and on the websocket."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    url, token = served
    host = url.removeprefix("http://")
    port = int(url.rsplit(":", 1)[1])
    seen: list[str] = []
    other = http.server.ThreadingHTTPServer(
        ("127.0.0.1", free_port()), type("C", (_Collector,), {"cookies": seen})
    )
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"{url}/?token={token}")  # the old printed form: redirected
                assert page.url == f"{url}/{token}/"
                settle(page)
                page.goto(f"http://127.0.0.1:{other.server_address[1]}/")
                jar = page.context.cookies()
            finally:
                browser.close()
    finally:
        other.shutdown()
        other.server_close()
    assert seen and all(token not in c for c in seen), seen  # the page and its favicon
    assert all(token not in c["value"] for c in jar), jar
    replay = {"Cookie": seen[0]} if seen[0] else {}
    assert get(url, "/", replay)[0] == 403
    assert get(url, "/sql", replay)[0] == 403
    assert websocket_status(url, {"Host": host, "Origin": url, **replay}) == 403
    # the old cookie itself, forged by the other user: refused
    assert get(url, "/", {"Cookie": f"perfscope_token_{port}={token}"})[0] == 403


def test_the_token_is_on_no_command_line(tmp_path: Path) -> None:
    """Every local user can read a process's command line (`ps`); the token goes in the environment."""
    cmd = command(tmp_path, "127.0.0.1", 8600)
    assert not any("baseUrlPath" in a for a in cmd)


def test_no_token_warns_and_serves(tmp_path: Path) -> None:
    make_run(tmp_path / "store", "r1", world_size=2)
    log = tmp_path / "server.log"
    with dashboard_server(tmp_path / "store", log) as (url, _):
        assert get(url, "/")[0] == 200
        text = log.read_text()
        assert "warning: --no-token" in text and "?token=" not in text


class _Trap(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).hits.append(self.path)
        self.send_response(502)
        self.end_headers()

    do_CONNECT = do_GET

    def log_message(self, *args: Any) -> None:
        pass


def test_a_wildcard_bind_looks_up_no_external_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamlit asks checkip.amazonaws.com for the machine's address on 0.0.0.0; the server is pointed at
    a proxy here that counts what goes out."""
    hits: list[str] = []
    trap = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), type("T", (_Trap,), {"hits": hits}))
    threading.Thread(target=trap.serve_forever, daemon=True).start()
    proxy = f"http://127.0.0.1:{trap.server_address[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, proxy)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,0.0.0.0")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost,0.0.0.0")
    make_run(tmp_path / "store", "r1", world_size=2)
    try:
        with dashboard_server(tmp_path / "store", tmp_path / "server.log", host="0.0.0.0", token=True) as (
            url,
            _,
        ):
            token = printed_token(tmp_path / "server.log")
            local = url.replace("0.0.0.0", "127.0.0.1")
            assert get(local, f"/?token={token}")[0] == 302
            assert get(local, f"/{token}/")[0] == 200
            # a foreign Origin on the websocket: refused without asking anyone for this machine's address
            port = int(url.rsplit(":", 1)[1])
            foreign = {"Host": f"127.0.0.1:{port}", "Origin": "http://elsewhere.example"}
            assert websocket_status(local, foreign, prefix=f"/{token}") == 403
            threading.Event().wait(2.5)  # Streamlit's lookup (1 s timeout, http then https) is over by now
    finally:
        trap.shutdown()
        trap.server_close()
    assert hits == [], f"the dashboard went out to {hits}"
    assert "localhost" in (tmp_path / "server.log").read_text()


def test_the_command_turns_off_the_banner_lookup(tmp_path: Path) -> None:
    cmd = command(tmp_path, "0.0.0.0", 8600)
    assert cmd[4].endswith("serve.py") and Path(cmd[4]).is_file()
    assert "--logger.hideWelcomeMessage=true" in cmd and "--browser.serverAddress=localhost" in cmd
    assert "--browser.gatherUsageStats=false" in cmd


# ---- the "open another store" box: folders under the root only -----------------------------------


def _app(store: str) -> None:
    from perfscope.dashboard.app import main

    main(store=store)


def _switch_to(store: Path, typed: str) -> tuple[list[str], str]:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_app, args=(str(store),), default_timeout=120)
    at.run()
    at.sidebar.text_input(key="store_switch").input(typed).run()
    assert not at.exception
    return [e.value for e in at.sidebar.error], str(at.sidebar.code[0].value)


def test_other_stores_open_under_the_root_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("streamlit")
    monkeypatch.delenv("PERFSCOPE_DASHBOARD_ROOT", raising=False)
    top = tmp_path / "top"
    make_run(top / "store", "r1", world_size=2)
    make_run(top / "store" / "inner", "r2", world_size=4)  # a store inside the root
    make_run(tmp_path / "outside", "r3", world_size=8)  # a readable store outside it
    (tmp_path / "secret.txt").write_text("x")
    store = top / "store"
    # the default root is the store the dashboard was started with
    errors, shown = _switch_to(store, str(tmp_path / "outside"))
    assert len(errors) == 1 and "only stores under" in errors[0] and shown == str(store.resolve())
    # outside the root, a file, a folder and nothing read alike: nothing tells which exists
    words = {
        _switch_to(store, str(p))[0][0].replace(str(p), "P")
        for p in (tmp_path / "secret.txt", tmp_path / "outside", tmp_path / "nothing", Path("/root/.ssh"))
    }
    assert len(words) == 1, words
    assert _switch_to(store, "../outside")[0] == errors  # not out by a relative path
    (store / "link").symlink_to(tmp_path / "outside")
    assert _switch_to(store, "link")[0] == errors  # nor by a link
    errors, shown = _switch_to(store, "inner")  # relative paths start at the root
    assert errors == [] and shown == str((store / "inner").resolve())
    monkeypatch.setenv("PERFSCOPE_DASHBOARD_ROOT", str(tmp_path))  # perfscope dashboard --root
    errors, shown = _switch_to(store, str(tmp_path / "outside"))
    assert errors == [] and shown == str((tmp_path / "outside").resolve())
