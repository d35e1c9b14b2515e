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
from storegen import make_run
from test_dashboard_browser import dashboard_server, free_port

from perfscope.commands.dashboard import command
from perfscope.dashboard.guard import cookie_name


def printed_token(log: Path) -> str:
    found = re.search(r"perfscope dashboard: http://\S+/\?token=([\w-]+)", log.read_text())
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


def websocket_status(url: str, headers: dict[str, str]) -> int:
    """The status line's code of a websocket handshake on Streamlit's stream (101: accepted)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lines = [
        "GET /_stcore/stream HTTP/1.1",
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
    port = int(url.rsplit(":", 1)[1])
    host = url.removeprefix("http://")
    status, _, body = get(url, "/")
    assert status == 403 and "token" in body and body.count("\n") == 1, body
    assert get(url, "/?token=wrong")[0] == 403
    assert get(url, "/_stcore/health")[0] == 200  # a liveness probe says nothing about the store
    # the printed URL: a redirect to the page without the token, which a cookie now carries
    status, headers, _ = get(url, f"/run?token={token}&run=r1")
    assert status == 302 and headers["location"] == "/run?run=r1"
    cookie = headers["set-cookie"]
    assert (
        cookie.startswith(f"{cookie_name(port)}={token};")
        and "HttpOnly" in cookie
        and "SameSite=Strict" in cookie
    )
    jar = {"Cookie": f"{cookie_name(port)}={token}"}
    assert get(url, "/", jar)[0] == 200
    assert get(url, "/", {"Cookie": f"{cookie_name(port)}=wrong"})[0] == 403
    same_origin = {"Host": host, "Origin": url}
    assert websocket_status(url, same_origin) == 403  # no token: no session
    assert websocket_status(url, {**same_origin, **jar}) == 101


def test_another_host_header_is_refused_on_http_and_the_websocket(served: tuple[str, str]) -> None:
    """DNS rebinding: a page at evil.example that resolves to 127.0.0.1 names its own Host."""
    url, token = served
    port = int(url.rsplit(":", 1)[1])
    jar = {"Cookie": f"{cookie_name(port)}={token}"}
    evil = f"evil.example:{port}"
    status, _, body = get(url, "/", {"Host": evil, **jar})
    assert status == 403 and "Host" in body, body
    assert get(url, f"/?token={token}", {"Host": evil})[0] == 403
    assert websocket_status(url, {"Host": evil, "Origin": f"http://{evil}", **jar}) == 403
    assert get(url, "/", {"Host": f"localhost:{port}", **jar})[0] == 200  # this machine's own names


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
            # a foreign Origin on the websocket: refused without asking anyone for this machine's address
            port = int(url.rsplit(":", 1)[1])
            foreign = {"Host": f"127.0.0.1:{port}", "Origin": "http://elsewhere.example"}
            assert websocket_status(local, {**foreign, "Cookie": f"{cookie_name(port)}={token}"}) == 403
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
