"""Listing runs on launch queues, with their resources and wait reasons."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.agent.tags import LAUNCH_TAG, tag_value
from prefect_launch.workers.agent.tags import PLACED_LABEL, WAIT_LABEL


class RunRow(BaseModel):
    run_id: str
    name: str
    job: Optional[str] = None
    queue: Optional[str] = None
    priority: Optional[str] = None
    state: str
    preset: Optional[str] = None
    resources: Optional[str] = None
    owner: Optional[str] = None
    launched_by: Optional[str] = None  # an admin or agent who launched it for its owner (the gateway's tag)
    created: Optional[str] = None
    start_time: Optional[str] = None
    end_time: Optional[str] = None
    note: Optional[str] = None
    position: Optional[int] = None  # waiting runs: place in its queue (1 = next; None while a starts-at is ahead)
    eta: Optional[str] = None  # waiting runs: predicted start (ISO); None when it cannot be told


def list_runs(client: Any, queue: Optional[str] = None, states: Optional[list[str]] = None,
              limit: int = 50, with_wait: bool = True) -> list[RunRow]:
    """``with_wait``: also the waiting runs' queue position and predicted start (more reads)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags,
        WorkPoolFilter, WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    state_filter = None
    if states:
        try:
            types = [StateType(s.upper()) for s in states]
        except ValueError:
            raise ValueError(f"unknown state in {states}; use one of {', '.join(t.value for t in StateType)}") from None
        state_filter = FlowRunFilterState(type=FlowRunFilterStateType(any_=types))
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=state_filter, tags=FlowRunFilterTags(all_=[LAUNCH_TAG])),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[queue])) if queue else None,
        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=limit,
    )
    from prefect_launch.deployments.wait_order import by_run, waiting_runs

    # position and predicted start among every waiting run of their queues (not only the ones listed)
    waits = by_run(waiting_runs(client, sorted({r.work_pool_name for r in runs
                                                if r.state_type == StateType.SCHEDULED and r.work_pool_name}))
                   ) if with_wait else {}
    rows = []
    for r in runs:
        w = waits.get(str(r.id))
        jv = r.job_variables or {}
        labels = r.labels or {}
        res = labels.get("launch.resources") or ",".join(
            f"{k}={jv[k]}" for k in ("cpu", "memory", "gpu", "shm_size") if jv.get(k) is not None)
        note = labels.get(WAIT_LABEL) if r.state_type == StateType.SCHEDULED else labels.get(PLACED_LABEL)
        if r.state_type == StateType.PENDING and (labels.get(WAIT_LABEL) or "").startswith("building environment"):
            note = labels[WAIT_LABEL]  # placed, its job environment building (workers/environments/run_env.py)
        if r.state and r.state_type in (StateType.FAILED, StateType.CRASHED, StateType.CANCELLED) and r.state.message:
            note = r.state.message
        rows.append(RunRow(
            run_id=str(r.id), name=r.name, job=labels.get("prefect.deployment.name"), queue=r.work_pool_name, priority=r.work_queue_name,
            state=r.state_name or "?", preset=tag_value(r.tags, "preset") or jv.get("preset"), resources=res or None,
            owner=tag_value(r.tags, "owner"), launched_by=tag_value(r.tags, "launched_by"),
            created=str(r.created) if r.created else None,
            start_time=str(r.start_time) if r.start_time else None,
            end_time=str(r.end_time) if r.end_time else None, note=note,
            position=w.position if w else None, eta=str(w.eta) if w and w.eta else None,
        ))
    return rows


def resolve_run_id(client: Any, text: str) -> str:
    """A full flow run id, or a unique prefix (8+ characters) of a recent launch run."""
    from uuid import UUID

    try:
        return str(UUID(text))
    except ValueError:
        pass
    if len(text) < 8:
        raise LookupError(f"run {text!r}: give the full id or at least 8 characters of it")
    matches = [r.run_id for r in list_runs(client, limit=200, with_wait=False) if r.run_id.startswith(text)]
    if len(matches) != 1:
        raise LookupError(f"run {text!r} matches {len(matches)} recent runs; give the full id")
    return matches[0]
