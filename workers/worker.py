"""The `launch-process` worker: Prefect's process worker made resource-aware.

Start it with ``prefect worker start --pool Q --type launch-process`` or
``prefect-launch agent --queue Q``. Compared with the stock process worker it

- claims a run only when the run's resolved resources fit the agent's free
  capacity (one ledger across every queue the agent serves), in priority then
  submit order, strict FIFO unless the queue allows backfill;
- pins each run: disjoint ``CUDA_VISIBLE_DEVICES``, CPU affinity,
  ``OMP_NUM_THREADS``, an enforced memory limit;
- says why a run waits (flow-run label ``launch.waiting``);
- wakes on Prefect events for its pool instead of waiting for the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio
import anyio.to_thread
from pydantic import Field

from prefect.states import Cancelled, Crashed, Failed, State
from prefect.utilities.engine import propose_state
from prefect.workers.process import (
    ProcessJobConfiguration,
    ProcessVariables,
    ProcessWorker,
    ProcessWorkerResult,
)

from prefect_launch.workers.agent_context import AgentContext
from prefect_launch.workers.agent_registry import AgentRun, AgentState, offline_reasons, publish, read_agents
from prefect_launch.workers.durations import format_duration
from prefect_launch.workers.ledger import Allocation
from prefect_launch.workers.limits import RunLimits, run_environment
from prefect_launch.workers.placement import Candidate, plan
from prefect_launch.workers.queue_spec import Preset, QueueSpec, queue_spec_of
from prefect_launch.workers.recovery import ALLOC_LABEL, Recovery, pid_start_time, process_is_run
from prefect_launch.workers.run_journal import alloc_label
from prefect_launch.workers.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.resources import LaunchValidationError
from prefect_launch.workers.secret_env import resolve_secret_env

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import WorkerFlowRunResponse

WAIT_LABEL = "launch.waiting"
PLACED_LABEL = "launch.placement"
PUBLISH_DEBOUNCE_S = 1.0
TIMEOUT_GRACE_S = float(os.environ.get("LAUNCH_TIMEOUT_GRACE_SECONDS", "10"))
HEARTBEAT_S = os.environ.get("LAUNCH_HEARTBEAT_SECONDS", "30")  # Prefect's minimum; the zombie automation waits 3x
SIZE_PATTERN = r"^\d+(\.\d+)?\s*([KMGTP]i?|[kmgtp]i?|B|b)?$"


class LaunchProcessJobConfiguration(ProcessJobConfiguration):
    """Process job configuration plus the run's requested resources."""

    preset: Optional[str] = Field(default=None)
    cpu: Optional[float] = Field(default=None)
    memory: Optional[str] = Field(default=None)
    gpu: Optional[int] = Field(default=None)
    shm_size: Optional[str] = Field(default=None)
    agent: Optional[str] = Field(default=None)
    timeout: Optional[str] = Field(default=None)
    secret_env: Optional[dict[str, str]] = Field(default=None)
    launch: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        template = super().json_template()
        template.pop("launch", None)  # a literal written by `queue apply`, not a variable
        return template


class LaunchProcessVariables(ProcessVariables):
    """Variables shown in the Prefect UI's job-variables form for a launch queue."""

    preset: Optional[str] = Field(default=None, description="Resource preset of the queue.")
    cpu: Optional[float] = Field(default=None, gt=0, description="CPUs; overrides the preset.")
    memory: Optional[str] = Field(
        default=None, pattern=SIZE_PATTERN, description="Memory limit, e.g. 4Gi; overrides the preset."
    )
    gpu: Optional[int] = Field(default=None, ge=0, description="GPUs; overrides the preset.")
    shm_size: Optional[str] = Field(
        default=None, pattern=SIZE_PATTERN, description="Shared memory, e.g. 1Gi; overrides the preset."
    )
    agent: Optional[str] = Field(default=None, description="Run only on the agent with this name.")
    timeout: Optional[str] = Field(
        default=None, pattern=r"^\s*(\d+(\.\d+)?|(\d+(\.\d+)?[smhd])+)\s*$",
        description="End the run Failed after it has run this long, e.g. 90s, 30m, 2h.",
    )
    secret_env: Optional[dict[str, str]] = Field(
        default=None, description="Environment from Prefect Secret blocks: NAME -> Secret block name "
        "(the agent reads the value at start; only the name is stored).",
    )


DEFAULT_SPEC = QueueSpec(
    name="default", presets={"default": Preset(cpu=1, memory="1Gi")}, default_preset="default"
)


class _PidHook:
    """Wraps the task status Prefect hands to ``run`` to learn the run's pid first."""

    def __init__(self, inner: Any, on_pid):
        self._inner = inner
        self._on_pid = on_pid

    def started(self, value: Any = None) -> None:
        if isinstance(value, int):
            self._on_pid(value)
        self._inner.started(value)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)


class LaunchProcessWorker(ProcessWorker):
    type = "launch-process"
    job_configuration = LaunchProcessJobConfiguration
    job_configuration_variables = LaunchProcessVariables
    _description = (
        "Resource-aware process worker of prefect-launch: claims runs only when their cpu, "
        "memory and GPUs fit, pins GPUs and CPUs, and explains why runs wait."
    )
    _display_name = "Launch Process"
    _documentation_url = "https://github.com/prefect-launch/prefect-launch"

    def __init__(self, *args: Any, agent: Optional[AgentContext] = None, capacity: Optional[str] = None,
                 use_cgroups: bool = True, **kwargs: Any):
        kwargs.setdefault("name", socket.gethostname())
        super().__init__(*args, **kwargs)
        self.agent = agent or AgentContext.detect(capacity)
        self.ledger = self.agent.ledger
        self.warm_pool = self.agent.warm_pool
        self.agent.queues.add(self._work_pool_name)
        self.agent.on_release(self._wake_up)
        self.use_cgroups = use_cgroups
        self.poll_seconds = float(os.environ.get("LAUNCH_POLL_SECONDS", "2"))
        self._deployments: dict[UUID, tuple[float, dict[str, Any]]] = {}
        self._wait_reasons: dict[UUID, str] = {}
        self._limits: dict[UUID, RunLimits] = {}
        self._kill_reasons: dict[UUID, str] = {}
        self._end_states: dict[UUID, State] = {}  # why the agent ended a run (timeout, cancel on exit)
        self._ended: set[UUID] = set()  # runs whose end state the agent recorded itself
        self._deadlines: dict[UUID, Any] = {}
        self._pids: dict[UUID, int] = {}
        self._agents_seen: tuple[float, dict[str, str], set[str]] = (0.0, {}, set())
        self.journal = self.agent.journal(self.name)
        self._priorities: dict[str, int] = {}
        self._wake: Optional[asyncio.Event] = None
        self._publish_wanted: Optional[asyncio.Event] = None
        self._samplers: dict[UUID, Any] = {}
        self._metrics_store: Any = None
        self._background_started = False

    # ------------------------------------------------------------------ set-up
    async def _initialize_after_sync(self) -> None:
        await super()._initialize_after_sync()
        await self._refresh_priorities()
        if self._metrics_store is None:
            from prefect_launch.workers.run_metrics import load_store

            self._metrics_store = await load_store()
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

    async def _in_scope(self, scope: anyio.CancelScope, fn) -> None:
        with scope:
            await fn()

    async def _refresh_priorities(self) -> None:
        try:
            queues = await self.client.read_work_queues(work_pool_name=self._work_pool_name)
            self._priorities = {q.name: q.priority for q in queues}
        except Exception as exc:  # keep the last known priorities
            self._logger.debug("could not read work queues: %s", exc)

    def queue_spec(self) -> QueueSpec:
        """The queue declaration carried by the pool's base job template."""
        spec = queue_spec_of(self._work_pool) if self._work_pool else None
        return spec or DEFAULT_SPEC.model_copy(update={"name": self._work_pool_name})

    # ---------------------------------------------------------------- dispatch
    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _wake_loop(self) -> None:
        """Place runs when an event or a released run says so, and at least every few seconds.

        Events are the fast path; the short poll bounds the delay when the event stream lags
        (a busy server) - Prefect's own 10 s poll keeps running underneath as well.
        """
        while True:
            with anyio.move_on_after(self.poll_seconds):
                await self._wake.wait()
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
                        if event.event in ("prefect.flow-run.Scheduled", "prefect.flow-run.Pending",
                                           "prefect.flow-run.Cancelled", "prefect.flow-run.Late"):
                            self._wake_up()
            except Exception as exc:
                self._logger.debug("event subscription dropped (%s); retrying", exc)
                await asyncio.sleep(2)

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

    async def _deployment_vars(self, deployment_id: Optional[UUID]) -> dict[str, Any]:
        if deployment_id is None:
            return {}
        cached = self._deployments.get(deployment_id)
        if cached and time.monotonic() - cached[0] < 30:
            return cached[1]
        deployment = await self.client.read_deployment(deployment_id)
        values = dict(deployment.job_variables or {})
        self._deployments[deployment_id] = (time.monotonic(), values)
        return values

    async def _submit_scheduled_flow_runs(
        self, flow_run_response: list["WorkerFlowRunResponse"]
    ) -> list["FlowRun"]:
        spec = self.queue_spec()
        runs = {entry.flow_run.id: entry.flow_run for entry in flow_run_response
                if entry.flow_run.id not in self._submitting_flow_run_ids}
        if not runs:
            return []
        candidates: list[Candidate] = []
        requests: dict[str, ResolvedRequest] = {}
        for fr in runs.values():
            error = None
            request = None
            try:
                request = resolve_request(spec, await self._deployment_vars(fr.deployment_id), fr.job_variables or {})
                requests[str(fr.id)] = request
            except LaunchValidationError as exc:
                error = str(exc)
            except Exception as exc:  # deployment gone or unreadable: leave it for Prefect
                self._logger.debug("skipping run %s: %s", fr.id, exc)
                continue
            candidates.append(Candidate(
                run_id=str(fr.id), name=fr.name, submitted=fr.expected_start_time,
                priority_rank=self._priorities.get(fr.work_queue_name or "", 99),
                request=request, error=error,
            ))
        offline, known = ((await self._pinned_agents()) if any(r.agent and r.agent != self.name
                                                               for r in requests.values()) else ({}, None))
        decisions = plan(candidates, self.ledger.free(), self.ledger.capacity, self.name, spec.backfill,
                         agents_offline=offline, agents_known=known)
        started: list["FlowRun"] = []
        for decision in decisions:
            fr = runs[UUID(decision.run_id)]
            if decision.action == "start":
                req = requests[decision.run_id]
                alloc = self.ledger.try_allocate(decision.run_id, req.resources, queue=self._work_pool_name,
                                                 preset=req.preset)
                if alloc is None:  # another queue of this agent took the room meanwhile
                    await self._note_waiting(fr, "waiting: capacity taken by a run of another queue")
                    continue
                self.journal.record(alloc)  # before any process exists: a crash from here on is recoverable
                if req.timeout_s:
                    self._deadlines[fr.id] = req.timeout_s
                self._start(fr)
                started.append(fr)
            elif decision.action == "reject":
                await self._reject(fr, decision.reason)
            else:
                await self._note_waiting(fr, decision.reason)
        if started:
            self._publish_soon()
        return started

    def _start(self, flow_run: "FlowRun") -> None:
        self._wait_reasons.pop(flow_run.id, None)
        run_logger = self.get_flow_run_logger(flow_run)
        alloc = self.ledger.get(str(flow_run.id))
        run_logger.info(f"Agent '{self.name}' starting flow run with {alloc.resources.describe()}"
                        f" gpus={alloc.gpu_indices} cores={alloc.cpu_cores}")
        self._submitting_flow_run_ids.add(flow_run.id)
        if self._cancelling_observer is not None:
            self._cancelling_observer.add_in_flight_flow_run_id(flow_run.id)
        self._runs_task_group.start_soon(self._submit_run, flow_run)

    async def _note_waiting(self, flow_run: "FlowRun", reason: str) -> None:
        """Put the one-line reason on the Prefect run, only when it changes."""
        known = self._wait_reasons.get(flow_run.id) or (flow_run.labels or {}).get(WAIT_LABEL)
        if known == reason:
            self._wait_reasons[flow_run.id] = reason
            return
        self._wait_reasons[flow_run.id] = reason
        try:
            await self.client.update_flow_run_labels(flow_run.id, {WAIT_LABEL: reason})
        except Exception as exc:
            self._logger.debug("could not label waiting run %s: %s", flow_run.id, exc)

    async def _reject(self, flow_run: "FlowRun", reason: str) -> None:
        """A run the queue can never serve as given fails now, with the reason."""
        message = f"Rejected by agent {self.name}: {reason}"
        self.get_flow_run_logger(flow_run).error(message)
        try:
            await propose_state(self.client, Failed(message=message), flow_run_id=flow_run.id)
        except Exception as exc:
            self._logger.warning("could not reject run %s: %s", flow_run.id, exc)

    # --------------------------------------------------------------- execution
    async def run(
        self,
        flow_run: "FlowRun",
        configuration: LaunchProcessJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[int]] = None,
    ) -> ProcessWorkerResult:
        alloc = self.ledger.get(str(flow_run.id))
        if alloc is None:  # e.g. an ad-hoc submission that bypassed placement
            raise RuntimeError(f"flow run {flow_run.id} has no allocation on agent {self.name}")
        configuration.env.update(run_environment(alloc, self.name))
        configuration.env.update(await resolve_secret_env({"secret_env": configuration.secret_env}))
        # Heartbeats let Prefect's zombie automation (created by `setup`) crash the run if its host dies.
        configuration.env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", HEARTBEAT_S)
        limits = RunLimits(str(flow_run.id), alloc, use_cgroup=self.use_cgroups)
        self._limits[flow_run.id] = limits

        def on_pid(pid: int) -> None:
            self._pids[flow_run.id] = pid
            self.journal.set_pid(str(flow_run.id), pid, pid_start_time(pid))
            limits.apply(pid)
            self._after_start(flow_run, alloc, pid)
            self._arm_deadline(flow_run, pid, self._deadlines.pop(flow_run.id, None), time.time())

        hooked = _PidHook(task_status or anyio.TASK_STATUS_IGNORED, on_pid)
        status_code: Optional[int] = None
        try:
            if self.warm_pool is not None and not configuration._command_configured:
                result = await self._run_warm(flow_run, configuration, hooked)
            else:
                result = await super().run(flow_run, configuration, hooked)
            status_code = result.status_code
            return result
        finally:
            reason = limits.finish()
            self._note_peak(flow_run.id, limits)
            self._limits.pop(flow_run.id, None)
            with anyio.CancelScope(shield=True):
                if reason:
                    self._kill_reasons[flow_run.id] = reason
                    await self._mark_stopped(flow_run, Crashed(message=reason))
                elif flow_run.id in self._end_states:
                    await self._mark_stopped(flow_run, self._end_states[flow_run.id])
                await self._after_finish(flow_run, status_code)

    async def _mark_stopped(self, flow_run: "FlowRun", state: State) -> None:
        """The run's executor already reported a bare signal; record the agent's reason instead."""
        self.get_flow_run_logger(flow_run).error(state.message)
        self._ended.add(flow_run.id)
        try:
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception as exc:
            self._logger.warning("could not record why run %s was stopped: %s", flow_run.id, exc)

    def _note_peak(self, run_id: UUID, limits: Any) -> None:
        """The kernel's final peak reaches the summary (finish() removes the cgroup before the last sample)."""
        sampler = self._samplers.get(run_id)
        if sampler is not None and limits.peak_rss:
            sampler.note_peak_memory(limits.peak_rss)

    # --------------------------------------------------------------- timeouts
    def _arm_deadline(self, flow_run: "FlowRun", pid: int, seconds: Optional[float], started: float) -> None:
        """One timeout mechanism for every run of the agent (placed or re-adopted)."""
        if seconds and self._runs_task_group is not None:
            self._runs_task_group.start_soon(self._enforce_deadline, flow_run, pid, seconds, started)

    async def _enforce_deadline(self, flow_run: "FlowRun", pid: int, seconds: float, started: float) -> None:
        from prefect_launch.workers.limits import kill_tree

        await asyncio.sleep(max(0.0, started + seconds - time.time()))
        if self.ledger.get(str(flow_run.id)) is None or not process_is_run(pid, None, str(flow_run.id)):
            return  # it ended in time
        message = (f"timeout after {seconds:g} s ({format_duration(seconds)}): the run was stopped by agent "
                   f"{self.name}; submit with a longer --timeout or split the job")
        self._end_states[flow_run.id] = Failed(message=message)
        self.get_flow_run_logger(flow_run).error(message)
        _signal_group(pid, signal.SIGTERM)
        deadline = time.time() + TIMEOUT_GRACE_S
        while time.time() < deadline and process_is_run(pid, None, str(flow_run.id)):
            await asyncio.sleep(0.2)
        kill_tree(pid)

    def running(self) -> int:
        return len(self._pids)

    async def cancel_running(self, reason: str, grace_s: float = 10.0) -> None:
        """Stop every run this worker holds (SIGTERM, then SIGKILL) and record them Cancelled with why."""
        from prefect_launch.workers.limits import kill_tree

        pids = dict(self._pids)
        for run_id, pid in pids.items():
            self._end_states[run_id] = Cancelled(message=reason)
            _signal_group(pid, signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(process_is_run(p, None, str(r)) for r, p in pids.items()):
            await asyncio.sleep(0.2)
        for run_id, pid in pids.items():
            if process_is_run(pid, None, str(run_id)):
                kill_tree(pid)
        while time.time() < deadline + 15 and any(r in self._pids for r in pids):
            await asyncio.sleep(0.2)  # run() records the Cancelled state and releases

    # --------------------------------------------------------------- recovery
    async def _recover(self) -> None:
        """Rebuild the ledger from Prefect and the live processes before placing anything."""
        from prefect_launch.workers.recovery import apply_end, decide, gather

        pools = sorted(self.agent.queues)
        found = await gather(self.client, self.name, pools, self.journal)
        alive = {f.run_id: process_is_run(f.pid, f.pid_started, f.run_id) for f in found}
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
                self._runs_task_group.start_soon(self._watch_adopted, rec)
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

    async def _watch_adopted(self, rec: Recovery) -> None:
        """A run started by a previous life of this agent: limits, sampler, timeout, end state, release."""
        from prefect_launch.workers.limits import RunLimits

        run_id = UUID(rec.run_id)
        alloc = rec.alloc
        try:
            flow_run = await self.client.read_flow_run(run_id)
        except Exception:
            flow_run = None
        limits = RunLimits(rec.run_id, alloc, use_cgroup=self.use_cgroups)
        try:
            limits.attach(rec.pid)
            self._limits[run_id] = limits
            self._pids[run_id] = rec.pid
            if flow_run is not None:
                self._after_start(flow_run, alloc, rec.pid, started_at=rec.started_at)
                timeout = await self._timeout_of(flow_run)
                started = (rec.started_at or flow_run.start_time)
                self._arm_deadline(flow_run, rec.pid, timeout,
                                   started.timestamp() if started else time.time())
            while process_is_run(rec.pid, rec.pid_started, rec.run_id):
                await asyncio.sleep(0.5)
            reason = limits.finish()
            self._note_peak(run_id, limits)
            if flow_run is None:  # deleted from the server meanwhile: only the hardware to give back
                return
            await asyncio.sleep(1.0)  # the engine reports its own final state as it exits
            state = (await self.client.read_flow_run(run_id)).state
            if reason:
                await self._mark_stopped(flow_run, Crashed(message=reason))
            elif run_id in self._end_states:
                await self._mark_stopped(flow_run, self._end_states[run_id])
            elif state is None or not state.is_final():
                await self._mark_stopped(flow_run, Crashed(message=(
                    f"the run's process ended without reporting a final state; agent {self.name} had re-adopted "
                    "it after a restart, so its exit code is unknown")))
            await self._after_finish(flow_run, None)
        except Exception:
            self._logger.exception("watching re-adopted run %s failed", rec.run_id)
        finally:
            self._limits.pop(run_id, None)
            self._release_allocation(run_id)

    async def _timeout_of(self, flow_run: "FlowRun") -> Optional[float]:
        try:
            req = resolve_request(self.queue_spec(), await self._deployment_vars(flow_run.deployment_id),
                                  flow_run.job_variables or {})
            return req.timeout_s
        except Exception:
            return None

    async def _run_warm(self, flow_run: "FlowRun", configuration: LaunchProcessJobConfiguration,
                        task_status: Any) -> ProcessWorkerResult:
        """Prefect's process-worker run, with the engine process taken from the warm pool.

        The engine runs the deployment's pull steps itself (`load_flow_from_flow_run`),
        so code-, git- and storage-based jobs behave as with a cold start.
        """
        from prefect.flows import load_flow_from_flow_run
        from prefect.runner._flow_run_executor import FlowRunExecutorContext
        from prefect.utilities.processutils import command_to_string, get_sys_executable

        from prefect_launch.workers.warm_start import WarmEngineStarter

        working_dir_ctx = (
            tempfile.TemporaryDirectory(suffix="prefect") if not configuration.working_dir
            else contextlib.nullcontext(configuration.working_dir)
        )
        execution = None
        with working_dir_ctx as working_dir:
            async with FlowRunExecutorContext() as ctx:
                starter = WarmEngineStarter(
                    pool=self.warm_pool, refill=self._refill_warm_pool,
                    before_order=lambda pid: self.journal.set_pid(str(flow_run.id), pid, pid_start_time(pid)),
                    log_path=str(self.journal.log_path(str(flow_run.id))),
                    command=command_to_string([get_sys_executable(), "-m", "prefect.engine"]),
                    cwd=Path(working_dir).resolve(), env=configuration.env,
                    stream_output=configuration.stream_output, control_channel=ctx.control_channel,
                )
                executor = ctx.create_executor(flow_run, starter, resolve_flow=load_flow_from_flow_run,
                                               propose_submitting=False)

                async def execute(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
                    nonlocal execution
                    execution = await executor.submit(task_status=task_status)

                async with anyio.create_task_group() as tg:
                    handle = await tg.start(execute)
                    if handle.pid is None:
                        raise RuntimeError("Flow run process has no PID")
                    task_status.started(handle.pid)
        if execution is None or execution.status_code is None:
            raise RuntimeError("Failed to start flow run process.")
        return ProcessWorkerResult(status_code=execution.status_code, identifier=str(execution.handle.pid))

    def _refill_warm_pool(self) -> None:
        if self.warm_pool is not None and self._runs_task_group is not None:
            self._runs_task_group.start_soon(self.warm_pool.fill)

    def _after_start(self, flow_run: "FlowRun", alloc: Allocation, pid: int,
                     started_at: Optional[datetime] = None) -> None:
        """Start sampling the run's process tree from outside (no change to the job)."""
        from prefect_launch.workers.run_metrics import start_sampler

        sampler = start_sampler(self._metrics_store, flow_run, alloc, self.name, alloc.queue or self._work_pool_name,
                                pid, self._logger, started_at=started_at)
        if sampler is not None:
            self._samplers[flow_run.id] = sampler
        if self._runs_task_group is not None:  # off the start path: the run is already running
            self._runs_task_group.start_soon(self._label_placement, flow_run, alloc)

    async def _label_placement(self, flow_run: "FlowRun", alloc: Allocation) -> None:
        """Show on the Prefect run where it runs, and clear its old waiting reason.

        Deferred a moment: on a SQLite server a write that collides with the engine's own
        Running transition makes one of them wait out a 2 s client retry.
        """
        await asyncio.sleep(PUBLISH_DEBOUNCE_S)
        placed = (f"agent {self.name}: {alloc.resources.describe()}; gpus "
                  f"{','.join(map(str, alloc.gpu_indices)) or 'none'}; cores {','.join(map(str, alloc.cpu_cores))}")
        entry = self.journal.get(str(flow_run.id))
        machine = alloc_label(alloc, self.name, entry.pid if entry else None, entry.pid_started if entry else None)
        try:
            await self.client.update_flow_run_labels(flow_run.id, {PLACED_LABEL: placed, WAIT_LABEL: "",
                                                                   ALLOC_LABEL: machine})
        except Exception as exc:
            self._logger.debug("could not label run %s: %s", flow_run.id, exc)

    async def _after_finish(self, flow_run: "FlowRun", status_code: Optional[int]) -> None:
        """Stop sampling, write the summary, and attach it to the Prefect run as a table."""
        sampler = self._samplers.pop(flow_run.id, None)
        if sampler is None:
            return
        from prefect_launch.workers.run_metrics import publish_summary_artifact

        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
            exit_state = state.type.value if state else "UNKNOWN"
            if state is None or not state.is_final():  # the worker marks crashes after this point
                exit_state = "CRASHED" if status_code not in (0, None) else exit_state
        except Exception:
            exit_state = "CRASHED" if status_code not in (0, None) else "UNKNOWN"
        summary = await anyio.to_thread.run_sync(sampler.stop, exit_state)
        try:
            await publish_summary_artifact(self.client, flow_run.id, summary, sampler.record)
        except Exception as exc:
            self._logger.debug("could not attach the metrics summary to run %s: %s", flow_run.id, exc)

    async def _propose_crashed_state(self, flow_run: "FlowRun", message: str, client: Any = None) -> None:
        reason = self._kill_reasons.pop(flow_run.id, None)
        if flow_run.id in self._ended:  # the agent already recorded why (memory, timeout, cancel on exit)
            self._ended.discard(flow_run.id)
            return
        await super()._propose_crashed_state(flow_run, reason or message, client)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        super()._release_limit_slot(flow_run_id)
        self._release_allocation(flow_run_id)

    def _release_allocation(self, flow_run_id: UUID) -> None:
        self._pids.pop(flow_run_id, None)
        if self.ledger.release(str(flow_run_id)) is not None:
            self.journal.remove(str(flow_run_id))
            self._end_states.pop(flow_run_id, None)
            self.agent.released()
            self._publish_soon()

    async def teardown(self, *exc_info: Any) -> None:
        if self.warm_pool is not None:
            await self.warm_pool.close()
        await super().teardown(*exc_info)

    # ------------------------------------------------------------- publishing
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
            await publish(self.client, state)
        except Exception as exc:
            self._logger.debug("could not publish agent state: %s", exc)


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


def _entry_for(rec: Recovery, agent: str):
    from prefect_launch.workers.run_journal import JournalEntry

    return JournalEntry(run_id=rec.run_id, agent=agent, allocation=rec.alloc, pid=rec.pid,
                        pid_started=rec.pid_started, started_at=rec.started_at)
