"""The dashboard's front door: an ASGI middleware before Streamlit that answers only requests for the
bound address (a DNS-rebinding page names another Host) from browsers that brought the access token.

The token comes once in the URL the CLI prints (`/?token=...`, as Jupyter does); the answer is a
redirect to the same page without it that sets an HttpOnly, SameSite=Strict cookie, which the page's
later requests and its websocket carry. Everything else gets 403 and one line saying why.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import CookieError, SimpleCookie
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


def cookie_name(port: int | None) -> str:
    """One cookie per port: two dashboards on one host do not overwrite each other's token."""
    return f"perfscope_token_{port or 0}"


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
        if self.token is None or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        port = (scope.get("server") or (None, None))[1]
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == TOKEN_PARAM]
        if given and scope["type"] == "http":
            if not self._valid(given[-1]):
                await self._refuse(scope, send, "perfscope dashboard: wrong token")
                return
            rest = urlencode([(k, v) for k, v in query if k != TOKEN_PARAM])
            where = scope.get("path", "/") + (f"?{rest}" if rest else "")
            await self._redirect(send, where, port)
            return
        if self._valid(self._cookie(headers.get("cookie", ""), port)):
            await self.app(scope, receive, send)
            return
        await self._refuse(
            scope,
            send,
            "perfscope dashboard: open the URL with ?token=... that `perfscope dashboard` printed at start",
        )

    def _valid(self, given: str | None) -> bool:
        if not given or self.token is None:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    @staticmethod
    def _cookie(header: str, port: int | None) -> str | None:
        try:
            jar = SimpleCookie(header)
        except CookieError:
            return None
        morsel = jar.get(cookie_name(port))
        return morsel.value if morsel is not None else None

    @staticmethod
    def _same_origin(origin: str | None, host: str) -> bool:
        """A websocket from a page of this server (or a client that sends no Origin)."""
        if origin is None:
            return True
        return urlsplit(origin).netloc.lower() == host.lower()

    async def _redirect(self, send: Send, where: str, port: int | None) -> None:
        cookie = f"{cookie_name(port)}={self.token}; Path=/; HttpOnly; SameSite=Strict"
        await send(
            {
                "type": "http.response.start",
                "status": 302,
                "headers": [
                    (b"location", where.encode("latin-1")),
                    (b"set-cookie", cookie.encode("latin-1")),
                    (b"cache-control", b"no-store"),
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
