"""What every launch back end does around a run: intake, dispatch, pinning, watching, ends, recovery.

`LaunchWorkerCore` is mixed in front of a Prefect worker class (ProcessWorker,
DockerWorker, ...). It owns the agent-wide pieces - the ledger (through
`AgentContext`), the journal, event wake-ups, the dispatch cycle
(`dispatch.dispatch_cycle`), the run's environment, limits watch, metrics
sampler and summary artifact, timeouts, cancel on exit, restart recovery and
the published agent state - and asks its back end only four things about a
running run, through a `RunHandle`:

- ``_handle_alive(run_id, handle)``: is it still running;
- ``_infrastructure_pid(handle)``: the id its `kill_infrastructure` takes (process: ``host:pid``,
  docker: ``base_url:container``); every stop of the agent goes through `stops.RunStops.kill`, which calls
  Prefect's `kill_infrastructure` (SIGTERM, grace, kill), so Prefect's own cancel path and the
  agent's stops (timeout, idle reclaim, preemption, cancel on exit) are one mechanism;
- ``_found_alive(found)`` / ``_adopt_handle(rec)``: after a restart, is it still
  there and what is its handle now;
- ``_adopted_end(run_id, handle, limits)``: why a re-adopted run ended, if the
  agent knows better than the run's own final state.

Its parts, one role each, live beside it and reach the worker's state through ``part.w``: `stops.RunStops`
(timeouts, preemption, cancel on exit: every stop through `kill_infrastructure`), `idle_reclaim.IdleReclaim`,
`adoption.RunAdoption` (restart recovery), `run_end.RunEnds` (a run's end and its records),
`run_labels.RunLabels` (what a run's labels say of its placement), `publishing.AgentPublisher` (the agent's
published state) and `peers.PeerView` (the queue's other agents, as dispatch sees them). What stays here is
set-up, intake, the dispatch glue (Prefect's worker hooks), a run's start and its capacity release.

Capacity is released exactly once per run, on every end: by `_free_capacity` as soon as its process or
container is gone (before the bookkeeping of its end), else by `_release_allocation` (Prefect's slot release).

Every decision becomes a scheduling-history record (`blocks.scheduling_history`, written by
one `HistoryWriter` per agent): dispatch's placement decisions, the start (or its failure),
the timeout (``check_timeout EXPIRED task-timeout``), idle reclaim (``idle_check EXPIRED``
with the checker's reason) and the end (``terminate``, capacity released). Timeouts and idle
reclaims take one stop path, `stops.RunStops.stop_run`: the agent's end state (with its reason first in the
message) wins over what the run reports after the signal.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import socket
import time
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio
import anyio.to_thread

from prefect.states import State

from prefect_launch.blocks.scheduling_history import HistoryWriter, SchedulingRecord, SubStep
from prefect_launch.workers.agent.active_run import RunHandle
from prefect_launch.workers.agent.intake import QueueIntake
from prefect_launch.workers.agent.context import AgentContext
from prefect_launch.workers.scheduling.dispatch import DispatchHooks, dispatch_cycle
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.queued_state import QUEUED
from prefect_launch.workers.agent.recovery import Found, Recovery, process_is_run
from prefect_launch.workers.scheduling.resolve import ResolvedRequest
from prefect_launch.workers.agent.scheduled_runs import IDLE_POLL_CAP_DEFAULT, next_poll_s, read_due_runs
from prefect_launch.api_retry import install as install_quick_503_retries
from prefect_launch.workers.agent.adoption import RunAdoption
from prefect_launch.workers.agent.idle_reclaim import IdleReclaim
from prefect_launch.workers.agent.run_end import RunEnds
from prefect_launch.workers.agent.run_labels import RunLabels
from prefect_launch.workers.agent.run_start import RunStarts
from prefect_launch.workers.agent.publishing import AgentPublisher
from prefect_launch.workers.agent.peers import PeerView
from prefect_launch.workers.agent.stops import RunStops
from prefect_launch.workers.cluster.follow import ClusterFollower
from prefect_launch.workers.cluster.protocol import PLANNED_EVENT
from prefect_launch.workers.cluster.lifecycle import ClusterRuns

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import WorkerFlowRunResponse

install_quick_503_retries()  # every agent: a busy SQLite server's 503 costs a claim milliseconds, not 2 s

WAKE_COALESCE_S = 0.05
# Set in the agent's own wake loop: its frequent polls read the due runs instead of calling the
# worker poll endpoint, which writes (see workers/agent/scheduled_runs.py).
_READ_ONLY_POLL: contextvars.ContextVar[bool] = contextvars.ContextVar("launch_read_only_poll", default=False)


# Not Pending: a run another agent claimed frees nothing here, and with N agents each claim woke all N to read
# the due runs again (bench/hosts.py: ~1 in 5 of the agents' requests). This agent's own released runs wake it.
WAKE_EVENTS = tuple(f"prefect.flow-run.{name}" for name in (QUEUED, "Scheduled", "Cancelled"))


class LaunchWorkerCore(QueueIntake):
    """Mixin: put it before the Prefect worker class, e.g. ``class W(LaunchWorkerCore, ProcessWorker)``.

    Each role is a part it holds (``self.stops``, ``self.clusters``, ...); the back end supplies the hooks
    marked as such below (how a run's process or container is found, adopted and stopped)."""

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
        self.journal = self.agent.journal(self.name)
        self._priorities: dict[str, int] = {}
        self._wake: Optional[asyncio.Event] = None
        self._empty_reads = 0  # the wake loop's looks in a row that found nothing due (its poll backs off)
        self._publish_wanted: Optional[asyncio.Event] = None
        self._metrics_store: Any = None
        self._background_started = False
        self._cut_ends = False  # the agent stops without waiting for the server: ends are recorded locally only
        # its parts, one role each (they reach the worker's state through it: ``part.w``)
        self.stops = RunStops(self)
        self.idle = IdleReclaim(self)
        self.adoption = RunAdoption(self)
        self.ends = RunEnds(self)
        self.labels = RunLabels(self)
        self.publisher = AgentPublisher(self)
        self.starts = RunStarts(self)
        self.peers = PeerView(self)
        self.clusters = ClusterRuns(self)  # cluster runs this agent leads
        self.follower = ClusterFollower(self)  # members of other agents' multi-node runs hosted here

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
    async def sync_with_backend(self) -> None:
        """Prefect's sync (pool, queues, heartbeat), then the agent's set-up once the pool is known: its
        loops, the history writer, restart recovery; then the priorities and the published state."""
        await super().sync_with_backend()
        await self._refresh_priorities()
        if self._metrics_store is None:
            from prefect_launch.workers.metrics.run_sampling import load_store

            self._metrics_store = await load_store()
        if self.history is None and self._metrics_store is not None:
            self.agent.history = HistoryWriter(self._metrics_store, flush_s=float(os.environ.get("LAUNCH_HISTORY_FLUSH_SECONDS", "1")), logger=self._logger)
        if self._work_pool is not None and not self._background_started:
            self._background_started = True
            self._wake = asyncio.Event()
            self._publish_wanted = asyncio.Event()
            self._refill_warm_pool()
            for loop in (self._wake_loop, self._event_loop, self.publisher.publish_loop):
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
        self.follower.start()
        await self.publisher.publish_state()

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
        (a busy server) - Prefect's own 10 s poll keeps running underneath as well. While nothing is due
        the poll backs off (`scheduled_runs.next_poll_s`, up to LAUNCH_IDLE_POLL_SECONDS). This loop looks
        at the due runs with a read (workers/agent/scheduled_runs.py), so re-planning often never takes
        the server's write lock from submissions.
        """
        _READ_ONLY_POLL.set(True)  # this task's context only: Prefect's own poll still marks queues polled
        cap = float(os.environ.get("LAUNCH_IDLE_POLL_SECONDS", IDLE_POLL_CAP_DEFAULT))
        while True:
            with anyio.move_on_after(next_poll_s(self.poll_seconds, self._empty_reads, cap)):
                await self._wake.wait()
            await asyncio.sleep(WAKE_COALESCE_S)  # a burst of events (a batch submitted) makes one cycle
            self._wake.clear()
            try:
                await self.get_and_submit_flow_runs()
            except Exception:
                self._logger.exception("event-driven poll failed; polling continues")

    async def _event_loop(self) -> None:
        """Wake on flow-run events for this pool, and the cluster follower on a multi-node plan naming this agent;
        the regular polls stay as the fallback."""
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

        pool_id = self.work_pool.id
        event_filter = EventFilter(
            event=EventNameFilter(prefix=["prefect.flow-run.", PLANNED_EVENT]),
            related=EventRelatedFilter(resources_in_roles=[(f"prefect.work-pool.{pool_id}", "work-pool")]),
        )
        while True:
            try:
                async with get_events_subscriber(filter=event_filter, reconnect_on_clean_close=True) as sub:
                    async for event in sub:
                        # a run queued (submitted or requeued: "Queued", see queued_state; "Scheduled" from
                        # Prefect's own schedules) or cancelled. Not Late: Prefect marks runs named
                        # Scheduled Late 15 s after their due time, which changes nothing to plan
                        if event.event in WAKE_EVENTS:
                            self._wake_up()
                        elif event.event == PLANNED_EVENT and self.name in (event.payload or {}).get("followers", ()):
                            self.follower.wake()  # a multi-node plan names this agent: answer it now
            except Exception as exc:
                self._logger.debug("event subscription dropped (%s); retrying", exc)
                await asyncio.sleep(2)

    async def _get_scheduled_flow_runs(self) -> list[Any]:
        if _READ_ONLY_POLL.get() and self._work_pool is not None:
            before = datetime.now(timezone.utc) + timedelta(seconds=int(self._prefetch_seconds))
            try:
                runs = await read_due_runs(self.client, self.work_pool, list(self._work_queues or []), before,
                                           queues=await self._recent_work_queues())
            except Exception as exc:
                self._logger.debug("reading due runs failed (%s); using the worker poll", exc)
                runs = None
            if runs is not None:
                self._empty_reads = 0 if runs else self._empty_reads + 1
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


    # ---------------------------------------------------------------- dispatch
    async def _submit_scheduled_flow_runs(
        self, flow_run_response: list["WorkerFlowRunResponse"]
    ) -> list["FlowRun"]:
        """Place what fits (dispatch.dispatch_cycle, against the agent's one ledger), then hand the placed runs
        to Prefect's own submit (its limiter, in-flight set, cancel observer and `_submit_run`)."""
        runs = [entry.flow_run for entry in flow_run_response
                if entry.flow_run.id not in self._submitting_flow_run_ids]
        placed: set[UUID] = set()

        def start(flow_run: "FlowRun", alloc: Allocation, request: ResolvedRequest) -> None:
            self._start(flow_run, alloc, request)
            placed.add(flow_run.id)

        hooks = DispatchHooks(
            deployment_vars=self._deployment_vars, pinned_agents=self.peers.pinned_agents,
            start=start, wait=self._note_waiting, reject=self._reject,
            booked=self.journal.record,  # before any process exists: a crash from here on is recoverable
            log=self._logger.debug, history=self._note_history,
            preempt=self.stops.preempt, stopping=lambda: set(self.agent.preempting), peers=self.peers.peer_free,
            placed_elsewhere=self.peers.placed_elsewhere,
        )
        foreign = [c for q, cs in self.agent.unplaced.items() if q != self._work_pool_name for c in cs]
        self._wait_notes.new_cycle([fr.id for fr in runs])
        result = await dispatch_cycle(runs, self.queue_spec(), self.ledger, self._work_pool_name, self.name,
                                      self._priorities, hooks, foreign=foreign)
        self.agent.unplaced[self._work_pool_name] = result.unplaced
        submitted = await super()._submit_scheduled_flow_runs(
            [entry for entry in flow_run_response if entry.flow_run.id in placed])
        for run_id in placed - {fr.id for fr in submitted}:  # refused by the worker's --limit: not started
            self._logger.info("run %s placed but over the worker's run limit: its capacity goes back", run_id)
            self._release_allocation(run_id)
        if placed:
            self._publish_soon()
        return [fr for fr in result.started if fr.id in {s.id for s in submitted}]

    def _start(self, flow_run: "FlowRun", alloc: Allocation, request: ResolvedRequest) -> None:
        self._wait_notes.forget(flow_run.id)
        self._active.take(flow_run.id, "ended")  # a preempted run placed again starts with a clean slate
        self._active.take(flow_run.id, "kill_reason")
        self._active.of(flow_run.id).request = request
        self.get_flow_run_logger(flow_run).info(
            f"Agent '{self.name}' starting flow run with {alloc.resources.describe()}"
            f" gpus={alloc.gpu_indices} cores={alloc.cpu_cores}")

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

    async def _give_worker_labels_to_flow_run(self, flow_run_id: UUID) -> None:
        """Prefect's worker labels are not written here, on the run's start path, but with the placement
        labels once its process is up (`RunLabels.label_placement`): one label write per run instead of two. On a
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
            self._runs_task_group.start_soon(self.labels.write_labels, flow_run_id, self.labels.worker_labels())

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

    def _infrastructure_pid(self, handle: RunHandle) -> Optional[str]:
        """The id the back end's `kill_infrastructure` takes for this run (None: nothing to stop)."""
        raise NotImplementedError


    async def _found_alive(self, found: Found) -> bool:
        return process_is_run(found.pid, found.pid_started, found.run_id)

    async def _adopt_handle(self, rec: Recovery) -> tuple[RunHandle, Any]:
        """The handle of a re-adopted run, and its limits watch (re-attached to its existing group)."""
        from prefect_launch.workers.agent.limits import RunLimits

        limits = RunLimits(rec.run_id, rec.alloc, use_cgroup=self.use_cgroups)
        limits.attach(rec.pid)
        return RunHandle(pid=rec.pid, pid_started=rec.pid_started), limits

    async def _adopted_end(self, run_id: str, handle: RunHandle, limits: Any) -> Optional[str]:
        await self.clusters.adopted_end(run_id)  # a cluster run's sub members end with its main1
        return limits.finish() if limits is not None else None

    def _adopt_cluster_members(self, run_id: str, subs: list, log_of: Any) -> Any:
        """A re-adopted cluster run's sub members on this host (processes: found by command line)."""
        from prefect_launch.workers.cluster.process import adopt_members

        return adopt_members(run_id, subs, log_of)

    # --------------------------------------------------------------- timeouts


    # ------------------------------------------------------------ idle checks


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


    # --------------------------------------------------------------- recovery
    def _owner_of(self, queue: Optional[str]) -> "LaunchWorkerCore":
        """The worker of this agent that serves ``queue`` (its back end knows how to find the run)."""
        return self.agent.workers.get(queue or "", self)


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

    def _publish_soon(self) -> None:
        """Ask for a publish; the publisher coalesces bursts so starts are not slowed by extra writes."""
        if self._publish_wanted is not None:
            self._publish_wanted.set()


    # --------------------------------------- entry points the back ends and the agent call
    async def _on_finished(self, flow_run: "FlowRun", status_code: Optional[int], limits: Any = None,
                           reason: Optional[str] = None) -> None:
        """The back end's run is gone: `RunEnds.on_finished`."""
        await self.ends.on_finished(flow_run, status_code, limits, reason)

    async def _stop_run(self, flow_run: "FlowRun", handle: RunHandle, state: State,
                        grace_s: Optional[float] = None) -> None:
        """The agent stops a run it decided to end: `RunStops.stop_run`."""
        await self.stops.stop_run(flow_run, handle, state, grace_s)

    async def cancel_running(self, reason: str, grace_s: float = 10.0) -> None:
        """Stop every run this worker holds, recorded Cancelled with ``reason`` (the agent's exit)."""
        await self.stops.cancel_running(reason, grace_s)

    def cut_ending(self) -> None:
        """Give up recording ends the server does not take (the agent's stop): `RunStops.cut_ending`."""
        self.stops.cut_ending()

    async def _recover(self) -> None:
        """Before anything is placed: the members this agent followed in its previous life, then the ledger
        rebuilt and the runs a previous life left adopted."""
        await self.follower.recover()
        await self.adoption.recover()


class PidHook:
    """Wraps the task status Prefect hands to ``run`` to learn the run's pid (or container id) first;
    ``announce`` turns it into the infrastructure id Prefect records on the run (process: ``host:pid``)."""

    def __init__(self, inner: Any, on_started, announce=None):
        self._inner = inner
        self._on_started = on_started
        self._announce = announce

    def started(self, value: Any = None) -> None:
        if value is not None:
            self._on_started(value)
            if self._announce is not None:
                value = self._announce(value)
        self._inner.started(value)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)
