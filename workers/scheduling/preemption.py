"""Which preemptible runs give their hardware back so a regular run can start.

Pure: the agent passes what it holds and what a waiting run lacks; this picks the
victims. The rule (issue 12): only a non-preemptible run preempts; it takes the
fewest preemptible runs that free enough, and among equally few the newest
(the least work lost); a run already told to stop (inside its grace period) is
never picked twice, but what it will free counts.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Optional

from pydantic import BaseModel

from prefect_launch.workers.scheduling.resources import Resources

PREEMPT_REASON = "preempted by {by}"
MAX_COMBINATIONS = 20_000  # exact search bound; past it, newest-first greedy


class Holder(BaseModel):
    """A run that holds part of the agent's capacity."""

    run_id: str
    resources: Resources
    preemptible: bool = False
    started: Optional[datetime] = None
    stopping: bool = False  # already preempted, inside its grace period


def _add(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=round(a.cpu + b.cpu, 6), memory=a.memory + b.memory, gpu=a.gpu + b.gpu)


def _newest_first(holders: list[Holder]) -> list[Holder]:
    return sorted(holders, key=lambda h: (h.started or datetime.min).replace(tzinfo=None), reverse=True)


def choose_victims(need: Resources, free: Resources, holders: list[Holder],
                   requester_preemptible: bool = False) -> Optional[list[str]]:
    """Run ids to preempt so that ``need`` fits; ``[]`` when it fits already (or will, once
    the runs already stopping are gone); None when preemption cannot make room (or is not allowed)."""
    pending = free
    for h in holders:
        if h.stopping:
            pending = _add(pending, h.resources)
    if need.fits(pending):
        return []
    if requester_preemptible:
        return None
    pool = _newest_first([h for h in holders if h.preemptible and not h.stopping])
    tried = 0
    for k in range(1, len(pool) + 1):
        for combo in itertools.combinations(pool, k):  # newest-first order: the first hit loses least work
            tried += 1
            room = pending
            for h in combo:
                room = _add(room, h.resources)
            if need.fits(room):
                return [h.run_id for h in combo]
            if tried >= MAX_COMBINATIONS:
                return _greedy(need, pending, pool)
    return None


def _greedy(need: Resources, room: Resources, pool: list[Holder]) -> Optional[list[str]]:
    picked: list[str] = []
    for h in pool:
        if not _helps(need, room, h.resources):
            continue
        room = _add(room, h.resources)
        picked.append(h.run_id)
        if need.fits(room):
            return picked
    return None


def _helps(need: Resources, room: Resources, extra: Resources) -> bool:
    """Whether ``extra`` adds to a resource ``need`` still lacks."""
    return any((need.cpu > room.cpu and extra.cpu > 0, need.memory > room.memory and extra.memory > 0,
                need.gpu > room.gpu and extra.gpu > 0))
