"""Rebuilding an agent's ledger after it restarts: re-adopt live runs, crash vanished ones.

The truth is (1) what Prefect shows as Pending/Running/Cancelling on this agent
(worker-name label, ``launch.alloc`` label) and (2) which processes still exist.
The agent's journal (workers/agent/journal.py) names the pid and its start time;
a pid whose start time differs, or whose environment names another run, is a
recycled pid and never taken for the run. Decisions are a pure function of
those facts (`decide`) so every case is tested without processes or servers.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any, Literal, Optional

import psutil
from pydantic import BaseModel

from prefect_launch.workers.cluster.protocol import run_of_booking
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.journal import JournalEntry, RunJournal, parse_alloc_label
from prefect_launch.workers.agent.tags import ALLOC_LABEL, WORKER_LABEL  # noqa: F401  (re-exported)

logger = logging.getLogger("prefect_launch.recovery")

LIVE_STATES = ("PENDING", "RUNNING", "CANCELLING")
GONE_REASON = "agent {agent} restarted; the run's process was gone"
NEVER_STARTED = "agent {agent} restarted before the run's process started; the run is back in its queue"

Action = Literal["adopt", "crash", "requeue", "forget"]


class Found(BaseModel):
    """One run this agent may hold, as the journal and Prefect describe it."""

    run_id: str
    state: Optional[str] = None  # Prefect state type; None when the server no longer has the run
    alloc: Optional[Allocation] = None
    pid: Optional[int] = None
    pid_started: Optional[float] = None
    started_at: Optional[datetime] = None
    queue: Optional[str] = None
    container: Optional[str] = None


class Recovery(BaseModel):
    run_id: str
    action: Action
    reason: str = ""
    alloc: Optional[Allocation] = None
    pid: Optional[int] = None
    pid_started: Optional[float] = None
    started_at: Optional[datetime] = None
    container: Optional[str] = None


def process_is_run(pid: Optional[int], pid_started: Optional[float], run_id: str) -> bool:
    """True when ``pid`` is alive, started when recorded, and (where readable) names ``run_id``."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if pid_started is not None and abs(proc.create_time() - pid_started) > 0.05:
            return False  # the pid was recycled
        try:
            env_run = proc.environ().get("PREFECT__FLOW_RUN_ID")
        except (psutil.AccessDenied, OSError):
            env_run = None
        if env_run and env_run != run_id:
            return False
        return True
    except psutil.Error:
        return False


def pid_start_time(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def find_run_processes(run_ids: set[str]) -> dict[str, tuple[int, float]]:
    """Processes whose environment or cgroup names one of ``run_ids`` (cold-started engines).

    Covers the moment between a process being spawned and its pid reaching the journal.
    """
    found: dict[str, tuple[int, float]] = {}
    if not run_ids:
        return found
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            rid = proc.environ().get("PREFECT__FLOW_RUN_ID")
            if rid not in run_ids:
                try:
                    cg = open(f"/proc/{proc.pid}/cgroup").read()
                    rid = next((r for r in run_ids if f"prefect-launch/{r}" in cg), None)
                except OSError:
                    rid = None
            if rid in run_ids and proc.status() != psutil.STATUS_ZOMBIE:
                prev = found.get(rid)
                if prev is None or proc.info["create_time"] < prev[1]:  # the root, not a child
                    found[rid] = (proc.pid, proc.info["create_time"])
        except (psutil.Error, OSError):
            continue
    return found


def decide(found: list[Found], alive: dict[str, bool], agent: str) -> list[Recovery]:
    """What to do with each run: adopt the live, crash the vanished, requeue the never started."""
    out: list[Recovery] = []
    for f in found:
        common = dict(run_id=f.run_id, alloc=f.alloc, pid=f.pid, pid_started=f.pid_started, started_at=f.started_at,
                      container=f.container)
        if alive.get(f.run_id):
            if f.alloc is None:  # live but nothing says what it holds: hold nothing, crash nothing
                out.append(Recovery(action="forget", reason="live process without a recorded allocation", **common))
            else:
                out.append(Recovery(action="adopt", reason="process alive", **common))
        elif f.state in ("RUNNING", "CANCELLING") or (f.state == "PENDING" and f.pid):
            out.append(Recovery(action="crash", reason=GONE_REASON.format(agent=agent), **common))
        elif f.state == "PENDING":
            out.append(Recovery(action="requeue", reason=NEVER_STARTED.format(agent=agent), **common))
        else:  # final, scheduled again, or deleted: only the journal entry is left to drop
            out.append(Recovery(action="forget", reason=f"run is {f.state or 'gone'}", **common))
    return out


async def gather(client: Any, agent: str, pools: list[str], journal: RunJournal) -> list[Found]:
    """Every run this agent may hold: its journal entries plus Prefect's live runs labelled with it."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, FlowRunFilterState,
                                                FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType

    # a multi-node follower's member bookings are recovered by `cluster/follow.py` (they are not runs it leads)
    entries: dict[str, JournalEntry] = {e.run_id: e for e in journal.entries() if run_of_booking(e.run_id) is None}
    live = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType(s) for s in LIVE_STATES]))),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=list(pools))),
    )
    runs = {}
    for fr in live:
        labels = fr.labels or {}
        parsed = parse_alloc_label(labels.get(ALLOC_LABEL))
        if str(fr.id) in entries or labels.get(WORKER_LABEL) == agent or (parsed and parsed[0] == agent):
            runs[str(fr.id)] = fr
    missing = [rid for rid in entries if rid not in runs]
    if missing:
        for fr in await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=missing))):
            runs[str(fr.id)] = fr
    out: list[Found] = []
    for rid in sorted(set(entries) | set(runs)):
        fr = runs.get(rid)
        entry = entries.get(rid)
        parsed = parse_alloc_label((fr.labels or {}).get(ALLOC_LABEL)) if fr is not None else None
        alloc = entry.allocation if entry else (parsed[1] if parsed and parsed[0] == agent else None)
        pid = entry.pid if entry and entry.pid else (parsed[2] if parsed else None)
        pid_started = entry.pid_started if entry and entry.pid else (parsed[3] if parsed else None)
        out.append(Found(
            run_id=rid, state=fr.state.type.value if fr is not None and fr.state else None, alloc=alloc,
            pid=pid, pid_started=pid_started,
            started_at=(fr.start_time if fr is not None else None) or (entry.started_at if entry else None),
            queue=(alloc.queue if alloc else None) or (fr.work_pool_name if fr is not None else None),
            container=entry.container if entry else None,
        ))
    unlocated = {f.run_id for f in out if not f.pid}
    for rid, (pid, started) in find_run_processes(unlocated).items():
        for f in out:
            if f.run_id == rid:
                f.pid, f.pid_started = pid, started
    return out


async def apply_end(client: Any, store: Any, rec: Recovery) -> None:
    """Record a crash or a requeue on the Prefect run and close its metrics record."""
    from prefect.states import Crashed

    from prefect_launch.workers.agent.queued_state import queued

    if rec.action == "crash":
        await client.set_flow_run_state(rec.run_id, Crashed(message=rec.reason), force=True)
        if store is not None:
            try:
                record = store.get_run(rec.run_id)
                if record is not None and record.state in (None, "RUNNING", "PENDING"):
                    store.upsert_run(record.model_copy(update={"state": "CRASHED",
                                                               "ended_at": datetime.now(timezone.utc)}))
            except Exception as exc:
                logger.warning("could not close the metrics record of run %s: %s", rec.run_id, exc)
    elif rec.action == "requeue":
        await client.set_flow_run_state(
            rec.run_id, queued(message=rec.reason), force=True)
