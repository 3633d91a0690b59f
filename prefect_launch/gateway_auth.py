"""The gateway's door: credentials from a request, failed attempts limited per address, verified keys cached.

Pure (no server): :func:`credentials` reads ``Authorization: Bearer <key>`` (Prefect's client with
``PREFECT_API_KEY``) or ``Basic base64(user:key)`` (``PREFECT_API_AUTH_STRING=user:key``, the Prefect UI's
login); :class:`FailureLimiter` refuses an address for the rest of a window after too many failed
attempts; :class:`KeyCache` keeps a verified key's user for a few seconds (a key check is a scrypt hash,
tens of milliseconds) under an HMAC of the key with a per-process secret, so the plaintext is never kept.
Nothing here logs a key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import threading
import time
from typing import Callable, Generic, NamedTuple, Optional, TypeVar

__all__ = ["Credentials", "credentials", "token_credentials", "FailureLimiter", "KeyCache"]

T = TypeVar("T")


class Credentials(NamedTuple):
    key: str
    user: Optional[str] = None  # Basic auth names the user too


def token_credentials(token: Optional[str]) -> Optional[Credentials]:
    """The events websocket's auth token: ``user:key`` (an auth string) or a bare key."""
    if not token or not isinstance(token, str):
        return None
    user, sep, key = token.partition(":")
    if sep:
        return Credentials(key=key, user=user) if user and key else None
    return Credentials(key=token)


def credentials(authorization: Optional[str]) -> Optional[Credentials]:
    """The key (and user) an ``Authorization`` header carries, else None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if not value:
        return None
    if scheme.lower() == "bearer":
        return Credentials(key=value)
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        user, sep, key = decoded.partition(":")
        return Credentials(key=key, user=user) if sep and user and key else None
    return None


class FailureLimiter:
    """At most ``limit`` failed attempts per address in ``window_s``; then the address waits out the window."""

    def __init__(self, limit: int = 20, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_addresses: int = 10_000) -> None:
        self.limit, self.window_s, self.clock, self.max_addresses = limit, window_s, clock, max_addresses
        self._fails: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, addr: str, now: float) -> list[float]:
        times = [t for t in self._fails.get(addr, ()) if now - t < self.window_s]
        if times:
            self._fails[addr] = times
        else:
            self._fails.pop(addr, None)
        return times

    def retry_after(self, addr: str) -> float:
        """Seconds ``addr`` must wait before it may try again (0: it may now)."""
        with self._lock:
            now = self.clock()
            times = self._recent(addr, now)
            if len(times) < self.limit:
                return 0.0
            return max(0.0, times[-self.limit] + self.window_s - now)

    def failed(self, addr: str) -> None:
        with self._lock:
            now = self.clock()
            if len(self._fails) >= self.max_addresses and addr not in self._fails:
                for a in list(self._fails):
                    self._recent(a, now)
                if len(self._fails) >= self.max_addresses:  # still full: forget the oldest address
                    self._fails.pop(next(iter(self._fails)))
            self._fails.setdefault(addr, []).append(now)


class KeyCache(Generic[T]):
    """A verified key's answer for ``ttl_s`` seconds, keyed by an HMAC of (user, key), never the key."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic, max_entries: int = 4096) -> None:
        self.ttl_s, self.clock, self.max_entries = ttl_s, clock, max_entries
        self._secret = secrets.token_bytes(32)
        self._data: dict[bytes, tuple[float, T]] = {}
        self._lock = threading.Lock()

    def _k(self, cred: Credentials) -> bytes:
        return hmac.new(self._secret, f"{cred.user or ''}\0{cred.key}".encode(), hashlib.sha256).digest()

    def get(self, cred: Credentials) -> Optional[T]:
        with self._lock:
            hit = self._data.get(self._k(cred))
            if hit is None or hit[0] <= self.clock():
                return None
            return hit[1]

    def forget(self, match: Callable[[T], bool]) -> None:
        """Drop every answer ``match`` picks (a revoked run key takes effect at once in this process)."""
        with self._lock:
            self._data = {k: v for k, v in self._data.items() if not match(v[1])}

    def put(self, cred: Credentials, value: T) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._data) >= self.max_entries:
                now = self.clock()
                self._data = {k: v for k, v in self._data.items() if v[0] > now}
                if len(self._data) >= self.max_entries:
                    self._data.clear()
            self._data[self._k(cred)] = (self.clock() + self.ttl_s, value)
