"""Where agents publish their capacity so `agent ls`, `queue ls` and submit checks can read it.

Each agent keeps one Prefect Variable (``launch_agent_<name>``, tagged
``launch-agent``) up to date with its queues, total and free capacity and what
it runs; Prefect's own worker heartbeats say whether it is online.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.scheduling.resources import Resources

TAG = "launch-agent"
ONLINE_WINDOW_S = 90  # an agent that does not say how often it beats: three of Prefect's default 30-s heartbeats
MISSED_BEATS = 3  # an agent silent for this many of its heartbeats is offline


def online_window_s(heartbeat_s: Optional[float]) -> float:
    """How long an agent may be silent and still count as online (its capacity counted, `agent ls` yes)."""
    return MISSED_BEATS * heartbeat_s if heartbeat_s else ONLINE_WINDOW_S


class AgentRun(BaseModel):
    run_id: str
    queue: Optional[str] = None
    preset: Optional[str] = None
    resources: Resources
    gpu_indices: list[int] = []


class AgentState(BaseModel):
    name: str
    queues: list[str]
    capacity: Resources
    free: Resources
    runs: list[AgentRun] = []
    heartbeat: datetime
    heartbeat_s: Optional[float] = None  # how often it publishes at the least (its worker heartbeat interval)
    address: Optional[str] = None  # where its cluster members are reached (workers/agent/address.py)

    def online(self, now: Optional[datetime] = None) -> bool:
        now = now or datetime.now(timezone.utc)
        return (now - self.heartbeat).total_seconds() <= online_window_s(self.heartbeat_s)

    def offline_since(self, now: Optional[datetime] = None) -> Optional[str]:
        """Its last heartbeat (UTC, to the second) when it is offline, else None."""
        return None if self.online(now) else f"{self.heartbeat.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def variable_name(agent: str) -> str:
    return "launch_agent_" + re.sub(r"[^a-z0-9_]+", "_", agent.lower())[:200]


async def publish(client: Any, state: AgentState) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name = variable_name(state.name)
    value = state.model_dump(mode="json")
    value["runs"] = value["runs"][:20]  # Variables are capped at 5000 characters
    from prefect_launch.api_retry import ServerBusy

    try:
        await client.update_variable(VariableUpdate(name=name, value=value, tags=[TAG]))
    except ServerBusy:  # under api_retry.single_try: the caller publishes again later
        raise
    except Exception:  # 404 when the agent publishes for the first time
        try:
            await client.create_variable(VariableCreate(name=name, value=value, tags=[TAG]))
        except Exception:
            await client.update_variable(VariableUpdate(name=name, value=value, tags=[TAG]))


def _agents_of(variables: Any) -> list[AgentState]:
    out = []
    for var in variables:
        if TAG in (var.tags or []) and isinstance(var.value, dict):
            try:
                out.append(AgentState.model_validate(var.value))
            except Exception:
                continue
    return sorted(out, key=lambda a: a.name)


def read_agents_sync(client: Any) -> list[AgentState]:
    return _agents_of(client.read_variables())


async def read_agents(client: Any) -> list[AgentState]:
    return _agents_of(await client.read_variables())


def offline_reasons(agents: list[AgentState], now: Optional[datetime] = None) -> dict[str, str]:
    """For each known agent that is offline: 'offline since <its last heartbeat>' (pure)."""
    now = now or datetime.now(timezone.utc)
    return {a.name: f"offline since {a.offline_since(now)}" for a in agents if not a.online(now)}
