"""The agent's on-disk journal of what it holds: one small file per allocated run.

Prefect knows which runs are Pending/Running on an agent, but not which process
holds them; the ledger lives in the agent's memory and dies with it. The journal
is written before a run's process receives its order and removed when its
capacity is released, so an agent killed at any moment (SIGKILL, OOM) leaves
behind exactly the runs it may still hold, with the pid and process start time
that tell a live run from a recycled pid.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, Field

from prefect_launch.workers.scheduling.ledger import Allocation


class JournalEntry(BaseModel):
    run_id: str
    agent: str
    allocation: Allocation
    pid: Optional[int] = None
    pid_started: Optional[float] = None  # psutil create_time of pid, to reject a recycled pid
    started_at: Optional[datetime] = None
    container: Optional[str] = None  # docker back end: the container's id (its labels name the run too)
    written_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


def default_journal_dir(agent: str) -> Path:
    """``LAUNCH_STATE_DIR`` or ``$PREFECT_HOME/launch/agents``, one folder per agent name."""
    base = os.environ.get("LAUNCH_STATE_DIR")
    if not base:
        home = os.environ.get("PREFECT_HOME") or str(Path.home() / ".prefect")
        base = str(Path(home) / "launch" / "agents")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", agent)[:200] or "agent"
    return Path(base) / safe


class RunJournal:
    def __init__(self, agent: str, directory: Optional[Path] = None):
        self.agent = agent
        self.dir = Path(directory) if directory else default_journal_dir(agent)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def write(self, entry: JournalEntry) -> None:
        """Atomic replace (write, fsync, rename) so a crash leaves the old or the new entry."""
        data = entry.model_dump_json().encode()
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._path(entry.run_id))

    def record(self, alloc: Allocation) -> JournalEntry:
        entry = JournalEntry(run_id=alloc.run_id, agent=self.agent, allocation=alloc)
        self.write(entry)
        return entry

    def set_pid(self, run_id: str, pid: int, pid_started: Optional[float], container: Optional[str] = None) -> None:
        entry = self.get(run_id)
        if entry is None:
            return
        if entry.pid == pid and entry.container == container:  # a warm start journals its pid before the order
            return
        self.write(entry.model_copy(update={"pid": pid, "pid_started": pid_started, "container": container,
                                            "started_at": datetime.now(timezone.utc)}))

    def get(self, run_id: str) -> Optional[JournalEntry]:
        try:
            return JournalEntry.model_validate_json(self._path(run_id).read_text())
        except (OSError, ValueError):
            return None

    def log_path(self, run_id: str) -> Path:
        """Where the run's engine writes stdout/stderr (kept until its capacity is released)."""
        return self.dir / f"{run_id}.log"

    def remove(self, run_id: str) -> None:
        for path in (self._path(run_id), self.log_path(run_id)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def entries(self) -> list[JournalEntry]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(JournalEntry.model_validate_json(p.read_text()))
            except (OSError, ValueError):
                continue  # a torn file cannot happen with os.replace; a foreign one is ignored
        return out


def alloc_label(alloc: Allocation, agent: str, pid: Optional[int], pid_started: Optional[float]) -> str:
    """The machine-readable twin of ``launch.placement``: enough to rebuild the ledger from Prefect."""
    return json.dumps({"agent": agent, "alloc": alloc.model_dump(mode="json"), "pid": pid,
                       "pid_started": pid_started}, separators=(",", ":"))


def parse_alloc_label(value: object) -> Optional[tuple[str, Allocation, Optional[int], Optional[float]]]:
    if not isinstance(value, str) or not value.startswith("{"):
        return None
    try:
        data = json.loads(value)
        return data["agent"], Allocation.model_validate(data["alloc"]), data.get("pid"), data.get("pid_started")
    except (ValueError, KeyError, TypeError):
        return None
