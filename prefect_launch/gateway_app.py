"""The gateway: Prefect's API (and UI) served with every request authenticated, forwarded to the Prefect server.

A Starlette app (run by uvicorn, as Prefect's own server is) that, for each request under ``/api``:

1. refuses an address that failed too often (429, :class:`~prefect_launch.gateway_auth.FailureLimiter`);
2. verifies the key (Bearer or Basic ``user:key``) against the identity tables
   (:class:`~prefect_launch.blocks.identity_repository.IdentityRepository`, answers cached a few seconds);
   anything else is 401;
3. applies :mod:`prefect_launch.gateway_rules` to creating and changing runs, reading what it needs (a
   deployment's queue, a run's tags) from the server;
4. forwards the request to the server with httpx, streaming both bodies, without the user's key (with
   the server's own auth string when it has one).

The UI's static files (paths outside ``/api``) are forwarded for GET and HEAD without a key, as the
Prefect server itself serves them; the UI then logs in with Basic ``user:key``. The events websockets
(``/api/events/in``, ``/api/events/out``) take Prefect's auth message (its token: ``user:key`` or a key)
and are relayed to the server's. No key, hash or Authorization header is ever logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Generic, Optional, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import anyio
import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from prefect_launch import gateway_rules as R
from prefect_launch.blocks.identity_records import User
from prefect_launch.blocks.identity_repository import IdentityRepository
from prefect_launch.gateway_auth import Credentials, FailureLimiter, KeyCache, credentials, token_credentials
from prefect_launch.gateway_run_keys import RUN_KEYS_PATH, RunKeys
from prefect_launch.settings import env_int, env_seconds

__all__ = ["GatewayConfig", "create_app"]

log = logging.getLogger("prefect_launch.gateway")
V = TypeVar("V")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "authorization", "content-length"}
MAX_RULE_BODY = 1 << 20  # the bodies the rules read (run creation, state changes) are small JSON


@dataclass
class GatewayConfig:
    upstream: str  # the Prefect server's API URL, e.g. http://127.0.0.1:4200/api
    store_url: str
    upstream_auth: Optional[str] = None  # the server's PREFECT_SERVER_API_AUTH_STRING, if it has one
    key_cache_s: float = 10.0
    failure_limit: int = 20
    failure_window_s: float = 60.0
    max_body: int = 16 << 20  # larger request bodies get 413

    @classmethod
    def from_env(cls, upstream: str, store_url: str) -> "GatewayConfig":
        from prefect.settings import get_current_settings

        auth = get_current_settings().api.auth_string
        return cls(upstream=upstream, store_url=store_url,
                   upstream_auth=auth.get_secret_value() if auth is not None else None,
                   key_cache_s=env_seconds("LAUNCH_GATEWAY_KEY_CACHE_SECONDS", 10),
                   failure_limit=env_int("LAUNCH_GATEWAY_FAILURE_LIMIT", 20),
                   max_body=env_int("LAUNCH_GATEWAY_MAX_BODY_BYTES", 16 << 20))

    @property
    def origin(self) -> str:
        """``scheme://host:port`` of the server: the gateway's paths are forwarded as they are."""
        u = urlsplit(self.upstream)
        return f"{u.scheme}://{u.netloc}"


class _TTL(Generic[V]):
    """Values kept ``ttl_s`` seconds (at most ``max_entries``; full: emptied)."""

    def __init__(self, ttl_s: float, max_entries: int = 4096) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._data: dict[str, tuple[float, V]] = {}

    def get(self, key: str) -> Optional[V]:
        hit = self._data.get(key)
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def put(self, key: str, value: V) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._data) >= self.max_entries:
            self._data.clear()
        self._data[key] = (time.monotonic() + self.ttl_s, value)


class BodyTooLarge(Exception):
    """A streamed request body passed the gateway's limit."""


def _deny(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers or None)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.repo = IdentityRepository(config.store_url)
        self.limiter = FailureLimiter(config.failure_limit, config.failure_window_s)
        self.keys: KeyCache[User] = KeyCache(config.key_cache_s)
        # a deployment's queue and a queue's access rows, kept as long as a key (a run creation then costs no
        # extra round trip to the server; an access change takes effect within that time)
        self.pools: _TTL[Optional[str]] = _TTL(config.key_cache_s)
        self.access: _TTL[Any] = _TTL(config.key_cache_s)
        self.client: Optional[httpx.AsyncClient] = None
        self.run_keys = RunKeys(self)

    def upstream_headers(self) -> dict[str, str]:
        if not self.config.upstream_auth:
            return {}
        return {"Authorization": "Basic " + base64.b64encode(self.config.upstream_auth.encode()).decode()}

    async def startup(self) -> None:
        self.client = httpx.AsyncClient(base_url=self.config.origin, timeout=httpx.Timeout(60.0, connect=10.0),
                                        limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # ----------------------------------------------------------------- identity

    async def verify(self, cred: Optional[Credentials]) -> Optional[User]:
        if cred is None:
            return None
        user = self.keys.get(cred)
        if user is None:
            user = await anyio.to_thread.run_sync(self.repo.verify, cred.key, cred.user)
            if user is not None and user.is_run_key and not await self.run_keys.still_live(user):
                user = None  # its run has ended
            if user is not None:
                self.keys.put(cred, user)
        return user

    async def authenticate(self, addr: str, cred: Optional[Credentials]) -> tuple[Optional[User], Optional[Response]]:
        wait = self.limiter.retry_after(addr)
        if wait > 0:
            return None, _deny(429, f"too many failed sign-ins from {addr}; try again in {wait:.0f} s",
                               **{"Retry-After": str(int(wait) + 1)})
        if cred is None:
            self.limiter.failed(addr)
            return None, _deny(401, "an API key is required: send Authorization: Bearer <key> "
                                    "(PREFECT_API_KEY) or Basic <user>:<key> (PREFECT_API_AUTH_STRING)",
                               **{"WWW-Authenticate": 'Bearer realm="prefect-launch"'})
        user = await self.verify(cred)
        if user is None:
            self.limiter.failed(addr)
            return None, _deny(401, "the API key is not valid (wrong, revoked, or its user is disabled)",
                               **{"WWW-Authenticate": 'Bearer realm="prefect-launch"'})
        return user, None

    # -------------------------------------------------------------------- rules

    async def _get_json(self, path: str) -> Optional[dict]:
        assert self.client is not None
        resp = await self.client.get(path, headers=self.upstream_headers())
        if resp.status_code != 200:
            return None
        return resp.json()

    async def _queue_refusal(self, user: User, deployment_id: Optional[str],
                             pool: Optional[str] = None) -> Optional[R.Refusal]:
        """Why the run's queue is closed to ``user``: the body's ``work_pool_name`` and its deployment's queue,
        each must be open (a body naming an open pool cannot carry a closed queue's deployment)."""
        pools = [pool] if isinstance(pool, str) and pool else []
        if deployment_id:
            dep_pool = self.pools.get(deployment_id)
            if dep_pool is None:
                dep = await self._get_json(f"/api/deployments/{deployment_id}")
                dep_pool = (dep or {}).get("work_pool_name") or ""
                if dep is not None:
                    self.pools.put(deployment_id, dep_pool)
            if isinstance(dep_pool, str) and dep_pool:
                pools.append(dep_pool)
        for name in dict.fromkeys(pools):  # none: no such deployment (the server answers that) or no queue
            access = self.access.get(name)
            if access is None:
                access = await anyio.to_thread.run_sync(self.repo.queue_access, name)
                self.access.put(name, access)
            refusal = R.queue_refusal(user, access)
            if refusal is not None:
                return refusal
        return None

    async def apply_rules(self, user: User, route: R.Route, request: Request,
                          body: bytes) -> tuple[Optional[bytes], Optional[Response]]:
        """The body to forward (None: unchanged) or a refusal."""
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            return None, None  # the server answers malformed JSON itself
        if not isinstance(data, dict):
            return None, None
        if route.kind == R.OWN_VARIABLE:
            refusal = R.own_variable_refusal(user, route.id if route.id is not None else data.get("name"),
                                             creating=request.method == "POST")
            return None, (_deny(refusal.status, refusal.message) if refusal is not None else None)
        labels = data if request.url.path.rstrip("/").endswith("/labels") else data.get("labels")
        refusal = R.label_refusal(user, labels)
        if refusal is not None:
            return None, _deny(refusal.status, refusal.message)
        if route.kind in (R.CREATE_FROM_DEPLOYMENT, R.CREATE_RUN):
            dep = route.id if route.kind == R.CREATE_FROM_DEPLOYMENT else data.get("deployment_id")
            pool = data.get("work_pool_name") if route.kind == R.CREATE_RUN else None
            refusal = await self._queue_refusal(user, dep, pool)
            if refusal is None:
                tags, refusal = R.launch_tags(user, data.get("tags"))
            if refusal is not None:
                return None, _deny(refusal.status, refusal.message)
            data["tags"] = tags
            return json.dumps(data).encode(), None
        # CHANGE_RUN
        run = await self._get_json(f"/api/flow_runs/{route.id}")
        if run is None:
            return None, None  # the server says 404
        what = {"DELETE": "delete", "PATCH": "rename or change"}.get(request.method, "change the state of")
        if request.url.path.rstrip("/").endswith("/labels"):
            what = "relabel"
        state_type = ((data.get("state") or {}) if isinstance(data.get("state"), dict) else {}).get("type")
        if state_type in ("CANCELLING", "CANCELLED"):
            what = "cancel"
        refusal = R.may_change_run(user, run.get("tags"), what)
        if refusal is not None:
            return None, _deny(refusal.status, refusal.message)
        if request.method == "PATCH" and "tags" in data and not (user.is_admin or user.is_agent):
            kept, _ = R.launch_tags(user, data.get("tags"))
            data["tags"] = kept
            return json.dumps(data).encode(), None
        return None, None

    # ------------------------------------------------------------------ forward

    async def http(self, request: Request) -> Response:
        path = request.url.path
        raw_path = request.scope.get("raw_path", b"").decode("latin-1")
        if not all(R.safe_path(p) for p in (path, request.scope.get("path", ""), raw_path, unquote(raw_path))):
            return _deny(400, "the path may not hold '.' or '..' segments")
        body: Optional[bytes] = None
        if path == "/api" or path.startswith("/api/"):
            addr = request.client.host if request.client else "unknown"
            user, refusal = await self.authenticate(addr, credentials(request.headers.get("authorization")))
            if refusal is not None:
                return refusal
            assert user is not None
            refusal = self._size_refusal(request)
            if refusal is None:
                rule = R.write_refusal(user, request.method, path)
                refusal = _deny(rule.status, rule.message) if rule is not None else None
            if refusal is None and user.is_run_key and R.token_write(request.method, path):
                body, refusal = await self.run_keys.token_write(user, request)  # its session's token only
                if refusal is None:
                    return await self.forward(request, body)
            if refusal is None:
                query, body, refusal = await self._secret_reads(user, request)
            if refusal is None:
                route = R.classify(request.method, path)
                if route is not None:
                    if body is None:
                        body = await self._read_limited(request)
                    if body is None:
                        return _deny(413, f"the request body is over {MAX_RULE_BODY} bytes (the limit for "
                                          "creating and changing runs)")
                    new, refusal = await self.apply_rules(user, route, request, body)
                    body = new if new is not None else body
            if refusal is not None:
                log.info("refused %s %s for %s: %s", request.method, path, user.name, refusal.body.decode())
                return refusal
            return await self.forward(request, body, query)
        elif request.method not in ("GET", "HEAD"):
            return _deny(401, "only the UI's files are served without a key; the API is under /api")
        return await self.forward(request, body)

    def _size_refusal(self, request: Request) -> Optional[Response]:
        length = request.headers.get("content-length")
        try:
            too_big = length is not None and int(length) > self.config.max_body
        except ValueError:
            return _deny(400, "the Content-Length header is not a number")
        if too_big:
            return _deny(413, f"the request body ({length} bytes) is over the gateway's limit of "
                              f"{self.config.max_body} bytes (LAUNCH_GATEWAY_MAX_BODY_BYTES)")
        return None

    async def _secret_reads(self, user: User, request: Request) -> tuple[Optional[str], Optional[bytes], Optional[Response]]:
        """A plain user's block read: (query to forward, body to forward, refusal). Secret values come back
        masked (``include_secrets`` forced off) except a session token to its session's owner; a Secret read
        by name with its value is refused."""
        params = parse_qsl(request.url.query, keep_blank_values=True)
        include = any(k == "include_secrets" and v.lower() in ("true", "1", "yes", "on") for k, v in params)
        sr = R.secret_read(user, request.method, request.url.path, include)
        if not sr.block_read:
            return None, None, None
        if sr.run_id is not None:
            run = await self._get_json(f"/api/flow_runs/{sr.run_id}")
            owner = R.tag_value((run or {}).get("tags"), R.OWNER)
            if owner == user.name:
                return None, None, None
            refusal = R.secret_refusal(user, sr.name or "", owner)
            return None, None, _deny(refusal.status, refusal.message)
        if sr.refuse:
            refusal = R.secret_refusal(user, sr.name or "")
            return None, None, _deny(refusal.status, refusal.message)
        query = urlencode([(k, v) for k, v in params if k != "include_secrets"] + [("include_secrets", "false")])
        body = None
        if request.method == "POST":
            body = await self._read_limited(request)
            if body is None:
                return None, None, _deny(413, f"the request body is over {MAX_RULE_BODY} bytes (the limit for "
                                              "reading blocks)")
            try:
                data = json.loads(body) if body else {}
            except ValueError:
                data = None
            if isinstance(data, dict):
                data["include_secrets"] = False
                body = json.dumps(data).encode()
        return query, body, None

    @staticmethod
    async def _read_limited(request: Request) -> Optional[bytes]:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_RULE_BODY:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _limited_stream(self, request: Request) -> AsyncIterator[bytes]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body:
                raise BodyTooLarge()
            yield chunk

    async def forward(self, request: Request, body: Optional[bytes], query: Optional[str] = None) -> Response:
        assert self.client is not None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        headers += list(self.upstream_headers().items())
        raw = request.scope.get("raw_path") or request.url.path.encode()
        query = request.url.query if query is None else query
        url = raw.decode("latin-1") + (("?" + query) if query else "")
        content: Any = body if body is not None else self._limited_stream(request)
        req = self.client.build_request(request.method, url, headers=headers, content=content)
        try:
            resp = await self.client.send(req, stream=True)
        except BodyTooLarge:
            return _deny(413, f"the request body is over the gateway's limit of {self.config.max_body} bytes "
                              "(LAUNCH_GATEWAY_MAX_BODY_BYTES)")
        except httpx.HTTPError as exc:
            return _deny(502, f"the Prefect server did not answer: {type(exc).__name__}")
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP - {"content-length"}}
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out_headers,
                                 background=BackgroundTask(resp.aclose))

    # -------------------------------------------------------------- websockets

    async def websocket(self, ws: WebSocket) -> None:
        from websockets.asyncio.client import connect

        protocols = [p.strip() for h in ws.headers.getlist("sec-websocket-protocol") for p in h.split(",")]
        prefect_protocol = "prefect" in protocols
        addr = ws.client.host if ws.client else "unknown"
        await ws.accept(subprotocol="prefect" if prefect_protocol else None)
        cred = credentials(ws.headers.get("authorization"))
        if prefect_protocol:
            try:
                message = json.loads(await asyncio.wait_for(ws.receive_text(), 10))
            except (asyncio.TimeoutError, ValueError, WebSocketDisconnect):
                message = {}
            if not isinstance(message, dict) or message.get("type") != "auth":
                await ws.close(1008, reason="expected Prefect's auth message first")
                return
            cred = token_credentials(message.get("token")) or cred
        user, refusal = await self.authenticate(addr, cred)
        if refusal is not None:
            await ws.close(1008, reason="an API key is required in the auth message (user:key or key)")
            return
        origin = urlsplit(self.config.origin)
        target = f"{'wss' if origin.scheme == 'https' else 'ws'}://{origin.netloc}{ws.url.path}"
        if ws.url.query:
            target += "?" + ws.url.query
        try:
            async with connect(target, subprotocols=["prefect"], additional_headers=self.upstream_headers(),
                               compression=None, open_timeout=10) as up:
                await up.send(json.dumps({"type": "auth", "token": self.config.upstream_auth}))

                async def client_to_server() -> None:
                    while True:
                        msg = await ws.receive()
                        if msg["type"] == "websocket.disconnect":
                            return
                        await up.send(msg.get("text") if msg.get("text") is not None else msg.get("bytes"))

                async def server_to_client() -> None:
                    async for msg in up:
                        if isinstance(msg, bytes):
                            await ws.send_bytes(msg)
                        else:
                            await ws.send_text(msg)

                tasks = [asyncio.create_task(client_to_server()), asyncio.create_task(server_to_client())]
                done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in pending:
                    t.cancel()
                for t in done:
                    t.exception()  # a dropped side ends the relay; nothing to report
        except Exception as exc:  # the server refused or dropped: tell the client, without any key
            log.info("events websocket for %s ended: %s", user.name if user else "?", type(exc).__name__)
        try:
            await ws.close()
        except Exception:
            pass


def create_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)
    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    app = Starlette(routes=[WebSocketRoute("/api/events/in", gw.websocket),
                            WebSocketRoute("/api/events/out", gw.websocket),
                            Route(RUN_KEYS_PATH, gw.run_keys.mint, methods=["POST"]),
                            Route(RUN_KEYS_PATH + "/{run_id}", gw.run_keys.revoke, methods=["DELETE"]),
                            Route("/{path:path}", gw.http, methods=methods)],
                    lifespan=lifespan)
    app.state.gateway = gw
    return app
