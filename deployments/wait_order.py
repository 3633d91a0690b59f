"""Queue position and predicted start (ETA) of waiting runs, as `queue ls`, `runs ls`, `session ls`
and the monitor show them.

Position: among a queue's runs that are due and waiting (Scheduled, scheduled start reached), in the
agents' order: priority, then submit time; 1 = next. A run whose `--starts-at` is still ahead has no
position yet. ETA: :func:`prefect_launch.deployments.eta_reader.predicted_starts` (the agents'
placement replayed forward); None where it cannot be told honestly (no agent online, a run ahead
with no known end, ...). Reading the ETA never fails a listing: on an error it is simply absent.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.agent.tags import WAIT_LABEL, tag_value

WAIT_LIMIT = 200  # waiting runs read per call (the same bound as the predictor's own read)


class WaitingRun(BaseModel):
    run_id: str
    name: str
    queue: str
    priority: Optional[str] = None
    owner: Optional[str] = None
    submitted: Optional[datetime] = None  # scheduled start (= submit time unless --starts-at)
    position: Optional[int] = None  # 1 = next in its queue; None: its scheduled start is still ahead
    eta: Optional[datetime] = None  # predicted start; None: cannot be told
    reason: Optional[str] = None  # the agent's one-line reason (label launch.waiting)


def positions(scheduled: list[Any], priorities: dict[str, dict[str, int]] | dict[str, int]) -> dict[str, int]:
    """Queue position of each run in ``scheduled`` (all due): priority, then submit time (pure).

    ``priorities``: work-queue name -> rank, either per pool (``{pool: {name: rank}}``) or flat."""
    far = datetime.max.replace(tzinfo=timezone.utc)
    out: dict[str, int] = {}
    by_queue: dict[str, list[Any]] = {}
    for fr in scheduled:
        by_queue.setdefault(fr.work_pool_name or "", []).append(fr)
    for pool, runs in by_queue.items():
        ranks = priorities.get(pool) if isinstance(priorities.get(pool), dict) else priorities
        runs.sort(key=lambda r: (ranks.get(r.work_queue_name or "", 99), r.expected_start_time or far,
                                 r.created or far))
        for i, r in enumerate(runs, 1):
            out[str(r.id)] = i
    return out


def _etas(client: Any, queues: list[str], now: datetime) -> dict[str, Optional[datetime]]:
    try:
        from prefect_launch.deployments.eta_reader import predicted_starts

        return predicted_starts(client, queues, now)
    except Exception:  # the prediction is extra information; a listing never fails for it
        return {}


def waiting_runs(client: Any, queues: list[str], now: Optional[datetime] = None,
                 with_eta: bool = True) -> list[WaitingRun]:
    """Every Scheduled run of ``queues`` (up to :data:`WAIT_LIMIT`), ordered by queue then position
    (runs whose scheduled start is ahead last, by that start)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    if not queues:
        return []
    now = now or datetime.now(timezone.utc)
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=list(queues))),
        sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=WAIT_LIMIT)
    if not runs:
        return []
    prios = {q: {wq.name: wq.priority for wq in client.read_work_queues(work_pool_name=q)}
             for q in sorted({r.work_pool_name for r in runs if r.work_pool_name})}
    due = [r for r in runs if not r.expected_start_time or r.expected_start_time <= now]
    pos = positions(due, prios)
    etas = _etas(client, sorted(prios), now) if with_eta else {}
    far = datetime.max.replace(tzinfo=timezone.utc)
    out = [WaitingRun(run_id=str(r.id), name=r.name, queue=r.work_pool_name or "", priority=r.work_queue_name,
                      owner=tag_value(r.tags, "owner"), submitted=r.expected_start_time,
                      position=pos.get(str(r.id)), eta=etas.get(str(r.id)),
                      reason=(r.labels or {}).get(WAIT_LABEL) or None) for r in runs]
    out.sort(key=lambda w: (w.queue, w.position is None, w.position or 0, w.submitted or far))
    return out


def by_run(waits: list[WaitingRun]) -> dict[str, WaitingRun]:
    return {w.run_id: w for w in waits}
