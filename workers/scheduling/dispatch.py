"""Dispatch: which of a queue's scheduled runs an agent starts now, on any back end.

One numbered cycle, Kueue's `schedule` in small: 1 heads, 2 snapshot, 3 resolve,
4 plan, 5 allocate and start (release on failure), 6 label the rest with why.
Every decision also becomes a scheduling-history record (``hooks.history``) with the
sub-steps sequencing, validation, capacity check and allocation: a run that waits is
``schedule NEED_RETRY`` (or ``SKIPPED`` behind a FIFO head, ``check_precondition NEED_RETRY``
when this agent can never take it), a placed one ``schedule SUCCESS`` (Scheduled -> Pending),
a rejected one ``check_precondition GIVE_UP``.
The ledger plays Kueue's cache (`free()` is the snapshot, `try_allocate` books,
`release` gives back); the caller plays the queue manager (it reads the
scheduled runs and wakes the cycle). It imports no back end and no worker: the
effects are the callbacks in `DispatchHooks`, so it is tested with plain fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Optional
from uuid import UUID

from prefect_launch.blocks.scheduling_history import SchedulingRecord, SubStep
from prefect_launch.workers.cluster.placement import as_candidate, members_text, multi_node_plan, waiting_reason
from prefect_launch.workers.cluster.fit import member_names
from prefect_launch.workers.scheduling.ledger import Allocation, Ledger
from prefect_launch.workers.scheduling.placement import Candidate, Decision, FairShare, Quotas, plan
from prefect_launch.workers.scheduling.fair_share import held_by_owner
from prefect_launch.workers.scheduling.preemption import Holder, choose_victims
from prefect_launch.workers.scheduling.queue_spec import QueueSpec
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources
from prefect_launch.workers.agent.tags import OWNER, tag_value

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
    history: Callable[[SchedulingRecord], None] = lambda rec: None  # a decision, for the scheduling history
    # preempt(victim run ids, the waiting run they make room for): SIGTERM, grace, back to their queue
    preempt: Optional[Callable[[list[str], Any], Awaitable[None]]] = None
    stopping: Callable[[], set[str]] = lambda: set()  # runs already told to give their capacity back
    # peers(): the free capacity of the queue's other online agents (multi-node cluster runs)
    peers: Optional[Callable[[], Awaitable[dict[str, Resources]]]] = None
    # placed_elsewhere(): (agent, allocation) of the queue's live runs, as their labels say (owner quotas)
    placed_elsewhere: Optional[Callable[[], Awaitable[list[tuple[str, Allocation]]]]] = None


@dataclass
class CycleResult:
    started: list[Any] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    unplaced: list[Candidate] = field(default_factory=list)  # for the agent's other queues' plans
    preempted: list[str] = field(default_factory=list)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _note(hooks: DispatchHooks, rec: SchedulingRecord) -> None:
    """History never breaks dispatch."""
    try:
        hooks.history(rec)
    except Exception as exc:  # pragma: no cover - the writer itself does not raise
        hooks.log(f"scheduling history: {exc}")


def _waiting_record(run_id: str, reason: str, request: Optional[ResolvedRequest], agent_name: str,
                    steps: list[SubStep], action: str) -> SchedulingRecord:
    """Why a run was not placed, as phase/result/error code (placement gives the one-line reason)."""
    now = _now()
    if action == "skip":  # this agent can never take it as asked; another may
        pinned = request is not None and request.agent and request.agent != agent_name
        code = "pinned-to-other-agent" if pinned else "exceeds-agent-capacity"
        step = SubStep(step="capacity_check" if not pinned else "validation", result="NEED_RETRY",
                       error_code=code, message=reason, started=now, ended=now)
        return SchedulingRecord(run_id=run_id, phase="check_precondition", result="NEED_RETRY", error_code=code,
                                message=reason, sub_steps=[*steps, step])
    if "at its quota" in reason or "preempt" in reason:
        code = "over-quota" if "at its quota" in reason else "preempting"
        step = SubStep(step="capacity_check", result="NEED_RETRY", error_code=code, message=reason,
                       started=now, ended=now)
        return SchedulingRecord(run_id=run_id, phase="schedule", result="NEED_RETRY", error_code=code,
                                message=reason, sub_steps=[*steps, step])
    if reason.endswith("(FIFO)"):
        step = SubStep(step="sequencing", result="SKIPPED", error_code="blocked-by-head", message=reason,
                       started=now, ended=now)
        return SchedulingRecord(run_id=run_id, phase="schedule", result="SKIPPED", error_code="blocked-by-head",
                                message=reason, sub_steps=[*steps, step])
    step = SubStep(step="capacity_check", result="NEED_RETRY", error_code="insufficient-resources",
                   message=reason, started=now, ended=now)
    return SchedulingRecord(run_id=run_id, phase="schedule", result="NEED_RETRY", error_code="insufficient-resources",
                            message=reason, sub_steps=[*steps, step])


async def dispatch_cycle(
    runs: list[Any],
    spec: QueueSpec,
    ledger: Ledger,
    queue: str,
    agent_name: str,
    priorities: dict[str, int],
    hooks: DispatchHooks,
    foreign: Optional[list[Candidate]] = None,
) -> CycleResult:
    """Place ``runs`` (Prefect FlowRun-like objects) of one queue against the agent's ledger.

    ``foreign``: the waiting runs of the agent's other queues, planned in the same priority order.
    """
    out = CycleResult()
    # 1. heads: the runs Prefect offers this worker, deduplicated by the caller
    by_id = {str(fr.id): fr for fr in runs}
    if not by_id:
        return out
    # 3. resolve each run's request (queue default < deployment < run) once; it travels with the run
    candidates: list[Candidate] = []
    requests: dict[str, ResolvedRequest] = {}
    validation: dict[str, SubStep] = {}
    for rid, fr in by_id.items():
        error = request = None
        t0 = _now()
        try:
            request = resolve_request(spec, await hooks.deployment_vars(fr.deployment_id), fr.job_variables or {},
                                      priority=fr.work_queue_name)
            requests[rid] = request
        except LaunchValidationError as exc:
            error = str(exc)
        except Exception as exc:  # deployment gone or unreadable: leave the run for Prefect
            hooks.log(f"skipping run {rid}: {exc}")
            continue
        validation[rid] = SubStep(
            step="validation", result="FAILURE" if error else "SUCCESS", error_code="invalid-request" if error else None,
            message=error or f"preset {request.preset}: {request.resources.describe()}"
            + (f" per member, cluster of {request.cluster.describe()}" if request.cluster.is_cluster else "")
            + (f", pinned to agent {request.agent}" if request.agent else ""), started=t0, ended=_now())
        candidates.append(Candidate(
            run_id=rid, name=fr.name, submitted=fr.expected_start_time,
            priority_rank=priorities.get(fr.work_queue_name or "", 99), error=error,
            request=as_candidate(request) if request is not None else None,  # a cluster run: all its members
            owner=tag_value(getattr(fr, "tags", None), OWNER),
        ))
    pinned_elsewhere = any(r.agent and r.agent != agent_name for r in requests.values())
    offline, known = (await hooks.pinned_agents()) if pinned_elsewhere else ({}, None)
    # 2. snapshot, 4. plan against it
    t_plan = _now()
    free_before = ledger.free()
    elsewhere: dict[str, Resources] = {}
    if hooks.placed_elsewhere is not None and (spec.owner_quota is not None or spec.owner_quotas):
        try:
            elsewhere = held_elsewhere(await hooks.placed_elsewhere(), agent_name, queue)
        except Exception as exc:  # the quota then counts this agent's runs only, as before; said in the log
            hooks.log(f"could not read what other agents hold for owner quotas: {exc}")
    decisions = plan(candidates, free_before, ledger.capacity, agent_name, spec.backfill,
                     agents_offline=offline, agents_known=known, foreign=[c for c in foreign or []
                                                                          if ledger.get(c.run_id) is None],
                     fair=_fair_share(spec, ledger), quotas=_quotas(spec, ledger, queue, elsewhere))
    t_planned = _now()
    by_cand = {c.run_id: c for c in candidates}
    decisions = await _preempt_for_head(decisions, by_cand, by_id, ledger, hooks, spec, out)
    for position, decision in enumerate(decisions, 1):
        fr = by_id[decision.run_id]
        req = requests.get(decision.run_id)
        steps = [SubStep(step="sequencing", result="SUCCESS", started=t_plan, ended=t_planned, position=position,
                         message=f"position {position} of {len(decisions)} in queue {queue} "
                                 f"(priority, then submit time{'; backfill' if spec.backfill else '; strict FIFO'})"),
                 validation[decision.run_id]]
        if decision.action == "start":
            # 5. book; the ledger checks again, since another queue of this agent may have taken the room
            steps.append(SubStep(step="capacity_check", result="SUCCESS", started=t_plan, ended=t_planned,
                                 message=f"needs {req.held().describe()}; agent {agent_name} had "
                                         f"{free_before.describe()} free"))
            t_alloc = _now()
            owner = by_cand[decision.run_id].owner
            if req.cluster.is_cluster and req.cluster.mode == "multi-node":
                peers = (await hooks.peers()) if hooks.peers is not None else {}
                ranks, why = multi_node_plan(req.cluster.size, req.resources, agent_name,
                                             {**peers, agent_name: ledger.free()})
                if not ranks:  # the other agents have no room now: wait, holding nothing
                    out.waiting[decision.run_id] = why
                    _note(hooks, _waiting_record(decision.run_id, why, req, agent_name, steps, "wait"))
                    await hooks.wait(fr, why)
                    continue
                alloc = ledger.try_allocate_cluster(decision.run_id, req.resources, req.cluster.size, queue=queue,
                                                 preset=req.preset, preemptible=req.preemptible, owner=owner,
                                                 ranks=[r for r, a in ranks.items() if a == agent_name])
                if alloc is not None:  # the others are booked by their agents when this run starts (run())
                    names = member_names(req.cluster.size)
                    alloc.remote_members = {names[r]: a for r, a in sorted(ranks.items()) if a != agent_name}
            elif req.cluster.is_cluster:  # every member at once, or none (all or none)
                alloc = ledger.try_allocate_cluster(decision.run_id, req.resources, req.cluster.size, queue=queue,
                                                 preset=req.preset, preemptible=req.preemptible, owner=owner)
            else:
                alloc = ledger.try_allocate(decision.run_id, req.resources, queue=queue, preset=req.preset,
                                            preemptible=req.preemptible, owner=owner)
            if alloc is None:
                out.waiting[decision.run_id] = OTHER_QUEUE_TOOK_IT
                steps.append(SubStep(step="allocation", result="NEED_RETRY", error_code="capacity-taken",
                                     message=OTHER_QUEUE_TOOK_IT, started=t_alloc, ended=_now()))
                _note(hooks, SchedulingRecord(run_id=decision.run_id, phase="schedule", result="NEED_RETRY",
                                              error_code="capacity-taken", message=OTHER_QUEUE_TOOK_IT,
                                              sub_steps=steps))
                await hooks.wait(fr, OTHER_QUEUE_TOOK_IT)
                continue
            where = (f"gpus {','.join(map(str, alloc.gpu_indices)) or 'none'}; "
                     f"cores {','.join(map(str, alloc.cpu_cores)) or 'none'}")
            if alloc.members:
                where = f"cluster of {req.cluster.describe()}: {members_text(alloc)}" + "".join(
                    f" | {m}: on agent {a}" for m, a in alloc.remote_members.items())
            try:
                hooks.booked(alloc)
                hooks.start(fr, alloc, req)
            except Exception as exc:
                ledger.release(decision.run_id)
                steps.append(SubStep(step="allocation", result="FAILURE", error_code="start-failed",
                                     message=f"{where}; handing it to the back end failed: {exc}",
                                     started=t_alloc, ended=_now()))
                _note(hooks, SchedulingRecord(run_id=decision.run_id, phase="schedule", result="FAILURE",
                                              error_code="start-failed", message=str(exc), sub_steps=steps))
                raise
            steps.append(SubStep(step="allocation", result="SUCCESS", message=where, started=t_alloc, ended=_now()))
            _note(hooks, SchedulingRecord(
                run_id=decision.run_id, phase="schedule", result="SUCCESS", from_state="SCHEDULED",
                to_state="PENDING", sub_steps=steps,
                message=f"placed on agent {agent_name} (queue {queue}): {req.held().describe()}; {where}"))
            out.started.append(fr)
        elif decision.action == "reject":
            # 6. say why
            out.rejected[decision.run_id] = decision.reason
            _note(hooks, SchedulingRecord(run_id=decision.run_id, phase="check_precondition", result="GIVE_UP",
                                          error_code="invalid-request", from_state="SCHEDULED", to_state="FAILED",
                                          message=decision.reason, sub_steps=steps))
            await hooks.reject(fr, decision.reason)
        else:
            if req is not None:  # a cluster run says so, with the room it found
                decision = decision.model_copy(update={"reason": waiting_reason(req, agent_name, ledger.free(),
                                                                                decision.reason)})
            out.waiting[decision.run_id] = decision.reason
            if decision.action == "wait" and decision.run_id in by_cand:
                out.unplaced.append(by_cand[decision.run_id].model_copy(update={"name": f"{fr.name} (queue {queue})"}))
            _note(hooks, _waiting_record(decision.run_id, decision.reason, req, agent_name, steps, decision.action))
            await hooks.wait(fr, decision.reason)
    return out


def _held_by_owner(ledger: Ledger, queue: Optional[str] = None) -> dict[str, Resources]:
    return held_by_owner((a.owner, a.resources) for a in ledger.allocations() if queue is None or a.queue == queue)


def _fair_share(spec: QueueSpec, ledger: Ledger) -> Optional[FairShare]:
    return FairShare(held=_held_by_owner(ledger), capacity=ledger.capacity) if spec.fair_share else None


def held_elsewhere(placed: list[tuple[str, Allocation]], me: str, queue: str) -> dict[str, Resources]:
    """What each owner holds of ``queue`` on agents other than ``me``, from their runs' allocations."""
    return held_by_owner((a.owner, a.resources) for agent, a in placed if agent != me and a.queue == queue)


def _quotas(spec: QueueSpec, ledger: Ledger, queue: str,
            elsewhere: Optional[dict[str, Resources]] = None) -> Optional[Quotas]:
    """Owner quotas count what each owner holds of this queue: here (the ledger) and on the queue's other
    agents (``elsewhere``, from their runs' labels), so a quota holds however many agents serve the queue."""
    if spec.owner_quota is None and not spec.owner_quotas:
        return None
    held = held_by_owner([*_held_by_owner(ledger, queue).items(), *(elsewhere or {}).items()])
    return Quotas(caps={o: q.resources() for o, q in spec.owner_quotas.items()},
                  default=spec.owner_quota.resources() if spec.owner_quota else None, held=held)


async def _preempt_for_head(decisions: list[Decision], cands: dict[str, Candidate], runs: dict[str, Any],
                            ledger: Ledger, hooks: DispatchHooks, spec: QueueSpec, out: CycleResult) -> list[Decision]:
    """The first regular run that waits only for capacity preemptible runs hold gets it back from them:
    the fewest, newest such runs are told to stop (SIGTERM, the queue's grace, back to their queue)."""
    if hooks.preempt is None:
        return decisions
    for i, d in enumerate(decisions):
        c = cands.get(d.run_id)
        if d.action != "wait" or c is None or c.request is None or c.preemptible:
            continue
        if not d.reason.startswith("waiting: needs") and "the room is kept" not in d.reason:
            continue  # waits for its turn (FIFO) or its quota: preemption would not start it
        stopping = hooks.stopping()
        holders = [Holder(run_id=a.run_id, resources=a.resources, preemptible=a.preemptible,
                          started=datetime.fromtimestamp(a.booked_at, timezone.utc), stopping=a.run_id in stopping)
                   for a in ledger.allocations()]
        free = ledger.free()
        for prior in decisions[:i]:  # what this cycle starts ahead of it is not free for it
            pc = cands.get(prior.run_id)
            if prior.action == "start" and pc is not None and pc.request is not None:
                r = pc.request.resources
                free = Resources(cpu=max(0.0, free.cpu - r.cpu), memory=max(0, free.memory - r.memory),
                                 gpu=max(0, free.gpu - r.gpu))
        victims = choose_victims(c.request.resources, free, holders)
        if victims is None:
            return decisions  # preemption cannot make room for the head: nothing is preempted
        if victims:
            await hooks.preempt(victims, runs[d.run_id])
            out.preempted.extend(victims)
            why = (f"waiting: preempting {len(victims)} preemptible run(s) to make room "
                   f"(they have {spec.preempt_grace_s:g} s to checkpoint)")
        else:
            why = "waiting: preempted runs are giving their capacity back"
        decisions = [*decisions[:i], d.model_copy(update={"reason": why}), *decisions[i + 1:]]
        return decisions
    return decisions
