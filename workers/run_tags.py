"""How a launch run is tagged: ``launch``, ``owner:<user>``, ``preset:<name>``.

Written by `submit`, read by the CLI, the agent's metrics records and the monitor;
one place so the convention cannot drift between them.
"""

from __future__ import annotations

from typing import Iterable, Optional

LAUNCH_TAG = "launch"


def tag(key: str, value: str) -> str:
    return f"{key}:{value}"


def launch_tags(owner: str, preset: str) -> list[str]:
    return [LAUNCH_TAG, tag("owner", owner), tag("preset", preset)]


def tag_value(tags: Optional[Iterable[str]], key: str) -> Optional[str]:
    """The value of the first ``key:value`` tag, or None."""
    prefix = key + ":"
    return next((t[len(prefix):] for t in tags or () if t.startswith(prefix)), None)
