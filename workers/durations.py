"""Durations as people write them: ``90``, ``90s``, ``30m``, ``2h``, ``1h30m``, ``1d``.

Used for run timeouts now and session lifetimes later; one parser so the CLI,
queue files and the agent agree on what ``--timeout 1h30m`` means.
"""

from __future__ import annotations

import re
from typing import Optional, Union

from prefect_launch.workers.scheduling.resources import LaunchValidationError

_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(value: Union[str, int, float, None], what: str = "timeout") -> Optional[float]:
    """Seconds, or None for no value; raises LaunchValidationError saying what to write."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise LaunchValidationError(f"{what} must be a duration like 90s, 30m or 2h, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        elif text and _PART.sub("", text) == "" and _PART.findall(text):
            seconds = sum(float(n) * _UNIT[u] for n, u in _PART.findall(text))
        else:
            raise LaunchValidationError(
                f"{what} must be a duration like 90s, 30m, 2h or 1h30m (plain numbers are seconds), got {value!r}"
            )
    if seconds <= 0:
        raise LaunchValidationError(f"{what} must be positive, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (sec, "s")) if v) or "0s"
