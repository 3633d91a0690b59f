"""Pin a started run to its allocation and enforce its memory limit.

CPU affinity comes from the ledger's cores; memory is enforced by a cgroup v1
memory group when the hierarchy is writable (as root on these machines), and
always watched, so a machine without writable cgroups still stops a run that
goes over and says why.

Memory is counted once, as the kernel charges it (:func:`run_memory`, used by the
watch here and by the sampler, hence by summaries and the monitor):

* with the run's memory group: the group's charge less the inactive file cache
  (``memory.usage_in_bytes - total_inactive_file``, the "working set" that
  kubelet and ``docker stats`` report). The kernel reclaims that cache before its
  OOM killer acts, so this is the figure that meets the limit when a run is in
  trouble; the peak is the kernel's own ``memory.max_usage_in_bytes`` less the
  same cache;
* without one: the sum of PSS over the run's process tree
  (``/proc/PID/smaps_rollup``), so pages that forked workers share (DataLoader
  workers, multiprocessing) are split between them instead of counted in each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import psutil

from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.settings import env_text
from prefect_launch.workers.scheduling.resources import format_size


def cgroup_memory_root() -> Path:
    """Root of the cgroup v1 memory hierarchy (LAUNCH_CGROUP_MEMORY_ROOT, read when used)."""
    return Path(env_text("LAUNCH_CGROUP_MEMORY_ROOT", "/sys/fs/cgroup/memory"))


logger = logging.getLogger("prefect_launch.limits")


def run_environment(alloc: Allocation, agent: str) -> dict[str, str]:
    """Environment a run gets from its allocation (set before its process starts).

    Its GPUs are the ledger's NVML indices, which are PCI bus order; CUDA numbers devices fastest
    first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so that is always set with them (on a host with
    mixed GPUs, index 1 would otherwise be another run's device)."""
    threads = str(max(1, int(alloc.resources.cpu))) if alloc.resources.cpu else "1"
    env = {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
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


def gpu_device_ids(indices: Iterable[int], uuids: Optional[dict[int, str]] = None) -> list[str]:
    """How a container's device request names the ledger's GPUs (pure): by UUID where NVML gave one
    for every GPU (a UUID names one device whatever the enumeration order), else by NVML index."""
    indices = list(indices)
    uuids = uuids or {}
    if indices and all(uuids.get(i) for i in indices):
        return [uuids[i] for i in indices]
    return [str(i) for i in indices]


def container_gpu_env(device_ids: list[str]) -> dict[str, str]:
    """``CUDA_*`` inside a container given ``device_ids`` (pure): it sees only those devices, renumbered
    from 0, so the host's indices would name the wrong ones; UUIDs still name the right ones, and
    without them the container's own ordinals, in bus order, do."""
    uuids = all(d.startswith(("GPU-", "MIG-")) for d in device_ids)
    visible = device_ids if uuids else [str(k) for k in range(len(device_ids))]
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(visible)}


def physical_cores(cores: list[int]) -> list[int]:
    """Map ledger cores onto this machine's CPUs (declared capacity may exceed them)."""
    avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(psutil.cpu_count() or 1))
    return sorted({avail[c % len(avail)] for c in cores})


@dataclass(frozen=True)
class MemoryReading:
    """Memory a run holds, counted once: ``used`` now, the best known ``peak``, and how it was measured."""

    used: int
    peak: int
    source: str  # "cgroup" (the run's memory group) or "pss" (its process tree)


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class MemoryGroup:
    """A cgroup v1 memory group for one run; ``None`` from ``create`` when not writable."""

    def __init__(self, path: Path):
        self.path = path

    @staticmethod
    def path_for(run_id: str) -> Path:
        return cgroup_memory_root() / "prefect-launch" / str(run_id)

    @classmethod
    def create(cls, run_id: str, limit_bytes: int) -> Optional["MemoryGroup"]:
        base = cgroup_memory_root() / "prefect-launch"
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

    @classmethod
    def open(cls, run_id: str) -> Optional["MemoryGroup"]:
        """The run's existing group (as left by this or an earlier agent), else ``None``; changes nothing."""
        path = cls.path_for(run_id)
        return cls(path) if (path / "memory.usage_in_bytes").exists() else None

    def add(self, pid: int) -> bool:
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
            return True
        except OSError as exc:
            logger.warning("could not move pid %s into %s: %s", pid, self.path, exc)
            return False

    def pids(self) -> set[int]:
        try:
            return {int(x) for x in (self.path / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    def limit(self) -> Optional[int]:
        return _read_int(self.path / "memory.limit_in_bytes")

    def reading(self) -> Optional[MemoryReading]:
        """The group's charge less its inactive file cache, and the kernel's peak less the same."""
        usage = _read_int(self.path / "memory.usage_in_bytes")
        if usage is None:
            return None
        inactive_file = 0
        try:
            for line in (self.path / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "total_inactive_file":
                    inactive_file = int(value)
                    break
        except (OSError, ValueError):
            pass
        used = max(0, usage - inactive_file)
        peak = max(used, (_read_int(self.path / "memory.max_usage_in_bytes") or 0) - inactive_file)
        return MemoryReading(used=used, peak=peak, source="cgroup")

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
        """The kernel's own maximum charge of the group (page cache included)."""
        return _read_int(self.path / "memory.max_usage_in_bytes") or 0

    def remove(self, retry_s: float = 0.0) -> bool:
        """Remove the (empty) group; with ``retry_s``, keep trying in a background thread that long
        (processes of a killed run leave it only once they are reaped). False if not removed now."""
        try:
            self.path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if retry_s > 0:
                threading.Thread(target=self._remove_later, args=(retry_s,), daemon=True,
                                 name=f"launch-cgroup-rm-{self.path.name[:8]}").start()
            return False

    def _remove_later(self, retry_s: float) -> None:
        deadline = time.monotonic() + retry_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                continue
        logger.warning("memory group %s still holds processes %s; left in place", self.path, sorted(self.pids()))


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def process_pss(p: psutil.Process) -> int:
    """One process's proportional set size (its RSS when smaps cannot be read)."""
    try:
        return p.memory_full_info().pss
    except (psutil.AccessDenied, AttributeError, NotImplementedError):
        return p.memory_info().rss


def tree_pss(procs: Iterable[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += process_pss(p)
        except psutil.Error:
            pass
    return total


def run_memory(pid: int, group: Optional[MemoryGroup] = None,
               procs: Optional[Iterable[psutil.Process]] = None) -> MemoryReading:
    """The memory a run holds, counted once.

    ``group``: the run's memory group, when it has one (its charge is used);
    else the PSS of ``procs`` (default: ``pid`` and its descendants).
    """
    if group is not None:
        reading = group.reading()
        if reading is not None:
            return reading
    used = tree_pss(_tree(pid) if procs is None else procs)
    return MemoryReading(used=used, peak=used, source="pss")


def tree_rss(pid: int) -> int:
    """Sum of RSS over the tree (counts shared pages in every process; see :func:`run_memory`)."""
    total = 0
    for p in _tree(pid):
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
        self.peak_rss = 0  # peak memory as counted by run_memory (the name predates PSS/cgroup counting)
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
        self._start_watch(pid)

    def attach(self, pid: int) -> None:
        """Re-adopt a run that is still running (a restarted agent): reopen its memory group and watch again.

        The group is reopened as it is (its limit is not rewritten, no process is moved) and
        only when ``pid`` is in it; CPU affinity is left alone (it was set when the run started).
        """
        self.pid = pid
        if self.use_cgroup:
            group = MemoryGroup.open(self.run_id)
            if group is not None and pid in group.pids():
                self.group = group
            elif group is not None:
                logger.warning("run %s: pid %s is not in its memory group %s; watching its processes instead",
                               self.run_id, pid, group.path)
        self._start_watch(pid)

    def _start_watch(self, pid: int) -> None:
        limit = self.alloc.resources.memory
        if limit:
            self._task = asyncio.get_running_loop().create_task(self._watch(pid, limit))

    def _kernel_reason(self) -> str:
        return (
            f"memory limit exceeded: the run reached its {format_size(self.alloc.resources.memory)} "
            "limit and was killed by the kernel (cgroup OOM); submit with a larger --memory or preset"
        )

    async def _watch(self, pid: int, limit: int) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not psutil.pid_exists(pid):
                return
            if self.group is not None and self.group.oom_killed():
                # the kernel killed one of the run's processes: stop the rest too (like Kubernetes'
                # memory.oom.group), so a main process never waits forever on a killed worker
                self.kill_reason = self._kernel_reason()
                kill_tree(pid)
                return
            mem = run_memory(pid, self.group)
            self.peak_rss = max(self.peak_rss, mem.peak)
            if mem.used > limit:
                self.kill_reason = (
                    f"memory limit exceeded: the run used {format_size(mem.used)} of its "
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
                self.kill_reason = self._kernel_reason()
            reading = self.group.reading()
            if reading is not None:
                self.peak_rss = max(self.peak_rss, reading.peak)
            self.group.remove(retry_s=30.0)
        return self.kill_reason
