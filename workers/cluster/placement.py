"""How dispatch treats a cluster run (pure): the cluster is planned as one request of all its members.

A single-node cluster run of N members fits exactly when N x the preset fits the agent's free
capacity (cpu, memory and GPU counts are interchangeable on one box), so the ordinary
plan - priority, FIFO/backfill, quotas, preemption - sees the run as that total and the
ledger books it in one step (`Ledger.try_allocate_cluster`). Nothing is booked while it
waits, so two cluster runs that could each take half never deadlock.
"""

from __future__ import annotations

from prefect_launch.workers.cluster.fit import fit_count
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.scheduling.resolve import ResolvedRequest
from prefect_launch.workers.scheduling.resources import Resources


def as_candidate(request: ResolvedRequest) -> ResolvedRequest:
    """The request the planner sees: the whole cluster's resources for a single-node cluster run; main1's for
    a multi-node one (the other members' agents are asked when it is placed); else unchanged."""
    if not request.cluster.is_cluster or request.cluster.mode == "multi-node":
        return request
    return request.model_copy(update={"resources": request.held()})


def waiting_reason(request: ResolvedRequest, agent: str, free: Resources, plan_reason: str) -> str:
    """A cluster run's one-line reason in place of the planner's ``waiting: needs ...`` (others unchanged)."""
    c = request.cluster
    if not c.is_cluster or not plan_reason.startswith("waiting: needs"):
        return plan_reason
    fits = min(fit_count(request.resources, free), c.size)
    return (f"waiting: cluster of {c.size} ({c.mode}) needs {c.size} x {request.resources.describe()} on one agent; "
            f"agent {agent} has {free.describe()} free, room for {fits} member(s); nothing is held while it waits")


def members_text(alloc: Allocation) -> str:
    """Each member's placement, e.g. ``main1: gpus 0; cores 0 | sub1: gpus 1; cores 1``."""
    return " | ".join(f"{m.name}: gpus {','.join(map(str, m.gpu_indices)) or 'none'}; "
                      f"cores {','.join(map(str, m.cpu_cores)) or 'none'}" for m in alloc.members)


def multi_node_plan(size: int, member: Resources, me: str, free: dict[str, Resources]) -> tuple[dict[int, str], str]:
    """Which agent hosts each rank of a multi-node cluster run that agent ``me`` leads: rank 0 (main1) on ``me``,
    the rest one per agent first, then on the agents with most room. ({}, reason) when it does not fit."""
    room = dict(free)
    if me not in room or not member.fits(room[me]):
        return {}, (f"waiting: cluster of {size} (multi-node) needs {member.describe()} for main1 on agent {me}; "
                    "nothing is held while it waits")
    placed: dict[int, str] = {0: me}
    room[me] = _minus(room[me], member)
    for rank in range(1, size):
        fits = [a for a in sorted(room) if member.fits(room[a])]
        if not fits:
            return {}, (f"waiting: cluster of {size} (multi-node) needs {size} x {member.describe()}; the queue's "
                        f"online agents have room for {len(placed)} member(s) now; nothing is held while it waits")
        a = min(fits, key=lambda x: (list(placed.values()).count(x), -fit_count(member, room[x]), x))
        room[a] = _minus(room[a], member)
        placed[rank] = a
    return placed, ""


def _minus(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=max(0.0, round(a.cpu - b.cpu, 6)), memory=max(0, a.memory - b.memory),
                     gpu=max(0, a.gpu - b.gpu))
