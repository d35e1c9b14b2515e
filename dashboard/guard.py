"""The dashboard's front door: an ASGI middleware before Streamlit that answers only requests for the
bound address (a DNS-rebinding page names another Host) that bring the access token.

The token is the first segment of every path: Streamlit serves the app under it
(`--server.baseUrlPath`, handed over in the environment, never on a command line `ps` shows), and
the CLI prints `http://127.0.0.1:PORT/TOKEN/`. There is no cookie: browsers scope cookies by host,
not port, so a token cookie for 127.0.0.1:8501 was sent to any server on 127.0.0.1, another local
user's included, who could replay it (issue 33). A path is sent to its own origin only, and the
answers carry `Referrer-Policy: no-referrer`, so no page takes the URL elsewhere. `/?token=TOKEN`
(the form printed before) redirects to `/TOKEN/`. Everything else gets 403 and one line saying why.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from . import ENV_HOSTS, ENV_TOKEN

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

TOKEN_PARAM = "token"
#: answered without a token: a liveness probe that says nothing about the store
OPEN_PATHS = frozenset({"/_stcore/health"})


def allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host header values a server bound to `host`:`port` answers; None for a wildcard bind
    (0.0.0.0, ::), whose names the server cannot know: the token alone guards it."""
    if host in ("0.0.0.0", "::", ""):
        return None
    names = {host}
    if host in ("127.0.0.1", "localhost", "::1"):
        names |= {"127.0.0.1", "localhost", "[::1]"}
    if ":" in host and not host.startswith("["):
        names.add(f"[{host}]")
    out = {f"{n}:{port}" for n in names}
    if port == 80:
        out |= names
    return frozenset(out)


class AccessGuard:
    """Check the Host header (HTTP and websocket) and the access token before Streamlit sees a request."""

    def __init__(self, app: App, token: str | None = None, hosts: frozenset[str] | None = None) -> None:
        self.app = app
        self.token = token if token is not None else os.environ.get(ENV_TOKEN) or None
        if hosts is None:
            given = os.environ.get(ENV_HOSTS, "*")
            hosts = None if given.strip() in ("", "*") else frozenset(h for h in given.split(",") if h)
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host", "")
        if self.hosts is not None and host.lower() not in self.hosts:
            await self._refuse(
                scope, send, f"perfscope dashboard: Host {host!r} is not this server's address"
            )
            return
        if scope["type"] == "websocket" and not self._same_origin(headers.get("origin"), host):
            await self._refuse(scope, send, "perfscope dashboard: the page's origin is not this server")
            return
        if self.token is None:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "/")
        if path in OPEN_PATHS:  # Streamlit answers it under the token's path only
            await self.app(self._under_token(scope), receive, send)
            return
        if self._valid(path.split("/")[1] if path.startswith("/") else ""):
            await self.app(scope, receive, self._no_referrer(send))
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == TOKEN_PARAM]
        if given and scope["type"] == "http":
            if not self._valid(given[-1]):
                await self._refuse(scope, send, "perfscope dashboard: wrong token")
                return
            rest = urlencode([(k, v) for k, v in query if k != TOKEN_PARAM])
            where = f"/{self.token}{path}" + (f"?{rest}" if rest else "")
            await self._redirect(send, where)
            return
        await self._refuse(
            scope,
            send,
            "perfscope dashboard: open the URL `perfscope dashboard` printed at start (http://HOST:PORT/TOKEN/)",
        )

    def _valid(self, given: str | None) -> bool:
        if not given or self.token is None:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _under_token(self, scope: Scope) -> Scope:
        inner = dict(scope)
        inner["path"] = f"/{self.token}{scope['path']}"
        inner["raw_path"] = inner["path"].encode("latin-1")
        return inner

    @staticmethod
    def _no_referrer(send: Send) -> Send:
        """`send` adding Referrer-Policy: no-referrer to every HTTP answer: the page's URL, which holds
        the token, is never sent to another site in a Referer header."""

        async def sending(message: Message) -> None:
            if message.get("type") == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"referrer-policy"]
                message = {**message, "headers": [*headers, (b"referrer-policy", b"no-referrer")]}
            await send(message)

        return sending

    @staticmethod
    def _same_origin(origin: str | None, host: str) -> bool:
        """A websocket from a page of this server (or a client that sends no Origin)."""
        if origin is None:
            return True
        return urlsplit(origin).netloc.lower() == host.lower()

    @staticmethod
    async def _redirect(send: Send, where: str) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 302,
                "headers": [
                    (b"location", where.encode("latin-1")),
                    (b"cache-control", b"no-store"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _refuse(scope: Scope, send: Send, why: str) -> None:
        if scope["type"] == "websocket":  # closing before accepting answers the handshake with 403
            await send({"type": "websocket.close", "code": 1008})
            return
        body = (why + "\n").encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
