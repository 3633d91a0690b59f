"""Deployments and flows as the agent last read them, kept a few seconds (``LAUNCH_READ_CACHE_SECONDS``, 10).

Prefect's worker reads a run's deployment in ``_submit_run`` and again, with its flow, in
``resolve_for_flow_run``; the agent reads it for the run's request (`intake._deployment_vars`) and its job
environment, and each agent that loses the claim of a run has read it too. With four agents on one queue
that was ~4 of the ~33 requests an agent path costs the server per run (bench/hosts.py access log), for
objects that change when someone redeploys. The cache sits on the worker's own client (its
``read_deployment`` and ``read_flow``), so Prefect's code and ours share it without a copy of either.
Only successful reads are kept: a deleted deployment is still noticed (ObjectNotFound) once its entry is
older than the TTL, which is also how long a redeploy may take to reach a run's submit. Every read gets its own
copy: Prefect's ``resolve_for_flow_run`` merges a run's ``env`` into the deployment's job variables in place,
which on a shared object would carry one run's environment into the next run's.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Awaitable, Callable, Optional

from prefect_launch.settings import env_seconds

CACHED_READS = ("read_deployment", "read_flow")
_MARK = "_launch_read_cache"


class ReadCache:
    """Successful reads by (method, id), each kept ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._kept: dict[tuple[str, str], tuple[float, Any]] = {}
        self.hits = 0
        self.misses = 0

    async def get(self, method: str, key: Any, read: Callable[[], Awaitable[Any]]) -> Any:
        now = self.clock()
        hit = self._kept.get((method, str(key)))
        if hit is not None and now - hit[0] < self.ttl_s:
            self.hits += 1
            return copy.deepcopy(hit[1])
        self.misses += 1
        value = await read()  # an error (not found, server down) is raised and not kept
        self._kept[(method, str(key))] = (self.clock(), copy.deepcopy(value))
        if len(self._kept) > 4096:  # deployments of a busy pool: drop what expired
            self._kept = {k: v for k, v in self._kept.items() if self.clock() - v[0] < self.ttl_s}
        return value


def cache_reads(client: Any, ttl_s: Optional[float] = None) -> ReadCache:
    """Wrap ``client``'s deployment and flow reads in one `ReadCache` (once per client; returns it)."""
    cache = getattr(client, _MARK, None)
    if cache is not None:
        return cache
    cache = ReadCache(env_seconds("LAUNCH_READ_CACHE_SECONDS", 10) if ttl_s is None else ttl_s)
    for method in CACHED_READS:
        read = getattr(client, method)

        async def cached(key: Any, *args: Any, _read: Any = read, _method: str = method, **kwargs: Any) -> Any:
            if args or kwargs:  # not the plain by-id read: not cached
                return await _read(key, *args, **kwargs)
            return await cache.get(_method, key, lambda: _read(key))

        setattr(client, method, cached)
    setattr(client, _MARK, cache)
    return cache
