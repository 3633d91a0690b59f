"""API keys: made once, shown once, kept as a slow salted hash, checked in constant time (pure: no database).

A key reads ``plk_<key id>_<secret>``: the key id (12 hex characters) is public and finds the key's row;
the secret (32 random bytes, URL-safe base64) is never stored. What is stored is
``scrypt(secret, salt, n=2**14, r=8, p=1)`` with a fresh 16-byte salt per key (stdlib :func:`hashlib.scrypt`,
about 16 MiB and some tens of milliseconds per check), compared with :func:`hmac.compare_digest`.

Run keys (a run's own key, minted at each run start and checked by its engine's first request) are kept as
``sha256(salt + secret)`` instead (``fast=True``): their secret is 32 random bytes, which no slow hash makes
harder to guess, and two scrypt hashes on every run start cost a loaded box a few hundred milliseconds.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import NamedTuple, Optional

__all__ = ["PREFIX", "NewKey", "new_key", "split_key", "hash_fast", "hash_secret", "verify_secret", "looks_like_key"]

PREFIX = "plk"
SCRYPT_N, SCRYPT_R, SCRYPT_P, DKLEN = 2 ** 14, 8, 1, 32
_KEY = re.compile(r"^plk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})$")


class NewKey(NamedTuple):
    """A key just made: ``plaintext`` goes to its user once; the rest is what the database keeps."""

    plaintext: str
    key_id: str
    salt: str  # hex
    hash: str  # hex


def hash_secret(secret: str, salt_hex: str) -> str:
    return hashlib.scrypt(secret.encode(), salt=bytes.fromhex(salt_hex), n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                          maxmem=64 * 1024 * 1024, dklen=DKLEN).hex()


def hash_fast(secret: str, salt_hex: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt_hex) + secret.encode()).hexdigest()


def new_key(fast: bool = False) -> NewKey:
    """A new key; ``fast``: a run key, kept as SHA-256 (see the module's note)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    return NewKey(f"{PREFIX}_{key_id}_{secret}", key_id, salt, (hash_fast if fast else hash_secret)(secret, salt))


def split_key(key: str) -> Optional[tuple[str, str]]:
    """``(key id, secret)`` of a well-formed key, else None."""
    m = _KEY.match(key.strip()) if isinstance(key, str) else None
    return (m.group(1), m.group(2)) if m else None


def looks_like_key(text: str) -> bool:
    return split_key(text) is not None


def launch_credentials(auth_string: Optional[str], api_key: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """Of Prefect's two credential settings, those that hold a prefect-launch key (``user:plk_...`` as the auth
    string, ``plk_...`` as the API key): both None when the client talks to a plain Prefect server, not a gateway.
    One check for the agent (its runs' keys) and the monitor (its sign-in mode)."""
    user, sep, key = (auth_string or "").partition(":")
    auth = auth_string if sep and user and looks_like_key(key) else None
    return auth, (api_key if api_key and looks_like_key(api_key) else None)


def verify_secret(secret: str, salt_hex: str, hash_hex: str, fast: bool = False) -> bool:
    """Whether ``secret`` hashes to ``hash_hex`` with ``salt_hex`` (constant-time comparison)."""
    try:
        got = (hash_fast if fast else hash_secret)(secret, salt_hex)
    except ValueError:
        return False
    return hmac.compare_digest(got, hash_hex)
