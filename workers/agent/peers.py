"""What dispatch needs to know about the queue's other agents: which are offline, their free capacity,
and the runs they placed (owner quotas count those too).

A part of `LaunchWorkerCore` (``worker.peers``), read through the Prefect API (the agents' published
state and the runs' ``launch.alloc`` labels), each read cached briefly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from prefect_launch.workers.agent.registry import offline_reasons, read_agents
from prefect_launch.workers.agent.tags import ALLOC_LABEL
from prefect_launch.workers.scheduling.ledger import Allocation

if TYPE_CHECKING:
    pass

    from prefect_launch.workers.agent.core import LaunchWorkerCore


class PeerView:
    """The other agents of one worker's (``w``) queue, as dispatch sees them."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker
        self._agents_seen: tuple[float, dict[str, str], set[str]] = (0.0, {}, set())
        self._elsewhere_cache: Optional[tuple[float, list[tuple[str, Allocation]]]] = None
        self._queue_agents: tuple[float, set[str]] = (-1e9, set())

    async def pinned_agents(self) -> tuple[dict[str, str], set[str]]:
        """Offline agents (and since when) and all known agents, re-read at most every 10 s."""
        at, offline, known = self._agents_seen
        if time.monotonic() - at > 10:
            try:
                agents = await read_agents(self.w.client)
                offline, known = offline_reasons(agents), {a.name for a in agents}
                self._agents_seen = (time.monotonic(), offline, known)
            except Exception as exc:
                self.w._logger.debug("could not read agents: %s", exc)
        return offline, known

    async def peer_free(self) -> dict[str, Any]:
        """Free capacity of the other online agents serving this queue (their last published state)."""
        try:
            agents = await read_agents(self.w.client)
        except Exception as exc:
            self.w._logger.debug("could not read agents: %s", exc)
            return {}
        return {a.name: a.free for a in agents
                if a.name != self.w.name and a.online() and self.w._work_pool_name in a.queues}

    async def queue_agents(self) -> set[str]:
        """The online agents serving this queue, this one included, re-read at most every 10 s: who writes which
        waiting run's reason (`scheduling.wait_notes.reason_writer`). A failed read keeps the last ones known."""
        at, names = self._queue_agents
        if time.monotonic() - at > 10:
            try:
                names = {a.name for a in await read_agents(self.w.client)
                         if a.online() and self.w._work_pool_name in a.queues}
            except Exception as exc:
                self.w._logger.debug("could not read agents: %s", exc)
            self._queue_agents = (time.monotonic(), names)
        return names | {self.w.name}

    async def placed_elsewhere(self) -> list[tuple[str, Allocation]]:
        """The queue's live runs placed by other agents, as their ``launch.alloc`` labels say (owner quotas).

        Read at most once a second. A run another agent placed less than a moment ago may not carry its
        label yet, so two agents placing the same owner's runs in the same second can overshoot its quota
        by one run each; every later decision counts it.
        """
        from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                    WorkPoolFilter, WorkPoolFilterName)
        from prefect.client.schemas.objects import StateType

        from prefect_launch.workers.agent.journal import parse_alloc_label

        cached = self._elsewhere_cache
        if cached is not None and time.monotonic() - cached[0] < 1.0:
            return cached[1]
        live = await self.w.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self.w._work_pool_name])),
        )
        placed = [(p[0], p[1]) for p in (parse_alloc_label((fr.labels or {}).get(ALLOC_LABEL)) for fr in live) if p]
        self._elsewhere_cache = (time.monotonic(), placed)
        return placed
