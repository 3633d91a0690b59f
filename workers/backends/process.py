"""The `launch-process` worker: Prefect's process worker made resource-aware.

Start it with ``prefect worker start --pool Q --type launch-process`` or
``prefect-launch agent --queue Q``. Everything a launch back end shares -
placement against one ledger per agent, pinning, limits, sampling, timeouts,
ends, restart recovery - is `lifecycle.LaunchWorkerCore`; this module is only
the process back end: the job variables, warm engines, and the run's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import anyio
import psutil
from pydantic import Field

from prefect.exceptions import InfrastructureNotAvailable, InfrastructureNotFound
from prefect.workers.process import (
    ProcessJobConfiguration,
    ProcessVariables,
    ProcessWorker,
    ProcessWorkerResult,
)

from prefect_launch.workers.cluster.lifecycle import ClusterAborted
from prefect_launch.workers.cluster.process import ClusterProcesses, adopt_members
from prefect_launch.workers.agent.core import LaunchWorkerCore, PidHook, RunHandle
from prefect_launch.workers.cluster.spec import MAX_CLUSTER_SIZE
from prefect_launch.workers.agent.limits import RunLimits, kill_tree
from prefect_launch.workers.agent.recovery import pid_start_time, process_is_run
from prefect_launch.workers.backends.executor_context import SharedExecutorContext, shared_context_enabled
from prefect_launch.workers.environments.run_env import prepare_job_environment

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

SIZE_PATTERN = r"^\d+(\.\d+)?\s*([KMGTP]i?|[kmgtp]i?|B|b)?$"
TIMEOUT_PATTERN = r"^\s*(\d+(\.\d+)?|(\d+(\.\d+)?[smhd])+)\s*$"



class LaunchProcessJobConfiguration(ProcessJobConfiguration):
    """Process job configuration plus the run's requested resources (as the UI form shows them)."""

    preset: Optional[str] = Field(default=None)
    cpu: Optional[float] = Field(default=None)
    memory: Optional[str] = Field(default=None)
    gpu: Optional[int] = Field(default=None)
    shm_size: Optional[str] = Field(default=None)
    agent: Optional[str] = Field(default=None)
    timeout: Optional[str] = Field(default=None)
    secret_env: Optional[dict[str, str]] = Field(default=None)
    environment: Optional[Any] = Field(default=None)  # a job environment (workers/environments/run_env.py)
    launch: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        template = super().json_template()
        template.pop("launch", None)  # a literal written by `queue apply`, not a variable
        return template


class LaunchVariables(ProcessVariables):
    """Variables shown in the Prefect UI's job-variables form for a launch queue (every back end)."""

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
        default=None, pattern=TIMEOUT_PATTERN,
        description="End the run Failed after it has run this long, e.g. 90s, 30m, 2h.",
    )
    preemptible: Optional[bool] = Field(
        default=None, description="May use idle capacity and be preempted (SIGTERM, grace, back to the queue) "
        "when a regular run needs it.",
    )
    secret_env: Optional[dict[str, str]] = Field(
        default=None, description="Environment from Prefect Secret blocks: NAME -> Secret block name "
        "(the agent reads the value at start; only the name is stored).",
    )
    cluster_size: Optional[int] = Field(
        default=None, ge=1, le=MAX_CLUSTER_SIZE,
        description="Members of a cluster run (main1, sub1, ...), each with the run's preset, placed all or none.",
    )
    cluster_mode: Optional[str] = Field(
        default=None, description="single-node (every member on one agent) or multi-node.",
    )
    environment: Optional[dict[str, Any]] = Field(
        default=None, description="The job's own Python environment, built once per content hash and cached by the "
        "agent (process queues): {requirements: requirements.txt} or a list of pins, or {pyproject: "
        "pyproject.toml}; optional python, find_links (a wheel folder), index_url.",
    )


LaunchProcessVariables = LaunchVariables


class LaunchProcessWorker(LaunchWorkerCore, ProcessWorker):
    type = "launch-process"
    job_configuration = LaunchProcessJobConfiguration
    job_configuration_variables = LaunchProcessVariables
    _description = (
        "Resource-aware process worker of prefect-launch: claims runs only when their cpu, "
        "memory and GPUs fit, pins GPUs and CPUs, and explains why runs wait."
    )
    _display_name = "Launch Process"
    _documentation_url = "https://github.com/prefect-launch/prefect-launch"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._shared_ctx: Optional[SharedExecutorContext] = SharedExecutorContext() if shared_context_enabled() else None

    async def run(
        self,
        flow_run: "FlowRun",
        configuration: LaunchProcessJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[int]] = None,
    ) -> ProcessWorkerResult:
        alloc = self._allocation_of(flow_run)
        configuration.env.update(await self.starts.env(alloc, configuration.secret_env))
        job_env = await prepare_job_environment(self, flow_run, configuration)  # None: no environment declared
        if job_env is not None and job_env.error:  # recorded Failed with the installer's words; capacity goes back
            (task_status or anyio.TASK_STATUS_IGNORED).started()
            return ProcessWorkerResult(status_code=0, identifier="environment-build-failed")
        cluster = None
        if alloc.members:
            try:
                cluster = await self.clusters.start(flow_run, alloc, configuration)
            except ClusterAborted as exc:  # multi-node: another agent refused; back to the queue, nothing held
                await self.clusters.requeue(flow_run, str(exc))
                return ProcessWorkerResult(status_code=0, identifier="cluster-incomplete")
        limits = RunLimits(str(flow_run.id), alloc, use_cgroup=self.use_cgroups)

        def on_pid(pid: Any) -> None:
            if isinstance(pid, int):
                self.starts.on_started(flow_run, alloc, RunHandle(pid=pid, pid_started=pid_start_time(pid)), limits)
                if cluster is not None:
                    self.clusters.on_main(flow_run, alloc, cluster, pid, limits)

        hooked = PidHook(task_status or anyio.TASK_STATUS_IGNORED, on_pid, announce=process_id)
        status_code: Optional[int] = None
        try:
            if self.warm_pool is not None and not configuration._command_configured:
                result = await self._run_warm(flow_run, configuration, hooked)
            else:
                result = await super().run(flow_run, configuration, hooked)
            status_code = result.status_code
            return result
        finally:
            if job_env is not None:
                job_env.release()
            if cluster is not None:  # main1 is gone: the other members end with it
                with anyio.CancelScope(shield=True):
                    await self.clusters.end(flow_run, cluster, status_code)
            await self._on_finished(flow_run, status_code, limits)

    async def _run_warm(self, flow_run: "FlowRun", configuration: LaunchProcessJobConfiguration,
                        task_status: Any) -> ProcessWorkerResult:
        """Prefect's process-worker run, with the engine process taken from the warm pool.

        The engine runs the deployment's pull steps itself (`load_flow_from_flow_run`),
        so code-, git- and storage-based jobs behave as with a cold start.
        """
        from prefect.flows import load_flow_from_flow_run
        from prefect.utilities.processutils import command_to_string, get_sys_executable

        from prefect_launch.workers.backends.warm_start import WarmEngineStarter

        working_dir_ctx = (
            tempfile.TemporaryDirectory(suffix="prefect") if not configuration.working_dir
            else contextlib.nullcontext(configuration.working_dir)
        )
        execution = None
        with working_dir_ctx as working_dir:
            async with self._executor_context() as ctx:
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

    @contextlib.asynccontextmanager
    async def _executor_context(self) -> AsyncIterator[Any]:
        """Prefect's `FlowRunExecutorContext` for a warm run: the worker's one shared context
        (backends/executor_context.py: entering one cost 0.26-0.62 s per run under load, and leaving it came
        before the run's capacity went back), or a context of the run's own where sharing is off or there is
        no run task group."""
        if self._shared_ctx is None or self._runs_task_group is None:
            from prefect_launch.compat.prefect import FlowRunExecutorContext

            async with FlowRunExecutorContext() as ctx:
                yield ctx
            return
        yield await self._shared_ctx.get(self._runs_task_group)

    def _infrastructure_pid(self, handle: RunHandle) -> Optional[str]:
        return process_id(handle.pid) if handle.pid else None

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: Any = None,
                                  grace_seconds: int = 30) -> None:
        """Stop a run's process group: SIGTERM, up to ``grace_seconds`` to exit, then SIGKILL (0: at once).

        Prefect's process worker has none; this one is the agent's only way to stop a process run (timeouts,
        idle reclaim, preemption, cancel on exit, Prefect's cancel of a pending run). ``infrastructure_pid`` is
        ``host:pid`` (a bare pid is read as this host's); only a process this agent started is signalled,
        checked against its recorded start time so a recycled pid is never hit.
        """
        host, _, pid_text = str(infrastructure_pid).rpartition(":")
        if host and host != socket.gethostname():
            raise InfrastructureNotAvailable(
                f"run process {infrastructure_pid} is on host {host!r}; agent {self.name} runs on "
                f"{socket.gethostname()!r}: stop it from an agent on that host")
        try:
            pid = int(pid_text)
        except ValueError:
            raise InfrastructureNotFound(f"{infrastructure_pid!r} does not name a process (host:pid)") from None
        found = [(rid, h) for rid, h in self._active.having("handle").items() if h.pid == pid]
        if not found:
            raise InfrastructureNotAvailable(f"process {pid} is not a run of agent {self.name}")
        run_id, handle = str(found[0][0]), found[0][1]
        if not process_is_run(pid, handle.pid_started, run_id):
            raise InfrastructureNotFound(f"the process {pid} of run {run_id} has already exited")
        group = run_group(pid)
        if grace_seconds > 0:
            signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_seconds
            while time.monotonic() < deadline and (process_is_run(pid, handle.pid_started, run_id)
                                                   or group_has_live_members(group)):
                await anyio.sleep(0.2)
        if process_is_run(pid, handle.pid_started, run_id):
            kill_tree(pid)
        if group_has_live_members(group):
            # the engine is gone but children it started (a job's workers, a shell's pipeline) outlive it
            # in its group: the grace is over, they go too, or they would hold GPUs no ledger counts
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)

    # ------------------------------------------------ cluster members as processes (`ClusterRuns`, `ClusterFollower`)
    def _member_base_env(self, configuration: Any) -> dict[str, str]:
        """What every sub member's environment starts from: the agent's own plus the run's."""
        return {**os.environ, **{k: v for k, v in configuration.env.items() if v is not None}}

    def _new_cluster(self, flow_run: "FlowRun", configuration: Any) -> ClusterProcesses:
        """The holder of a run's sub members (the docker worker's starts containers instead)."""
        return ClusterProcesses(run_id=str(flow_run.id))

    def _adopt_followed_members(self, run_id: str, members: list, log_of: Any) -> ClusterProcesses:
        """A restarted follower's hold on its live members (found by command line)."""
        return adopt_members(run_id, members, log_of)

    async def _follower_members(self, fr: "FlowRun", alloc: Any,
                                dvars: dict[str, Any]) -> tuple[ClusterProcesses, dict[str, str]]:
        """The holder of this agent's members of another agent's multi-node run ``fr`` and the environment they
        start from: an engine's (the agent's Prefect settings, even from a profile, and the job's env)."""
        from prefect.settings import get_current_settings

        env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
               **(dvars.get("env") or {}), **((fr.job_variables or {}).get("env") or {})}
        return ClusterProcesses(run_id=str(fr.id)), {k: str(v) for k, v in env.items() if v is not None}

    def _refill_warm_pool(self) -> None:
        if self.warm_pool is not None and self._runs_task_group is not None:
            self._runs_task_group.start_soon(self.warm_pool.fill)

    async def teardown(self, *exc_info: Any) -> None:
        if self._shared_ctx is not None:  # its holder task is in the run task group the teardown waits for
            await self._shared_ctx.close()
        if self.warm_pool is not None:
            await self.warm_pool.close()
        await super().teardown(*exc_info)


def process_id(pid: int) -> str:
    """The infrastructure id Prefect records for a process run: ``host:pid`` (`kill_infrastructure` reads it)."""
    return f"{socket.gethostname()}:{pid}"


def run_group(pid: int) -> Optional[int]:
    """The run's own process group id (its session), or None when it shares the agent's (never signalled)."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return None
    return pgid if pgid != os.getpgid(0) else None


def group_has_live_members(pgid: Optional[int]) -> bool:
    """Whether any process of the group is still running (zombies waiting for their parent's wait do not count)."""
    if pgid is None:
        return False
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def signal_group(pid: int, sig: int) -> None:
    """Signal the run's process group (its own session), never the agent's."""
    try:
        pgid = os.getpgid(pid)
        if pgid != os.getpgid(0):
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
