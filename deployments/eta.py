"""When will a waiting run start? Replay the agents' placement forward in time.

A run holds its agent's capacity from the agent's claim (Prefect's Pending) until its
process has exited and the agent claims the next run, which is longer than its run time
(Running to end). Per queue, `Overhead` says by how much, as learnt from recent runs:

    claim (Pending) --start_s--> start (Running) --expected_s--> end --release_s--> next claim

Each running run frees its capacity at its start + expected run time (its job's past
runs, capped by its timeout) + release_s; a claimed run not yet running, at its claim +
start_s + expected + release_s. Waiting runs are placed, in the agents' own order
(priority, then submit time; FIFO holds the queue unless it backfills), on the first
agent where they fit, as capacity frees; a run placed at time t is predicted to start at
t + start_s (+ claim_s when it finds room at once: the agents' next poll).

Pure: the caller reads the runs, agents and history; `predict` only simulates. A run
whose predecessors' ends cannot be estimated gets no prediction rather than a made-up one.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.resources import Resources


class Running(BaseModel):
    """A run holding capacity: running (``claimed`` None) or claimed and starting (``claimed`` set)."""

    run_id: str
    agent: Optional[str] = None  # None: claimed, but by which agent is not known yet
    queue: Optional[str] = None  # where ``agent`` is None: placed on the first agent of the queue it fits
    resources: Resources
    started: Optional[datetime] = None  # Running since (None while it is only claimed)
    claimed: Optional[datetime] = None  # Pending since
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


class Overhead(BaseModel):
    """What a queue's runs hold beyond their run time, in seconds (learnt; 0 when there is no history)."""

    claim_s: float = 0.0  # submit -> claim when the run finds room at once (the agents' poll)
    start_s: float = 0.0  # claim (Pending) -> start (Running): the agent starts the process, the engine the flow
    release_s: float = 0.0  # end -> the next claim on the capacity it held: process exit, release, next poll


def _sub(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=a.cpu - b.cpu, memory=a.memory - b.memory, gpu=a.gpu - b.gpu)


def _add(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=a.cpu + b.cpu, memory=a.memory + b.memory, gpu=a.gpu + b.gpu)


def _fits(req: Resources, free: Resources) -> bool:
    return req.cpu <= free.cpu + 1e-9 and req.memory <= free.memory and req.gpu <= free.gpu


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def predict(now: datetime, agents: list[AgentCap], running: list[Running], waiting: list[Waiting],
            backfill: Optional[dict[str, bool]] = None, horizon_s: float = 30 * 86400,
            overhead: Optional[dict[str, Overhead]] = None) -> dict[str, Optional[datetime]]:
    """Predicted start of every waiting run (None when it cannot be told), and of every claimed one.

    A running run's prediction is its start; a claimed one's, its claim + start_s (never before now).
    """
    backfill = backfill or {}
    overhead = overhead or {}
    none = Overhead()
    free = {a.name: a.capacity.model_copy() for a in agents}
    ends: list[tuple[datetime, str, Resources]] = []  # (when capacity is back, agent, resources)
    out: dict[str, Optional[datetime]] = {}
    for r in running:
        agent = r.agent
        if agent is None:  # claimed moments ago, not yet told where: the first agent of its queue it fits on
            agent = next((a.name for a in agents if r.queue in a.queues and _fits(r.resources, free[a.name])), None)
        if agent not in free:
            continue
        oh = overhead.get(r.queue or "", none) if r.queue else none
        free[agent] = _sub(free[agent], r.resources)
        start = r.started or max(now, (r.claimed or now) + _s(oh.start_s))
        out[r.run_id] = start
        if r.expected_s is not None:  # unknown: its capacity never comes back in the simulation
            back = start + _s(r.expected_s + oh.release_s)
            ends.append((max(now + _s(1), back), agent, r.resources))  # overdue: back any moment
    pending = sorted(waiting, key=lambda w: (w.priority_rank, w.submitted))
    out.update({w.run_id: None for w in waiting})
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
                oh = overhead.get(w.queue, none)
                free[target.name] = _sub(free[target.name], w.resources)
                claim = t + _s(oh.claim_s) if t == now else t  # room now: the next poll; later: release_s has it
                start = claim + _s(oh.start_s)
                out[w.run_id] = start
                pending.remove(w)
                placed_any = True
                if w.expected_s is not None:
                    ends.append((start + _s(w.expected_s + oh.release_s), target.name, w.resources))
        if not pending:
            break
        future = sorted([e for e in ends if e[0] > t] + [(x, "", None) for x in wakes if x > t],
                        key=lambda e: e[0])
        if not future:
            break  # what would free capacity next has no known end: no honest prediction
        t = future[0][0]
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


# Parameters that name one run's own resources rather than the work it does (a session's free port).
NOT_SHAPE = frozenset({"ports"})


def job_shape(deployment_id: Any, parameters: Optional[dict]) -> str:
    """What makes two runs the same job: the deployment and its parameters (a session's command, ...)."""
    params = {k: v for k, v in (parameters or {}).items() if k not in NOT_SHAPE}
    return f"{deployment_id}|{json.dumps(params, sort_keys=True, default=str)}"


class PastRun(BaseModel):
    """One finished run, as `expected_runtime` and `learn_overhead` need it."""

    deployment_id: Optional[str] = None
    shape: Optional[str] = None
    queue: Optional[str] = None
    agent: Optional[str] = None
    created: Optional[datetime] = None
    claimed: Optional[datetime] = None  # Pending
    started: Optional[datetime] = None  # Running
    ended: Optional[datetime] = None
    run_s: Optional[float] = None  # Running time (Prefect's total_run_time)


def expected_runtime(shape: str, deployment_id: Any, past: list[PastRun], timeout_s: Optional[float],
                     last: int = 20) -> Optional[float]:
    """Median of the job shape's last ``last`` run times, else the deployment's, else the timeout; never
    above the timeout (the agent ends the run there). ``past`` newest first."""
    def med(rows: list[PastRun]) -> Optional[float]:
        return median_runtime([r.run_s for r in rows if r.run_s and r.run_s > 0][:last])

    expected = med([r for r in past if r.shape == shape])
    if expected is None:
        expected = med([r for r in past if r.deployment_id == str(deployment_id)])
    if expected is None:
        return timeout_s
    return min(expected, timeout_s) if timeout_s is not None else expected


def learn_overhead(runs: list[PastRun], max_gap_s: float = 120.0) -> Overhead:
    """A queue's overhead from its recent runs (with claim and start times; ends where known).

    start_s: median claim -> start. release_s: median, over runs that were claimed after waiting
    for room, of the gap between the last end on the same agent before the claim and the claim.
    claim_s: median submit -> claim of the runs that found room (no run on their agent ended while they
    waited to be claimed): the agents' poll; 0 when no recent run found room.
    """
    starts = [(r.started - r.claimed).total_seconds() for r in runs if r.started and r.claimed]
    gaps = []
    for r in runs:
        if not (r.claimed and r.created and r.agent):
            continue
        before = [o.ended for o in runs if o is not r and o.agent == r.agent and o.ended and o.ended <= r.claimed]
        if not before:
            continue
        last_end = max(before)
        if r.created < last_end and (r.claimed - last_end).total_seconds() <= max_gap_s:  # it waited for that end
            gaps.append((r.claimed - last_end).total_seconds())
    claims = [max(0.0, (r.claimed - r.created).total_seconds()) for r in runs
              if r.claimed and r.created and r.agent
              and not any(o is not r and o.agent == r.agent and o.ended and r.created <= o.ended <= r.claimed
                          for o in runs)]
    return Overhead(start_s=max(0.0, median_runtime(starts) or 0.0), release_s=max(0.0, median_runtime(gaps) or 0.0),
                    claim_s=median_runtime(claims) or 0.0)
