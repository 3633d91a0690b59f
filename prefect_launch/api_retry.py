"""Retry a busy SQLite server's 503 within a fraction of a second, before Prefect's own 2-4-8 s back-off.

A Prefect server on SQLite answers 503 when a write meets another writer's lock ("database is locked":
SQLite refuses to upgrade a read transaction at once, whatever the busy timeout). The transaction was
rolled back, so the request can be sent again, and a lock held for milliseconds is gone a moment later.
Prefect's client retries 503, but only after ``2 ** attempt`` seconds: measured on this project's
2-agent ETA benchmark, 81 claims, label updates and state changes waited 2 s each (6 s after a second
503), which delayed run starts, capacity hand-over and the start-time predictions that rely on them.

`install` wraps the ``send`` that Prefect's HTTP clients (async and sync) pass to their retry loop:
each of Prefect's attempts first retries a 503 up to ``LAUNCH_API_QUICK_RETRIES`` times (default 4)
after 50-400 ms with jitter; whatever is left goes on to Prefect's back-off unchanged, so a server that
stays unavailable is treated exactly as before. Not applied for Prefect Cloud (its 503s mean load,
which quick retries would add to). Called by prefect-launch's own processes: agents, warm engines,
cluster members and the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import random
import time
from typing import Any, Callable, Iterator

QUICK_DELAYS_S = (0.05, 0.1, 0.2, 0.4)
_SINGLE_TRY: contextvars.ContextVar[bool] = contextvars.ContextVar("launch_api_single_try", default=False)


class ServerBusy(Exception):
    """A request sent under `single_try` met a busy server (503): it was not repeated."""


@contextlib.contextmanager
def single_try() -> Iterator[None]:
    """Requests made inside are sent once: a 503 raises `ServerBusy` at once, with neither the quick retries
    nor Prefect's 2-4-8 s back-off. For writes the caller makes again anyway (a waiting run's label is
    decided again next cycle): on a SQLite server a label PATCH reads, then writes in a deferred
    transaction, and fails whenever another write commits in between; measured with bench/scale.py (b),
    3 agents, 60 runs: 69% of the agents' label PATCHes answered 503, each retried up to 5 times at once
    and again after 2, 4, 8 s, while the dispatch cycle that waited on it held the agent's plan lock."""
    token = _SINGLE_TRY.set(True)
    try:
        yield
    finally:
        _SINGLE_TRY.reset(token)


def _busy(request: Any) -> ServerBusy:
    return ServerBusy(f"{request.method} {request.url.path}: 503 (server busy; not repeated)")


def quick_delays() -> tuple[float, ...]:
    n = int(os.environ.get("LAUNCH_API_QUICK_RETRIES", str(len(QUICK_DELAYS_S))))
    return tuple(QUICK_DELAYS_S[min(i, len(QUICK_DELAYS_S) - 1)] for i in range(max(0, n)))


def _jitter(delay: float) -> float:
    return delay * random.uniform(0.5, 1.5)


def _is_cloud(client: Any) -> bool:
    return "api.prefect.cloud" in str(getattr(client, "base_url", ""))


def _async_quick(send: Callable[..., Any]) -> Callable[..., Any]:
    async def send_quick(request: Any, *args: Any, **kwargs: Any) -> Any:
        if _SINGLE_TRY.get():
            response = await send(request, *args, **kwargs)
            if response.status_code == 503:
                await response.aclose()
                raise _busy(request)
            return response
        for delay in quick_delays():
            response = await send(request, *args, **kwargs)
            if response.status_code != 503:
                return response
            await response.aclose()
            await asyncio.sleep(_jitter(delay))
        return await send(request, *args, **kwargs)

    return send_quick


def _sync_quick(send: Callable[..., Any]) -> Callable[..., Any]:
    def send_quick(request: Any, *args: Any, **kwargs: Any) -> Any:
        if _SINGLE_TRY.get():
            response = send(request, *args, **kwargs)
            if response.status_code == 503:
                response.close()
                raise _busy(request)
            return response
        for delay in quick_delays():
            response = send(request, *args, **kwargs)
            if response.status_code != 503:
                return response
            response.close()
            time.sleep(_jitter(delay))
        return send(request, *args, **kwargs)

    return send_quick


def install() -> bool:
    """Wrap Prefect's client retry loops once per process; False where this Prefect has no such seam."""
    try:
        from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient
    except ImportError:
        return False
    done = True
    for cls, quick in ((PrefectHttpxAsyncClient, _async_quick), (PrefectHttpxSyncClient, _sync_quick)):
        original = getattr(cls, "_send_with_retry", None)
        if original is None:
            done = False
            continue
        if getattr(original, "_launch_quick_retry", False):
            continue

        @functools.wraps(original)
        def _send_with_retry(self: Any, request: Any, send: Callable[..., Any], *args: Any,
                             _original: Callable[..., Any] = original, _quick: Callable[..., Any] = quick,
                             **kwargs: Any) -> Any:
            return _original(self, request, send if _is_cloud(self) else _quick(send), *args, **kwargs)

        _send_with_retry._launch_quick_retry = True  # type: ignore[attr-defined]
        cls._send_with_retry = _send_with_retry  # type: ignore[method-assign]
    return done
