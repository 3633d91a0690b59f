"""Queues as Prefect work pools: apply a queues.yaml idempotently, and read queue status."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.agent.registry import AgentState, read_agents_sync
from prefect_launch.workers.scheduling.fair_share import OwnerUsage, owner_usage
from prefect_launch.workers.scheduling.queue_spec import PRIORITIES, QueueSpec, queue_spec_of
from prefect_launch.workers.scheduling.resources import Resources
from prefect_launch.workers.scheduling.template import build_base_job_template

WAITING_SHOWN = 10  # waiting runs listed per queue (all are counted)
LAUNCH_POOL_TYPES = ("launch-process", "launch-docker", "docker", "kubernetes")
SESSION_TARGETS = ("process", "docker")  # the queues that get the built-in session flow


class ApplyResult(BaseModel):
    queue: str
    action: str  # created | updated | unchanged
    session_job: Optional[str] = None  # the built-in session flow's deployment on the queue (process and docker)


class QueueApplyError(Exception):
    """`apply_queues` stopped part-way (the server failed after the checks passed): says exactly what was
    written before the failure and what was not."""

    def __init__(self, queue: str, error: BaseException, written: list[str], not_applied: list[str]):
        self.queue, self.error, self.written, self.not_applied = queue, error, written, not_applied
        super().__init__(
            f"applying queue {queue!r} failed: {type(error).__name__}: {error}\n"
            + (f"  written before the failure: {'; '.join(written)}\n" if written
               else "  nothing was written before the failure\n")
            + (f"  not applied: {', '.join(not_applied)}\n" if not_applied else "")
            + "  `queue apply` is idempotent: run it again once the cause is fixed")


def apply_queue(client: Any, spec: QueueSpec) -> ApplyResult:
    """Create or update the work pool and its priority queues (sync client)."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    template = build_base_job_template(spec)
    try:
        pool = client.read_work_pool(spec.name)
    except ObjectNotFound:
        pool = None
    if pool is None:
        client.create_work_pool(WorkPoolCreate(
            name=spec.name, type=spec.pool_type, base_job_template=template,
            description=spec.description, concurrency_limit=spec.concurrency_limit,
        ))
        action = "created"
    elif pool.type != spec.pool_type:
        raise ValueError(
            f"queue {spec.name!r} exists with target type {pool.type!r}, the file says {spec.pool_type!r}; "
            f"delete it first with `prefect work-pool delete {spec.name}`"
        )
    else:
        changed = (pool.base_job_template != template or pool.description != spec.description
                   or pool.concurrency_limit != spec.concurrency_limit)
        if changed:
            client.update_work_pool(spec.name, WorkPoolUpdate(
                base_job_template=template, description=spec.description,
                concurrency_limit=spec.concurrency_limit,
            ))
        action = "updated" if changed else "unchanged"
    _ensure_priority_queues(client, spec)
    return ApplyResult(queue=spec.name, action=action)


def apply_problems(client: Any, specs: list[QueueSpec]) -> list[str]:
    """Every reason the queues cannot all be applied, found before anything is written: a queue that exists
    with another target type, a template that cannot be built, the session flow missing from the installation."""
    from prefect.exceptions import ObjectNotFound

    problems = []
    for spec in specs:
        try:
            build_base_job_template(spec)
        except Exception as exc:
            problems.append(f"queue {spec.name!r}: its work pool template cannot be built: {exc}")
        try:
            pool = client.read_work_pool(spec.name)
        except ObjectNotFound:
            pool = None
        if pool is not None and pool.type != spec.pool_type:
            problems.append(f"queue {spec.name!r} exists with target type {pool.type!r}, the file says "
                            f"{spec.pool_type!r}; delete it first with `prefect work-pool delete {spec.name}`")
    if any(s.target in SESSION_TARGETS for s in specs):
        from prefect_launch.deployments.sessions import session_flow_file
        from prefect_launch.workers.scheduling.resources import LaunchValidationError

        try:
            session_flow_file()
        except LaunchValidationError as exc:
            problems.append(str(exc))
    return problems


def apply_queues(client: Any, specs: list[QueueSpec]) -> list[ApplyResult]:
    """Apply a whole queues file: check everything first (:func:`apply_problems`; a
    ``LaunchValidationError`` listing every problem, nothing written), then write each queue: its work
    pool, priority queues and, on process and docker queues, the built-in session flow. A failure while
    writing raises :class:`QueueApplyError` naming what was written and what was not."""
    from prefect_launch.deployments.sessions import deploy_session_flow
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    problems = apply_problems(client, specs)
    if problems:
        raise LaunchValidationError("nothing applied:\n  - " + "\n  - ".join(problems))
    results: list[ApplyResult] = []
    written: list[str] = []
    for i, spec in enumerate(specs):
        step = f"work pool {spec.name}"
        try:
            result = apply_queue(client, spec)
            written.append(f"work pool {spec.name} {result.action} with its priority queues")
            if spec.target in SESSION_TARGETS:
                step = f"session job on {spec.name}"
                result.session_job = deploy_session_flow(spec.name, spec.default_priority, target=spec.target,
                                                         image=spec.image)
                written.append(f"session job {result.session_job}")
        except Exception as exc:
            if step.startswith("work pool"):  # the pool may have been created before its priority queues failed
                written.append(f"work pool {spec.name}: possibly created or updated (the failure came while writing it)")
            raise QueueApplyError(spec.name, exc, written, [s.name for s in specs[i + 1:]]) from exc
        results.append(result)
    return results


def _ensure_priority_queues(client: Any, spec: QueueSpec) -> None:
    existing = {q.name: q for q in client.read_work_queues(work_pool_name=spec.name)}
    for rank, name in enumerate(spec.priorities, start=1):
        q = existing.get(name)
        if q is None:
            client.create_work_queue(name=name, work_pool_name=spec.name, priority=rank,
                                     description=f"{name} priority")
        elif q.priority != rank:
            client.update_work_queue(q.id, priority=rank)
    default = existing.get("default") or {q.name: q for q in client.read_work_queues(work_pool_name=spec.name)}.get("default")
    if default is not None and default.priority <= len(spec.priorities):
        client.update_work_queue(default.id, priority=len(spec.priorities) + 1)


class QueueStatus(BaseModel):
    name: str
    target: str
    description: Optional[str] = None
    presets: dict[str, str]
    default_preset: Optional[str] = None
    backfill: bool = False
    agents_online: list[str]
    queued: int
    running: int
    free: Optional[Resources] = None
    capacity: Optional[Resources] = None
    state: str  # busy | idle | offline
    # waiting runs in position order: run_id, name, position (1 = next; None while a starts-at is ahead),
    # eta (predicted start, None when it cannot be told), reason
    waiting: list[dict[str, Any]] = []
    waiting_count: int = 0  # due and waiting (have a position); `queued` also counts runs whose starts-at is ahead
    head_eta: Optional[datetime] = None  # predicted start of position 1
    next_eta: Optional[datetime] = None  # earliest predicted start of any waiting run (backfill can beat the head)
    sharing: str = ""  # fair share, owner quotas, preemptible levels ('' when the queue has none)
    owners: list[OwnerUsage] = []  # what each owner holds now (queues with fair share or quotas)


def queue_status(client: Any, pool: Any, agents: list[AgentState], waits: Optional[list[Any]] = None) -> QueueStatus:
    """``waits``: the queue's :class:`~prefect_launch.deployments.wait_order.WaitingRun` rows (read here when None)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType

    from prefect_launch.deployments.wait_order import waiting_runs

    spec = queue_spec_of(pool)
    pf = WorkPoolFilter(name=WorkPoolFilterName(any_=[pool.name]))

    def count(types: list[StateType]) -> int:
        return client.count_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=types))),
            work_pool_filter=pf,
        )

    queued = count([StateType.SCHEDULED])
    running = count([StateType.PENDING, StateType.RUNNING])
    if waits is None:
        waits = waiting_runs(client, [pool.name]) if queued else []
    waits = [w for w in waits if w.queue == pool.name]
    etas = [w.eta for w in waits if w.eta is not None]
    head = next((w for w in waits if w.position == 1), None)
    online = [a for a in agents if pool.name in a.queues and a.online()]
    prefect_online = {w.name for w in client.read_workers_for_work_pool(pool.name) if str(w.status).upper().endswith("ONLINE")}
    names = sorted({a.name for a in online} | prefect_online)
    free = cap = None
    if online:
        free = Resources(cpu=sum(a.free.cpu for a in online), memory=sum(a.free.memory for a in online),
                         gpu=sum(a.free.gpu for a in online))
        cap = Resources(cpu=sum(a.capacity.cpu for a in online), memory=sum(a.capacity.memory for a in online),
                        gpu=sum(a.capacity.gpu for a in online))
    state = "offline" if not names else ("busy" if running or queued else "idle")
    owners = _owners(client, pool.name, spec, cap) if spec and running and (
        spec.fair_share or spec.owner_quota or spec.owner_quotas) else []
    return QueueStatus(
        name=pool.name, target=spec.target if spec else pool.type, description=pool.description,
        presets={n: p.to_resources().describe() for n, p in spec.presets.items()} if spec else {},
        default_preset=spec.default_preset if spec else None, backfill=spec.backfill if spec else False,
        agents_online=names, queued=queued, running=running, free=free, capacity=cap, state=state,
        waiting=[{"run_id": w.run_id, "name": w.name, "position": w.position, "eta": w.eta,
                  "reason": w.reason or "waiting: not planned yet (agents plan the oldest due runs of each priority first)"} for w in waits[:WAITING_SHOWN]],
        waiting_count=sum(1 for w in waits if w.position is not None),
        head_eta=head.eta if head else None, next_eta=min(etas) if etas else None,
        sharing=spec.sharing_text() if spec else "", owners=owners,
    )


def _owners(client: Any, queue: str, spec: Any, capacity: Optional[Resources]) -> list[OwnerUsage]:
    """What each owner holds of ``queue`` now, from its live runs' ``launch.alloc`` labels (every agent's)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    from prefect_launch.workers.agent.journal import parse_alloc_label
    from prefect_launch.workers.agent.tags import ALLOC_LABEL

    live = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[queue])))
    held = []
    for fr in live:
        parsed = parse_alloc_label((fr.labels or {}).get(ALLOC_LABEL))
        if parsed is not None and parsed[1].queue in (None, queue):
            held.append((parsed[1].owner, parsed[1].resources))

    def quota_of(owner: str):
        q = spec.quota_for(owner)
        return (q.resources(), q.describe()) if q is not None else None

    smallest = min((p.to_resources() for p in spec.presets.values()), key=lambda r: (r.gpu, r.cpu, r.memory),
                   default=None)
    return owner_usage(held, capacity or Resources(), quota_of, smallest)


def list_queue_status(client: Any, names: Optional[list[str]] = None) -> list[QueueStatus]:
    pools = [p for p in client.read_work_pools() if queue_spec_of(p) is not None or p.type == "launch-process"]
    if names:
        known = {p.name for p in pools}
        missing = [n for n in names if n not in known]
        if missing:
            raise LookupError(f"unknown queue(s): {', '.join(missing)}; see `prefect-launch queue ls`")
        pools = [p for p in pools if p.name in names]
    agents = read_agents_sync(client)
    from prefect_launch.deployments.wait_order import waiting_runs

    waits = waiting_runs(client, [p.name for p in pools])  # one read and one prediction for every queue
    return [queue_status(client, p, agents, waits) for p in sorted(pools, key=lambda p: p.name)]


__all__ = ["apply_queue", "list_queue_status", "queue_spec_of", "QueueStatus", "PRIORITIES"]
