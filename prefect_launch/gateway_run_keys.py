"""The gateway's run keys: a key an agent obtains for one run, which the run's process gets instead of the agent's.

Without them a job inherited its agent's key and could act as the agent (read every Secret, change any run).
``POST /api/launch/run-keys`` ``{"flow_run_id": ...}`` (agents' keys only) mints a key bound to that run and acting
as its owner (the ``owner:`` tag the gateway set), stored hashed like every key, valid
``LAUNCH_RUN_KEY_TTL_SECONDS`` (7 days) at most; ``DELETE /api/launch/run-keys/{flow_run_id}`` revokes the run's
keys (the agent calls it when the run's process has exited). A run key also stops working once its run has been
in a final state for ``LAUNCH_RUN_KEY_GRACE_SECONDS`` (60), checked whenever the gateway verifies it afresh, so a
run whose agent died does not leave a live key behind. The decisions are :mod:`prefect_launch.gateway_rules`'.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Optional

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prefect_launch import gateway_rules as R
from prefect_launch.blocks.identity_records import User
from prefect_launch.blocks.identity_repository import IdentityError
from prefect_launch.gateway_auth import credentials
from prefect_launch.settings import env_seconds

if TYPE_CHECKING:
    from prefect_launch.gateway_app import Gateway

__all__ = ["RUN_KEYS_PATH", "RunKeys"]

RUN_KEYS_PATH = "/api/launch/run-keys"


def _deny(refusal: R.Refusal) -> JSONResponse:
    return JSONResponse({"detail": refusal.message}, status_code=refusal.status)


class RunKeys:
    """The run-key endpoints of one gateway, and the end-of-run check of a run key being verified."""

    def __init__(self, gateway: "Gateway") -> None:
        self.gw = gateway
        self.ttl_s = env_seconds("LAUNCH_RUN_KEY_TTL_SECONDS", 7 * 24 * 3600)
        self.grace_s = env_seconds("LAUNCH_RUN_KEY_GRACE_SECONDS", 60)

    async def _read_run(self, run_id: str) -> tuple[int, Optional[dict]]:
        """The server's status and the run (None unless 200); a malformed id is a 404 here, not a server call."""
        if not R.is_run_id(run_id):
            return 404, None
        assert self.gw.client is not None
        try:
            resp = await self.gw.client.get(f"/api/flow_runs/{run_id}", headers=self.gw.upstream_headers())
        except Exception:
            return 502, None
        return resp.status_code, (resp.json() if resp.status_code == 200 else None)

    async def _agent(self, request: Request) -> tuple[Optional[User], Optional[Response]]:
        addr = request.client.host if request.client else "unknown"
        return await self.gw.authenticate(addr, credentials(request.headers.get("authorization")))

    async def mint(self, request: Request) -> Response:
        user, refusal = await self._agent(request)
        if refusal is not None:
            return refusal
        try:
            body = json.loads(await request.body() or b"{}")
            run_id = str(body["flow_run_id"])
        except (ValueError, KeyError, TypeError):
            return _deny(R.Refusal(422, 'expected a JSON body {"flow_run_id": "<id>"}'))
        status, run = await self._read_run(run_id) if user.is_agent else (200, None)
        if status not in (200, 404):
            return _deny(R.Refusal(502, f"the Prefect server did not answer for flow run {run_id} ({status})"))
        rule = R.run_key_refusal(user, run)
        if rule is not None:
            return _deny(rule)
        owner = R.tag_value(run.get("tags"), R.OWNER)
        try:
            key = await anyio.to_thread.run_sync(self.gw.repo.mint_run_key, owner, run_id, self.ttl_s)
        except IdentityError as exc:
            return _deny(R.Refusal(409, str(exc)))
        return JSONResponse({"flow_run_id": run_id, "owner": owner, "key": key, "auth_string": f"{owner}:{key}",
                             "ttl_s": self.ttl_s}, status_code=201)

    async def revoke(self, request: Request) -> Response:
        user, refusal = await self._agent(request)
        if refusal is not None:
            return refusal
        if not user.is_agent:
            return _deny(R.Refusal(403, f"user {user.name!r} may not revoke run keys: only agents' keys may"))
        run_id = request.path_params["run_id"]
        key_ids = request.query_params.getlist("key_id") or None  # none named: every key of the run
        n = await anyio.to_thread.run_sync(self.gw.repo.revoke_run_keys, run_id, key_ids)
        self.gw.keys.forget(lambda u: u.run_id == run_id and (key_ids is None or u.key_id in key_ids))
        return JSONResponse({"flow_run_id": run_id, "revoked": n})

    async def token_write(self, user: User, request: Request) -> tuple[Optional[bytes], Optional[Response]]:
        """A run key's block write: (body to forward, refusal); only its own session's token. The name is the
        body's (creating) or the stored document's (changing, deleting)."""
        body = await self.gw._read_limited(request)
        if body is None:
            return None, _deny(R.Refusal(413, "the request body is over 1 MiB (the limit for writing a token)"))
        if request.method == "POST":
            try:
                name = json.loads(body or b"{}").get("name")
            except (ValueError, AttributeError):
                name = None
        else:
            assert self.gw.client is not None
            doc_id = request.url.path.rstrip("/").rsplit("/", 1)[-1]
            resp = await self.gw.client.get(f"/api/block_documents/{doc_id}", headers=self.gw.upstream_headers(),
                                            params={"include_secrets": "false"})
            if resp.status_code == 404:
                return None, None  # the server says 404
            name = resp.json().get("name") if resp.status_code == 200 else None
        refusal = R.token_write_refusal(user, name)
        return body, (_deny(refusal) if refusal is not None else None)

    async def still_live(self, user: User) -> bool:
        """Whether a run key just verified afresh may still act: its run has not ended (beyond the grace).
        An ended run's keys are revoked here, so they stay refused even if the agent never said so."""
        status, run = await self._read_run(user.run_id or "")
        if status not in (200, 404) or not R.run_key_ended(run, time.time(), self.grace_s):
            return True  # the server did not answer: not a reason to end a running job's key
        await anyio.to_thread.run_sync(self.gw.repo.revoke_run_keys, user.run_id or "")
        self.gw.keys.forget(lambda u: u.run_id == user.run_id)
        return False
