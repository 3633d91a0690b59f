"""Dispatch: which of a queue's scheduled runs an agent starts now, on any back end.

One numbered cycle, Kueue's `schedule` in small: 1 heads, 2 snapshot, 3 resolve,
4 plan, 5 allocate and start (release on failure), 6 label the rest with why.
The ledger plays Kueue's cache (`free()` is the snapshot, `try_allocate` books,
`release` gives back); the caller plays the queue manager (it reads the
scheduled runs and wakes the cycle). It imports no back end and no worker: the
effects are the callbacks in `DispatchHooks`, so it is tested with plain fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional
from uuid import UUID

from prefect_launch.workers.ledger import Allocation, Ledger
from prefect_launch.workers.placement import Candidate, plan
from prefect_launch.workers.queue_spec import QueueSpec
from prefect_launch.workers.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.resources import LaunchValidationError
from prefect_launch.workers.run_tags import WAIT_LABEL

OTHER_QUEUE_TOOK_IT = "waiting: capacity taken by a run of another queue"


@dataclass
class DispatchHooks:
    """What a cycle may do to the world; every field is an async or plain callable."""

    deployment_vars: Callable[[Optional[UUID]], Awaitable[dict[str, Any]]]
    pinned_agents: Callable[[], Awaitable[tuple[dict[str, str], set[str]]]]
    start: Callable[[Any, Allocation, ResolvedRequest], None]  # hand the run to the back end
    wait: Callable[[Any, str], Awaitable[None]]  # label a waiting run with its reason
    reject: Callable[[Any, str], Awaitable[None]]  # fail a run the queue can never serve
    booked: Callable[[Allocation], None] = lambda alloc: None  # e.g. journal it before anything starts
    log: Callable[[str], None] = lambda msg: None


@dataclass
class CycleResult:
    started: list[Any] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


async def dispatch_cycle(
    runs: list[Any],
    spec: QueueSpec,
    ledger: Ledger,
    queue: str,
    agent_name: str,
    priorities: dict[str, int],
    hooks: DispatchHooks,
) -> CycleResult:
    """Place ``runs`` (Prefect FlowRun-like objects) of one queue against the agent's ledger."""
    out = CycleResult()
    # 1. heads: the runs Prefect offers this worker, deduplicated by the caller
    by_id = {str(fr.id): fr for fr in runs}
    if not by_id:
        return out
    # 3. resolve each run's request (queue default < deployment < run) once; it travels with the run
    candidates: list[Candidate] = []
    requests: dict[str, ResolvedRequest] = {}
    for rid, fr in by_id.items():
        error = request = None
        try:
            request = resolve_request(spec, await hooks.deployment_vars(fr.deployment_id), fr.job_variables or {})
            requests[rid] = request
        except LaunchValidationError as exc:
            error = str(exc)
        except Exception as exc:  # deployment gone or unreadable: leave the run for Prefect
            hooks.log(f"skipping run {rid}: {exc}")
            continue
        candidates.append(Candidate(
            run_id=rid, name=fr.name, submitted=fr.expected_start_time,
            priority_rank=priorities.get(fr.work_queue_name or "", 99), request=request, error=error,
        ))
    pinned_elsewhere = any(r.agent and r.agent != agent_name for r in requests.values())
    offline, known = (await hooks.pinned_agents()) if pinned_elsewhere else ({}, None)
    # 2. snapshot, 4. plan against it
    decisions = plan(candidates, ledger.free(), ledger.capacity, agent_name, spec.backfill,
                     agents_offline=offline, agents_known=known)
    for decision in decisions:
        fr = by_id[decision.run_id]
        if decision.action == "start":
            # 5. book; the ledger checks again, since another queue of this agent may have taken the room
            req = requests[decision.run_id]
            alloc = ledger.try_allocate(decision.run_id, req.resources, queue=queue, preset=req.preset)
            if alloc is None:
                out.waiting[decision.run_id] = OTHER_QUEUE_TOOK_IT
                await hooks.wait(fr, OTHER_QUEUE_TOOK_IT)
                continue
            try:
                hooks.booked(alloc)
                hooks.start(fr, alloc, req)
            except Exception:
                ledger.release(decision.run_id)
                raise
            out.started.append(fr)
        elif decision.action == "reject":
            # 6. say why
            out.rejected[decision.run_id] = decision.reason
            await hooks.reject(fr, decision.reason)
        else:
            out.waiting[decision.run_id] = decision.reason
            await hooks.wait(fr, decision.reason)
    return out


class WaitNotes:
    """The last waiting reason written per run, so a label is written only when it changes."""

    def __init__(self) -> None:
        self._known: dict[Any, str] = {}

    def changed(self, flow_run: Any, reason: str) -> bool:
        known = self._known.get(flow_run.id) or (getattr(flow_run, "labels", None) or {}).get(WAIT_LABEL)
        self._known[flow_run.id] = reason
        return known != reason

    def forget(self, run_id: Any) -> None:
        self._known.pop(run_id, None)
