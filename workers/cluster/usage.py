"""Per-member figures of a cluster run, next to the run's own (which are the sum over its members).

The run's sampler measures every process of every member as one run. This splits the same
readings by member: each process belongs to the member whose root process it descends from
(main1 is the run's own process, sub1.. the agent's member processes). CPU seconds are counted
exactly as the run's are (a reaped child's time moves into its parent, so it is not counted twice);
memory is the member's processes' PSS (shared pages split between sharers, so members do not count
one page each), RSS where PSS cannot be read; GPU use is read for the member's own GPUs only.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import psutil
from pydantic import BaseModel


class MemberUsage(BaseModel):
    """What one member of a cluster run used, over the run."""

    member: str
    pid: int
    gpu_indices: list[int] = []
    cpu_seconds: float = 0.0
    peak_memory_bytes: Optional[int] = None
    memory_measure: Optional[str] = None  # "pss" or "rss"
    avg_gpu_util_pct: Optional[float] = None
    peak_gpu_mem_bytes: Optional[int] = None
    samples: int = 0


def member_of(pid: int, roots: dict[int, str], parent: dict[int, Optional[int]], limit: int = 64) -> Optional[str]:
    """The member whose root ``pid`` descends from (following ``parent``), or None."""
    cur: Optional[int] = pid
    for _ in range(limit):
        if cur is None:
            return None
        if cur in roots:
            return roots[cur]
        cur = parent.get(cur)
    return None


def cpu_by_member(tot_now: dict[int, float], prev_tot: dict[int, float], parent_now: dict[int, Optional[int]],
                  prev_parent: dict[int, Optional[int]], roots: dict[int, str]) -> dict[str, float]:
    """CPU seconds since the last tick per member, by the run-level rule (see the sampler's ``_tick``)."""
    out: dict[str, float] = {name: 0.0 for name in roots.values()}
    for pid, tot in tot_now.items():
        m = member_of(pid, roots, parent_now)
        if m is not None:
            out[m] += tot - prev_tot.get(pid, 0.0)
    for pid, prev in prev_tot.items():
        if pid not in tot_now and prev_parent.get(pid) in tot_now:  # reaped by a tracked parent
            m = member_of(pid, roots, prev_parent)
            if m is not None:
                out[m] -= prev
    return {m: max(0.0, v) for m, v in out.items()}


def _memory(proc: psutil.Process) -> tuple[int, str]:
    try:
        return int(proc.memory_full_info().pss), "pss"
    except (psutil.AccessDenied, AttributeError):
        return int(proc.memory_info().rss), "rss"


class MemberTracker:
    """Accumulates `MemberUsage` per member, fed by the sampler's ticks (its sampling thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots: dict[int, str] = {}
        self._usage: dict[str, MemberUsage] = {}
        self._gpu_wall: dict[str, float] = {}
        self._gpu_sum: dict[str, float] = {}

    @property
    def active(self) -> bool:
        return bool(self._roots)

    def add_root(self, pid: int, member: str, gpu_indices: Optional[list[int]] = None) -> None:
        with self._lock:
            self._roots[int(pid)] = member
            self._usage.setdefault(member, MemberUsage(member=member, pid=int(pid), gpu_indices=list(gpu_indices or [])))

    def tick(self, tot_now: dict[int, float], prev_tot: dict[int, float], parent_now: dict[int, Optional[int]],
             prev_parent: dict[int, Optional[int]], procs: dict[int, psutil.Process], wall: float,
             nvml: Any = None) -> None:
        with self._lock:
            roots = dict(self._roots)
        cpu = cpu_by_member(tot_now, prev_tot, parent_now, prev_parent, roots)
        pids_of: dict[str, list[int]] = {m: [] for m in roots.values()}
        for pid in tot_now:
            m = member_of(pid, roots, parent_now)
            if m is not None:
                pids_of[m].append(pid)
        for m, pids in pids_of.items():
            u = self._usage[m]
            u.cpu_seconds = round(u.cpu_seconds + cpu.get(m, 0.0), 3)
            if not pids:
                continue
            used, how = 0, None
            for pid in pids:
                p = procs.get(pid)
                if p is None:
                    continue
                try:
                    b, how = _memory(p)
                    used += b
                except psutil.Error:
                    continue
            if how is not None:
                u.peak_memory_bytes = max(u.peak_memory_bytes or 0, used)
                u.memory_measure = how if u.memory_measure in (None, how) else "rss"
            if nvml is not None and u.gpu_indices and getattr(nvml, "available", False):
                try:
                    g = nvml.usage(u.gpu_indices, pids)
                except Exception:
                    g = None
                if g is not None and g.util_pct is not None:
                    self._gpu_sum[m] = self._gpu_sum.get(m, 0.0) + g.util_pct * wall
                    self._gpu_wall[m] = self._gpu_wall.get(m, 0.0) + wall
                    u.avg_gpu_util_pct = round(self._gpu_sum[m] / self._gpu_wall[m], 2)
                    if g.mem_bytes is not None:
                        u.peak_gpu_mem_bytes = max(u.peak_gpu_mem_bytes or 0, g.mem_bytes)
            u.samples += 1

    def results(self) -> dict[str, dict]:
        with self._lock:
            return {m: u.model_dump() for m, u in sorted(self._usage.items())}
