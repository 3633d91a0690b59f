"""What dispatch needs to know about the queue's other agents: which are offline, their free capacity,
and the runs they placed (owner quotas count those too).

A part of `LaunchWorkerCore` (``worker.peers``), read through the Prefect API (the agents' published
state and the runs' ``launch.alloc`` labels), each read cached briefly.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

from prefect_launch.workers.agent.registry import AgentState, offline_reasons, read_agents
from prefect_launch.workers.agent.tags import ALLOC_LABEL
from prefect_launch.workers.scheduling.ledger import Allocation

if TYPE_CHECKING:
    pass

    from prefect_launch.workers.agent.core import LaunchWorkerCore


class PeerView:
    """The other agents of one worker's (``w``) queue, as dispatch sees them."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker
        self._agents_read: tuple[float, Optional[list[AgentState]], Optional[datetime]] = (0.0, None, None)
        self._elsewhere_cache: Optional[tuple[float, list[tuple[str, Allocation]]]] = None

    async def _recent_agents(self) -> tuple[list[AgentState], Optional[datetime]]:
        """The agents' published states as read at most 10 s ago, and when (one read for pinned runs and for
        reason writers). A failed read keeps the last states and is tried again 10 s later."""
        at, agents, read_at = self._agents_read
        if agents is None or time.monotonic() - at > 10:
            try:
                agents, read_at = await read_agents(self.w.client), datetime.now(timezone.utc)
            except Exception as exc:
                self.w._logger.debug("could not read agents: %s", exc)
            self._agents_read = (time.monotonic(), agents, read_at)
        return agents or [], read_at

    def _serves_queue(self, agent: AgentState, at: Optional[datetime] = None) -> bool:
        return agent.online(at) and self.w._work_pool_name in agent.queues

    async def pinned_agents(self) -> tuple[dict[str, str], set[str]]:
        """Offline agents (and since when) and all known agents, as of the last read (`_recent_agents`)."""
        agents, read_at = await self._recent_agents()
        return offline_reasons(agents, read_at), {a.name for a in agents}

    async def peer_free(self) -> dict[str, Any]:
        """Free capacity of the other online agents serving this queue (their last published state)."""
        try:
            agents = await read_agents(self.w.client)
        except Exception as exc:
            self.w._logger.debug("could not read agents: %s", exc)
            return {}
        return {a.name: a.free for a in agents if a.name != self.w.name and self._serves_queue(a)}

    async def queue_agents(self) -> set[str]:
        """The online agents serving this queue, this one included, as of the last read (`_recent_agents`): who
        writes which waiting run's reason (`scheduling.wait_notes.reason_writer`)."""
        agents, read_at = await self._recent_agents()
        return {a.name for a in agents if self._serves_queue(a, read_at)} | {self.w.name}

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
