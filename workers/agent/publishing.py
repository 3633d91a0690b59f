"""The agent's published state (capacity, free, runs, heartbeat): what `agent ls`, peers and the monitor read.

A part of `LaunchWorkerCore` (``worker.publisher``): changes ask for a publish, a loop coalesces them
(one write per `PUBLISH_DEBOUNCE_S` at most) so starts are not slowed by extra writes.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from prefect_launch.api_retry import single_try
from prefect_launch.workers.agent.registry import AgentRun, AgentState, publish

if TYPE_CHECKING:
    pass

    from prefect_launch.workers.agent.core import LaunchWorkerCore

PUBLISH_DEBOUNCE_S = 1.0


class AgentPublisher:
    """Publishes one worker's (``w``) agent state."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    async def publish_loop(self) -> None:
        while True:
            await self.w._publish_wanted.wait()
            await asyncio.sleep(PUBLISH_DEBOUNCE_S)
            self.w._publish_wanted.clear()
            await self.publish_state()

    async def publish_state(self) -> None:
        if self.w._client is None:
            return
        state = AgentState(
            name=self.w.name,
            queues=sorted(self.w.agent.queues),
            capacity=self.w.ledger.capacity,
            free=self.w.ledger.free(),
            runs=[AgentRun(run_id=a.run_id, queue=a.queue, preset=a.preset, resources=a.resources,
                           gpu_indices=a.gpu_indices) for a in self.w.ledger.allocations()],
            heartbeat=datetime.now(timezone.utc),
            heartbeat_s=self.w.heartbeat_interval_seconds,  # sync_with_backend publishes at least this often
            address=self.w.agent.address,
        )
        try:
            with single_try():  # a busy server's 503: published again after the debounce, not retried at once
                await publish(self.w.client, state)
        except Exception as exc:
            self.w._logger.debug("could not publish agent state: %s", exc)
            self.w._publish_soon()
