"""One run's process tree, read once per sampler tick: CPU seconds, parents, disk I/O and network bytes.

The tree is the run's root pid and every descendant (found through one scan of the process table that every
sampler ticking within ``_SCAN_MAX_AGE_S`` shares), plus roots added with `ProcessTree.add` (a cluster run's
other members). Descendants that get re-parented stay tracked. CPU time per process is utime+stime plus the
CPU of children it has reaped (cutime+cstime, one read of /proc/PID/stat), so short-lived children that exit
between two ticks are still counted, minus what was already counted while they lived.
"""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple, Optional

import psutil

from prefect_launch.compat.psutil import ppid_map

# One scan of the process table serves every sampler that ticks within
# _SCAN_MAX_AGE_S of it (ticks are aligned to a common grid, so N runs cost one scan).
_SCAN_MAX_AGE_S = 0.1
_scan_lock = threading.Lock()
_scan_cache: tuple[float, dict[int, list[int]]] = (-1e9, {})


def children_map() -> dict[int, list[int]]:
    """parent pid -> child pids, from a scan at most _SCAN_MAX_AGE_S old."""
    global _scan_cache
    with _scan_lock:
        t, m = _scan_cache
        now = time.monotonic()
        if now - t <= _SCAN_MAX_AGE_S:
            return m
        children: dict[int, list[int]] = {}
        for child, parent in ppid_map().items():
            children.setdefault(parent, []).append(child)
        _scan_cache = (time.monotonic(), children)
        return children


def net_ns(pid: int | str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def net_dev_bytes(pid: int) -> Optional[tuple[int, int]]:
    """(rx, tx) bytes over the non-loopback interfaces of pid's network namespace."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    rx = tx = 0
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            continue
        parts = rest.split()
        if len(parts) >= 9:
            rx += int(parts[0])
            tx += int(parts[8])
    return rx, tx


class TreeReading(NamedTuple):
    """One read of the tree: per live pid its CPU seconds, its parent, and its (read, write) bytes."""

    cpu_s: dict[int, float]
    parent: dict[int, Optional[int]]
    io: dict[int, tuple[int, int]]
    io_ok: bool  # at least one process's I/O counters could be read


class ProcessTree:
    """The processes of one run and the previous tick's reading (the deltas are against it)."""

    def __init__(self, root: int):
        self.root = int(root)
        self.procs: dict[int, psutil.Process] = {}
        self.prev = TreeReading({}, {}, {}, False)
        self.prev_m: Optional[float] = None
        self.primed = False
        self._own_netns = False
        self._prev_net: Optional[tuple[int, int]] = None

    def watch_network(self) -> None:
        """Network bytes are the run's only when it has a network namespace of its own (a container)."""
        own, theirs = net_ns("self"), net_ns(self.root)
        self._own_netns = bool(own and theirs and own != theirs)

    def add(self, pid: int) -> None:
        """Also read ``pid`` and its descendants."""
        if int(pid) == self.root:
            return
        try:
            self.procs.setdefault(int(pid), psutil.Process(int(pid)))
        except psutil.Error:
            pass

    def discover(self) -> None:
        """Add every descendant of the tracked processes (one /proc scan)."""
        # before priming the root is the only known process; afterwards only the processes
        # we track (never a bare pid again: it may have been reused by another process)
        roots = set(self.procs) if self.primed else {self.root}
        if not roots:
            return
        try:
            if ppid_map is not None:
                children = children_map()
                todo = list(roots)
                seen = set(todo)
                while todo:
                    p = todo.pop()
                    for c in children.get(p, ()):
                        if c not in seen:
                            seen.add(c)
                            todo.append(c)
                found = seen
            else:  # pragma: no cover
                found = set(roots)
                for r in list(roots):
                    try:
                        found.update(c.pid for c in psutil.Process(r).children(recursive=True))
                    except psutil.Error:
                        pass
        except Exception:
            found = set(roots)
        for pid in found:
            if pid not in self.procs:
                try:
                    self.procs[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass

    def read(self) -> TreeReading:
        """Discover, then read every tracked process (the gone ones are dropped)."""
        self.discover()
        reading = TreeReading({}, {}, {}, False)
        io_ok = False
        for pid, p in list(self.procs.items()):
            try:
                with p.oneshot():
                    ct = p.cpu_times()
                    reading.cpu_s[pid] = ct.user + ct.system + ct.children_user + ct.children_system
                    reading.parent[pid] = p.ppid()
                    try:
                        io = p.io_counters()
                        reading.io[pid] = (io.read_bytes, io.write_bytes)
                        io_ok = True
                    except (psutil.AccessDenied, AttributeError, NotImplementedError):
                        pass
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                del self.procs[pid]
        return reading._replace(io_ok=io_ok)

    def cpu_since(self, now: TreeReading) -> float:
        """CPU seconds the tree used since the previous reading."""
        cpu = 0.0
        for pid, tot in now.cpu_s.items():
            cpu += tot - self.prev.cpu_s.get(pid, 0.0)
        for pid, prev in self.prev.cpu_s.items():
            if pid not in now.cpu_s and self.prev.parent.get(pid) in now.cpu_s:
                # reaped by a tracked parent: its full CPU is now in the parent's
                # children times; what we counted while it lived must not count twice
                cpu -= prev
        return max(0.0, cpu)

    def io_since(self, now: TreeReading) -> tuple[int, int]:
        """(read, written) bytes since the previous reading."""
        rd = wr = 0
        for pid, (r, w) in now.io.items():
            pr, pw = self.prev.io.get(pid, (0, 0))
            rd += max(0, r - pr)
            wr += max(0, w - pw)
        return rd, wr

    def remember(self, now_m: float, reading: TreeReading) -> None:
        self.prev_m = now_m
        self.prev = reading

    def net_since(self) -> Optional[tuple[int, int]]:
        """(rx, tx) bytes since the previous call, when the run has its own network namespace."""
        if not self._own_netns:
            return None
        cur = net_dev_bytes(self.root)
        prev, self._prev_net = self._prev_net, cur
        if cur is None or prev is None:
            return None
        return max(0, cur[0] - prev[0]), max(0, cur[1] - prev[1])
