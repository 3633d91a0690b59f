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

from prefect_launch.workers.scheduling.resources import Resources


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
    """Never below zero: Prefect can show a run as still claimed after its agent has let its capacity go."""
    return Resources(cpu=max(0.0, a.cpu - b.cpu), memory=max(0, a.memory - b.memory), gpu=max(0, a.gpu - b.gpu))


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
    """One run (finished, or still holding capacity: ``ended`` None), as `expected_runtime` and
    `learn_overhead` need it."""

    deployment_id: Optional[str] = None
    shape: Optional[str] = None
    queue: Optional[str] = None
    agent: Optional[str] = None
    resources: Optional[Resources] = None
    created: Optional[datetime] = None
    claimed: Optional[datetime] = None  # Pending (read from its state history; only for the newest runs)
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


def learn_overhead(runs: list[PastRun], capacity: Optional[dict[str, Resources]] = None,
                   max_gap_s: float = 120.0) -> Overhead:
    """A queue's overhead from its recent runs (claims known for the newest; ends where finished).

    start_s: median claim -> start.
    release_s: median, over claims that waited for room, of room -> claim, where "room" is when the
    agent's capacity last became enough for the run: its ledger replayed from the runs' claims (read,
    or start - start_s) and ends, from the oldest end in ``runs`` (every run holding capacity then is
    in ``runs``). Without the agent's capacity or the runs' resources: the last end on the agent
    before the claim (an underestimate where several runs share an agent).
    claim_s: median submit -> claim of the runs that found room on arrival: the agents' poll; 0 when
    no recent run did.
    """
    capacity = capacity or {}
    starts = [(r.started - r.claimed).total_seconds() for r in runs if r.started and r.claimed]
    start_s = max(0.0, median_runtime(starts) or 0.0)
    gaps: list[float] = []
    claims: list[float] = []
    by_agent: dict[str, list[PastRun]] = {}
    for r in runs:
        if r.agent:
            by_agent.setdefault(r.agent, []).append(r)
    for agent, rs in by_agent.items():
        if agent in capacity and all(r.resources is not None for r in rs):
            _replay(rs, capacity[agent], start_s, max_gap_s, gaps, claims)
        else:
            _last_end(rs, max_gap_s, gaps, claims)
    return Overhead(start_s=start_s, release_s=max(0.0, median_runtime(gaps) or 0.0),
                    claim_s=max(0.0, median_runtime(claims) or 0.0))


def _replay(rs: list[PastRun], cap: Resources, start_s: float, max_gap_s: float,
            gaps: list[float], claims: list[float]) -> None:
    """Replay one agent's ledger: capacity freed by ends goes to the following claims, earliest first."""
    def claim_of(r: PastRun) -> Optional[datetime]:
        return r.claimed or (r.started - _s(start_s) if r.started else None)

    ends = [r.ended for r in rs if r.ended]
    if not ends:
        return
    t0 = min(ends)  # every run holding capacity at t0 ended after it (or still runs): all in rs
    free = cap.model_copy()
    events: list[tuple[datetime, int, PastRun]] = []
    for r in rs:
        c = claim_of(r)
        if c is None:
            continue
        if c <= t0 and (r.ended is None or r.ended > t0):
            free = _sub(free, r.resources)
        if c > t0:
            events.append((c, 1, r))
            if r.ended and c <= r.ended:
                events.append((r.ended, 0, r))
        elif r.ended and r.ended > t0:
            events.append((r.ended, 0, r))
    events.sort(key=lambda e: (e[0], e[1]))  # ends first at equal times
    zero = Resources(cpu=0, memory=0, gpu=0)
    chunks: list[tuple[datetime, Resources]] = [(t0, free)]  # capacity not yet claimed, since when
    for t, kind, r in events:
        if kind == 0:
            chunks.append((t, r.resources))
            continue
        got, room = zero, None
        while chunks and not _fits(r.resources, got):
            when, res = chunks.pop(0)
            got, room = _add(got, res), when
        if not _fits(r.resources, got):  # the replay cannot explain this claim: no sample from it
            chunks = []
            continue
        left = _sub(got, r.resources)
        if left.cpu > 1e-9 or left.memory > 0 or left.gpu > 0:
            chunks.insert(0, (room, left))
        if r.claimed is None or r.created is None or room is None:
            continue
        if room > r.created and room > t0:  # it waited for that capacity
            if (t - room).total_seconds() <= max_gap_s:
                gaps.append((t - room).total_seconds())
        elif room <= r.created:  # the capacity was there when it arrived
            claims.append(max(0.0, (t - r.created).total_seconds()))


def _last_end(rs: list[PastRun], max_gap_s: float, gaps: list[float], claims: list[float]) -> None:
    for r in rs:
        if not (r.claimed and r.created):
            continue
        before = [o.ended for o in rs if o is not r and o.ended and o.ended <= r.claimed]
        if before and r.created < max(before):
            if (r.claimed - max(before)).total_seconds() <= max_gap_s:
                gaps.append((r.claimed - max(before)).total_seconds())
        elif not any(o is not r and o.ended and r.created <= o.ended <= r.claimed for o in rs):
            claims.append(max(0.0, (r.claimed - r.created).total_seconds()))
