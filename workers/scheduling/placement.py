"""Placement decisions: which scheduled runs an agent starts now, and why the rest wait.

Pure: given the runs in queue order and the agent's free/total capacity, return
one decision per run. Strict FIFO by default (a head run that does not fit
holds the runs behind it); backfill lets smaller runs pass. Runs this agent can
never take (pinned to another agent, bigger than this box) do not hold the
queue, since another agent may take them.
"""

from __future__ import annotations

from datetime import datetime
from itertools import groupby
from typing import Literal, Optional

from pydantic import BaseModel

from prefect_launch.workers.scheduling.fair_share import Quota, drf_order, over_quota
from prefect_launch.workers.scheduling.resolve import ResolvedRequest
from prefect_launch.workers.scheduling.resources import Resources

Action = Literal["start", "wait", "skip", "reject"]


class Candidate(BaseModel):
    run_id: str
    name: str = ""
    priority_rank: int = 0  # Prefect work-queue priority: 1 is highest
    submitted: Optional[datetime] = None
    request: Optional[ResolvedRequest] = None
    error: Optional[str] = None  # a validation error found by the worker
    owner: Optional[str] = None  # the run's owner: tag, for quotas and fair share

    @property
    def preemptible(self) -> bool:
        return bool(self.request and self.request.preemptible)


class Decision(BaseModel):
    run_id: str
    action: Action
    reason: str = ""


# The runs right behind a FIFO head are told its name; further back the reason stays the same as the
# head changes, so a deep queue does not cost a label write per waiting run each time a run starts
# (300 waiting runs x 3 agents made every start cost ~900 writes on a SQLite server). Their position
# and predicted start are in `queue ls` / `runs ls`.
FIFO_NAMED = 5

def explain(short: list[tuple[str, str, str]], agent_name: str, what: str) -> str:
    """One line, e.g. ``waiting: needs gpu=2, agent w1 has 1 free``."""
    return "waiting: " + "; ".join(f"needs {n}={need}, agent {agent_name} has {have} {what}" for n, need, have in short)


def order(candidates: list[Candidate], fair: Optional["FairShare"] = None) -> list[Candidate]:
    """Priority first, regular before preemptible within a level (a preempted run keeps its submit time
    and must not win the room back from the run that preempted it), then submit time; with ``fair``,
    owners by dominant resource share within each group (FIFO within an owner)."""
    far = datetime.max
    ranked = sorted(
        candidates,
        key=lambda c: (c.priority_rank, c.preemptible, (c.submitted.replace(tzinfo=None) if c.submitted else far)),
    )
    if fair is None:
        return ranked
    out: list[Candidate] = []
    for _, group in groupby(ranked, key=lambda c: (c.priority_rank, c.preemptible)):
        out.extend(drf_order(list(group), owner_of=lambda c: c.owner,
                             request_of=lambda c: c.request.resources if c.request else None,
                             held=fair.held, capacity=fair.capacity))
    return out


class FairShare(BaseModel):
    """What each owner holds now and the capacity shares are measured against."""

    held: dict[str, Resources] = {}
    capacity: Resources


class Quotas(BaseModel):
    """Owner quotas of the queue: ``of(owner)`` is the cap, ``held`` what each owner holds now."""

    caps: dict[str, Quota] = {}
    default: Optional[Quota] = None
    held: dict[str, Resources] = {}

    def of(self, owner: Optional[str]) -> Optional[Quota]:
        return self.caps.get(owner or "") or self.default


def plan(
    candidates: list[Candidate],
    free: Resources,
    total: Resources,
    agent_name: str,
    backfill: bool = False,
    agents_offline: Optional[dict[str, str]] = None,
    agents_known: Optional[set[str]] = None,
    foreign: Optional[list[Candidate]] = None,
    fair: Optional[FairShare] = None,
    quotas: Optional[Quotas] = None,
) -> list[Decision]:
    """``agents_offline`` maps an offline agent to why ('offline since ...'); ``agents_known`` the names
    seen at all, so a run pinned to an agent that is gone or never existed says so instead of waiting mutely.

    ``foreign`` are the waiting runs of the agent's other queues (their ``name`` says which queue): they
    are planned in the same priority order but get no decision here (their own queue starts them), so a
    ``low`` run of this queue never takes the room a ``critical`` run of another queue is about to take.
    ``fair`` orders owners by dominant share inside a priority level; ``quotas`` make a run whose owner
    would go over its cap wait with that reason (it does not hold the queue: others may go).
    """
    decisions: list[Decision] = []
    free = free.model_copy()
    head: Optional[Candidate] = None
    mine = {id(c) for c in candidates}
    kept: list[Candidate] = []  # runs of other queues that go first and fit: their room is kept
    held = dict(quotas.held) if quotas else {}
    behind = 0  # runs waiting behind the head (FIFO)
    for c in order([*candidates, *(foreign or [])], fair):
        if id(c) not in mine:
            before = free
            head, free = _plan_foreign(c, head, free, total, agent_name, backfill)
            if free is not before:
                kept.append(c)
            continue
        if c.error or c.request is None:
            decisions.append(Decision(run_id=c.run_id, action="reject", reason=c.error or "no resources resolved"))
            continue
        req = c.request.resources
        if c.request.agent and c.request.agent != agent_name:
            pinned = c.request.agent
            if agents_offline and pinned in agents_offline:
                why = f"waiting: pinned to agent {pinned}, which is {agents_offline[pinned]}"
            elif agents_known is not None and pinned not in agents_known:
                why = f"waiting: pinned to agent {pinned}, which has never been seen on this server"
            else:
                why = f"waiting: pinned to agent {pinned}"
            decisions.append(Decision(run_id=c.run_id, action="skip", reason=why))
            continue
        too_big = req.shortfall(total)
        if too_big:
            decisions.append(Decision(run_id=c.run_id, action="skip",
                                      reason=explain(too_big, agent_name, "in total")))
            continue
        if head is not None and not backfill:
            behind += 1
            why = (f"waiting: queued behind {head.name or head.run_id} (FIFO)" if behind <= FIFO_NAMED
                   else "waiting: queued behind earlier runs (FIFO)")
            decisions.append(Decision(run_id=c.run_id, action="wait", reason=why))
            continue
        over = over_quota(held.get(c.owner or "", Resources()), req, quotas.of(c.owner), f"owner {c.owner}") \
            if quotas and quotas.of(c.owner) else None
        if over:
            decisions.append(Decision(run_id=c.run_id, action="wait", reason=over))
            continue
        short = req.shortfall(free)
        if short:
            room = free
            for k in kept:
                r = k.request.resources
                room = Resources(cpu=room.cpu + r.cpu, memory=room.memory + r.memory, gpu=room.gpu + r.gpu)
            why = (f"waiting: the room is kept for {kept[0].name or kept[0].run_id}, which goes first (priority)"
                   if kept and req.fits(room) else explain(short, agent_name, "free"))
            decisions.append(Decision(run_id=c.run_id, action="wait", reason=why))
            if head is None:
                head = c
            continue
        free = Resources(cpu=free.cpu - req.cpu, memory=free.memory - req.memory, gpu=free.gpu - req.gpu)
        if quotas is not None:
            mine_held = held.get(c.owner or "", Resources())
            held[c.owner or ""] = Resources(cpu=mine_held.cpu + req.cpu, memory=mine_held.memory + req.memory,
                                            gpu=mine_held.gpu + req.gpu)
        decisions.append(Decision(run_id=c.run_id, action="start", reason=f"starting on agent {agent_name}"))
    return decisions


def _plan_foreign(c: Candidate, head: Optional[Candidate], free: Resources, total: Resources,
                  agent_name: str, backfill: bool) -> tuple[Optional[Candidate], Resources]:
    """A run of another queue of this agent, ahead of what follows: it keeps the room it fits in, or
    becomes the head the runs behind it wait for (FIFO)."""
    if c.error or c.request is None or (c.request.agent and c.request.agent != agent_name):
        return head, free
    req = c.request.resources
    if req.shortfall(total) or (head is not None and not backfill):
        return head, free
    if req.shortfall(free):
        return (head or c), free
    return head, Resources(cpu=free.cpu - req.cpu, memory=free.memory - req.memory, gpu=free.gpu - req.gpu)
