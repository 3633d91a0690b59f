"""How dispatch treats a cluster run (pure): the gang is planned as one request of all its members.

A single-node gang of N members fits exactly when N x the preset fits the agent's free
capacity (cpu, memory and GPU counts are interchangeable on one box), so the ordinary
plan - priority, FIFO/backfill, quotas, preemption - sees the run as that total and the
ledger books it in one step (`Ledger.try_allocate_gang`). Nothing is booked while it
waits, so two gangs that could each take half never deadlock.
"""

from __future__ import annotations

from prefect_launch.workers.gang import fit_count
from prefect_launch.workers.ledger import Allocation
from prefect_launch.workers.resolve import ResolvedRequest
from prefect_launch.workers.resources import Resources


def as_candidate(request: ResolvedRequest) -> ResolvedRequest:
    """The request the planner sees: the whole gang's resources for a cluster run, else unchanged."""
    if not request.cluster.is_cluster:
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
