"""Placement decisions: which scheduled runs an agent starts now, and why the rest wait.

Pure: given the runs in queue order and the agent's free/total capacity, return
one decision per run. Strict FIFO by default (a head run that does not fit
holds the runs behind it); backfill lets smaller runs pass. Runs this agent can
never take (pinned to another agent, bigger than this box) do not hold the
queue, since another agent may take them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Optional

from pydantic import BaseModel

from prefect_launch.workers.resolve import ResolvedRequest
from prefect_launch.workers.resources import Resources

Action = Literal["start", "wait", "skip", "reject"]


class Candidate(BaseModel):
    run_id: str
    name: str = ""
    priority_rank: int = 0  # Prefect work-queue priority: 1 is highest
    submitted: Optional[datetime] = None
    request: Optional[ResolvedRequest] = None
    error: Optional[str] = None  # a validation error found by the worker


class Decision(BaseModel):
    run_id: str
    action: Action
    reason: str = ""


def explain(short: list[tuple[str, str, str]], agent_name: str, what: str) -> str:
    """One line, e.g. ``waiting: needs gpu=2, agent w1 has 1 free``."""
    return "waiting: " + "; ".join(f"needs {n}={need}, agent {agent_name} has {have} {what}" for n, need, have in short)


def order(candidates: list[Candidate]) -> list[Candidate]:
    """Priority first, then submit time (stable for equal keys)."""
    far = datetime.max
    return sorted(
        candidates,
        key=lambda c: (c.priority_rank, (c.submitted.replace(tzinfo=None) if c.submitted else far)),
    )


def plan(
    candidates: list[Candidate],
    free: Resources,
    total: Resources,
    agent_name: str,
    backfill: bool = False,
    agents_offline: Optional[dict[str, str]] = None,
    agents_known: Optional[set[str]] = None,
    foreign: Optional[list[Candidate]] = None,
) -> list[Decision]:
    """``agents_offline`` maps an offline agent to why ('offline since ...'); ``agents_known`` the names
    seen at all, so a run pinned to an agent that is gone or never existed says so instead of waiting mutely.

    ``foreign`` are the waiting runs of the agent's other queues (their ``name`` says which queue): they
    are planned in the same priority order but get no decision here (their own queue starts them), so a
    ``low`` run of this queue never takes the room a ``critical`` run of another queue is about to take.
    """
    decisions: list[Decision] = []
    free = free.model_copy()
    head: Optional[Candidate] = None
    mine = {id(c) for c in candidates}
    kept: list[Candidate] = []  # runs of other queues that go first and fit: their room is kept
    for c in order([*candidates, *(foreign or [])]):
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
            decisions.append(Decision(run_id=c.run_id, action="wait",
                                      reason=f"waiting: queued behind {head.name or head.run_id} (FIFO)"))
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
