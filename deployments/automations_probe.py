"""Whether the Prefect server acts on events at all: `prefect-launch setup --check`.

The zombie automation (deployments/zombies.py) only works while the server's reactive-triggers service
runs. Prefect 3.9's server starts each service as a task and never looks at it again: when the
service's start fails - PostgreSQL unreachable while the server starts, e.g. both restarted together -
the service is gone until the server restarts, silently (the API answers, events are stored, the
proactive loop keeps running, but no event reaches any automation, so no lost run is ever marked
Crashed). Nothing in the API says so; this probe does: it posts a probe event and waits for a probe
automation (reactive, do-nothing) to fire on it.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from pydantic import BaseModel

PROBE_NAME = "prefect-launch: automations probe"
PROBE_EVENT = "prefect-launch.automations.probe"
PROBE_RESOURCE = "prefect-launch.probe"


class ProbeResult(BaseModel):
    answering: bool
    seconds: float  # until the probe automation fired, or how long it was waited for
    why: Optional[str] = None  # when not answering: what that means and what to do


def probe_automation() -> Any:
    from prefect.events.actions import DoNothing
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=PROBE_NAME,
        description="Fires on prefect-launch's probe events (`prefect-launch setup --check`); does nothing.",
        trigger=EventTrigger(expect={PROBE_EVENT}, match={"prefect.resource.id": f"{PROBE_RESOURCE}.*"},
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[DoNothing()],
    )


def _probe_id(client: Any) -> uuid.UUID:
    existing = client.read_automations_by_name(PROBE_NAME)
    if existing and existing[0].enabled:
        return existing[0].id
    for old in existing:
        client.delete_automation(old.id)
    return client.create_automation(probe_automation())


def _post_probe(client: Any) -> str:
    from prefect.events import Event

    event = Event(event=PROBE_EVENT, resource={"prefect.resource.id": f"{PROBE_RESOURCE}.{uuid.uuid4()}"})
    client.request("POST", "/events", json=[event.model_dump(mode="json")]).raise_for_status()
    return str(event.id)


def _fired_on(client: Any, automation_id: uuid.UUID, since: datetime) -> set[str]:
    """The probe event ids the probe automation fired on (its ``prefect.automation.triggered`` events)."""
    body = {"filter": {"occurred": {"since": since.isoformat()},
                       "event": {"name": ["prefect.automation.triggered"]},
                       "resource": {"id": [f"prefect.automation.{automation_id}"]}},
            "limit": 50}
    resp = client.request("POST", "/events/filter", json=body)
    resp.raise_for_status()
    return {r["prefect.resource.id"].removeprefix("prefect.event.")
            for e in resp.json().get("events", []) for r in e.get("related", [])
            if r.get("prefect.resource.role") == "triggering-event"}


def check_automations(client: Any, timeout_s: float = 30.0, repost_s: float = 5.0) -> ProbeResult:
    """Post probe events (again every ``repost_s``: a just-created probe automation is loaded by the
    server within its 5-s reconcile) until the probe automation fires on one, or ``timeout_s``."""
    t0 = time.monotonic()
    since = datetime.now(timezone.utc) - timedelta(seconds=60)
    automation_id = _probe_id(client)
    posted: set[str] = set()
    last_post = -repost_s
    while time.monotonic() - t0 < timeout_s:
        if time.monotonic() - last_post >= repost_s:
            posted.add(_post_probe(client))
            last_post = time.monotonic()
        time.sleep(1.0)
        if posted & _fired_on(client, automation_id, since):
            return ProbeResult(answering=True, seconds=round(time.monotonic() - t0, 1))
    return ProbeResult(answering=False, seconds=round(time.monotonic() - t0, 1), why=not_answering_why(timeout_s))


def not_answering_why(timeout_s: float) -> str:
    """What a failed probe means and what to do: the cause (the server's reactive-triggers service is not
    running) and the next step (restart the server, check again), for `setup --check`'s error."""
    return (f"the Prefect server's automations do not act on events (a probe event did not fire the "
            f"'{PROBE_NAME}' automation in {timeout_s:g} s), so a run whose host is lost will never be "
            "marked Crashed. Prefect's reactive-triggers service is not running: it stops for good when its "
            "start fails (e.g. PostgreSQL unreachable while the server started), and it is off where the "
            "server runs with PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false. Restart the Prefect server "
            "(with that service enabled), then run `prefect-launch setup --check` again")
