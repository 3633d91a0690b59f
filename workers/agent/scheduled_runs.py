"""The agents' frequent look at a queue's due runs, as a read.

Prefect's worker poll (``/work_pools/{name}/get_scheduled_flow_runs``) also marks the pool's work
queues and deployments as polled: a write on every call. An agent re-plans every couple of seconds
and on every flow-run event; with several agents on a SQLite-backed server those writes hold the
database lock, and a submission's run creation gets "503 database is locked" and backs off (seen:
up to 15 s per run with two agents). So the agent's own fast path reads the due runs with the flow-run
filter (a plain read), and Prefect's own slower poll keeps doing the marking. Where the server applies
limits this read cannot see (a work-pool or work-queue concurrency limit), the caller uses Prefect's
endpoint instead.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Optional

from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterNextScheduledStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
    WorkQueueFilter,
    WorkQueueFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import WorkerFlowRunResponse
from prefect.client.schemas.sorting import FlowRunSort

from prefect_launch.settings import env_int


# How many due runs of each priority level an agent plans per cycle (the oldest). A cycle starts far fewer;
# reading every waiting run of a deep queue on each wake-up (every event, every 2 s, every agent) kept a
# SQLite-backed server busy serializing them: 300 waiting runs and 3 agents cut placements to a third.
# Runs further back wait with no label of their own until they come within the window.
DUE_WINDOW_DEFAULT = 50  # LAUNCH_DUE_WINDOW, read per call


IDLE_POLL_CAP_DEFAULT = 8.0  # LAUNCH_IDLE_POLL_SECONDS: the longest wait between looks at a queue with nothing due


def next_poll_s(poll_s: float, empty_reads: int, cap_s: float = IDLE_POLL_CAP_DEFAULT) -> float:
    """How long the agent waits for an event before it looks at the queue again: ``poll_s`` while runs are due,
    doubling after each look that found none, up to ``cap_s`` (never below ``poll_s``). A new run is an event
    (the fast path) and a released run wakes the agent itself, so an idle queue needs only the fallback when an
    event is lost; an agent serving several queues stops reading the idle ones every 2 s (with 4 agents and an
    idle second queue that was ~1 in 7 of the server's requests per run, bench/hosts.py)."""
    return max(poll_s, min(cap_s, poll_s * 2 ** min(max(empty_reads, 0), 16)))


def needs_server_limits(pool: Any, queues: Iterable[Any]) -> bool:
    """True when the server's poll enforces a concurrency limit that a plain read would skip."""
    return getattr(pool, "concurrency_limit", None) is not None or any(
        getattr(q, "concurrency_limit", None) is not None for q in queues)


def runnable_queues(queues: Iterable[Any], wanted: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The pool's work queues a worker may take from: not paused, and among ``wanted`` when given."""
    names = set(wanted or [])
    return {q.name: q for q in queues if not getattr(q, "is_paused", False) and (not names or q.name in names)}


def due_runs(runs: Iterable[Any], pool_id: Any, queues: dict[str, Any]) -> list[WorkerFlowRunResponse]:
    """Scheduled runs of runnable queues, as the worker poll would return them (no in-process retries)."""
    out = []
    for fr in runs:
        q = queues.get(fr.work_queue_name or "")
        if q is None:
            continue
        policy = getattr(fr, "empirical_policy", None)
        if getattr(policy, "retry_type", None) == "in_process":
            continue
        out.append(WorkerFlowRunResponse(work_pool_id=pool_id, work_queue_id=q.id, flow_run=fr))
    return out


async def read_due_runs(client: Any, pool: Any, work_queue_names: Optional[Iterable[str]],
                        scheduled_before: datetime, limit: Optional[int] = None,
                        queues: Optional[list[Any]] = None) -> Optional[list[WorkerFlowRunResponse]]:
    """The pool's due runs by a read: the oldest ``limit`` of each priority level (work queue), so a late
    ``critical`` run is seen however many older ``low`` ones wait; None when only Prefect's own poll gives
    the right answer. ``queues``: the pool's work queues when the caller read them lately (paused or
    limited queues then count from that read)."""
    if limit is None:
        limit = env_int("LAUNCH_DUE_WINDOW", DUE_WINDOW_DEFAULT)
    if queues is None:
        queues = await client.read_work_queues(work_pool_name=pool.name)
    if getattr(pool, "is_paused", False):
        return []
    if needs_server_limits(pool, queues):
        return None
    runnable = runnable_queues(queues, work_queue_names)
    if not runnable:
        return []
    async def read(names: list[str]) -> list[Any]:
        return await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=scheduled_before)),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool.name])),
            work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(any_=names)),
            sort=FlowRunSort.NEXT_SCHEDULED_START_TIME_ASC, limit=limit)

    import asyncio

    names = sorted(runnable)
    # first one read of every level together: fewer than ``limit`` due runs in all is every level's
    # whole window, the common case (an idle agent's wake-ups were one read per level: most of what an
    # idle agent cost its server). Only a deep queue needs the window per level
    levels = [await read(names)]
    if len(names) > 1 and len(levels[0]) >= limit:
        levels = await asyncio.gather(*(read([name]) for name in names))

    def due_at(fr: Any) -> float:
        when = fr.next_scheduled_start_time or fr.expected_start_time
        return when.timestamp() if when is not None else float("inf")

    runs = sorted((fr for runs in levels for fr in runs), key=lambda fr: (due_at(fr), str(fr.id)))
    return due_runs(runs, pool.id, runnable)
