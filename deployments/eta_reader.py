"""Reads what `eta.predict` needs from Prefect: agents, claimed and waiting runs, past runs, overheads.

Per queue, one read of its newest finished runs (cached for `HISTORY_TTL_S`) gives every job
shape's past run times and, with the runs holding capacity now and the agents' capacities, the
agents' ledgers to replay for the overheads; the state histories of its newest
`OVERHEAD_SAMPLES` finished runs (finished runs' states never change: cached for good) give
their claim times.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from prefect_launch.deployments.eta import (AgentCap, PastRun, Running, Waiting, expected_runtime,
                                            job_shape, learn_overhead, predict)
from prefect_launch.workers.agent.registry import read_agents_sync
from prefect_launch.workers.scheduling.queue_spec import queue_spec_of
from prefect_launch.workers.scheduling.resolve import resolve_request
from prefect_launch.workers.agent.journal import parse_alloc_label
from prefect_launch.workers.agent.tags import ALLOC_LABEL, WORKER_LABEL

HISTORY_LIMIT = 200
HISTORY_TTL_S = 5.0
OVERHEAD_SAMPLES = 20
_history: dict[tuple[str, str], tuple[float, list[PastRun]]] = {}
_states: dict[str, tuple[Optional[datetime], Optional[datetime]]] = {}  # finished run -> (Pending, Running) times


def _api_key() -> str:
    try:
        from prefect.settings import PREFECT_API_URL

        return str(PREFECT_API_URL.value() or "")
    except Exception:
        return ""


def claim_and_start(states: list[tuple[str, datetime]]) -> tuple[Optional[datetime], Optional[datetime]]:
    """From a run's (state type, timestamp) history: its last claim and the first Running after it.

    The claim is the first Pending after the last Scheduled: Prefect 3 records a second Pending
    ("Submitting") when the worker hands the run to its infrastructure, and that one is part of the
    claim -> start time, not the claim.
    """
    claimed = started = None
    for kind, at in sorted(states, key=lambda s: s[1]):
        if kind == "SCHEDULED":
            claimed = started = None
        elif kind == "PENDING" and (claimed is None or started is not None):
            claimed, started = at, None
        elif kind == "RUNNING" and claimed is not None and started is None:
            started = at
    return claimed, started


def _claim_start(client: Any, run_id: str) -> tuple[Optional[datetime], Optional[datetime]]:
    """`claim_and_start` of the run's state history (cached)."""
    if run_id not in _states:
        states = [(s.type.value, s.timestamp) for s in client.read_flow_run_states(run_id)]
        if len(_states) > 5000:
            _states.clear()
        _states[run_id] = claim_and_start(states)
    return _states[run_id]


def _agent_of(labels: Optional[dict]) -> Optional[str]:
    labels = labels or {}
    parsed = parse_alloc_label(labels.get(ALLOC_LABEL))
    return parsed[0] if parsed else labels.get(WORKER_LABEL)


def queue_history(client: Any, queue: str, resources_of: Optional[Callable[[Any], Any]] = None) -> list[PastRun]:
    """The queue's newest finished runs, newest first (cached briefly); ``resources_of(flow_run)``: what
    each held (for the ledger replay)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    key = (_api_key(), queue)
    hit = _history.get(key)
    if hit and time.monotonic() - hit[0] < HISTORY_TTL_S:
        return hit[1]
    finished = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[
            StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[queue])),
        sort=FlowRunSort.END_TIME_DESC, limit=HISTORY_LIMIT)
    past = []
    for k, fr in enumerate(finished):
        ran = fr.state_type in (StateType.COMPLETED, StateType.FAILED)  # cancelled ones say nothing of the job
        claimed = started = None
        if k < OVERHEAD_SAMPLES:
            try:
                claimed, started = _claim_start(client, str(fr.id))
            except Exception:
                pass
        try:
            held = resources_of(fr) if resources_of else None
        except Exception:
            held = None
        past.append(PastRun(
            deployment_id=str(fr.deployment_id) if fr.deployment_id else None,
            shape=job_shape(fr.deployment_id, fr.parameters), queue=queue, agent=_agent_of(fr.labels),
            resources=held, created=fr.created, claimed=claimed, started=started or fr.start_time,
            ended=fr.end_time, run_s=fr.total_run_time.total_seconds() if ran and fr.total_run_time else None))
    _history[key] = (time.monotonic(), past)
    return past


def predicted_starts(client: Any, queues: list[str], now: Optional[datetime] = None,
                     include_claimed: bool = False) -> dict[str, Optional[datetime]]:
    """Predicted start of every waiting run of ``queues`` (None: cannot be told honestly).

    ``include_claimed``: also the claimed ones: a running run's start, a Pending one's claim + start overhead.
    """
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
    history: dict[str, list[PastRun]] = {}  # read only for queues with live runs
    live: dict[str, list[PastRun]] = {}  # what holds capacity now, for the ledger replay
    deployments: dict[Any, dict] = {}

    def request_of(fr: Any) -> Any:
        if fr.deployment_id not in deployments:
            try:
                deployments[fr.deployment_id] = dict(client.read_deployment(fr.deployment_id).job_variables or {})
            except Exception:
                deployments[fr.deployment_id] = {}
        return resolve_request(specs[fr.work_pool_name], deployments[fr.deployment_id], fr.job_variables or {})

    running, waiting = [], []
    held = {r.run_id: (a.name, r.resources) for a in agents_state for r in a.runs}
    for fr in runs:
        spec = specs.get(fr.work_pool_name)
        if spec is None:
            continue
        try:
            req = request_of(fr)
        except Exception:
            continue
        if fr.work_pool_name not in history:
            history[fr.work_pool_name] = queue_history(client, fr.work_pool_name,
                                                       lambda past_run: request_of(past_run).held())
        past = history[fr.work_pool_name]
        expected = expected_runtime(job_shape(fr.deployment_id, fr.parameters), fr.deployment_id, past, req.timeout_s)
        rid = str(fr.id)
        if fr.state_type == StateType.SCHEDULED:
            waiting.append(Waiting(run_id=rid, queue=fr.work_pool_name, resources=req.held(),
                                   priority_rank=prios[fr.work_pool_name].get(fr.work_queue_name or "", 99),
                                   submitted=fr.created or now, expected_s=expected, agent=req.agent,
                                   not_before=fr.expected_start_time))
            continue
        # claimed: it holds capacity on its agent (the registry's word, else the run's labels; else not yet known)
        agent, res = held.get(rid, (_agent_of(fr.labels), req.held()))
        running_since = fr.start_time if fr.state_type == StateType.RUNNING else None
        claimed = fr.state.timestamp if fr.state_type == StateType.PENDING and fr.state else None
        running.append(Running(run_id=rid, agent=agent, queue=fr.work_pool_name, resources=res,
                               started=running_since or (None if claimed else now), claimed=claimed,
                               expected_s=expected))
        live.setdefault(fr.work_pool_name, []).append(PastRun(
            queue=fr.work_pool_name, agent=agent, resources=res, created=fr.created, claimed=claimed,
            started=running_since))
    backfill = {q: bool(s and s.backfill) for q, s in specs.items()}
    capacity = {a.name: a.capacity for a in agents_state}
    overhead = {q: learn_overhead(past + live.get(q, []), capacity) for q, past in history.items()}
    out = predict(now, agents, running, waiting, backfill=backfill, overhead=overhead)
    if not include_claimed:
        out = {r: t for r, t in out.items() if r not in {c.run_id for c in running}}
    return out
