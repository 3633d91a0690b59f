"""Durations and times as people write them: one parser for every command, queue file and page.

- A duration: ``90`` (a plain number is seconds), ``90s``, ``30m``, ``2h``, ``1.5h``, ``2d``, ``2w``, or
  parts together, ``1h30m``, ``1d 12h`` (case and spaces do not matter). Run timeouts, preempt
  grace, idle limits, ``--timeout``.
- A time (``--since``, ``--until``, ``--starts-at``): an ISO 8601 date or date-time (``2026-03-01``,
  ``2026-03-01T12:00``, ``2026-03-01T12:00:00+02:00``, ``...Z``; no offset means UTC), else a
  duration: that long ago, or, where the option looks ahead (``--starts-at 1h``), that long from now.
  ISO is tried first, so ``20260301`` is a date, not seconds.

Errors are :class:`LaunchValidationError` (a ``ValueError``) saying which forms are accepted; the CLI's
option types (``prefect_launch.cli_common``) turn them into ``typer.BadParameter``. Pure: stdlib and the
validation error only, no Prefect.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from typing import Optional, Union

from prefect_launch.workers.scheduling.resources import LaunchValidationError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")

DURATION_FORMS = "90s, 30m, 2h, 1h30m, 2d or 2w (a plain number is seconds)"
TIME_FORMS = "an ISO date or time (2026-03-01, 2026-03-01T12:00, 2026-03-01T12:00:00+02:00; no offset means UTC)"

Duration = Union[str, int, float, timedelta]


def _text_seconds(text: str) -> Optional[float]:
    """Seconds of a written duration, or None when it is not one."""
    t = text.strip().lower().replace(" ", "")
    if _NUMBER.fullmatch(t):
        return float(t)
    parts = _PART.findall(t)
    if t and parts and _PART.sub("", t) == "":
        return sum(float(n) * UNITS[u] for n, u in parts)
    return None


def _seconds(value: Duration, what: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or value is None:
        raise LaunchValidationError(f"{what} must be a duration like {DURATION_FORMS}, got {value!r}")
    if isinstance(value, timedelta):
        seconds: Optional[float] = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    else:
        seconds = _text_seconds(str(value))
        if seconds is None:
            raise LaunchValidationError(f"{what} must be a duration like {DURATION_FORMS}, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise LaunchValidationError(f"{what} must be positive, got {value!r}")
    return seconds


def parse_duration(value: Duration, what: str = "duration") -> timedelta:
    """A positive duration (see the module doc); raises LaunchValidationError saying what to write."""
    seconds = _seconds(value, what)
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise LaunchValidationError(f"{what} {value!r} is too long") from None


def duration_seconds(value: Union[Duration, None], what: str = "timeout") -> Optional[float]:
    """Seconds of a positive duration, or None for no value (``None`` or ``""``): queue files' and
    requests' optional limits (timeouts, grace periods, idle limits)."""
    if value is None or value == "":
        return None
    return _seconds(value, what)


def format_duration(value: Union[float, timedelta]) -> str:
    """``1h30m``, ``3s``, ``50h`` (hours at most; ``0s`` for nothing): how the CLI and pages write a duration."""
    s = int(round(value.total_seconds() if isinstance(value, timedelta) else value))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (sec, "s")) if v) or "0s"


def when_problem(text: object, ahead: bool = False) -> str:
    """What is wrong with a time that cannot be read, and what to write instead."""
    return (f"{text!r} is not a time: give {TIME_FORMS} or a duration {'from now' if ahead else 'ago'} "
            f"like {DURATION_FORMS}")


def _iso(text: str) -> Optional[datetime]:
    try:
        v = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in ("Z", "z") else text)
    except ValueError:
        return None
    return v if v.tzinfo else v.replace(tzinfo=timezone.utc)


def parse_when(value: Union[str, datetime], now: Optional[datetime] = None, *, what: str = "time",
               ahead: bool = False) -> datetime:
    """An aware datetime from ``value`` (see the module doc): an ISO date or date-time (no offset: UTC), or
    a duration before ``now`` (after it with ``ahead``, as ``--starts-at``). Raises LaunchValidationError
    ``"{what} '...' is not a time: give ..."``."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    text = str(value).strip() if value is not None else ""
    problem = f"{what} {when_problem(value, ahead)}" if what else when_problem(value, ahead)
    if not text:
        raise LaunchValidationError(problem)
    iso = _iso(text)
    if iso is not None:
        return iso
    seconds = _text_seconds(text)
    if seconds is None:
        raise LaunchValidationError(problem)
    now = now or datetime.now(timezone.utc)
    now = now if now.tzinfo else now.replace(tzinfo=timezone.utc)
    try:
        delta = timedelta(seconds=seconds)
        return now + delta if ahead else now - delta
    except OverflowError:
        raise LaunchValidationError(f"{what + ' ' if what else ''}{value!r} is too far "
                                    f"{'ahead' if ahead else 'back'}") from None
