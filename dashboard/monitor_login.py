"""Who the monitor acts as (issue 40): the gateway's users and keys, or the monitor's own password.

Two login modes, chosen by :func:`login_mode`:

- ``users``: the person at the browser signs in with a user name and that user's API key, checked by the
  identity store's own :meth:`~prefect_launch.blocks.identity_repository.IdentityRepository.verify`
  (scrypt, constant-time compare: the gateway's check, not a copy). Every write the pages make then goes
  to Prefect as that user (:func:`acting_as`: ``PREFECT_API_AUTH_STRING=<user>:<key>`` for the duration),
  through the gateway, whose rules decide: a user renames and terminates only their own sessions and
  reads only their own sessions' app tokens.
- ``password``: the old gate (:mod:`.links_auth`): one password before anything writes (none configured:
  no gate), the pages acting as the user the monitor runs as.

``LAUNCH_DASHBOARD_LOGIN=users|password`` chooses; unset, the monitor signs people in as users when its
own Prefect credentials are a prefect-launch key (it talks to Prefect through the gateway), else it
keeps the password mode. Failed sign-ins are limited per browser address with the gateway's
:class:`~prefect_launch.gateway_auth.FailureLimiter`. Pure but for :func:`verify_in_store` and
:func:`acting_as`; no Streamlit here (the form is :mod:`.login_form`).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import threading
import time
from enum import Enum
from typing import Callable, Iterator, Mapping, Optional

from pydantic import BaseModel, ConfigDict, SecretStr

from prefect_launch.blocks.identity_keys import launch_credentials
from prefect_launch.blocks.identity_records import User
from prefect_launch.dashboard.links_auth import PASSWORD_BLOCK_ENV, PASSWORD_ENV
from prefect_launch.gateway_auth import FailureLimiter

__all__ = ["LOGIN_ENV", "Mode", "SignedIn", "acting_as", "current_mode", "login_mode", "may_write", "refusal_text",
           "sign_in", "verify_in_store", "viewer"]

LOGIN_ENV = "LAUNCH_DASHBOARD_LOGIN"
STORE_TTL_S = 60.0


class Mode(str, Enum):
    USERS = "users"
    PASSWORD = "password"


class SignedIn(BaseModel):
    """The user the page acts as after a sign-in; the key stays a SecretStr (masked in any repr or log)."""

    model_config = ConfigDict(frozen=True)

    name: str
    role: str
    key: SecretStr

    def auth_string(self) -> str:
        return f"{self.name}:{self.key.get_secret_value()}"


def _is_gateway_key(api_key: Optional[str], auth_string: Optional[str]) -> bool:
    return any(launch_credentials(auth_string, api_key))


def login_mode(chosen: Optional[str], api_key: Optional[str] = None, auth_string: Optional[str] = None) -> Mode:
    """The login mode: ``chosen`` (``LAUNCH_DASHBOARD_LOGIN``) if given, else ``users`` when the monitor's own
    Prefect credentials are a prefect-launch key, else ``password``. ValueError for any other ``chosen``."""
    value = (chosen or "").strip().lower()
    if value:
        try:
            return Mode(value)
        except ValueError:
            raise ValueError(f"{LOGIN_ENV}={chosen!r} is not a login mode: use 'users' (sign in with a user name "
                             f"and key, checked against the gateway's users) or 'password' ({PASSWORD_ENV} or "
                             f"{PASSWORD_BLOCK_ENV})") from None
    return Mode.USERS if _is_gateway_key(api_key, auth_string) else Mode.PASSWORD


def current_mode(env: Mapping[str, str] = os.environ) -> Mode:
    """:func:`login_mode` from the environment and the Prefect settings the monitor's API client uses."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY

    def value(setting) -> Optional[str]:
        v = setting.value()
        return v.get_secret_value() if isinstance(v, SecretStr) else v

    return login_mode(env.get(LOGIN_ENV), value(PREFECT_API_KEY), value(PREFECT_API_AUTH_STRING))


def sign_in(name: Optional[str], key: Optional[str], addr: str,
            verify: Callable[[str, str], Optional[User]], limiter: FailureLimiter) -> tuple[Optional[SignedIn], str]:
    """(the signed-in user, "") or (None, why not). ``verify(name, key)`` is the identity store's check; an
    address with too many failures waits; a store that cannot be read keeps the page locked (fail closed)."""
    name, key = (name or "").strip(), (key or "").strip()
    wait = limiter.retry_after(addr)
    if wait > 0:
        return None, f"Too many failed sign-ins from {addr}; try again in {wait:.0f} s."
    if not name or not key:
        return None, "Enter your user name and your API key (`prefect-launch user add` or `user key rotate` print it)."
    try:
        user = verify(name, key)
    except Exception as exc:  # the store is down: nobody signs in, and nothing is counted against them
        return None, f"Sign-in unavailable: the users cannot be read ({type(exc).__name__}). Try again later."
    if user is None:
        limiter.failed(addr)
        return None, "Wrong user name or key (or the key was revoked, or the user is disabled)."
    if user.is_agent:
        return None, f"{user.name!r} is an agent's key; sign in with a person's user name and key."
    return SignedIn(name=user.name, role=user.role, key=SecretStr(key)), ""


def may_write(mode: Mode, signed: Optional[SignedIn], password_ok: bool, password_configured: bool) -> bool:
    """Whether the page may offer writes: a signed-in user (users), the password given or none set (password)."""
    if mode is Mode.USERS:
        return signed is not None
    return password_ok or not password_configured


def viewer(mode: Mode, signed: Optional[SignedIn]) -> Optional[str]:
    """Whose sessions the page manages: the signed-in user (users: None before a sign-in), else the user
    the monitor runs as (what the CLI defaults to)."""
    if mode is Mode.USERS:
        return signed.name if signed is not None else None
    return getpass.getuser()


def refusal_text(exc: BaseException) -> str:
    """What a failed write says on the page: the gateway's (or server's) ``detail`` with its status (a 403
    names the rule), else the error's kind and first line."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        try:
            detail = response.json().get("detail")
        except Exception:
            detail = None
        if detail:
            return f"{status}: {detail}"
    first = (str(exc).splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextlib.contextmanager
def acting_as(signed: Optional[SignedIn]) -> Iterator[None]:
    """Prefect's clients made inside (``get_client``, block loads and saves) authenticate as ``signed``
    (nothing changes for None): its ``user:key`` as the auth string, the monitor's own key set aside."""
    if signed is None:
        yield
        return
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, temporary_settings

    with temporary_settings(updates={PREFECT_API_AUTH_STRING: signed.auth_string()},
                            restore_defaults={PREFECT_API_KEY}):
        yield


LIMITER = FailureLimiter(limit=10, window_s=60.0)  # one per monitor process, per browser address
_store: dict[str, tuple[float, str]] = {}
_store_lock = threading.Lock()


def _store_url() -> str:
    """The identity store's URL as the gateway finds it (re-read each minute: a block load is a round trip)."""
    from prefect_launch.blocks.identity_repository import store_url

    where = "\0".join(os.environ.get(k, "") for k in ("LAUNCH_METRICS_URL", "LAUNCH_METRICS_BLOCK", "PREFECT_API_URL"))
    now = time.monotonic()
    with _store_lock:
        hit = _store.get(where)
        if hit and now - hit[0] < STORE_TTL_S:
            return hit[1]
    url = store_url()
    with _store_lock:
        _store[where] = (now, url)
    return url


def verify_in_store(name: str, key: str) -> Optional[User]:
    """The identity store's own check of ``key`` for user ``name`` (None: wrong, revoked, or disabled)."""
    from prefect_launch.blocks.identity_repository import IdentityRepository

    return IdentityRepository(_store_url()).verify(key, name)
