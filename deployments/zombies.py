"""Prefect's "crash zombie flows" automation, created by `prefect-launch setup`.

Launch runs send flow-run heartbeats (the agent sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY).
When a run's heartbeats stop without a final state - its host lost power, or its
engine and agent were both killed - this automation marks it Crashed with why,
even when no agent is left to notice. It is Prefect's own detect-zombie-flows
recipe: a proactive trigger per flow run, fired after `within` seconds of silence.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

NAME = "prefect-launch: crash zombie runs"
FINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed")


class ZombieSetup(BaseModel):
    name: str
    within_s: int
    action: str  # created / updated / kept


def zombie_within_s() -> int:
    """Silence after which a run is a zombie: three missed heartbeats by default."""
    beat = int(os.environ.get("LAUNCH_HEARTBEAT_SECONDS", "30"))
    return int(os.environ.get("LAUNCH_ZOMBIE_AFTER_SECONDS", str(3 * beat)))


def zombie_automation(within_s: int) -> Any:
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=NAME,
        description="Marks a flow run Crashed when its heartbeats stop before it reaches a final state.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=(f"no heartbeat for {within_s} s: the run's process and its agent are gone "
                     "(host down, or both killed); marked Crashed by prefect-launch's zombie automation"),
        )],
    )


def ensure_zombie_automation(client: Any, within_s: int | None = None) -> ZombieSetup:
    """Create the automation, or bring an existing one to ``within_s`` (idempotent)."""
    within_s = within_s or zombie_within_s()
    wanted = zombie_automation(within_s)
    existing = client.read_automations_by_name(NAME)
    if not existing:
        client.create_automation(wanted)
        return ZombieSetup(name=NAME, within_s=within_s, action="created")
    current = existing[0]
    for extra in existing[1:]:
        client.delete_automation(extra.id)
    within = getattr(current.trigger, "within", None)
    seconds = within.total_seconds() if hasattr(within, "total_seconds") else within
    if seconds == within_s and current.enabled and current.actions and current.actions[0].type == "change-flow-run-state":
        return ZombieSetup(name=NAME, within_s=within_s, action="kept")
    client.update_automation(current.id, wanted)
    return ZombieSetup(name=NAME, within_s=within_s, action="updated")
