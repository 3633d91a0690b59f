"""The sub members of a cluster run on the process back end: start, watch, stop them together.

main1 is the run's Prefect engine (started by the worker as for any run); sub1.. are extra
processes of the agent (`cluster_member`), each in its own session, pinned to its own cores and
GPUs, writing to a log file (not a pipe held by the agent). One member that exits non-zero ends
the run; the worker stops the others through this class.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Optional

import psutil

from prefect_launch.workers.scheduling.ledger import MemberAlloc
from prefect_launch.workers.agent.limits import physical_cores


NO_EXIT_STATUS = -1000  # a member that ended while no agent was its parent, without an exit file (a signal)


def exit_file(log_path: Path) -> Path:
    """Where a member records its exit status (`cluster_member.record_exit`): beside its log."""
    return log_path.with_suffix(".exit")


class FoundProcess:
    """A member a restarted agent found by its command line: not its child, so `poll` reads the exit status
    the member recorded (`NO_EXIT_STATUS` when it left none: killed by a signal)."""

    def __init__(self, proc: Optional[psutil.Process], exit_path: Path):
        self._proc, self._exit_path = proc, exit_path
        self.pid = proc.pid if proc is not None else 0
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        if self._proc is not None:
            try:
                if self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE:
                    return None
            except psutil.Error:
                pass
        try:
            self.returncode = int(self._exit_path.read_text().strip())
        except (OSError, ValueError):
            self.returncode = NO_EXIT_STATUS
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            _signal_session(self.pid, signal.SIGKILL)


@dataclass
class SubMember:
    member: MemberAlloc
    proc: "subprocess.Popen | FoundProcess"
    log_path: Path

    @property
    def name(self) -> str:
        return self.member.name


@dataclass
class ClusterProcesses:
    """A run's sub members; ``failed`` is the first member that exited non-zero (name, exit code)."""

    run_id: str
    subs: list[SubMember] = field(default_factory=list)
    failed: Optional[tuple[str, int]] = None
    stopping: bool = False

    def start(self, member: MemberAlloc, env: dict[str, str], log_path: Path) -> SubMember:
        """Start ``member`` running the run's flow function (see `cluster_member`)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        exit_file(log_path).unlink(missing_ok=True)
        env = {**env, "LAUNCH_MEMBER_EXIT_FILE": str(exit_file(log_path))}
        with open(log_path, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", MEMBER_MODULE, self.run_id],
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd="/")
        pin_cores(proc.pid, member.cpu_cores)
        sub = SubMember(member=member, proc=proc, log_path=log_path)
        self.subs.append(sub)
        return sub

    def remove(self) -> None:
        """What is left of the members once their ends are read: nothing for processes (containers are
        removed, see `ClusterContainers.remove`)."""

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.subs]

    def alive(self) -> list[SubMember]:
        return [s for s in self.subs if s.proc.poll() is None]

    async def watch(self, on_failure: Callable[[str, int], Awaitable[None]], interval_s: float = 0.2) -> None:
        """Until every sub member has exited: the first non-zero exit (not one we caused) is reported once."""
        while self.alive():
            await asyncio.sleep(interval_s)
            if self.failed is None and not self.stopping:
                for s in self.subs:
                    code = s.proc.poll()
                    if code not in (None, 0):
                        self.failed = (s.name, code)
                        await on_failure(s.name, code)
                        break
        if self.failed is None and not self.stopping:
            bad = next(((s.name, s.proc.returncode) for s in self.subs if s.proc.returncode not in (None, 0)), None)
            if bad:
                self.failed = bad
                await on_failure(*bad)

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every sub member to exit on its own; True when they have."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return not self.alive()

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM each live member's session, then SIGKILL what is left after ``grace_s``."""
        self.stopping = True
        for s in self.alive():
            _signal_session(s.proc.pid, signal.SIGTERM)
        if not await self.wait(grace_s):
            for s in self.alive():
                _signal_session(s.proc.pid, signal.SIGKILL)
            await self.wait(5.0)

    def forget_files(self) -> None:
        """Drop the members' logs and exit files (once nothing needs them)."""
        for s in self.subs:
            s.log_path.unlink(missing_ok=True)
            exit_file(s.log_path).unlink(missing_ok=True)

    def first_failure(self) -> Optional[tuple[str, int]]:
        """The failure to report: the one seen while watching, else any non-zero exit we did not cause."""
        if self.failed is not None:
            return self.failed
        if self.stopping:
            return None
        return next(((s.name, s.proc.returncode) for s in self.subs if s.proc.poll() not in (None, 0)), None)


MEMBER_MODULE = "prefect_launch.workers.cluster.member"


def find_members(run_id: str) -> list[psutil.Process]:
    """The live sub members of ``run_id`` by their command line (a restarted agent has no handle on them)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if MEMBER_MODULE in cmd and str(run_id) in cmd:
            found.append(p)
    return found


def adopt_members(run_id: str, members: list[MemberAlloc], log_of: Callable[[str], Path]) -> ClusterProcesses:
    """A restarted agent's handle on ``run_id``'s members it started before: the live ones found by command
    line and member name, the others as ended (their exit status from their exit file)."""
    live: dict[str, psutil.Process] = {}
    for p in find_members(run_id):
        try:
            live.setdefault(p.environ().get("LAUNCH_CLUSTER_MEMBER", ""), p)
        except (psutil.Error, OSError):
            continue
    procs = ClusterProcesses(run_id=str(run_id))
    for m in members:
        log_path = log_of(m.name)
        procs.subs.append(SubMember(member=m, proc=FoundProcess(live.get(m.name), exit_file(log_path)),
                                    log_path=log_path))
    return procs


async def stop_found(procs: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGTERM, ``grace_s``, SIGKILL: for members found by `find_members` (not our children)."""
    for p in procs:
        _signal_session(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        await asyncio.sleep(0.2)
    for p in procs:
        if p.is_running():
            _signal_session(p.pid, signal.SIGKILL)


def describe_exit(code: int) -> str:
    """``code 3`` or ``code -9 (SIGKILL)``."""
    if code == NO_EXIT_STATUS:
        return "no exit status (it ended while its agent was away and left none: killed by a signal)"
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def pin_cores(pid: int, cores: list[int]) -> None:
    if not cores:
        return
    try:
        psutil.Process(pid).cpu_affinity(physical_cores(cores))
    except (psutil.Error, AttributeError, OSError):
        pass


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass
