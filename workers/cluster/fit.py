"""All-or-nothing placement of cluster runs: every member gets its resources, or none does.

Pure. A cluster run of N members, each with the run's preset, is placed only
when all N fit at once (Backend.AI cluster mode, Kueue's all-or-nothing
admission); nothing is held while it waits, so two cluster runs that could each
take half never deadlock. Single-node puts every member on one agent; multi-node
spreads them over the queue's agents (one per agent first, then doubling up on
the agents with most room).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from prefect_launch.workers.scheduling.resources import Resources

ClusterMode = Literal["single-node", "multi-node"]


class Member(BaseModel):
    """One member of a placed cluster run, with the names launchers expect."""

    rank: int
    name: str  # main1, sub1, sub2, ...
    agent: str


class ClusterPlan(BaseModel):
    members: list[Member] = Field(default_factory=list)
    reason: str = ""

    @property
    def placed(self) -> bool:
        return bool(self.members)


def member_names(size: int) -> list[str]:
    """Stable names: ``main1`` then ``sub1 .. sub{size-1}``."""
    return ["main1"] + [f"sub{i}" for i in range(1, size)]


def _times(r: Resources, n: int) -> Resources:
    return Resources(cpu=round(r.cpu * n, 6), memory=r.memory * n, gpu=r.gpu * n)


def _minus(a: Resources, b: Resources) -> Resources:
    return Resources(cpu=max(0.0, round(a.cpu - b.cpu, 6)), memory=max(0, a.memory - b.memory), gpu=max(0, a.gpu - b.gpu))


def cluster_plan(size: int, request: Resources, free: dict[str, Resources], mode: ClusterMode = "single-node") -> ClusterPlan:
    """Where each of ``size`` members goes, given each agent's free capacity; no members when it cannot."""
    if size < 1:
        return ClusterPlan(reason="cluster size must be at least 1")
    names = member_names(size)
    agents = sorted(free)  # stable order: same inputs, same plan
    if mode == "single-node":
        whole = _times(request, size)
        for a in agents:
            if whole.fits(free[a]):
                return ClusterPlan(members=[Member(rank=i, name=names[i], agent=a) for i in range(size)])
        best = max(agents, key=lambda a: _fit_count(request, free[a]), default=None)
        have = _fit_count(request, free[best]) if best else 0
        return ClusterPlan(reason=f"waiting: cluster of {size} (single-node) needs {whole.describe()} on one agent; "
                               f"the most any agent fits now is {have} member(s)")
    room = {a: free[a] for a in agents}
    placed: list[str] = []
    while len(placed) < size:
        # the agent with fewest members of this run so far, then most room; one per agent first
        fits = [a for a in agents if request.fits(room[a])]
        if not fits:
            total = sum(_fit_count(request, free[a]) for a in agents)
            return ClusterPlan(reason=f"waiting: cluster of {size} (multi-node) needs {size} x {request.describe()}; "
                                   f"the queue's agents fit {total} member(s) now (nothing is held while it waits)")
        a = min(fits, key=lambda x: (placed.count(x), -_fit_count(request, room[x]), x))
        room[a] = _minus(room[a], request)
        placed.append(a)
    return ClusterPlan(members=[Member(rank=i, name=names[i], agent=placed[i]) for i in range(size)])


def fit_count(request: Resources, free: Resources) -> int:
    """How many copies of ``request`` fit in ``free`` (public: dispatch's waiting reason uses it)."""
    return _fit_count(request, free)


def _fit_count(request: Resources, free: Resources) -> int:
    """How many copies of ``request`` fit in ``free``."""
    counts = []
    if request.cpu > 0:
        counts.append(int(free.cpu / request.cpu + 1e-9))
    if request.memory > 0:
        counts.append(free.memory // request.memory)
    if request.gpu > 0:
        counts.append(free.gpu // request.gpu)
    return min(counts) if counts else 10**6
