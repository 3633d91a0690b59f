"""What every launch back end does around a run: intake, dispatch, pinning, watching, ends, recovery.

`LaunchWorkerCore` is mixed in front of a Prefect worker class (ProcessWorker,
DockerWorker, ...). It owns the agent-wide pieces - the ledger (through
`AgentContext`), the journal, event wake-ups, the dispatch cycle
(`dispatch.dispatch_cycle`), the run's environment, limits watch, metrics
sampler and summary artifact, timeouts, cancel on exit, restart recovery and
the published agent state - and asks its back end only four things about a
running run, through a `RunHandle`:

- ``_handle_alive(run_id, handle)``: is it still running;
- ``_terminate(run_id, handle, force)``: ask it to stop (SIGTERM-like) or kill it;
- ``_found_alive(found)`` / ``_adopt_handle(rec)``: after a restart, is it still
  there and what is its handle now;
- ``_adopted_end(run_id, handle, limits)``: why a re-adopted run ended, if the
  agent knows better than the run's own final state.

Capacity is released exactly once per run, on every end: by `_free_capacity` as soon as its process or
container is gone (before the bookkeeping of its end), else by `_release_allocation` (Prefect's slot release).

Every decision becomes a scheduling-history record (`blocks.scheduling_history`, written by
one `HistoryWriter` per agent): dispatch's placement decisions, the start (or its failure),
the timeout (``check_timeout EXPIRED task-timeout``), idle reclaim (``idle_check EXPIRED``
with the checker's reason) and the end (``terminate``, capacity released). Timeouts and idle
reclaims take one stop path, `_stop_run`: the agent's end state (with its reason first in the
message) wins over what the run reports after the signal.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import signal
import socket
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio
import anyio.to_thread

from prefect.states import Cancelled, Crashed, Failed, State

from prefect_launch.blocks.scheduling_history import HistoryWriter, SchedulingRecord, SubStep
from prefect_launch.workers.agent.active_run import RunHandle
from prefect_launch.workers.agent.intake import QueueIntake
from prefect_launch.workers.agent.context import AgentContext
from prefect_launch.workers.agent.registry import AgentRun, AgentState, offline_reasons, publish, read_agents
from prefect_launch.workers.scheduling.dispatch import DispatchHooks, dispatch_cycle
from prefect_launch.times import format_duration
from prefect_launch.workers.metrics.idle_checks import IdleChecker, Verdict, app_activity
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.limits import run_environment
from prefect_launch.workers.agent.queued_state import QUEUED, queued
from prefect_launch.workers.agent.recovery import Found, Recovery, process_is_run
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.agent.journal import JournalEntry, alloc_label
from prefect_launch.workers.agent.scheduled_runs import read_due_runs
from prefect_launch.workers.agent.tags import ALLOC_LABEL, IDLE_LABEL, PLACED_LABEL, WAIT_LABEL, tag_value
from prefect_launch.api_retry import install as install_quick_503_retries
from prefect_launch.api_retry import single_try
from prefect_launch.workers.agent.secrets import resolve_secret_env

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import WorkerFlowRunResponse

install_quick_503_retries()  # every agent: a busy SQLite server's 503 costs a claim milliseconds, not 2 s

PUBLISH_DEBOUNCE_S = 1.0
WAKE_COALESCE_S = 0.05
# Set in the agent's own wake loop: its frequent polls read the due runs instead of calling the
# worker poll endpoint, which writes (see workers/agent/scheduled_runs.py).
_READ_ONLY_POLL: contextvars.ContextVar[bool] = contextvars.ContextVar("launch_read_only_poll", default=False)
END_READ_S = 3.0  # how long a stopping agent waits for one read of a run's state before acting without it
TIMEOUT_GRACE_S = float(os.environ.get("LAUNCH_TIMEOUT_GRACE_SECONDS", "10"))
HEARTBEAT_S = os.environ.get("LAUNCH_HEARTBEAT_SECONDS", "30")  # Prefect's minimum; the zombie automation waits 3x
HISTORY_FLUSH_S = float(os.environ.get("LAUNCH_HISTORY_FLUSH_SECONDS", "1"))
IDLE_PUBLISH_S = float(os.environ.get("LAUNCH_IDLE_PUBLISH_SECONDS", "30"))  # moving idle deadlines: label refresh


WAKE_EVENTS = tuple(f"prefect.flow-run.{name}" for name in (QUEUED, "Scheduled", "Pending", "Cancelled"))


class LaunchWorkerCore(QueueIntake):
    """Mixin: put it before the Prefect worker class, e.g. ``class W(LaunchWorkerCore, ProcessWorker)``."""

    def __init__(self, *args: Any, agent: Optional[AgentContext] = None, capacity: Optional[str] = None,
                 use_cgroups: bool = True, **kwargs: Any):
        kwargs.setdefault("name", socket.gethostname())
        super().__init__(*args, **kwargs)
        self.agent = agent or AgentContext.detect(capacity)
        self.ledger = self.agent.ledger
        self.warm_pool = self.agent.warm_pool
        self.agent.queues.add(self._work_pool_name)
        self.agent.workers[self._work_pool_name] = self
        self.agent.on_release(self._wake_up)
        self.use_cgroups = use_cgroups
        self.poll_seconds = float(os.environ.get("LAUNCH_POLL_SECONDS", "2"))
        self._agents_seen: tuple[float, dict[str, str], set[str]] = (0.0, {}, set())
        self.journal = self.agent.journal(self.name)
        self._priorities: dict[str, int] = {}
        self._wake: Optional[asyncio.Event] = None
        self._publish_wanted: Optional[asyncio.Event] = None
        self._metrics_store: Any = None
        self._background_started = False
        self._elsewhere_cache: Optional[tuple[float, list[tuple[str, Allocation]]]] = None
        self._cut_ends = False  # the agent stops without waiting for the server: ends are recorded locally only

    @property
    def history(self) -> Optional[HistoryWriter]:
        """One scheduling-history writer per agent (its queues' workers share it); None without a store."""
        return getattr(self.agent, "history", None)

    def _note_history(self, rec: SchedulingRecord) -> None:
        writer = self.history
        if writer is not None:
            writer.note(rec)

    def _note(self, flow_run_id: Any, phase: str, result: str, message: str, error_code: Optional[str] = None,
              from_state: Optional[str] = None, to_state: Optional[str] = None,
              sub_steps: Optional[list[SubStep]] = None) -> None:
        try:
            self._note_history(SchedulingRecord(run_id=str(flow_run_id), phase=phase, result=result, message=message,
                                                error_code=error_code, from_state=from_state, to_state=to_state,
                                                sub_steps=sub_steps or []))
        except Exception as exc:  # history never breaks a run
            self._logger.debug("scheduling history: %s", exc)

    # ------------------------------------------------------------------ set-up
    async def _initialize_after_sync(self) -> None:
        await super()._initialize_after_sync()
        await self._refresh_priorities()
        if self._metrics_store is None:
            from prefect_launch.workers.metrics.run_sampling import load_store

            self._metrics_store = await load_store()
        if self.history is None and self._metrics_store is not None:
            self.agent.history = HistoryWriter(self._metrics_store, flush_s=HISTORY_FLUSH_S, logger=self._logger)
        if self._work_pool is not None and not self._background_started:
            self._background_started = True
            self._wake = asyncio.Event()
            self._publish_wanted = asyncio.Event()
            self._refill_warm_pool()
            for loop in (self._wake_loop, self._event_loop, self._publish_loop):
                scope = anyio.CancelScope()
                self._scheduled_task_scopes.add(scope)
                self._runs_task_group.start_soon(self._in_scope, scope, loop)
        if self._work_pool is not None and not self.agent.recovery_started:
            self.agent.recovery_started = True
            try:
                await self._recover()
                self.agent.recovered.set()
            except Exception:
                self.agent.recovery_started = False  # the next sync tries again; nothing is placed meanwhile
                self._logger.exception("rebuilding the ledger failed; placing nothing until it succeeds")
        await self._publish_state()

    def _refill_warm_pool(self) -> None:
        """Only the process back end keeps warm engines."""

    async def _refresh_priorities(self) -> None:
        try:
            queues = await self.client.read_work_queues(work_pool_name=self._work_pool_name)
            self._priorities = {q.name: q.priority for q in queues}
            self._queues_read = (time.monotonic(), queues)
        except Exception as exc:  # keep the last known priorities
            self._logger.debug("could not read work queues: %s", exc)

    async def _recent_work_queues(self) -> list[Any]:
        """The pool's work queues, read again when the last read is older than Prefect's default worker poll
        interval (10 s; a paused queue stops being served as soon as with Prefect's own worker): the 2-s wake
        loop then costs the server one read, not two."""
        at, queues = getattr(self, "_queues_read", (0.0, None))
        if queues is None or time.monotonic() - at > 10.0:
            await self._refresh_priorities()
            at, queues = getattr(self, "_queues_read", (0.0, None))
        return queues if queues is not None else await self.client.read_work_queues(work_pool_name=self._work_pool_name)

    # ------------------------------------------------------------------ intake
    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _wake_loop(self) -> None:
        """Place runs when an event or a released run says so, and at least every few seconds.

        Events are the fast path; the short poll bounds the delay when the event stream lags
        (a busy server) - Prefect's own 10 s poll keeps running underneath as well. This loop looks
        at the due runs with a read (workers/agent/scheduled_runs.py), so re-planning often never takes
        the server's write lock from submissions.
        """
        _READ_ONLY_POLL.set(True)  # this task's context only: Prefect's own poll still marks queues polled
        while True:
            with anyio.move_on_after(self.poll_seconds):
                await self._wake.wait()
            await asyncio.sleep(WAKE_COALESCE_S)  # a burst of events (a batch submitted) makes one cycle
            self._wake.clear()
            try:
                await self.get_and_submit_flow_runs()
            except Exception:
                self._logger.exception("event-driven poll failed; polling continues")

    async def _event_loop(self) -> None:
        """Wake on flow-run events for this pool; the regular poll stays as the fallback."""
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

        pool_id = self._work_pool.id
        event_filter = EventFilter(
            event=EventNameFilter(prefix=["prefect.flow-run."]),
            related=EventRelatedFilter(resources_in_roles=[(f"prefect.work-pool.{pool_id}", "work-pool")]),
        )
        while True:
            try:
                async with get_events_subscriber(filter=event_filter, reconnect_on_clean_close=True) as sub:
                    async for event in sub:
                        # a run queued (submitted or requeued: "Queued", see queued_state; "Scheduled" from
                        # Prefect's own schedules), claimed or cancelled. Not Late: Prefect marks runs named
                        # Scheduled Late 15 s after their due time, which changes nothing to plan
                        if event.event in WAKE_EVENTS:
                            self._wake_up()
            except Exception as exc:
                self._logger.debug("event subscription dropped (%s); retrying", exc)
                await asyncio.sleep(2)

    async def _get_scheduled_flow_runs(self) -> list[Any]:
        if _READ_ONLY_POLL.get() and self._work_pool is not None:
            before = datetime.now(timezone.utc) + timedelta(seconds=int(self._prefetch_seconds))
            try:
                runs = await read_due_runs(self.client, self._work_pool, list(self._work_queues or []), before,
                                           queues=await self._recent_work_queues())
            except Exception as exc:
                self._logger.debug("reading due runs failed (%s); using the worker poll", exc)
                runs = None
            if runs is not None:
                return runs
        return await super()._get_scheduled_flow_runs()

    async def get_and_submit_flow_runs(self) -> list["FlowRun"]:
        if self.agent.draining:
            return []
        await self.agent.recovered.wait()  # never place from a ledger that is not rebuilt yet
        async with self.agent.plan_lock:
            if self.agent.draining:
                return []
            return await super().get_and_submit_flow_runs()

    async def _pinned_agents(self) -> tuple[dict[str, str], set[str]]:
        """Offline agents (and since when) and all known agents, re-read at most every 10 s."""
        at, offline, known = self._agents_seen
        if time.monotonic() - at > 10:
            try:
                agents = await read_agents(self.client)
                offline, known = offline_reasons(agents), {a.name for a in agents}
                self._agents_seen = (time.monotonic(), offline, known)
            except Exception as exc:
                self._logger.debug("could not read agents: %s", exc)
        return offline, known

    async def _peer_free(self) -> dict[str, Any]:
        """Free capacity of the other online agents serving this queue (their last published state)."""
        try:
            agents = await read_agents(self.client)
        except Exception as exc:
            self._logger.debug("could not read agents: %s", exc)
            return {}
        return {a.name: a.free for a in agents
                if a.name != self.name and a.online() and self._work_pool_name in a.queues}

    async def _placed_elsewhere(self) -> list[tuple[str, Allocation]]:
        """The queue's live runs placed by other agents, as their ``launch.alloc`` labels say (owner quotas).

        Read at most once a second. A run another agent placed less than a moment ago may not carry its
        label yet, so two agents placing the same owner's runs in the same second can overshoot its quota
        by one run each; every later decision counts it.
        """
        from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                    WorkPoolFilter, WorkPoolFilterName)
        from prefect.client.schemas.objects import StateType

        from prefect_launch.workers.agent.journal import parse_alloc_label

        cached = self._elsewhere_cache
        if cached is not None and time.monotonic() - cached[0] < 1.0:
            return cached[1]
        live = await self.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self._work_pool_name])),
        )
        placed = [(p[0], p[1]) for p in (parse_alloc_label((fr.labels or {}).get(ALLOC_LABEL)) for fr in live) if p]
        self._elsewhere_cache = (time.monotonic(), placed)
        return placed

    # ---------------------------------------------------------------- dispatch
    async def _submit_scheduled_flow_runs(
        self, flow_run_response: list["WorkerFlowRunResponse"]
    ) -> list["FlowRun"]:
        runs = [entry.flow_run for entry in flow_run_response
                if entry.flow_run.id not in self._submitting_flow_run_ids]
        hooks = DispatchHooks(
            deployment_vars=self._deployment_vars, pinned_agents=self._pinned_agents,
            start=self._start, wait=self._note_waiting, reject=self._reject,
            booked=self.journal.record,  # before any process exists: a crash from here on is recoverable
            log=self._logger.debug, history=self._note_history,
            preempt=self._preempt, stopping=lambda: set(self.agent.preempting), peers=self._peer_free,
            placed_elsewhere=self._placed_elsewhere,
        )
        foreign = [c for q, cs in self.agent.unplaced.items() if q != self._work_pool_name for c in cs]
        self._wait_notes.new_cycle([fr.id for fr in runs])
        result = await dispatch_cycle(runs, self.queue_spec(), self.ledger, self._work_pool_name, self.name,
                                      self._priorities, hooks, foreign=foreign)
        self.agent.unplaced[self._work_pool_name] = result.unplaced
        if result.started:
            self._publish_soon()
        return result.started

    def _start(self, flow_run: "FlowRun", alloc: Allocation, request: ResolvedRequest) -> None:
        self._wait_notes.forget(flow_run.id)
        self._active.take(flow_run.id, "ended")  # a preempted run placed again starts with a clean slate
        self._active.take(flow_run.id, "kill_reason")
        self._active.of(flow_run.id).request = request
        self.get_flow_run_logger(flow_run).info(
            f"Agent '{self.name}' starting flow run with {alloc.resources.describe()}"
            f" gpus={alloc.gpu_indices} cores={alloc.cpu_cores}")
        self._submitting_flow_run_ids.add(flow_run.id)
        if self._cancelling_observer is not None:
            self._cancelling_observer.add_in_flight_flow_run_id(flow_run.id)
        self._runs_task_group.start_soon(self._submit_run, flow_run)

    async def _propose_pending_state(self, flow_run: "FlowRun") -> bool:
        """Prefect's claim (Scheduled -> Pending); a refused claim is a decision worth recording."""
        ok = await super()._propose_pending_state(flow_run)
        if not ok:
            self._note(flow_run.id, "schedule", "FAILURE", error_code="claim-refused",
                       message=f"agent {self.name} placed the run but Prefect refused its Pending claim "
                               "(another agent claimed it, or its state changed); capacity released")
        return ok

    async def _submit_run_and_capture_errors(self, flow_run: "FlowRun", task_status: Any = None) -> Any:
        """A run whose process or container never came up is a ``start FAILURE`` in its history."""
        try:
            result = await super()._submit_run_and_capture_errors(flow_run, task_status)
        finally:
            started = self._active.get(flow_run.id).ever_started
            self._active.take(flow_run.id, "ever_started")
        if isinstance(result, Exception) and not started:
            self._note(flow_run.id, "start", "FAILURE", error_code="start-failed", from_state="PENDING",
                       to_state="CRASHED", message=f"agent {self.name} could not start the run: "
                                                   f"{type(result).__name__}: {result}")
        return result

    # --------------------------------------------------------------- lifecycle
    def _allocation_of(self, flow_run: "FlowRun") -> Allocation:
        alloc = self.ledger.get(str(flow_run.id))
        if alloc is None:  # e.g. an ad-hoc submission that bypassed placement
            raise RuntimeError(f"flow run {flow_run.id} has no allocation on agent {self.name}")
        return alloc

    async def _run_env(self, alloc: Allocation, secret_env: Optional[dict[str, str]]) -> dict[str, str]:
        """Pinning (GPUs, threads, the allocation), secrets read now, and heartbeats for the zombie automation."""
        env = run_environment(alloc, self.name)
        if alloc.preemptible:  # the job may checkpoint between SIGTERM and the kill
            env.update(LAUNCH_PREEMPTIBLE="1", LAUNCH_PREEMPT_GRACE_S=f"{self.queue_spec().preempt_grace_s:g}",
                       LAUNCH_PREEMPT_DEADLINE_FILE=str(preempt_deadline_file(alloc.run_id)))
        env.update(await resolve_secret_env({"secret_env": secret_env}))
        env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", HEARTBEAT_S)
        return env

    def _on_started(self, flow_run: "FlowRun", alloc: Allocation, handle: RunHandle, limits: Any = None) -> None:
        """The run exists: journal its handle, apply limits, start the sampler and the deadline."""
        run_id = flow_run.id
        self._active.of(run_id).handle = handle
        self._active.of(run_id).ever_started = True
        where = f"container {handle.container[:12]}" if handle.container else f"process {handle.pid}"
        self._note(run_id, "start", "SUCCESS", from_state="PENDING", to_state="RUNNING",
                   message=f"agent {self.name} started the run ({where})")
        if handle.pid:
            self.journal.set_pid(str(run_id), handle.pid, handle.pid_started, container=handle.container)
        if limits is not None:
            self._active.of(run_id).limits = limits
            if handle.pid:
                limits.apply(handle.pid)
        if handle.pid:
            self._after_start(flow_run, alloc, handle.pid)
        request = self._active.take(run_id, "request")
        self._arm_deadline(flow_run, handle, request.timeout_s if request else None, time.time())

    async def _on_finished(self, flow_run: "FlowRun", status_code: Optional[int], limits: Any = None,
                           reason: Optional[str] = None) -> None:
        """Record why the agent ended the run (limits, timeout, cancel), stop sampling, publish the summary."""
        reason = (limits.finish() if limits is not None else None) or reason
        if limits is not None:
            self._note_peak(flow_run.id, limits)
        self._active.take(flow_run.id, "limits")
        self._active.take(flow_run.id, "request")
        with anyio.CancelScope(shield=True) as scope:  # shielded from the agent's stop; `cut_ending` may end it
            self._active.of(flow_run.id).ending = scope
            if self._cut_ends:
                scope.cancel()
            try:
                try:
                    if reason:
                        self._active.of(flow_run.id).kill_reason = reason
                        await self._mark_stopped(flow_run, Crashed(message=reason))
                    elif self._active.get(flow_run.id).end_state is not None:
                        await self._mark_stopped(flow_run, self._active.get(flow_run.id).end_state)
                    self._free_capacity(flow_run.id)  # its process is gone: the next run need not wait for the summary
                    await self._after_finish(flow_run, status_code)  # cut short: still writes the summary locally
                finally:
                    self._free_capacity(flow_run.id)  # also when cut short: the hardware is free either way
                    sampler = self._active.take(flow_run.id, "sampler")
                    if sampler is not None:  # cut short before its summary: it still reaches the local store
                        await self._stop_sampler(sampler, "UNKNOWN")
                    if self._active.get(flow_run.id).handle is not None:  # it ran: record its end (a failed start: the caller records it)
                        await self._note_end(flow_run, status_code, reason)
            finally:
                self._active.take(flow_run.id, "ending")

    async def _note_end(self, flow_run: "FlowRun", status_code: Optional[int], reason: Optional[str]) -> None:
        """``terminate``: how the run ended and that its capacity goes back (the release follows at once)."""
        agent_state = Crashed(message=reason) if reason else self._active.get(flow_run.id).end_state
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception:
            state = None
        except BaseException:  # cut short by the agent's stop (`cut_ending`): the history still gets the end
            self._write_end_note(flow_run, status_code, reason, agent_state, None, unread=True)
            raise
        self._write_end_note(flow_run, status_code, reason, agent_state, state)

    def _write_end_note(self, flow_run: "FlowRun", status_code: Optional[int], reason: Optional[str],
                        agent_state: Optional[State], state: Optional[State], unread: bool = False) -> None:
        if state is not None and state.is_final():  # after _mark_stopped: the agent's reason, unless it ended first
            end, message = state.type.value, state.message
        elif agent_state is not None:
            end, message = agent_state.type.value, agent_state.message
        else:
            end = "CRASHED" if status_code not in (0, None) else (state.type.value if state else "UNKNOWN")
            message = f"exit status {status_code}" if status_code is not None else None
        unread_note = ""
        if unread:
            unread_note = "; its Prefect state was not read: the agent stopped while the server did not answer"
            if not reason:  # only the agent's own kill (limit, timeout) is known without the server
                asked = f" after agent {self.name} asked it to stop ({message})" if agent_state is not None else ""
                end, message = "UNKNOWN", (f"its process ended{asked}" if asked else
                                           f"its process ended (exit status {status_code})")
        code = None
        if end != "COMPLETED":
            head = (message or "").split(":", 1)[0].strip()
            code = head if head and " " not in head and len(head) <= 64 else end.lower()
        self._note(flow_run.id, "terminate", "SUCCESS", error_code=code, from_state="RUNNING", to_state=end,
                   message=f"ended {end.capitalize()}{': ' + message if message else ''}; agent {self.name} "
                           f"released its capacity{unread_note}",
                   sub_steps=self._stop_steps(flow_run.id))

    async def _mark_stopped(self, flow_run: "FlowRun", state: State) -> None:
        """The run's executor already reported a bare signal; record the agent's reason instead."""
        self._active.of(flow_run.id).ended = True
        try:
            current = (await self.client.read_flow_run(flow_run.id)).state
            signalled = self._active.get(flow_run.id).signalled_at
            if current is not None and current.is_completed() and (
                    signalled is None or current.timestamp.timestamp() < signalled):
                return  # it finished before the signal landed (after it: it ended because of it)
            if current is not None and current.is_final() and current.type == state.type \
                    and current.message == state.message:
                return  # already recorded (a cluster member's failure is recorded before the stop)
            self.get_flow_run_logger(flow_run).error(state.message)
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception as exc:
            self._logger.warning("could not record why run %s was stopped: %s", flow_run.id, exc)

    def _note_peak(self, run_id: UUID, limits: Any) -> None:
        """The kernel's final peak reaches the summary (finish() removes the cgroup before the last sample)."""
        sampler = self._active.get(run_id).sampler
        if sampler is not None and getattr(limits, "peak_rss", None):
            sampler.note_peak_memory(limits.peak_rss)

    def _after_start(self, flow_run: "FlowRun", alloc: Allocation, pid: int,
                     started_at: Optional[datetime] = None) -> None:
        """Start sampling the run's process tree from outside (no change to the job)."""
        from prefect_launch.workers.metrics.run_sampling import start_sampler

        sampler = start_sampler(self._metrics_store, flow_run, alloc, self.name, alloc.queue or self._work_pool_name,
                                pid, self._logger, started_at=started_at)
        if sampler is not None:
            self._active.of(flow_run.id).sampler = sampler
            self._arm_idle_checks(flow_run, alloc, sampler, started_at)
        if self._runs_task_group is not None:  # off the start path: the run is already running
            worker_labels = self._active.get(flow_run.id).unlabelled
            self._active.take(flow_run.id, "unlabelled")
            self._runs_task_group.start_soon(self._label_placement, flow_run, alloc, worker_labels)

    def _placement_text(self, alloc: Allocation) -> str:
        text = (f"agent {self.name}: {alloc.resources.describe()}; gpus "
                f"{','.join(map(str, alloc.gpu_indices)) or 'none'}; cores {','.join(map(str, alloc.cpu_cores))}")
        if alloc.members:  # a cluster run: where each member runs
            from prefect_launch.workers.cluster.placement import members_text

            text += f"; members {members_text(alloc)}"
        return text

    async def _label_placement(self, flow_run: "FlowRun", alloc: Allocation, worker_labels: bool = False) -> None:
        """Show on the Prefect run where it runs, and clear its old waiting reason.

        Deferred a moment: on a SQLite server a write that collides with the engine's own
        Running transition makes one of them wait out a 2 s client retry.
        """
        await asyncio.sleep(PUBLISH_DEBOUNCE_S)
        entry = self.journal.get(str(flow_run.id))
        machine = alloc_label(alloc, self.name, entry.pid if entry else None, entry.pid_started if entry else None)
        labels = {PLACED_LABEL: self._placement_text(alloc), WAIT_LABEL: "", ALLOC_LABEL: machine}
        if worker_labels:  # Prefect's worker labels ride along (see _give_worker_labels_to_flow_run)
            labels.update(self._worker_labels())
        await self._write_labels(flow_run.id, labels)

    def _worker_labels(self) -> dict[str, str]:
        """The labels Prefect's BaseWorker gives each run it submits (worker, work pool)."""
        labels = {"prefect.worker.name": self.name, "prefect.worker.type": self.type}
        if self._work_pool:
            labels.update({"prefect.work-pool.name": self._work_pool.name, "prefect.work-pool.id": str(self._work_pool.id)})
        return labels

    async def _write_labels(self, flow_run_id: UUID, labels: dict[str, str]) -> bool:
        """Labels written off the run's start path with the client's retries (api_retry's quick 503 retries,
        then Prefect's back-off): on a SQLite server Prefect's label endpoint fails (503) whenever another
        write commits between its read and its write."""
        try:
            await self.client.update_flow_run_labels(flow_run_id, labels)
            return True
        except Exception as exc:
            self._logger.warning("could not label run %s: %s", flow_run_id, exc)
            return False

    async def _after_finish(self, flow_run: "FlowRun", status_code: Optional[int]) -> None:
        """Stop sampling, write the summary, and attach it to the Prefect run as a table."""
        sampler = self._active.take(flow_run.id, "sampler")
        if sampler is None:
            return
        from prefect_launch.workers.metrics.run_sampling import publish_summary_artifact

        exit_state = "UNKNOWN"  # stays so when cut short by the agent's stop (the state was not read)
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
            exit_state = state.type.value if state else "UNKNOWN"
            if state is None or not state.is_final():  # the worker marks crashes after this point
                exit_state = "CRASHED" if status_code not in (0, None) else exit_state
        except Exception:
            exit_state = "CRASHED" if status_code not in (0, None) else "UNKNOWN"
        finally:  # also when cut short: the summary reaches the local metrics store
            summary = await self._stop_sampler(sampler, exit_state)
        try:
            await publish_summary_artifact(self.client, flow_run.id, summary, sampler.record)
        except Exception as exc:
            self._logger.debug("could not attach the metrics summary to run %s: %s", flow_run.id, exc)

    @staticmethod
    async def _stop_sampler(sampler: Any, exit_state: str) -> Any:
        """Stop sampling and write the run's summary to the metrics store (local: done even while stopping)."""
        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(sampler.stop, exit_state)

    async def _give_worker_labels_to_flow_run(self, flow_run_id: UUID) -> None:
        """Prefect's worker labels are not written here, on the run's start path, but with the placement
        labels once its process is up (`_label_placement`): one label write per run instead of two. On a
        SQLite server most label writes of many agents failed (503) and were retried with back-off, the
        start waiting on them (bench/scale.py (b)). Until then the journal holds the claim (recovery reads
        it first); a run that ends before it started gets them when it ends (`_release_limit_slot`)."""
        self._active.of(flow_run_id).unlabelled = True

    async def _propose_crashed_state(self, flow_run: "FlowRun", message: str, client: Any = None) -> None:
        reason = self._active.take(flow_run.id, "kill_reason")
        if self._active.get(flow_run.id).ended:  # the agent already recorded why (memory, timeout, cancel on exit)
            self._active.take(flow_run.id, "ended")
            return
        await super()._propose_crashed_state(flow_run, reason or message, client)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        super()._release_limit_slot(flow_run_id)
        self._release_allocation(flow_run_id)
        if self._active.get(flow_run_id).unlabelled and self._runs_task_group is not None:  # never started: labelled now
            self._active.take(flow_run_id, "unlabelled")
            self._runs_task_group.start_soon(self._write_labels, flow_run_id, self._worker_labels())

    def _release_allocation(self, flow_run_id: UUID) -> None:
        self._active.take(flow_run_id, "handle")
        self._active.take(flow_run_id, "request")
        self._active.take(flow_run_id, "idle")
        self._active.take(flow_run_id, "signalled_at")
        self._active.take(flow_run_id, "stops")
        self.agent.preempting.discard(str(flow_run_id))
        self._free_capacity(flow_run_id)
        if self._active.get(flow_run_id).freed:  # freed now or when its process ended
            self._active.take(flow_run_id, "freed")
            self._active.take(flow_run_id, "end_state")

    def _free_capacity(self, flow_run_id: UUID) -> bool:
        """Give the run's capacity back (once): called as soon as its process or container is gone, before the
        bookkeeping of its end (metrics summary, artifact, history), which used to delay the next placement."""
        if self.ledger.release(str(flow_run_id)) is None:
            return False
        self._active.of(flow_run_id).freed = True
        self.journal.remove(str(flow_run_id))
        self.agent.released()
        self._publish_soon()
        return True

    # ------------------------------------------------- back-end hooks (process)
    async def _handle_alive(self, run_id: str, handle: RunHandle) -> bool:
        return process_is_run(handle.pid, handle.pid_started, run_id)

    async def _terminate(self, run_id: str, handle: RunHandle, force: bool) -> None:
        """Ask the run to stop (``force=False``: SIGTERM to its group) or kill it."""
        from prefect_launch.workers.agent.limits import kill_tree

        if handle.pid is None:
            return
        if force:
            kill_tree(handle.pid)
        else:
            _signal_group(handle.pid, signal.SIGTERM)

    async def _found_alive(self, found: Found) -> bool:
        return process_is_run(found.pid, found.pid_started, found.run_id)

    async def _adopt_handle(self, rec: Recovery) -> tuple[RunHandle, Any]:
        """The handle of a re-adopted run, and its limits watch (re-attached to its existing group)."""
        from prefect_launch.workers.agent.limits import RunLimits

        limits = RunLimits(rec.run_id, rec.alloc, use_cgroup=self.use_cgroups)
        limits.attach(rec.pid)
        return RunHandle(pid=rec.pid, pid_started=rec.pid_started), limits

    async def _adopted_end(self, run_id: str, handle: RunHandle, limits: Any) -> Optional[str]:
        return limits.finish() if limits is not None else None

    # --------------------------------------------------------------- timeouts
    def _arm_deadline(self, flow_run: "FlowRun", handle: RunHandle, seconds: Optional[float], started: float,
                      task_group: Any = None) -> None:
        """One timeout mechanism for every run of the agent (placed or re-adopted), on every back end."""
        tg = task_group or self._runs_task_group
        if seconds and tg is not None:
            tg.start_soon(self._enforce_deadline, flow_run, handle, seconds, started)

    async def _enforce_deadline(self, flow_run: "FlowRun", handle: RunHandle, seconds: float, started: float) -> None:
        run_id = str(flow_run.id)
        await asyncio.sleep(max(0.0, started + seconds - time.time()))
        if self.ledger.get(run_id) is None or not await self._handle_alive(run_id, handle) \
                or await self._reported_end(flow_run):
            return  # it ended in time (a run that reported its end is only exiting)
        message = (f"task-timeout: timeout after {seconds:g} s ({format_duration(seconds)}): the run was stopped by "
                   f"agent {self.name}; submit with a longer --timeout or split the job")
        self._note(flow_run.id, "check_timeout", "EXPIRED", error_code="task-timeout", from_state="RUNNING",
                   to_state="FAILED", message=message)
        await self._stop_run(flow_run, handle, Failed(message=message))

    async def _reported_end(self, flow_run: "FlowRun") -> bool:
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
            return state is not None and state.is_final()
        except Exception:
            return False

    async def _preempt(self, victims: list[str], by: "FlowRun") -> None:
        """Give capacity back to ``by``: each victim is stopped by the worker of its own queue and goes back
        to the queue keeping its submit time, with the reason in its state and history."""
        for run_id in victims:
            alloc = self.ledger.get(run_id)
            worker = self.agent.workers.get(alloc.queue) if alloc else None
            worker = worker if isinstance(worker, LaunchWorkerCore) else self
            handle = worker._active.get(UUID(run_id)).handle
            if alloc is None or handle is None or run_id in self.agent.preempting:
                continue
            try:
                victim = await self.client.read_flow_run(UUID(run_id))
            except Exception as exc:
                self._logger.warning("could not read run %s to preempt it: %s", run_id, exc)
                continue
            grace = worker.queue_spec().preempt_grace_s
            message = (f"preempted by {by.name} ({by.id}) on agent {self.name}: back to the queue with its "
                       f"submit time; it runs again when capacity frees")
            self.agent.preempting.add(run_id)
            self._note(victim.id, "terminate", "SUCCESS", error_code="preempted", from_state="RUNNING",
                       to_state="SCHEDULED", message=message)
            state = queued(victim.expected_start_time, message)
            try:
                preempt_deadline_file(run_id).write_text(f"{time.time() + grace:.3f}\n")
            except OSError:
                pass
            worker._runs_task_group.start_soon(worker._stop_run, victim, handle, state, grace)

    async def _stop_run(self, flow_run: "FlowRun", handle: RunHandle, state: State,
                        grace_s: float = TIMEOUT_GRACE_S) -> None:
        """The agent ends a run it decided to stop (timeout, idle reclaim): SIGTERM, grace, kill.

        ``state`` (reason first in its message) is recorded before the signal when it is final, and again
        once the process is gone, even if the run reports Completed after the signal (an interactive session
        exits cleanly on it).
        ``grace_s`` 0: killed at once, no SIGTERM - for a run whose final state the agent has already set
        (its engine would report "Crashed ... termination signal" over it on a SIGTERM).
        """
        run_id = str(flow_run.id)
        if self._active.get(flow_run.id).end_state is not None:
            return  # already being stopped
        self._active.of(flow_run.id).end_state = state
        self._active.of(flow_run.id).signalled_at = time.time()
        self.get_flow_run_logger(flow_run).warning(f"agent {self.name} is stopping the run: {state.message}")
        steps = self._active.of(flow_run.id).stops = []  # read by the terminate record once the run is gone
        t0 = datetime.now(timezone.utc)
        if grace_s > 0 and state.is_final():
            # The agent's state first, so readers see its reason at once. Prefect's engine still forces
            # "Crashed ... termination signal" when the SIGTERM reaches it (process back end: a short window,
            # mended by _mark_stopped once the process is gone; containers shield the engine from the signal,
            # see container_engine.shield_from_sigterm). The grace still lets the job checkpoint.
            try:
                await self.client.set_flow_run_state(flow_run.id, state, force=True)
            except Exception as exc:  # recorded again once the process is gone (_mark_stopped)
                self._logger.warning("could not record why run %s is stopped before signalling it: %s",
                                     flow_run.id, exc)
        if grace_s <= 0:
            await self._terminate(run_id, handle, force=True)
            steps.append(SubStep(step="signal", result="SUCCESS", started=t0, ended=datetime.now(timezone.utc),
                                 message="killed at once: the run's final state was already set"))
            return
        await self._terminate(run_id, handle, force=False)
        steps.append(SubStep(step="signal", result="SUCCESS", started=t0, ended=datetime.now(timezone.utc),
                             message=f"SIGTERM to the run; {grace_s:g} s to exit"))
        deadline = time.time() + grace_s
        while time.time() < deadline and await self._handle_alive(run_id, handle):
            await asyncio.sleep(0.2)
        if await self._handle_alive(run_id, handle):
            now = datetime.now(timezone.utc)
            steps.append(SubStep(step="signal", result="SUCCESS", started=now, ended=now,
                                 message=f"still alive after the {grace_s:g} s grace: killed"))
        await self._terminate(run_id, handle, force=True)

    def _stop_steps(self, run_id: UUID) -> list[SubStep]:
        """The stop's own steps (signal, kill) for the ``terminate`` record, when the agent stopped it."""
        return list(self._active.take(run_id, "stops") or [])

    # ------------------------------------------------------------ idle checks
    def _arm_idle_checks(self, flow_run: "FlowRun", alloc: Allocation, sampler: Any,
                         started_at: Optional[datetime]) -> None:
        """Feed the queue's idle checkers from the sampler's ``on_sample`` hook (sampling thread)."""
        try:
            policy = self.queue_spec().idle
            session_type = tag_value(flow_run.tags, "session-type")
            if policy is None or not policy.applies(session_type):
                return
            loop = asyncio.get_running_loop()
        except Exception as exc:
            self._logger.debug("idle checks not armed for run %s: %s", flow_run.id, exc)
            return
        started = started_at.timestamp() if started_at else time.time()
        scheduled = flow_run.expected_start_time.timestamp() if flow_run.expected_start_time else None
        checker = IdleChecker(policy, started=started, session_type=session_type,
                              requested_gpu=alloc.resources.gpu, allocated_memory=alloc.resources.memory,
                              interval_s=sampler.interval_s, scheduled=scheduled)
        self._active.of(flow_run.id).idle = checker
        ports = [int(p) for p in str((flow_run.labels or {}).get("launch.session.ports") or "").split(",")
                 if p.strip().isdigit()]
        watch_net = bool(policy.network_idle_timeout and session_type == "interactive" and ports)
        published: dict[str, Any] = {"at": 0.0, "kind": None, "full": None}
        fired: list[Verdict] = []

        def on_sample(sample: Any) -> None:
            now = time.time()
            ready, conns = app_activity(ports) if watch_net else (None, 0)
            total = getattr(sampler, "gpu_mem_total_bytes", None)
            gpu_mem_pct = (100.0 * sample.gpu_mem_bytes / total) if total and sample.gpu_mem_bytes is not None else None
            checker.observe(now, cpu_share_pct=sample.cpu_share_pct, rss_bytes=sample.rss_bytes,
                            gpu_util_pct=sample.gpu_util_pct, gpu_mem_pct=gpu_mem_pct, connections=conns,
                            app_ready=ready)
            verdict = checker.check(now)
            if verdict is not None and not fired:
                fired.append(verdict)
                asyncio.run_coroutine_threadsafe(self._reclaim_idle(flow_run, verdict), loop)
                return
            status = checker.status(now)
            # a change of kind (grace over, window full, app up) at once; moving deadlines and averages at most
            # every IDLE_PUBLISH_S; nothing while nothing changes (readers compute the time left themselves)
            full = json.dumps(status["checks"], sort_keys=True)
            kind = json.dumps([{k: v for k, v in c.items() if k not in ("deadline", "averages", "connections")}
                               for c in status["checks"]], sort_keys=True)
            if kind != published["kind"] or (full != published["full"] and now - published["at"] >= IDLE_PUBLISH_S):
                published.update(at=now, kind=kind, full=full)
                asyncio.run_coroutine_threadsafe(self._publish_idle(flow_run.id, status), loop)

        sampler.on_sample = on_sample

    async def _publish_idle(self, run_id: UUID, status: dict[str, Any]) -> None:
        """The live idle-check state on the run (label ``launch.idle``), for `session show`."""
        try:
            await self.client.update_flow_run_labels(run_id, {IDLE_LABEL: json.dumps(status, separators=(",", ":"))})
        except Exception as exc:
            self._logger.debug("could not publish idle checks of run %s: %s", run_id, exc)

    async def _reclaim_idle(self, flow_run: "FlowRun", verdict: Verdict) -> None:
        """An idle checker said so: end the run Cancelled with the checker's reason (the timeout's stop path)."""
        run_id = str(flow_run.id)
        handle = self._active.get(flow_run.id).handle
        if handle is None or self.ledger.get(run_id) is None or not await self._handle_alive(run_id, handle) \
                or await self._reported_end(flow_run):
            return  # ended meanwhile, or reported its end and is only exiting
        message = f"{verdict.message}; reclaimed by agent {self.name}"
        self._note(flow_run.id, "idle_check", "EXPIRED", error_code=verdict.reason, from_state="RUNNING",
                   to_state="CANCELLED", message=message)
        await self._stop_run(flow_run, handle, Cancelled(message=message))

    async def live(self) -> int:
        """Runs whose process or container is alive: what a drain waits for (not for the record of their end,
        which needs the server)."""
        n = 0
        for run_id, handle in list(self._active.having("handle").items()):
            if self._active.get(run_id).ending is None and await self._handle_alive(str(run_id), handle):
                n += 1
        return n

    def held(self) -> list[str]:
        """Runs this worker still holds: alive, or ended with their end not yet recorded."""
        return [str(r) for r in self._active.having("handle")]

    def cut_ending(self) -> None:
        """The agent stops and the server does not answer: give up recording the ends still pending.

        The capacity is freed, the metrics summary written locally and the history told why; what only the
        server can hold (the agent's own end state, the summary artifact) is not written. A run the server
        still shows live is settled by the next start's recovery (crashed: its process is gone)."""
        self._cut_ends = True
        for scope in list(self._active.having("ending").values()):
            scope.cancel()

    async def cancel_running(self, reason: str, grace_s: float = 10.0) -> None:
        """Stop every run this worker holds (SIGTERM, then SIGKILL) and record them Cancelled with why."""
        handles = {}
        for run_id, handle in self._active.having("handle").items():
            try:  # a run that already reported its end (its process is only exiting) keeps that end
                with anyio.fail_after(END_READ_S):  # a server that does not answer must not delay the stop
                    state = (await self.client.read_flow_run(run_id)).state
                if state is not None and state.is_final():
                    continue
            except Exception:
                pass
            if not await self._handle_alive(str(run_id), handle):
                continue
            handles[run_id] = handle
            self._active.of(run_id).end_state = Cancelled(message=reason)
            await self._terminate(str(run_id), handle, force=False)

        async def any_alive() -> bool:
            for r, h in handles.items():
                if await self._handle_alive(str(r), h):
                    return True
            return False

        deadline = time.time() + grace_s
        while time.time() < deadline and await any_alive():
            await asyncio.sleep(0.2)
        for run_id, handle in handles.items():
            if await self._handle_alive(str(run_id), handle):
                await self._terminate(str(run_id), handle, force=True)
        while time.time() < deadline + 15 and any(self._active.get(r).handle is not None and self._active.get(r).ending is None for r in handles):
            await asyncio.sleep(0.2)  # until run() sees the process gone (the agent then waits on `ending`)

    # --------------------------------------------------------------- recovery
    def _owner_of(self, queue: Optional[str]) -> "LaunchWorkerCore":
        """The worker of this agent that serves ``queue`` (its back end knows how to find the run)."""
        return self.agent.workers.get(queue or "", self)

    async def _recover(self) -> None:
        """Rebuild the ledger from Prefect and the live processes/containers before placing anything."""
        from prefect_launch.workers.agent.recovery import apply_end, decide, gather

        pools = sorted(self.agent.queues)
        found = await gather(self.client, self.name, pools, self.journal)
        alive = {f.run_id: await self._owner_of(f.queue)._found_alive(f) for f in found}
        for rec in decide(found, alive, self.name):
            self._logger.warning("recovery: run %s -> %s (%s)", rec.run_id, rec.action, rec.reason)
            if rec.action == "adopt":
                if self.ledger.get(rec.run_id) is not None:  # adopted by an earlier, interrupted attempt
                    continue
                try:
                    self.ledger.adopt(rec.alloc)
                except ValueError as exc:
                    self._logger.error("recovery: %s", exc)
                    continue
                self.journal.write(self.journal.get(rec.run_id) or _entry_for(rec, self.name))
                owner = self._owner_of(rec.alloc.queue)
                self._runs_task_group.start_soon(owner._watch_adopted, rec, self._runs_task_group)
                continue
            try:
                await apply_end(self.client, self._metrics_store, rec)
            except Exception as exc:  # leave the journal entry: the next start tries again
                self._logger.error("recovery: could not record run %s as %s: %s", rec.run_id, rec.action, exc)
                continue
            self.journal.remove(rec.run_id)
        if found:
            print(f"agent {self.name!r}: recovered {sum(alive.values())} live run(s), "
                  f"{len(found) - sum(alive.values())} ended while it was away", flush=True)

    async def _watch_adopted(self, rec: Recovery, task_group: Any = None) -> None:
        """A run started by a previous life of this agent: limits, sampler, timeout, end state, release."""
        run_id = UUID(rec.run_id)
        alloc = rec.alloc
        try:
            flow_run = await self.client.read_flow_run(run_id)
        except Exception:
            flow_run = None
        try:
            handle, limits = await self._adopt_handle(rec)
            self._active.of(run_id).handle = handle
            self._note(run_id, "start", "SUCCESS", message=f"agent {self.name} re-adopted the running run after a "
                                                           "restart (its capacity is held again)")
            if limits is not None:
                self._active.of(run_id).limits = limits
            if flow_run is not None:
                if handle.pid:
                    self._after_start(flow_run, alloc, handle.pid, started_at=rec.started_at)
                timeout = await self._timeout_of(flow_run)
                started = (rec.started_at or flow_run.start_time)
                self._arm_deadline(flow_run, handle, timeout, started.timestamp() if started else time.time(),
                                   task_group=task_group)
            while await self._handle_alive(rec.run_id, handle):
                await asyncio.sleep(0.5)
            with anyio.CancelScope() as scope:  # its end is recorded now; `cut_ending` may give up on it
                self._active.of(run_id).ending = scope
                await self._record_adopted_end(rec, run_id, flow_run, handle, limits)
        except Exception:
            self._logger.exception("watching re-adopted run %s failed", rec.run_id)
        finally:
            self._active.take(run_id, "ending")
            self._active.take(run_id, "limits")
            self._release_allocation(run_id)

    async def _record_adopted_end(self, rec: Recovery, run_id: UUID, flow_run: Optional["FlowRun"],
                                  handle: RunHandle, limits: Any) -> None:
        reason = await self._adopted_end(rec.run_id, handle, limits)
        if limits is not None:
            self._note_peak(run_id, limits)
        if flow_run is None:  # deleted from the server meanwhile: only the hardware to give back
            return
        await asyncio.sleep(1.0)  # the engine reports its own final state as it exits
        state = (await self.client.read_flow_run(run_id)).state
        if reason:
            await self._mark_stopped(flow_run, Crashed(message=reason))
        elif self._active.get(run_id).end_state is not None:
            await self._mark_stopped(flow_run, self._active.get(run_id).end_state)
        elif state is None or not state.is_final():
            await self._mark_stopped(flow_run, Crashed(message=(
                f"the run's {'container' if handle.container else 'process'} ended without reporting a final "
                f"state; agent {self.name} had re-adopted it after a restart, so its exit code is unknown")))
        await self._after_finish(flow_run, None)
        await self._note_end(flow_run, None, reason)

    async def _timeout_of(self, flow_run: "FlowRun") -> Optional[float]:
        try:
            req = resolve_request(self.queue_spec(), await self._deployment_vars(flow_run.deployment_id),
                                  flow_run.job_variables or {})
            return req.timeout_s
        except Exception:
            return None

    # ------------------------------------------------------------- publishing
    async def teardown(self, *exc_info: Any) -> None:
        await super().teardown(*exc_info)
        if self.history is not None:  # what the agent decided last (its runs' ends) reaches the store
            await anyio.to_thread.run_sync(self.history.flush, 5.0)

    async def _worker_metadata(self):
        """The installed integrations, as Prefect reports them, read from the distributions' metadata:
        Prefect's own version imports every collection first (see :mod:`.worker_metadata`)."""
        from prefect_launch.workers.agent.metadata import installed_integrations

        return installed_integrations()

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        await self._refresh_priorities()
        await self._publish_state()

    def _publish_soon(self) -> None:
        """Ask for a publish; the publisher coalesces bursts so starts are not slowed by extra writes."""
        if self._publish_wanted is not None:
            self._publish_wanted.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._publish_wanted.wait()
            await asyncio.sleep(PUBLISH_DEBOUNCE_S)
            self._publish_wanted.clear()
            await self._publish_state()

    async def _publish_state(self) -> None:
        if self._client is None:
            return
        state = AgentState(
            name=self.name,
            queues=sorted(self.agent.queues),
            capacity=self.ledger.capacity,
            free=self.ledger.free(),
            runs=[AgentRun(run_id=a.run_id, queue=a.queue, preset=a.preset, resources=a.resources,
                           gpu_indices=a.gpu_indices) for a in self.ledger.allocations()],
            heartbeat=datetime.now(timezone.utc),
        )
        try:
            with single_try():  # a busy server's 503: published again after the debounce, not retried at once
                await publish(self.client, state)
        except Exception as exc:
            self._logger.debug("could not publish agent state: %s", exc)
            self._publish_soon()


class PidHook:
    """Wraps the task status Prefect hands to ``run`` to learn the run's pid (or container id) first."""

    def __init__(self, inner: Any, on_started):
        self._inner = inner
        self._on_started = on_started

    def started(self, value: Any = None) -> None:
        if value is not None:
            self._on_started(value)
        self._inner.started(value)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)


def _signal_group(pid: int, sig: int) -> None:
    """Signal the run's process group (its own session), never the agent's."""
    try:
        pgid = os.getpgid(pid)
        if pgid != os.getpgid(0):
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _entry_for(rec: Recovery, agent: str) -> JournalEntry:
    return JournalEntry(run_id=rec.run_id, agent=agent, allocation=rec.alloc, pid=rec.pid,
                        pid_started=rec.pid_started, started_at=rec.started_at, container=rec.container)


def preempt_deadline_file(run_id: str) -> Path:
    """Where a preemptible run finds the time (epoch seconds) it will be killed, once it is preempted."""
    folder = Path(tempfile.gettempdir()) / "prefect-launch-preempt"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / str(run_id)
