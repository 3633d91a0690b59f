"""How the agent stops a run it holds: timeouts, preemption, idle reclaim's stop, cancel on exit.

Every stop goes through `RunStops.kill`, which calls the back end's `kill_infrastructure` (process:
``host:pid``, docker: prefect-docker's own with a grace period): SIGTERM, the grace, then SIGKILL.
`stop_run` is the one path for a stop the agent decides: the agent's end state (its reason first in the
message) is recorded before the signal and wins over what the run reports after it; the steps of the
stop go to the run's ``terminate`` record. A part of `LaunchWorkerCore` (``worker.stops``).
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio

from prefect.exceptions import InfrastructureNotFound
from prefect.states import Cancelled, Failed, State

from prefect_launch.blocks.scheduling_history import SubStep
from prefect_launch.times import format_duration
from prefect_launch.workers.agent.active_run import RunHandle
from prefect_launch.workers.agent.queued_state import queued

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.agent.core import LaunchWorkerCore


def timeout_grace_s() -> float:
    """SIGTERM-to-SIGKILL grace of a timeout or idle stop (LAUNCH_TIMEOUT_GRACE_SECONDS, read when used)."""
    return float(os.environ.get("LAUNCH_TIMEOUT_GRACE_SECONDS", "10"))


END_READ_S = 3.0  # how long a stopping agent waits for one read of a run's state before acting without it


def preempt_deadline_file(run_id: str) -> Path:
    """Where a preemptible run finds the time (epoch seconds) it will be killed, once it is preempted."""
    folder = Path(tempfile.gettempdir()) / "prefect-launch-preempt"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / str(run_id)


class RunStops:
    """Stops of the runs of one worker (``w``): the worker's back end knows how, this knows when and why."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    async def kill(self, run_id: str, handle: RunHandle, grace_s: float) -> bool:
        """Stop the run through its back end's `kill_infrastructure`: SIGTERM, ``grace_s`` to exit, then
        SIGKILL (0: killed at once). False when it was already gone or could not be stopped (logged)."""
        infrastructure_pid = self.w._infrastructure_pid(handle)
        if infrastructure_pid is None:
            return False
        try:
            await self.w.kill_infrastructure(infrastructure_pid, None, grace_seconds=math.ceil(max(0.0, grace_s)))
            return True
        except InfrastructureNotFound:
            return False
        except Exception as exc:
            self.w._logger.warning("could not stop run %s (%s): %s", run_id, infrastructure_pid, exc)
            return False

    def arm_deadline(self, flow_run: "FlowRun", handle: RunHandle, seconds: Optional[float], started: float,
                     task_group: Any = None) -> None:
        """One timeout mechanism for every run of the agent (placed or re-adopted), on every back end."""
        tg = task_group or self.w._runs_task_group
        if seconds and tg is not None:
            tg.start_soon(self.enforce_deadline, flow_run, handle, seconds, started)

    async def enforce_deadline(self, flow_run: "FlowRun", handle: RunHandle, seconds: float, started: float) -> None:
        run_id = str(flow_run.id)
        await asyncio.sleep(max(0.0, started + seconds - time.time()))
        if self.w.ledger.get(run_id) is None or not await self.w._handle_alive(run_id, handle) \
                or await self.reported_end(flow_run):
            return  # it ended in time (a run that reported its end is only exiting)
        message = (f"task-timeout: timeout after {seconds:g} s ({format_duration(seconds)}): the run was stopped by "
                   f"agent {self.w.name}; submit with a longer --timeout or split the job")
        self.w._note(flow_run.id, "check_timeout", "EXPIRED", error_code="task-timeout", from_state="RUNNING",
                   to_state="FAILED", message=message)
        await self.stop_run(flow_run, handle, Failed(message=message))

    async def reported_end(self, flow_run: "FlowRun") -> bool:
        try:
            state = (await self.w.client.read_flow_run(flow_run.id)).state
            return state is not None and state.is_final()
        except Exception:
            return False

    async def preempt(self, victims: list[str], by: "FlowRun") -> None:
        """Give capacity back to ``by``: each victim is stopped by the worker of its own queue and goes back
        to the queue keeping its submit time, with the reason in its state and history."""
        for run_id in victims:
            alloc = self.w.ledger.get(run_id)
            worker = self.w.agent.workers.get(alloc.queue) if alloc else None
            worker = worker if hasattr(worker, "stops") else self.w
            handle = worker._active.get(UUID(run_id)).handle
            if alloc is None or handle is None or run_id in self.w.agent.preempting:
                continue
            try:
                victim = await self.w.client.read_flow_run(UUID(run_id))
            except Exception as exc:
                self.w._logger.warning("could not read run %s to preempt it: %s", run_id, exc)
                continue
            grace = worker.queue_spec().preempt_grace_s
            message = (f"preempted by {by.name} ({by.id}) on agent {self.w.name}: back to the queue with its "
                       f"submit time; it runs again when capacity frees")
            self.w.agent.preempting.add(run_id)
            self.w._note(victim.id, "terminate", "SUCCESS", error_code="preempted", from_state="RUNNING",
                       to_state="SCHEDULED", message=message)
            state = queued(victim.expected_start_time, message)
            try:
                preempt_deadline_file(run_id).write_text(f"{time.time() + grace:.3f}\n")
            except OSError:
                pass
            worker._runs_task_group.start_soon(worker.stops.stop_run, victim, handle, state, grace)

    async def stop_run(self, flow_run: "FlowRun", handle: RunHandle, state: State,
                       grace_s: Optional[float] = None) -> None:
        """The agent ends a run it decided to stop (timeout, idle reclaim): SIGTERM, grace, kill.

        ``state`` (reason first in its message) is recorded before the signal when it is final, and again
        once the process is gone, even if the run reports Completed after the signal (an interactive session
        exits cleanly on it).
        ``grace_s`` 0: killed at once, no SIGTERM - for a run whose final state the agent has already set
        (its engine would report "Crashed ... termination signal" over it on a SIGTERM).
        """
        run_id = str(flow_run.id)
        grace_s = timeout_grace_s() if grace_s is None else grace_s
        if self.w._active.get(flow_run.id).end_state is not None:
            return  # already being stopped
        self.w._active.of(flow_run.id).end_state = state
        self.w._active.of(flow_run.id).signalled_at = time.time()
        self.w.get_flow_run_logger(flow_run).warning(f"agent {self.w.name} is stopping the run: {state.message}")
        steps = self.w._active.of(flow_run.id).stops = []  # read by the terminate record once the run is gone
        t0 = datetime.now(timezone.utc)
        if grace_s > 0 and state.is_final():
            # The agent's state first, so readers see its reason at once. Prefect's engine still forces
            # "Crashed ... termination signal" when the SIGTERM reaches it (process back end: a short window,
            # mended by RunEnds.mark_stopped once the process is gone; containers shield the engine from the signal,
            # see container_engine.shield_from_sigterm). The grace still lets the job checkpoint.
            try:
                await self.w.client.set_flow_run_state(flow_run.id, state, force=True)
            except Exception as exc:  # recorded again once the process is gone (RunEnds.mark_stopped)
                self.w._logger.warning("could not record why run %s is stopped before signalling it: %s",
                                     flow_run.id, exc)
        # each step is written before the signal it names: the run's end (and its `terminate` record, which
        # reads these steps) may follow the signal before `kill` returns
        if grace_s <= 0:
            steps.append(SubStep(step="signal", result="SUCCESS", started=t0, ended=datetime.now(timezone.utc),
                                 message="killed at once: the run's final state was already set"))
            await self.kill(run_id, handle, 0)
            return
        steps.append(SubStep(step="signal", result="SUCCESS", started=t0, ended=datetime.now(timezone.utc),
                             message=f"SIGTERM to the run; {grace_s:g} s to exit"))
        await self.kill(run_id, handle, grace_s)
        if (datetime.now(timezone.utc) - t0).total_seconds() >= grace_s:  # kill_infrastructure waited it out
            now = datetime.now(timezone.utc)
            steps.append(SubStep(step="signal", result="SUCCESS", started=now, ended=now,
                                 message=f"still alive after the {grace_s:g} s grace: killed"))

    def stop_steps(self, run_id: UUID) -> list[SubStep]:
        """The stop's own steps (signal, kill) for the ``terminate`` record, when the agent stopped it."""
        return list(self.w._active.take(run_id, "stops") or [])

    def cut_ending(self) -> None:
        """The agent stops and the server does not answer: give up recording the ends still pending.

        The capacity is freed, the metrics summary written locally and the history told why; what only the
        server can hold (the agent's own end state, the summary artifact) is not written. A run the server
        still shows live is settled by the next start's recovery (crashed: its process is gone)."""
        self.w._cut_ends = True
        for scope in list(self.w._active.having("ending").values()):
            scope.cancel()

    async def cancel_running(self, reason: str, grace_s: float = 10.0) -> None:
        """Stop every run this worker holds (SIGTERM, then SIGKILL) and record them Cancelled with why."""
        handles = {}
        for run_id, handle in self.w._active.having("handle").items():
            try:  # a run that already reported its end (its process is only exiting) keeps that end
                with anyio.fail_after(END_READ_S):  # a server that does not answer must not delay the stop
                    state = (await self.w.client.read_flow_run(run_id)).state
                if state is not None and state.is_final():
                    continue
            except Exception:
                pass
            if not await self.w._handle_alive(str(run_id), handle):
                continue
            handles[run_id] = handle
            self.w._active.of(run_id).end_state = Cancelled(message=reason)
        deadline = time.time() + grace_s
        async with anyio.create_task_group() as tg:  # every run gets the same grace, side by side
            for run_id, handle in handles.items():
                tg.start_soon(self.kill, str(run_id), handle, grace_s)
        while time.time() < deadline + 15 and any(self.w._active.get(r).handle is not None and self.w._active.get(r).ending is None for r in handles):
            await asyncio.sleep(0.2)  # until run() sees the process gone (the agent then waits on `ending`)
