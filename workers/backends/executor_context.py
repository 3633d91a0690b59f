"""One Prefect `FlowRunExecutorContext` per process worker, open for the worker's life.

Prefect's process worker enters a fresh context per run (client, process manager, event emitter, control
channel listener, cancellation observer with its events websocket) and leaves it when the run's process is
gone. On a loaded box entering cost 0.26-0.62 s on every run's start, and leaving it came before the run's
capacity went back (bench/preemption.py): GPU-seconds idle between one run and the next.

Prefect's own `Runner` keeps exactly these parts (one client, `ProcessManager`, `StateProposer`,
`EventEmitter`, `ControlChannel`, `CancellationManager`, `FlowRunCancellingObserver`) for all its concurrent
runs; the context is the same set for one caller. Every run here resolves its flow the same way
(`load_flow_from_flow_run`), so the hook runner `create_executor` wires into the shared cancellation manager
is the same for every run. ``LAUNCH_SHARED_EXECUTOR_CONTEXT=0``: a context per run, as Prefect does.

The context's task groups must be left by the task that entered them, so one task of the worker's run task
group holds it (`_hold`) until `close`; a context that fails is dropped and the next run opens a new one.
"""

from __future__ import annotations

import logging
from typing import Optional

import anyio
import anyio.abc

from prefect_launch.compat.prefect import FlowRunExecutorContext
from prefect_launch.settings import env_text

logger = logging.getLogger("prefect_launch.executor_context")


def shared_context_enabled() -> bool:
    """``LAUNCH_SHARED_EXECUTOR_CONTEXT`` (default on): one context for all the worker's runs."""
    return env_text("LAUNCH_SHARED_EXECUTOR_CONTEXT", "1").lower() not in ("0", "false", "no")


class SharedExecutorContext:
    """The worker's one `FlowRunExecutorContext`, opened on the first run and kept until `close`."""

    def __init__(self) -> None:
        self._ctx: Optional[FlowRunExecutorContext] = None
        self._ready: Optional[anyio.Event] = None
        self._error: Optional[BaseException] = None
        self._closing: Optional[anyio.Event] = None
        self._closed: Optional[anyio.Event] = None
        self.opened = 0  # contexts entered over the worker's life (tests: one for many runs)

    async def get(self, task_group: anyio.abc.TaskGroup) -> FlowRunExecutorContext:
        """The open context; the first caller starts its holder in ``task_group`` (the worker's run task group).
        Raises what entering it raised (that run fails to start, as with Prefect's own per-run context)."""
        if self._ctx is not None:
            return self._ctx
        if self._ready is None:
            self._ready, self._error = anyio.Event(), None
            self._closing, self._closed = anyio.Event(), anyio.Event()
            task_group.start_soon(self._hold, self._ready, self._closing, self._closed)
        ready = self._ready
        await ready.wait()
        if self._ctx is None:
            error = self._error or RuntimeError("the worker's executor context closed")
            if self._ready is ready:
                self._ready = None  # the next run tries again
            raise error
        return self._ctx

    async def _hold(self, ready: anyio.Event, closing: anyio.Event, closed: anyio.Event) -> None:
        try:
            async with FlowRunExecutorContext() as ctx:
                self._ctx = ctx
                self.opened += 1
                ready.set()
                await closing.wait()
        except Exception as exc:  # never out into the worker's task group: that would end the worker
            self._error = exc
            logger.warning("the worker's Prefect executor context failed (%s: %s); the next run opens a new one",
                           type(exc).__name__, exc)
        finally:
            self._ctx = None
            if self._ready is ready:
                self._ready = None
            ready.set()
            closed.set()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Leave the context (its process manager stops what it still tracks, as Prefect's does at its exit).
        Shielded: the worker's teardown runs it while being cancelled (the agent's stop), and must go on after."""
        closing, closed = self._closing, self._closed
        if closing is None or closed is None or self._ready is None:
            return
        closing.set()
        with anyio.move_on_after(timeout_s, shield=True):
            await closed.wait()


__all__ = ["SharedExecutorContext", "shared_context_enabled"]
