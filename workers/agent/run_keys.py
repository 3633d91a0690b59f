"""A run's own key: what the run's process gets instead of its agent's key, when the agent talks to a gateway.

A job used to inherit its agent's key (``PREFECT_API_AUTH_STRING``) and could act as the agent through the
gateway. Now an agent whose key is a prefect-launch key (``plk_...``: it talks to a gateway) obtains, as each run
starts, a key bound to that run and acting as its owner (``POST <api>/launch/run-keys``, see
``prefect_launch.gateway_run_keys``), and the run's environment carries that key in place of the agent's
(:func:`run_key_env`); the agent revokes it when the run's process has ended (:func:`revoke_run_keys`).
Processes started before any run (the warm engines' zygote) get no key at all (:func:`without_agent_key`).
Without a gateway (loopback, Prefect's own auth string) nothing changes: every function returns its input.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Mapping, Optional, TypeVar

import httpx

from prefect_launch.blocks.identity_keys import launch_credentials, split_key
from prefect_launch.workers.scheduling.resources import LaunchValidationError

__all__ = ["CREDENTIAL_VARS", "RunKeyError", "agent_credentials", "revoke_run_keys", "run_key_env",
           "without_agent_key"]

log = logging.getLogger("prefect_launch.agent")
CREDENTIAL_VARS = ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY")
RETRY_DELAYS_S = (0.5, 1, 2, 4, 8, 15)  # a gateway restarting takes seconds: ride it out, then say why
_MINTED: dict[str, list[str]] = {}  # run id -> ids of the keys this agent obtained for its current life
REVOKE_DELAYS_S = (0.5, 2)  # off the run's end path; the gateway ends the key itself a minute after the run
E = TypeVar("E", bound=Mapping)


class RunKeyError(LaunchValidationError):
    """The gateway gave no key for the run: the run does not start with the agent's key instead."""


def agent_credentials() -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(API URL, auth string, API key) of the agent's Prefect settings, the last two only when they hold a
    prefect-launch key (the agent talks to a gateway); (url, None, None) otherwise."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    auth = api.auth_string.get_secret_value() if api.auth_string is not None else None
    key = api.key.get_secret_value() if api.key is not None else None
    return (api.url, *launch_credentials(auth, key))


def behind_gateway() -> bool:
    _, auth, key = agent_credentials()
    return bool(auth or key)


def _headers(auth: Optional[str], key: Optional[str]) -> dict[str, str]:
    if auth:
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {"Authorization": f"Bearer {key}"}


def without_agent_key(env: E) -> E:
    """``env`` without the agent's credentials when it talks to a gateway (for processes started before any run,
    which get their run's key with their order); unchanged otherwise."""
    if not behind_gateway():
        return env
    return type(env)({k: v for k, v in env.items() if k not in CREDENTIAL_VARS})  # type: ignore[call-arg]


async def _call(method: str, path: str, what: str, delays: Optional[tuple[float, ...]] = None,
                **kw: object) -> httpx.Response:
    url, auth, key = agent_credentials()
    last: Optional[str] = None
    async with httpx.AsyncClient(timeout=30) as client:
        for delay in (*(RETRY_DELAYS_S if delays is None else delays), None):
            try:
                resp = await client.request(method, f"{url}/launch/run-keys{path}", headers=_headers(auth, key), **kw)
                if resp.status_code < 500:
                    return resp
                last = f"{resp.status_code} {resp.text[:300]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if delay is None:
                break
            await asyncio.sleep(delay)
    raise RunKeyError(f"could not {what} at the gateway ({url}): {last}")


async def run_key_env(run_id: object, revoked_here: bool = True) -> dict[str, str]:
    """The run's credentials for its environment (replacing the agent's): ``PREFECT_API_AUTH_STRING=<owner>:<run
    key>`` (and ``PREFECT_API_KEY=<run key>`` where the agent uses one); {} without a gateway. ``revoked_here``:
    this agent revokes the key when the run's process ends (:func:`revoke_run_keys`); a multi-node follower's
    members' key ends instead by the gateway's check, a minute after the run's final state."""
    _, auth, key = agent_credentials()
    if not (auth or key):
        return {}
    resp = await _call("POST", "", f"obtain a key for run {run_id}", json={"flow_run_id": str(run_id)})
    if resp.status_code != 201:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text[:300]
        raise RunKeyError(f"the gateway gave run {run_id} no key ({resp.status_code}): {detail}")
    body = resp.json()
    if revoked_here:
        _MINTED.setdefault(str(run_id), []).append(split_key(body["key"])[0])
    env = {"PREFECT_API_AUTH_STRING": body["auth_string"]}
    if key:
        env["PREFECT_API_KEY"] = body["key"]
    return env


async def revoke_run_keys(run_id: object) -> None:
    """Revoke the run's keys (its process has ended); a failure is logged, never raised (the gateway also ends
    them once the run has been final for a minute)."""
    if not behind_gateway():
        return
    key_ids = _MINTED.pop(str(run_id), None)  # this life's keys; unknown (the agent restarted): all of the run's
    try:
        resp = await _call("DELETE", f"/{run_id}", f"revoke the keys of run {run_id}", delays=REVOKE_DELAYS_S,
                           params=[("key_id", k) for k in key_ids or ()])
        if resp.status_code != 200:
            log.warning("the gateway did not revoke the keys of run %s (%s)", run_id, resp.status_code)
    except RunKeyError as exc:
        log.warning("%s", exc)
