"""What the workers of one agent share: one ledger, one warm-engine pool, one planning lock.

`prefect-launch agent --queue A --queue B` runs a worker per queue in one
process; they place runs against the same capacity, one at a time, and wake
each other when a run ends and capacity comes back.
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable, Optional

from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.resources import detect_capacity


class AgentContext:
    def __init__(self, ledger: Ledger, warm_engines: Optional[int] = None):
        from prefect_launch.workers.backends.warm_start import WarmPool

        self.ledger = ledger
        self.queues: set[str] = set()
        self.workers: dict[str, object] = {}  # queue -> the worker (back end) serving it
        self._listeners: list[Callable[[], None]] = []
        self._plan_lock: Optional[asyncio.Lock] = None
        if warm_engines is None:
            warm_engines = int(os.environ.get("LAUNCH_WARM_ENGINES", "2"))
        self.warm_pool: Optional[WarmPool] = WarmPool(warm_engines) if warm_engines > 0 else None
        self.draining = False  # set on the first SIGINT/SIGTERM: claim nothing new
        self.unplaced: dict[str, list] = {}  # queue -> its waiting candidates, for one priority order across queues
        self.preempting: set[str] = set()  # run ids told to give their capacity back (inside their grace)
        self.recovery_started = False
        self._recovered: Optional[asyncio.Event] = None
        self._journal = None
        self.address: Optional[str] = None  # published; multi-node members are reached here (agent_address)

    def journal(self, agent_name: str):
        """The agent's on-disk journal (one per agent name; shared by its queues' workers)."""
        from prefect_launch.workers.agent.journal import RunJournal

        if self._journal is None:
            self._journal = RunJournal(agent_name)
        return self._journal

    @property
    def recovered(self) -> asyncio.Event:
        """Set once the ledger has been rebuilt; nothing is placed before (created in the running loop)."""
        if self._recovered is None:
            self._recovered = asyncio.Event()
        return self._recovered

    @classmethod
    def detect(cls, capacity: Optional[str] = None, warm_engines: Optional[int] = None) -> "AgentContext":
        return cls(Ledger(detect_capacity(capacity)), warm_engines)

    @property
    def plan_lock(self) -> asyncio.Lock:
        """Serialises placement across the agent's queues (created in the running loop)."""
        if self._plan_lock is None:
            self._plan_lock = asyncio.Lock()
        return self._plan_lock

    def on_release(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def released(self) -> None:
        for callback in list(self._listeners):
            callback()
