"""prefect-launch's own ``LAUNCH_*`` settings, read from the environment when they are used, never at import.

A module constant read at import fixes a value for the life of the process, so a test (or an operator
with `env`) that sets it after the first import is silently ignored. Every ``LAUNCH_*`` variable is
listed, with its default and where it is read, in docs/configuration.md (tests/test_settings_doc.py
checks the table against the code). Durations end in ``_SECONDS``, counts are bare nouns.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def _env(name: str, default: Any, cast: Callable[[str], Any], what: str) -> Any:
    """``name`` read as ``cast`` of its value, ``default`` when unset or blank; a bad value names the variable."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return cast(str(default))
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}; unset it or give e.g. {name}={default:g}") from None


def env_seconds(name: str, default: float) -> float:
    """A duration in seconds (``LAUNCH_*_SECONDS``)."""
    return _env(name, default, float, "a number of seconds")


def env_int(name: str, default: int) -> int:
    """A count (``LAUNCH_DUE_WINDOW``, ``LAUNCH_WAIT_LABEL_BUDGET``, ...)."""
    return _env(name, default, int, "a whole number")


def env_text(name: str, default: str) -> str:
    """A name or a path."""
    return os.environ.get(name) or default
