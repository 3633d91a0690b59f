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
ONLINE_WINDOW_S = 90


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
    address: Optional[str] = None  # where its cluster members are reached (workers/agent/address.py)

    def online(self, now: Optional[datetime] = None) -> bool:
        now = now or datetime.now(timezone.utc)
        return (now - self.heartbeat).total_seconds() <= ONLINE_WINDOW_S


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
    return {a.name: f"offline since {a.heartbeat.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
            for a in agents if not a.online(now)}
