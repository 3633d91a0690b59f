"""Streamlit's hashed static assets (its scripts, styles and fonts) answered from memory.

A new visitor's browser fetches ~100 of them (3.4 MB) before the page can draw, and Streamlit's
Starlette server answers each through ``StaticFiles``: a stat and every 64-KB read on a worker
thread, after the path, session and gzip middleware. That costs the monitor's process ~2.5-6 ms of CPU a
file (0.25-0.6 s a visit here), in the same process, and under the same GIL, as the script run that
draws the page, just while the browser waits for both. An asset whose name carries its content hash
never changes while the server runs (Streamlit marks it ``immutable``), so the first answer for its
path is kept and replayed: one write of the headers and one of the body.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, MutableMapping

from prefect_launch.compat.streamlit import CREATE_APP, SERVER_MODULE
from prefect_launch.dashboard import streamlit_hook

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SERVER = SERVER_MODULE  # listed in compat.streamlit with the functions the monitor wraps
MAX_BYTES = 64 << 20  # Streamlit's static folder is ~20 MB; a bound, so no folder can grow the process without end
_CONDITIONAL = (b"if-none-match", b"if-modified-since", b"range", b"if-range")


def kept(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response may be replayed for every later GET of its path: a whole 200 its server
    marked ``immutable`` (Streamlit's content-hashed assets; never its index.html or manifest)."""
    if status != 200:
        return False
    h = {k.lower(): v for k, v in headers}
    return (b"immutable" in h.get(b"cache-control", b"").lower() and b"content-range" not in h
            # an answer that depends on the request's headers (compressed for one that accepts gzip) is not one
            # answer for its path; Streamlit sends its static files plain, and this keeps it so if that changes
            and b"content-encoding" not in h and b"vary" not in h)


class AssetCache:
    """ASGI wrapper of an app: the first whole ``immutable`` 200 answered for a path is kept
    (up to :data:`MAX_BYTES` in all) and replayed for later plain GETs of it. Conditional and range
    requests, other methods, and whatever is not kept go to the app as before."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.size = 0
        self.entries: dict[str, tuple[int, list[tuple[bytes, bytes]], bytes]] = {}

    def __getattr__(self, name: str) -> Any:  # the wrapped app's own attributes (state, routes, …)
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "GET" or any(
                k.lower() in _CONDITIONAL for k, _ in scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        path = scope.get("root_path", "") + "\0" + scope.get("path", "")
        hit = self.entries.get(path)
        if hit is not None:
            status, headers, body = hit
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        start: dict = {}
        chunks: list[bytes] = []

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))
            await send(message)

        await self.app(scope, receive, recording)
        status, headers = start.get("status", 0), [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
        body = b"".join(chunks)
        if kept(status, headers) and self.size + len(body) <= self.max_bytes:
            self.entries[path] = (status, headers, body)
            self.size += len(body)


def install() -> bool:
    """Put an :class:`AssetCache` in front of the app Streamlit's Starlette server makes (its middleware
    included: a kept asset's path passed its path check the first time, and a replay is then two writes).
    Returns whether it is there (False where this Streamlit makes its app some other way: nothing
    changes)."""

    def around(make: Callable[..., Any]) -> Callable[..., Any]:
        def create_starlette_app(*args, **kwargs):
            return AssetCache(make(*args, **kwargs))

        return create_starlette_app

    return streamlit_hook.wrap(SERVER, CREATE_APP, "asset_cache", around)
