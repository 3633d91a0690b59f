"""The agent's capacity ledger: what is allocated to which run, and what is free.

One ledger is shared by every queue an agent serves, so a box polled through
two queues is never oversubscribed. GPU indices and CPU cores are handed out
disjointly; release is idempotent because Prefect's worker may report the end
of a run more than once on error paths.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Optional

from pydantic import BaseModel, Field

from prefect_launch.workers.scheduling.resources import Resources


class MemberAlloc(BaseModel):
    """One member of a cluster run: its own GPUs and cores out of the run's allocation."""

    rank: int
    name: str  # main1, sub1, ...
    resources: Resources
    gpu_indices: list[int] = []
    cpu_cores: list[int] = []


class Allocation(BaseModel):
    run_id: str
    resources: Resources
    gpu_indices: list[int] = []
    cpu_cores: list[int] = []
    queue: Optional[str] = None
    preset: Optional[str] = None
    preemptible: bool = False  # may be preempted for a regular run (issue 12)
    owner: Optional[str] = None  # for quotas and fair share
    booked_at: float = Field(default_factory=time.time)  # newest preemptible runs go first
    members: list[MemberAlloc] = []  # a cluster run's members on this agent; ``resources`` is then their sum
    cluster_size: int = 0  # all members of the run, here and on other agents (multi-node)
    remote_members: dict[str, str] = {}  # multi-node: member name -> the agent that hosts it


class Ledger:
    def __init__(self, capacity: Resources, gpu_indices: Optional[list[int]] = None):
        self.capacity = capacity
        self._gpu_ids = list(gpu_indices) if gpu_indices is not None else list(range(capacity.gpu))
        self._core_ids = list(range(max(1, math.ceil(capacity.cpu))))
        self._allocs: dict[str, Allocation] = {}
        self._lock = threading.Lock()

    def free(self) -> Resources:
        with self._lock:
            return self._free_locked()

    def _free_locked(self) -> Resources:
        used_cpu = sum(a.resources.cpu for a in self._allocs.values())
        used_mem = sum(a.resources.memory for a in self._allocs.values())
        used_gpu = sum(a.resources.gpu for a in self._allocs.values())
        return Resources(
            cpu=max(0.0, round(self.capacity.cpu - used_cpu, 6)),
            memory=max(0, self.capacity.memory - used_mem),
            gpu=max(0, self.capacity.gpu - used_gpu),
        )

    def allocations(self) -> list[Allocation]:
        with self._lock:
            return list(self._allocs.values())

    def get(self, run_id: str) -> Optional[Allocation]:
        with self._lock:
            return self._allocs.get(str(run_id))

    def try_allocate(self, run_id: str, request: Resources, queue: str | None = None,
                     preset: str | None = None, preemptible: bool = False,
                     owner: str | None = None) -> Optional[Allocation]:
        """Reserve ``request`` for ``run_id`` if it fits now; None otherwise."""
        run_id = str(run_id)
        with self._lock:
            if run_id in self._allocs:
                return self._allocs[run_id]
            gpus = self._free_gpus_for(request)
            if gpus is None:
                return None
            alloc = Allocation(run_id=run_id, resources=request, gpu_indices=gpus,
                               cpu_cores=self._pick_cores(request.cpu), queue=queue, preset=preset,
                               preemptible=preemptible, owner=owner)
            self._allocs[run_id] = alloc
            return alloc

    def try_allocate_cluster(self, run_id: str, member: Resources, size: int, queue: str | None = None,
                          preset: str | None = None, preemptible: bool = False,
                          owner: str | None = None, ranks: Optional[list[int]] = None) -> Optional[Allocation]:
        """Book all ``size`` members of a cluster run at once, each with its own GPUs and cores, or nothing.

        One allocation holds them (released together); ``members`` says which GPUs and cores each
        member gets. Nothing is booked when the whole cluster does not fit, so waiting cluster runs hold nothing.
        ``ranks``: only these members of the cluster live on this agent (multi-node).
        """
        from prefect_launch.workers.cluster.fit import member_names

        run_id = str(run_id)
        mine = sorted(ranks) if ranks is not None else list(range(size))
        n = len(mine)
        total = member.times(n)
        with self._lock:
            if run_id in self._allocs:
                return self._allocs[run_id]
            gpus = self._free_gpus_for(total)
            if gpus is None:
                return None
            extra: dict[int, float] = {}
            members = []
            names = member_names(size)
            for i, rank in enumerate(mine):
                cores = self._pick_cores(member.cpu, extra)
                for c in cores:
                    extra[c] = extra.get(c, 0.0) + member.cpu / max(1, len(cores))
                members.append(MemberAlloc(rank=rank, name=names[rank], resources=member, cpu_cores=cores,
                                           gpu_indices=gpus[i * member.gpu:(i + 1) * member.gpu]))
            alloc = Allocation(run_id=run_id, resources=total, gpu_indices=gpus,
                               cpu_cores=sorted({c for m in members for c in m.cpu_cores}), queue=queue,
                               preset=preset, preemptible=preemptible, owner=owner, members=members,
                               cluster_size=size)
            self._allocs[run_id] = alloc
            return alloc

    def _free_gpus_for(self, request: Resources) -> Optional[list[int]]:
        """The GPU indices ``request`` would get now (lowest free first), or None when it does not fit.
        Call with the lock held."""
        if not request.fits(self._free_locked()):
            return None
        used = {i for a in self._allocs.values() for i in a.gpu_indices}
        gpus = [i for i in self._gpu_ids if i not in used][: request.gpu]
        return gpus if len(gpus) == request.gpu else None

    def _pick_cores(self, cpu: float, extra: Optional[dict[int, float]] = None) -> list[int]:
        """The least loaded cores; ``extra`` is load booked in this same call (a cluster run's earlier members)."""
        want = max(1, math.ceil(cpu)) if cpu > 0 else 0
        load = {c: 0.0 for c in self._core_ids}
        for a in self._allocs.values():
            share = a.resources.cpu / max(1, len(a.cpu_cores))
            for c in a.cpu_cores:
                load[c] = load.get(c, 0.0) + share
        for c, v in (extra or {}).items():
            load[c] = load.get(c, 0.0) + v
        return sorted(sorted(load, key=lambda c: (load[c], c))[:want])

    def adopt(self, alloc: Allocation) -> Allocation:
        """Restore an allocation a previous life of this agent made (restart recovery).

        Kept exactly as it was, GPU indices and cores included, even past today's
        capacity: the hardware is held by a live process whatever we declare now.
        """
        with self._lock:
            held = {i for a in self._allocs.values() if a.run_id != alloc.run_id for i in a.gpu_indices}
            clash = held & set(alloc.gpu_indices)
            if clash:
                raise ValueError(f"run {alloc.run_id} holds GPUs {sorted(clash)} that another run holds")
            self._allocs[alloc.run_id] = alloc
            return alloc

    def release(self, run_id: str) -> Optional[Allocation]:
        with self._lock:
            return self._allocs.pop(str(run_id), None)
