"""Pin a started run to its allocation and enforce its memory limit.

CPU affinity comes from the ledger's cores; memory is enforced by a cgroup v1
memory group when the hierarchy is writable (as root on these machines), and
always watched by summing the RSS of the run's process tree, so a machine
without writable cgroups still stops a run that goes over and says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Optional

import psutil

from prefect_launch.workers.ledger import Allocation
from prefect_launch.workers.resources import format_size

CGROUP_MEMORY_ROOT = Path(os.environ.get("LAUNCH_CGROUP_MEMORY_ROOT", "/sys/fs/cgroup/memory"))
logger = logging.getLogger("prefect_launch.limits")


def run_environment(alloc: Allocation, agent: str) -> dict[str, str]:
    """Environment a run gets from its allocation (set before its process starts)."""
    threads = str(max(1, int(alloc.resources.cpu))) if alloc.resources.cpu else "1"
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in alloc.gpu_indices),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
        "LAUNCH_AGENT": agent,
        "LAUNCH_CPU": f"{alloc.resources.cpu:g}",
        "LAUNCH_MEMORY": str(alloc.resources.memory),
        "LAUNCH_GPU": str(alloc.resources.gpu),
        "LAUNCH_CPU_CORES": ",".join(str(c) for c in physical_cores(alloc.cpu_cores)),
    }
    if alloc.preset:
        env["LAUNCH_PRESET"] = alloc.preset
    if alloc.resources.shm_size:
        env["LAUNCH_SHM_SIZE"] = str(alloc.resources.shm_size)
    return env


def physical_cores(cores: list[int]) -> list[int]:
    """Map ledger cores onto this machine's CPUs (declared capacity may exceed them)."""
    avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(psutil.cpu_count() or 1))
    return sorted({avail[c % len(avail)] for c in cores})


class MemoryGroup:
    """A cgroup v1 memory group for one run; ``None`` from ``create`` when not writable."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, run_id: str, limit_bytes: int) -> Optional["MemoryGroup"]:
        base = CGROUP_MEMORY_ROOT / "prefect-launch"
        try:
            base.mkdir(exist_ok=True)
            path = base / str(run_id)
            path.mkdir(exist_ok=True)
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                try:
                    memsw.write_text(str(limit_bytes))
                except OSError:
                    pass
            return cls(path)
        except OSError as exc:
            logger.debug("cgroup memory group unavailable: %s", exc)
            return None

    def add(self, pid: int) -> bool:
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
            return True
        except OSError as exc:
            logger.warning("could not move pid %s into %s: %s", pid, self.path, exc)
            return False

    def oom_killed(self) -> bool:
        try:
            text = (self.path / "memory.oom_control").read_text()
            fields = dict(line.split() for line in text.splitlines() if line.strip())
            if int(fields.get("oom_kill", 0)) > 0:
                return True
            return int((self.path / "memory.failcnt").read_text()) > 0 and int(fields.get("under_oom", 0)) > 0
        except (OSError, ValueError):
            return False

    def peak(self) -> int:
        try:
            return int((self.path / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def kill_tree(pid: int) -> None:
    """SIGKILL the run's process group (Prefect starts runs in their own session)."""
    try:
        pgid = os.getpgid(pid)
        if pgid == os.getpgid(0):  # never signal the agent's own group
            raise PermissionError("run shares the agent's process group")
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            for p in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
                p.kill()
        except psutil.Error:
            pass


class RunLimits:
    """Applies the allocation to a started process and watches its memory."""

    def __init__(self, run_id: str, alloc: Allocation, use_cgroup: bool = True, interval_s: float = 0.5):
        self.run_id = run_id
        self.alloc = alloc
        self.interval_s = interval_s
        self.group: Optional[MemoryGroup] = None
        self.use_cgroup = use_cgroup
        self.kill_reason: Optional[str] = None
        self.peak_rss = 0
        self._task: Optional[asyncio.Task] = None
        self.pid: Optional[int] = None

    def apply(self, pid: int) -> None:
        self.pid = pid
        cores = physical_cores(self.alloc.cpu_cores) if self.alloc.cpu_cores else []
        if cores:
            try:
                psutil.Process(pid).cpu_affinity(cores)
            except (psutil.Error, AttributeError, OSError) as exc:
                logger.warning("could not set CPU affinity for pid %s: %s", pid, exc)
        limit = self.alloc.resources.memory
        if limit and self.use_cgroup:
            self.group = MemoryGroup.create(self.run_id, limit)
            if self.group and not self.group.add(pid):
                self.group.remove()
                self.group = None
        if limit:
            self._task = asyncio.get_running_loop().create_task(self._watch(pid, limit))

    async def _watch(self, pid: int, limit: int) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not psutil.pid_exists(pid):
                return
            rss = tree_rss(pid)
            self.peak_rss = max(self.peak_rss, rss)
            if rss > limit:
                self.kill_reason = (
                    f"memory limit exceeded: the run used {format_size(rss)} of its "
                    f"{format_size(limit)} limit and was stopped by the agent; "
                    "submit with a larger --memory or preset"
                )
                kill_tree(pid)
                return

    def finish(self) -> Optional[str]:
        """Stop watching, clean up; return why the run was stopped, if it was."""
        if self._task:
            self._task.cancel()
        if self.group is not None:
            if self.kill_reason is None and self.group.oom_killed():
                self.kill_reason = (
                    f"memory limit exceeded: the run reached its {format_size(self.alloc.resources.memory)} "
                    "limit and was killed by the kernel (cgroup OOM); submit with a larger --memory or preset"
                )
            self.peak_rss = max(self.peak_rss, self.group.peak())
            self.group.remove()
        return self.kill_reason
