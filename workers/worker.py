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

from prefect.states import Crashed, Failed
from prefect.utilities.engine import propose_state
from prefect.workers.process import (
    ProcessJobConfiguration,
    ProcessVariables,
    ProcessWorker,
    ProcessWorkerResult,
)

from prefect_launch.workers.agent_context import AgentContext
from prefect_launch.workers.agent_registry import AgentRun, AgentState, publish
from prefect_launch.workers.ledger import Allocation
from prefect_launch.workers.limits import RunLimits, run_environment
from prefect_launch.workers.placement import Candidate, plan
from prefect_launch.workers.queue_spec import Preset, QueueSpec, queue_spec_of
from prefect_launch.workers.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.resources import LaunchValidationError

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import WorkerFlowRunResponse

WAIT_LABEL = "launch.waiting"
PLACED_LABEL = "launch.placement"
PUBLISH_DEBOUNCE_S = 1.0
SIZE_PATTERN = r"^\d+(\.\d+)?\s*([KMGTP]i?|[kmgtp]i?|B|b)?$"


class LaunchProcessJobConfiguration(ProcessJobConfiguration):
    """Process job configuration plus the run's requested resources."""

    preset: Optional[str] = Field(default=None)
    cpu: Optional[float] = Field(default=None)
    memory: Optional[str] = Field(default=None)
    gpu: Optional[int] = Field(default=None)
    shm_size: Optional[str] = Field(default=None)
    agent: Optional[str] = Field(default=None)
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
        async with self.agent.plan_lock:
            return await super().get_and_submit_flow_runs()

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
        decisions = plan(candidates, self.ledger.free(), self.ledger.capacity, self.name, spec.backfill)
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
        limits = RunLimits(str(flow_run.id), alloc, use_cgroup=self.use_cgroups)
        self._limits[flow_run.id] = limits

        def on_pid(pid: int) -> None:
            limits.apply(pid)
            self._after_start(flow_run, alloc, pid)

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
            self._limits.pop(flow_run.id, None)
            if reason:
                self._kill_reasons[flow_run.id] = reason
                await self._mark_stopped(flow_run, reason)
            with anyio.CancelScope(shield=True):
                await self._after_finish(flow_run, status_code)

    async def _mark_stopped(self, flow_run: "FlowRun", reason: str) -> None:
        """The run's executor already reported a bare SIGKILL; record the agent's reason instead."""
        self.get_flow_run_logger(flow_run).error(reason)
        try:
            await self.client.set_flow_run_state(flow_run.id, Crashed(message=reason), force=True)
        except Exception as exc:
            self._logger.warning("could not record why run %s was stopped: %s", flow_run.id, exc)

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

    def _after_start(self, flow_run: "FlowRun", alloc: Allocation, pid: int) -> None:
        """Start sampling the run's process tree from outside (no change to the job)."""
        from prefect_launch.workers.run_metrics import start_sampler

        sampler = start_sampler(self._metrics_store, flow_run, alloc, self.name, self._work_pool_name, pid,
                                self._logger)
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
        try:
            await self.client.update_flow_run_labels(flow_run.id, {PLACED_LABEL: placed, WAIT_LABEL: ""})
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
        await super()._propose_crashed_state(flow_run, reason or message, client)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        super()._release_limit_slot(flow_run_id)
        if self.ledger.release(str(flow_run_id)) is not None:
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
