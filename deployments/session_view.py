"""What `session ls` / `session show` print: rows built from the session runs' own records."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.deployments.sessions import SESSION_TAG
from prefect_launch.deployments.wait_order import by_run, positions, waiting_runs  # noqa: F401  (positions: moved there)
from prefect_launch.workers.agent.queued_state import WAITING_NAMES
from prefect_launch.workers.agent.tags import IDLE_LABEL, PLACED_LABEL, WAIT_LABEL, tag_value


class SessionRow(BaseModel):
    id: str
    name: str
    owner: Optional[str] = None
    launched_by: Optional[str] = None  # an admin who launched it for its owner (the gateway's tag)
    status: str
    type: Optional[str] = None
    queue: Optional[str] = None
    resources: Optional[str] = None
    agent: Optional[str] = None
    created: Optional[datetime] = None
    started: Optional[datetime] = None
    ended: Optional[datetime] = None
    elapsed_s: Optional[float] = None  # running (or ran) for
    waited_s: Optional[float] = None  # queued for, while waiting
    position: Optional[int] = None  # 1 = next in its queue
    eta: Optional[datetime] = None  # predicted start (placement replayed forward); None: cannot be told
    reason: Optional[str] = None  # why it waits, or how it ended
    ports: list[int] = []


def row_of(fr: Any, now: datetime, position: Optional[int] = None) -> SessionRow:
    labels = fr.labels or {}
    placed = labels.get(PLACED_LABEL) or ""
    agent = placed.split(":", 1)[0].removeprefix("agent ") if placed else None
    state = fr.state.type.value if fr.state else "UNKNOWN"
    end = fr.end_time or (now if state == "RUNNING" else None)
    reason = None
    if state == "SCHEDULED":
        reason = labels.get(WAIT_LABEL) or None
        if fr.expected_start_time and fr.expected_start_time > now:
            reason = f"starts at {fr.expected_start_time:%Y-%m-%d %H:%M:%S} UTC"
    elif fr.state and fr.state.message and state in ("FAILED", "CRASHED", "CANCELLED"):
        reason = fr.state.message
    ports = [int(p) for p in str(labels.get("launch.session.ports") or "").split(",") if p.strip().isdigit()]
    return SessionRow(
        id=str(fr.id), name=fr.name, owner=tag_value(fr.tags, "owner"), launched_by=tag_value(fr.tags, "launched_by"),
        status=fr.state_name or state,
        type=tag_value(fr.tags, "session-type"), queue=fr.work_pool_name, resources=labels.get("launch.resources"),
        agent=agent, created=fr.created, started=fr.start_time, ended=fr.end_time,
        elapsed_s=(end - fr.start_time).total_seconds() if fr.start_time and end else None,
        waited_s=(now - fr.expected_start_time).total_seconds()
        if state == "SCHEDULED" and fr.expected_start_time and fr.expected_start_time <= now else None,
        position=position, reason=reason, ports=ports,
    )


def idle_checks_of(fr: Any, now: datetime) -> Optional[dict[str, Any]]:
    """The run's idle checks as its agent last judged them (label ``launch.idle``), with the time left now.

    Only while it runs: an ended session's reason is in its state message. Each check with a
    deadline gets ``remaining_s``; ``lines`` is what `session show` prints.
    """
    import json

    from prefect_launch.workers.metrics.idle_checks import describe_status

    raw = (fr.labels or {}).get(IDLE_LABEL)
    if not raw or not fr.state or fr.state.type.value != "RUNNING":
        return None
    try:
        status = json.loads(raw)
    except ValueError:
        return None
    t = now.timestamp()
    for c in status.get("checks") or []:
        if "deadline" in c:
            c["remaining_s"] = round(max(0.0, float(c["deadline"]) - t), 1)
        if "grace_until" in c:
            c["grace_remaining_s"] = round(max(0.0, float(c["grace_until"]) - t), 1)
    status["lines"] = describe_status(status, t)
    return status


def list_sessions(client: Any, owner: Optional[str] = None, include_ended: bool = False,
                  limit: int = 100) -> list[SessionRow]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    tags = [SESSION_TAG] + ([f"owner:{owner}"] if owner else [])
    state = None if include_ended else FlowRunFilterState(type=FlowRunFilterStateType(any_=[
        StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]))
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags), state=state),
                                 sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=limit)
    now = datetime.now(timezone.utc)
    queues = sorted({r.work_pool_name for r in runs if r.state_type == StateType.SCHEDULED and r.work_pool_name})
    # position among every waiting run of the queue (jobs too), not only sessions; ETA from the predictor
    waits = by_run(waiting_runs(client, queues, now))
    return [row_of(r, now, waits[str(r.id)].position if str(r.id) in waits else None).model_copy(
        update={"eta": waits[str(r.id)].eta if str(r.id) in waits else None}) for r in runs]


def find_session(client: Any, text: str, owner: Optional[str] = None) -> Any:
    """A session by id, id prefix (8+) or name among the owner's sessions (newest first)."""
    rows = list_sessions(client, owner=owner, include_ended=True, limit=200)
    hits = [r for r in rows if r.id == text or (len(text) >= 8 and r.id.startswith(text))]
    if not hits:
        hits = [r for r in rows if r.name == text]
        live = [r for r in hits if r.status in (*WAITING_NAMES, "Pending", "Running", "Cancelling")]
        hits = live or hits[:1]
    if not hits:
        whose = f" of {owner}" if owner else ""
        raise LookupError(f"no session {text!r}{whose}; list them with `prefect-launch session ls`")
    if len(hits) > 1:
        raise LookupError(f"{text!r} names several sessions; use the id")
    return client.read_flow_run(hits[0].id)


def app_urls(client: Any, fr: Any) -> list[str]:
    """A running interactive session's app URL with its token (`session show`, the Sessions page); [] for any
    other session, or when its token cannot be read."""
    from prefect.blocks.system import Secret

    row = row_of(fr, datetime.now(timezone.utc))
    if row.type != "interactive" or not fr.state or fr.state.type.value != "RUNNING":
        return []
    try:
        token = Secret.load(f"session-token-{fr.id}").get()
    except Exception:
        return []
    host = _agent_address(client, row.agent) if _exposed(fr) else None
    return [f"http://{host or '127.0.0.1'}:{p}/lab?token={token}" for p in row.ports[:1]]


def _exposed(fr: Any) -> bool:
    """Whether the session's apps listen beyond the loopback (`session start --expose`)."""
    return (fr.parameters or {}).get("bind_host") not in (None, "", "127.0.0.1", "localhost")


def _agent_address(client: Any, agent: Optional[str]) -> Optional[str]:
    """The address ``agent`` publishes (issue 41 §2: its host's, as other hosts reach it); None when unknown."""
    if not agent:
        return None
    from prefect_launch.workers.agent.registry import read_agents_sync

    try:
        return next((a.address for a in read_agents_sync(client) if a.name == agent), None)
    except Exception:
        return None


def app_tunnel(client: Any, fr: Any) -> Optional[str]:
    """How to reach a loopback-bound session on another host: an SSH tunnel line to its agent's published address
    (the app URL then works as printed on this machine); None when the apps are exposed or on this machine."""
    if _exposed(fr):
        return None
    row = row_of(fr, datetime.now(timezone.utc))
    host = _agent_address(client, row.agent)
    if not host or not row.ports or host.startswith("127.") or host in ("::1", "localhost"):
        return None
    p = row.ports[0]
    return f"ssh -N -L {p}:127.0.0.1:{p} {host}"
