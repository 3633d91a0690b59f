"""The monitor's login gate before anything writes (the Manage Links form).

Off unless configured. Turn it on with one of:

- ``LAUNCH_DASHBOARD_PASSWORD_BLOCK=<name>``: the password is the value of that Prefect
  Secret block (read through the Prefect API the monitor already uses, re-read every minute);
- ``LAUNCH_DASHBOARD_PASSWORD=<password>``: the password itself, from the environment.

The block wins when both are set. A configured block that cannot be read keeps the
form locked (fail closed). Reading the monitor needs no login; for that, put an
authenticating reverse proxy in front of Streamlit (see docs/security.md).
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from typing import Optional

PASSWORD_ENV = "LAUNCH_DASHBOARD_PASSWORD"
PASSWORD_BLOCK_ENV = "LAUNCH_DASHBOARD_PASSWORD_BLOCK"
TTL_S = 60.0

_cache: dict[str, tuple[float, Optional[str]]] = {}
_lock = threading.Lock()


class GateUnavailable(RuntimeError):
    """A login is required but its password cannot be read (the form stays locked)."""


def gate_enabled() -> bool:
    return bool(os.environ.get(PASSWORD_BLOCK_ENV) or os.environ.get(PASSWORD_ENV))


def expected_password() -> Optional[str]:
    """The password the form asks for; None when no login is configured."""
    block = os.environ.get(PASSWORD_BLOCK_ENV)
    if block:
        now = time.monotonic()
        with _lock:
            hit = _cache.get(block)
            if hit and now - hit[0] < TTL_S:
                return hit[1]
        from prefect.blocks.system import Secret

        try:
            value = str(Secret.load(block, _sync=True).get())
        except Exception as exc:
            raise GateUnavailable(f"the login password (Secret block {block!r}) cannot be read: "
                                  f"{type(exc).__name__}") from None
        with _lock:
            _cache[block] = (now, value)
        return value
    return os.environ.get(PASSWORD_ENV) or None


def check_password(given: Optional[str]) -> bool:
    """True when ``given`` is the configured password (constant-time compare); False when none is set."""
    expected = expected_password()
    if not expected or not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


__all__ = ["GateUnavailable", "check_password", "expected_password", "gate_enabled"]
