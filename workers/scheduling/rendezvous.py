"""Rendezvous (highest random weight) hashing: one name out of several for a key, the same for every reader of
the same names, spread evenly, and only the keys of a name that leaves move. Gives each waiting run one
reason writer among a queue's agents (`wait_notes`)."""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Optional


def rendezvous(key: Any, names: Iterable[str]) -> Optional[str]:
    """The name of ``names`` that ``key`` goes to (None when there are none)."""
    return max(sorted(set(names)), key=lambda n: hashlib.blake2b(f"{key}|{n}".encode(), digest_size=8).digest(),
               default=None)
