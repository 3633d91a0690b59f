"""Reads what `eta.predict` needs from Prefect: agents, running runs, waiting runs, past run times."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from prefect_launch.deployments.eta import AgentCap, Running, Waiting, median_runtime, predict
from prefect_launch.workers.agent_registry import read_agents_sync
from prefect_launch.workers.queue_spec import queue_spec_of
from prefect_launch.workers.resolve import resolve_request


def _expected(client: Any, deployment_id: Any, cache: dict, timeout_s: Optional[float]) -> Optional[float]:
    """Median of the job's last 20 completed runs, else the run's timeout, else unknown."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    if deployment_id not in cache:
        past = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.COMPLETED]))),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            sort=FlowRunSort.END_TIME_DESC, limit=20) if deployment_id else []
        cache[deployment_id] = median_runtime([r.total_run_time.total_seconds() for r in past
                                               if r.total_run_time and r.total_run_time.total_seconds() > 0])
    return cache[deployment_id] if cache[deployment_id] is not None else timeout_s


def predicted_starts(client: Any, queues: list[str], now: Optional[datetime] = None) -> dict[str, Optional[datetime]]:
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    now = now or datetime.now(timezone.utc)
    agents_state = [a for a in read_agents_sync(client) if a.online(now) and set(a.queues) & set(queues)]
    agents = [AgentCap(name=a.name, queues=a.queues, capacity=a.capacity) for a in agents_state]
    all_queues = sorted({q for a in agents_state for q in a.queues} | set(queues))
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=all_queues)), limit=200)
    specs = {q: queue_spec_of(client.read_work_pool(q)) for q in all_queues}
    prios = {q: {wq.name: wq.priority for wq in client.read_work_queues(work_pool_name=q)} for q in all_queues}
    deployments: dict[Any, dict] = {}
    cache: dict = {}
    running, waiting = [], []
    held = {r.run_id: (a.name, r.resources) for a in agents_state for r in a.runs}
    for fr in runs:
        spec = specs.get(fr.work_pool_name)
        if spec is None:
            continue
        if fr.deployment_id not in deployments:
            try:
                deployments[fr.deployment_id] = dict(client.read_deployment(fr.deployment_id).job_variables or {})
            except Exception:
                deployments[fr.deployment_id] = {}
        try:
            req = resolve_request(spec, deployments[fr.deployment_id], fr.job_variables or {})
        except Exception:
            continue
        expected = _expected(client, fr.deployment_id, cache, req.timeout_s)
        if fr.state_type == StateType.SCHEDULED:
            waiting.append(Waiting(run_id=str(fr.id), queue=fr.work_pool_name, resources=req.resources,
                                   priority_rank=prios[fr.work_pool_name].get(fr.work_queue_name or "", 99),
                                   submitted=fr.created or now, expected_s=expected, agent=req.agent,
                                   not_before=fr.expected_start_time))
        elif str(fr.id) in held:
            agent, res = held[str(fr.id)]
            running.append(Running(run_id=str(fr.id), agent=agent, resources=res,
                                   started=fr.start_time or now, expected_s=expected))
    backfill = {q: bool(s and s.backfill) for q, s in specs.items()}
    return predict(now, agents, running, waiting, backfill=backfill)
