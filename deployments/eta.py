"""When will a waiting run start? Replay the agents' placement forward in time.

Each running run is expected to end at its start plus its expected run time (the
median of its job's past runs, else its timeout); waiting runs are placed, in the
agents' own order (priority, then submit time; FIFO holds the queue unless it
backfills), on the first agent where they fit, as capacity frees. Pure: the caller
reads the runs and agents; `predict` only simulates. A run whose predecessors' ends
cannot be estimated gets no prediction rather than a made-up one.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Optional

from pydantic import BaseModel

from prefect_launch.workers.resources import Resources


class Running(BaseModel):
    run_id: str
    agent: str
    resources: Resources
    started: datetime
    expected_s: Optional[float] = None  # None: unknown end


class Waiting(BaseModel):
    run_id: str
    queue: str
    resources: Resources
    priority_rank: int = 99
    submitted: datetime
    expected_s: Optional[float] = None
    not_before: Optional[datetime] = None  # scheduled start (starts-at)
    agent: Optional[str] = None  # pinned


class AgentCap(BaseModel):
    name: str
    queues: list[str]
    capacity: Resources


def _sub(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=a.cpu - b.cpu, memory=a.memory - b.memory, gpu=a.gpu - b.gpu)


def _add(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=a.cpu + b.cpu, memory=a.memory + b.memory, gpu=a.gpu + b.gpu)


def _fits(req: Resources, free: Resources) -> bool:
    return req.cpu <= free.cpu + 1e-9 and req.memory <= free.memory and req.gpu <= free.gpu


def predict(now: datetime, agents: list[AgentCap], running: list[Running], waiting: list[Waiting],
            backfill: Optional[dict[str, bool]] = None, horizon_s: float = 30 * 86400) -> dict[str, Optional[datetime]]:
    """Predicted start of every waiting run (None when it cannot be told)."""
    backfill = backfill or {}
    free = {a.name: a.capacity.model_copy() for a in agents}
    ends: list[tuple[datetime, str, Resources]] = []  # (when, agent, resources) of runs holding capacity
    for r in running:
        if r.agent not in free:
            continue
        free[r.agent] = _sub(free[r.agent], r.resources)
        if r.expected_s is not None:  # unknown: its capacity never comes back in the simulation
            overdue = now + timedelta(seconds=1)  # past its expected end: assume it ends any moment
            ends.append((max(overdue, r.started + timedelta(seconds=r.expected_s)), r.agent, r.resources))
    pending = sorted(waiting, key=lambda w: (w.priority_rank, w.submitted))
    out: dict[str, Optional[datetime]] = {w.run_id: None for w in waiting}
    wakes = {w.not_before for w in waiting if w.not_before and w.not_before > now}
    t = now
    while pending and (t - now).total_seconds() <= horizon_s:
        placed_any = True
        while placed_any:  # place everything that fits now, in the agents' order
            placed_any = False
            held: set[str] = set()  # queues whose head waits (strict FIFO)
            for w in list(pending):
                if w.queue in held:
                    continue
                ready = not (w.not_before and w.not_before > t)
                cands = [a for a in agents if w.queue in a.queues and (w.agent is None or a.name == w.agent)]
                target = next((a for a in cands if _fits(w.resources, free[a.name])), None) if ready else None
                if target is None:
                    if not backfill.get(w.queue):
                        held.add(w.queue)
                    continue
                free[target.name] = _sub(free[target.name], w.resources)
                out[w.run_id] = t
                pending.remove(w)
                placed_any = True
                if w.expected_s is not None:
                    ends.append((t + timedelta(seconds=w.expected_s), target.name, w.resources))
        if not pending:
            break
        future = sorted([e for e in ends if e[0] > t] + [(x, "", None) for x in wakes if x > t],
                        key=lambda e: e[0])
        if not future:
            break  # what would free capacity next has no known end: no honest prediction
        when, agent, res = future[0]
        t = when
        for e in [e for e in ends if e[0] <= t]:  # everything ending by then gives its capacity back
            ends.remove(e)
            free[e[1]] = _add(free[e[1]], e[2])
    return out


def median_runtime(durations: list[float]) -> Optional[float]:
    if not durations:
        return None
    s = sorted(durations)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
