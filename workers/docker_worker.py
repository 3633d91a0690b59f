"""The `launch-docker` worker: prefect-docker's DockerWorker with the launch core in front.

Start it with ``prefect worker start --pool Q --type launch-docker`` or
``prefect-launch agent --queue Q`` (one agent serves process and docker queues
with one ledger). The back end adds only what is Docker's own:

- `container_kwargs` (pure): the run's resources and allocation as docker-py
  limits - ``nano_cpus`` and ``cpuset_cpus`` (the run's cores), ``mem_limit`` (no
  extra swap), ``shm_size``, GPU ``device_requests`` with the run's indices
  (rendered always, sent only where this host has NVIDIA GPUs), host networking,
  and labels naming the run, its agent and queue;
- how a container ends: exit code, ``OOMKilled`` from the container state, stop
  on cancel/timeout; the container is removed unless the queue keeps it;
- finding a run's container again after an agent restart, by its run-id label.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import anyio
import anyio.to_thread
from pydantic import Field, PrivateAttr

from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration, DockerWorkerResult

from prefect_launch.workers.ledger import Allocation
from prefect_launch.workers.lifecycle import LaunchWorkerCore, PidHook, RunHandle
from prefect_launch.workers.limits import physical_cores
from prefect_launch.workers.queue_spec import queue_spec_of
from prefect_launch.workers.recovery import Found, Recovery, pid_start_time
from prefect_launch.workers.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.resources import LaunchValidationError, Resources, format_size
from prefect_launch.workers.run_tags import AGENT_LABEL, QUEUE_LABEL, RUN_ID_LABEL

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

LIVE_STATUSES = ("created", "running", "restarting", "paused")


def container_kwargs(resources: Resources, alloc: Allocation, run_id: str, agent: str, queue: str,
                     send_gpus: bool) -> dict[str, Any]:
    """docker-py ``containers.create`` keyword arguments for the run's allocation (pure).

    ``device_requests`` is a list of plain dicts in the Engine API's shape
    (``Driver``, ``DeviceIDs``, ``Capabilities``); under ``send_gpus=False`` it is
    returned as ``rendered_device_requests`` and not sent, so a GPU-less host can
    run GPU-sized jobs on declared (virtual) GPUs and still check the request.
    """
    cores = physical_cores(alloc.cpu_cores) if alloc.cpu_cores else []
    kw: dict[str, Any] = {
        "nano_cpus": int(round(resources.cpu * 1e9)) if resources.cpu else None,
        "cpuset_cpus": ",".join(map(str, cores)) or None,
        "mem_limit": str(resources.memory) if resources.memory else None,
        "memswap_limit": str(resources.memory) if resources.memory else None,  # no swap beyond the limit
        "shm_size": str(resources.shm_size) if resources.shm_size else None,
        "labels": {RUN_ID_LABEL: run_id, AGENT_LABEL: agent, QUEUE_LABEL: queue},
    }
    requests = []
    if alloc.gpu_indices:
        requests.append({"Driver": "nvidia", "Count": 0, "DeviceIDs": [str(i) for i in alloc.gpu_indices],
                         "Capabilities": [["gpu"]], "Options": {}})
    kw["device_requests" if send_gpus else "rendered_device_requests"] = requests
    return {k: v for k, v in kw.items() if v is not None}


def host_has_gpus() -> bool:
    try:
        from prefect_launch.workers.nvml import detect_gpus

        return bool(detect_gpus())
    except Exception:
        return False


class LaunchDockerJobConfiguration(DockerWorkerJobConfiguration):
    """prefect-docker's configuration; the run's resolved request travels in a private attribute."""

    keep_container: bool = Field(default=False, description="Keep the container after the run ends.")
    launch: dict[str, Any] = Field(default_factory=dict)
    _request: Optional[ResolvedRequest] = PrivateAttr(default=None)
    _secret_env: Optional[dict[str, str]] = PrivateAttr(default=None)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        template = super().json_template()
        template.pop("launch", None)  # a literal written by `queue apply`, not a variable
        return template

    def prepare_for_flow_run(self, flow_run: "FlowRun", deployment: Any = None, flow: Any = None,
                             work_pool: Any = None, worker_name: Optional[str] = None, worker_id: Any = None):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        dep_vars = dict(getattr(deployment, "job_variables", None) or {})
        run_vars = dict(flow_run.job_variables or {})
        spec = queue_spec_of(work_pool) if work_pool is not None else None
        if spec is not None:
            try:
                self._request = resolve_request(spec, dep_vars, run_vars)
            except LaunchValidationError:
                self._request = None  # placement rejected it already; a cancel still needs this configuration
        self._secret_env = {**(dep_vars.get("secret_env") or {}), **(run_vars.get("secret_env") or {})} or None
        if not self.network_mode and not self.networks:
            self.network_mode = "host"  # the API and the metrics store are on this host's loopback


class LaunchDockerWorker(LaunchWorkerCore, DockerWorker):
    type = "launch-docker"
    job_configuration = LaunchDockerJobConfiguration
    _description = (
        "Resource-aware Docker worker of prefect-launch: claims runs only when they fit, runs each in a "
        "container limited to its preset (cpus, cores, memory, shm, GPUs) and records why runs wait or end."
    )
    _display_name = "Launch Docker"
    _documentation_url = "https://github.com/prefect-launch/prefect-launch"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._docker: Any = None
        self._send_gpus: Optional[bool] = None

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        template = DockerWorker.get_default_base_job_template()
        template["job_configuration"]["keep_container"] = "{{ keep_container }}"
        template["variables"]["properties"]["keep_container"] = {
            "type": "boolean", "default": False, "title": "Keep container",
            "description": "Keep the container after the run ends (for inspection)."}
        return template

    def docker(self) -> Any:
        if self._docker is None:
            self._docker = self._get_client()
        return self._docker

    def gpus_sent(self) -> bool:
        if self._send_gpus is None:
            self._send_gpus = host_has_gpus()
        return self._send_gpus

    # ------------------------------------------------------------------ run
    async def run(self, flow_run: "FlowRun", configuration: LaunchDockerJobConfiguration,
                  task_status: Optional[anyio.abc.TaskStatus[str]] = None) -> DockerWorkerResult:
        alloc = self._allocation_of(flow_run)
        configuration.env.update(await self._run_env(alloc, configuration._secret_env))
        self.apply_allocation(configuration, alloc, str(flow_run.id))
        configuration.auto_remove = False  # its end state is read first; removed below unless kept

        def on_started(infrastructure_pid: Any) -> None:
            container_id = str(infrastructure_pid).rsplit(":", 1)[-1]
            pid = self._container_pid(container_id)
            self._on_started(flow_run, alloc, RunHandle(pid=pid, pid_started=pid_start_time(pid) if pid else None,
                                                        container=container_id))

        status_code: Optional[int] = None
        reason: Optional[str] = None
        try:
            result = await super().run(flow_run, configuration, PidHook(task_status or anyio.TASK_STATUS_IGNORED,
                                                                          on_started))
            status_code = result.status_code
            return result
        finally:
            handle = self._handles.get(flow_run.id)
            if handle is not None and handle.container:
                with anyio.CancelScope(shield=True):
                    reason = await anyio.to_thread.run_sync(self._end_of, handle.container, alloc,
                                                            configuration.keep_container)
            await self._on_finished(flow_run, status_code, None, reason)

    def apply_allocation(self, configuration: LaunchDockerJobConfiguration, alloc: Allocation, run_id: str) -> None:
        """Write the run's limits into the configuration prefect-docker turns into a container."""
        resources = alloc.resources
        kw = container_kwargs(resources, alloc, run_id, self.name, alloc.queue or self._work_pool_name,
                              self.gpus_sent())
        configuration.labels = {**configuration.labels, **kw.pop("labels")}
        configuration.mem_limit = kw.pop("mem_limit", None)
        configuration.memswap_limit = kw.pop("memswap_limit", None)
        kw.pop("rendered_device_requests", None)
        if "device_requests" in kw:
            import docker.types

            kw["device_requests"] = [docker.types.DeviceRequest(
                driver=r["Driver"], device_ids=r["DeviceIDs"], capabilities=r["Capabilities"])
                for r in kw["device_requests"]]
        configuration.container_create_kwargs = {**(configuration.container_create_kwargs or {}), **kw}

    def _container_pid(self, container_id: str) -> Optional[int]:
        try:
            c = self.docker().containers.get(container_id)
            return int(c.attrs["State"].get("Pid") or 0) or None
        except Exception:
            return None

    def _end_of(self, container_id: str, alloc: Allocation, keep: bool) -> Optional[str]:
        """Why the container ended when the agent knows better than the engine (OOM); remove it."""
        import docker.errors

        try:
            c = self.docker().containers.get(container_id)
            state = c.attrs.get("State") or {}
            reason = None
            if state.get("OOMKilled"):
                reason = (f"out of memory: the container exceeded its memory limit "
                          f"{format_size(alloc.resources.memory)} and the kernel killed it (OOMKilled, exit code "
                          f"{state.get('ExitCode')}); ask for more memory (--memory or a larger preset)")
            if not keep:
                c.remove(force=True)
            return reason
        except docker.errors.NotFound:
            return None

    # ------------------------------------------------ back-end hooks (docker)
    async def _handle_alive(self, run_id: str, handle: RunHandle) -> bool:
        if not handle.container:
            return False
        return await anyio.to_thread.run_sync(self._container_alive, handle.container)

    def _container_alive(self, container_id: str) -> bool:
        try:
            return self.docker().containers.get(container_id).status in LIVE_STATUSES
        except Exception:
            return False

    async def _terminate(self, run_id: str, handle: RunHandle, force: bool) -> None:
        def kill() -> None:
            try:
                self.docker().containers.get(handle.container).kill(signal="SIGKILL" if force else "SIGTERM")
            except Exception:
                pass

        if handle.container:
            await anyio.to_thread.run_sync(kill)

    def _containers_of(self, run_id: str) -> list[Any]:
        return self.docker().containers.list(all=True, filters={"label": f"{RUN_ID_LABEL}={run_id}"})

    async def _found_alive(self, found: Found) -> bool:
        def alive() -> bool:
            return any(c.status in LIVE_STATUSES for c in self._containers_of(found.run_id))

        try:
            return await anyio.to_thread.run_sync(alive)
        except Exception as exc:
            self._logger.warning("recovery: cannot ask dockerd about run %s: %s", found.run_id, exc)
            return False

    async def _adopt_handle(self, rec: Recovery) -> tuple[RunHandle, Any]:
        def find() -> RunHandle:
            live = [c for c in self._containers_of(rec.run_id) if c.status in LIVE_STATUSES]
            c = live[0]
            pid = int(c.attrs["State"].get("Pid") or 0) or None
            return RunHandle(pid=pid, pid_started=pid_start_time(pid) if pid else None, container=c.id)

        return await anyio.to_thread.run_sync(find), None

    async def _adopted_end(self, run_id: str, handle: RunHandle, limits: Any) -> Optional[str]:
        alloc = self.ledger.get(run_id)
        if alloc is None or not handle.container:
            return None
        return await anyio.to_thread.run_sync(self._end_of, handle.container, alloc, False)
