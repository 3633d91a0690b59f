"""psutil's private name the sampler relies on: ``_ppid_map``, every process's parent in one scan of /proc.

`Process.children` uses it internally; the sampler calls it once per tick for all runs instead of one
`children()` walk per process. Without it (another psutil build) the sampler walks children itself:
slower, same figures.
"""

from __future__ import annotations

from typing import Callable, Optional

import psutil

ppid_map: Optional[Callable[[], dict[int, int]]] = getattr(psutil, "_ppid_map", None)


def missing() -> list[str]:
    return [] if ppid_map is not None else ["psutil._ppid_map"]
