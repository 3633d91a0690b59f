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

import shlex
from typing import TYPE_CHECKING, Any, Optional

import anyio
import anyio.to_thread
from pydantic import Field, PrivateAttr

from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration, DockerWorkerResult

from prefect_launch.workers.cluster.docker import MEMBER_LABEL, ClusterContainers, adopt_member_containers
from prefect_launch.workers.backends.container_engine import COMMAND as ENGINE_COMMAND
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.core import LaunchWorkerCore, PidHook, RunHandle
from prefect_launch.workers.agent.limits import container_gpu_env, gpu_device_ids, physical_cores
from prefect_launch.workers.scheduling.queue_spec import queue_spec_of
from prefect_launch.workers.agent.recovery import Found, Recovery, pid_start_time
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources, format_size
from prefect_launch.workers.agent.tags import AGENT_LABEL, QUEUE_LABEL, RUN_ID_LABEL
from prefect_launch.workers.backends.warm_containers import WarmContainers, run_container_name, shape_key, shape_of
from prefect_launch.workers.environments.run_image import prepare_job_image

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

LIVE_STATUSES = ("created", "running", "restarting", "paused")


def container_kwargs(resources: Resources, alloc: Allocation, run_id: str, agent: str, queue: str,
                     send_gpus: bool, uuids: Optional[dict[int, str]] = None) -> dict[str, Any]:
    """docker-py ``containers.create`` keyword arguments for the run's allocation (pure).

    ``device_requests`` is a list of plain dicts in the Engine API's shape
    (``Driver``, ``DeviceIDs``, ``Capabilities``); under ``send_gpus=False`` it is
    returned as ``rendered_device_requests`` and not sent, so a GPU-less host can
    run GPU-sized jobs on declared (virtual) GPUs and still check the request. Its ``DeviceIDs`` are
    the GPUs' UUIDs where ``uuids`` (NVML index -> UUID) has them all, else the NVML indices.
    """
    cores = physical_cores(alloc.cpu_cores) if alloc.cpu_cores else []
    kw: dict[str, Any] = {
        "nano_cpus": int(round(resources.cpu * 1e9)) if resources.cpu else None,
        "cpuset_cpus": ",".join(map(str, cores)) or None,
        "mem_limit": str(resources.memory) if resources.memory else None,
        "memswap_limit": str(resources.memory) if resources.memory else None,  # no swap beyond the limit
        "shm_size": str(resources.shm_size) if resources.shm_size else None,
        "labels": {RUN_ID_LABEL: run_id, AGENT_LABEL: agent, QUEUE_LABEL: queue},
        # Docker's init (tini) as PID 1: the engine runs as the container's command, and a PID 1 without a
        # handler ignores SIGTERM (stop, cancel, timeout would wait for the kill) and reaps no orphans
        "init": True,
    }
    requests = []
    if alloc.gpu_indices:
        requests.append({"Driver": "nvidia", "Count": 0, "DeviceIDs": gpu_device_ids(alloc.gpu_indices, uuids),
                         "Capabilities": [["gpu"]], "Options": {}})
    kw["device_requests" if send_gpus else "rendered_device_requests"] = requests
    return {k: v for k, v in kw.items() if v is not None}


def host_has_gpus() -> bool:
    try:
        from prefect_launch.workers.metrics.nvml import detect_gpus

        return bool(detect_gpus())
    except Exception:
        return False


def host_gpu_uuids() -> dict[int, str]:
    try:
        from prefect_launch.workers.metrics.nvml import gpu_uuids

        return gpu_uuids()
    except Exception:
        return {}


class LaunchDockerJobConfiguration(DockerWorkerJobConfiguration):
    """prefect-docker's configuration; the run's resolved request travels in a private attribute."""

    keep_container: bool = Field(default=False, description="Keep the container after the run ends.")
    environment: Optional[Any] = Field(default=None)  # a job environment: an image per hash (environments/image.py)
    launch: dict[str, Any] = Field(default_factory=dict)
    _request: Optional[ResolvedRequest] = PrivateAttr(default=None)
    _secret_env: Optional[dict[str, str]] = PrivateAttr(default=None)
    _command_configured: bool = PrivateAttr(default=False)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        template = super().json_template()
        template.pop("launch", None)  # a literal written by `queue apply`, not a variable
        return template

    def prepare_for_flow_run(self, flow_run: "FlowRun", deployment: Any = None, flow: Any = None,
                             work_pool: Any = None, worker_name: Optional[str] = None, worker_id: Any = None):
        command_configured = self._command_configured = bool(self.command)
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
        if not command_configured:  # Prefect's engine without its CLI in front (workers/backends/container_engine.py)
            self.command = shlex.join(ENGINE_COMMAND)
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
        self._warm: Optional[WarmContainers] = None  # this queue's warm containers (queue setting warm_containers)
        self._warm_checked = False

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        template = DockerWorker.get_default_base_job_template()
        template["job_configuration"]["keep_container"] = "{{ keep_container }}"
        template["variables"]["properties"]["keep_container"] = {
            "type": "boolean", "default": False, "title": "Keep container",
            "description": "Keep the container after the run ends (for inspection)."}
        template["job_configuration"]["environment"] = "{{ environment }}"
        template["variables"]["properties"]["environment"] = {
            "title": "Environment", "default": None,
            "description": "The job's environment: requirements (a file or pins), base_image or dockerfile; built "
                           "into an image launch-env/<job>:<hash> once per content hash (workers/environments)."}
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
        job_image = await prepare_job_image(self, flow_run, configuration.environment, configuration.image,
                                            self.docker)  # None: no environment declared
        if job_image is not None and job_image.error:  # recorded Failed with Docker's words; capacity goes back
            (task_status or anyio.TASK_STATUS_IGNORED).started()
            return DockerWorkerResult(status_code=0, identifier="environment-build-failed")
        if job_image is not None:
            configuration.image = job_image.reference
        configuration.env.update(await self.starts.env(alloc, configuration._secret_env))
        self.apply_allocation(configuration, alloc, str(flow_run.id))
        configuration.auto_remove = False  # its end state is read first; removed below unless kept
        cluster: Optional[ClusterContainers] = None
        if alloc.members:  # sub members' containers first: the run is Running once main1 (this container) is
            cluster = await self.clusters.start(flow_run, alloc, configuration)  # type: ignore[assignment]

        def on_started(infrastructure_pid: Any) -> None:
            container_id = str(infrastructure_pid).rsplit(":", 1)[-1]
            pid = self._container_pid(container_id)
            self.starts.on_started(flow_run, alloc, RunHandle(pid=pid, pid_started=pid_start_time(pid) if pid else None,
                                                        container=container_id))
            if cluster is not None and pid:
                self.clusters.on_main(flow_run, alloc, cluster, pid, None)

        status_code: Optional[int] = None
        reason: Optional[str] = None
        try:
            hook = PidHook(task_status or anyio.TASK_STATUS_IGNORED, on_started)
            result = await self._run_warm(flow_run, configuration, hook) if self._warm is not None else None
            if result is None:
                result = await super().run(flow_run, configuration, hook)
            status_code = result.status_code
            return result
        finally:
            if cluster is not None:  # main1 is gone: the other members end with it
                with anyio.CancelScope(shield=True):
                    await self.clusters.end(flow_run, cluster, status_code)
                    await anyio.to_thread.run_sync(cluster.remove)
            handle = self._active.get(flow_run.id).handle
            if handle is not None and handle.container:
                with anyio.CancelScope(shield=True):
                    reason = await anyio.to_thread.run_sync(self._end_of, handle.container, alloc,
                                                            configuration.keep_container)
            await self._on_finished(flow_run, status_code, None, reason)

    async def _run_warm(self, flow_run: "FlowRun", configuration: LaunchDockerJobConfiguration,
                        task_status: Any) -> Optional[DockerWorkerResult]:
        """prefect-docker's run, in a warm container of the run's shape; None: start it cold instead."""
        warm = self._warm
        assert warm is not None
        settings = await anyio.to_thread.run_sync(self._build_container_settings, self.docker(), configuration)
        shape = shape_of(settings, configuration._command_configured)
        if shape is None:
            return None
        key = shape_key(shape)
        entry = await anyio.to_thread.run_sync(warm.take, key)
        labels = {AGENT_LABEL: self.name, QUEUE_LABEL: self._work_pool_name}
        self._runs_task_group.start_soon(self._fill_warm, key, shape, labels)  # for the next run of this shape
        if entry is None:
            return None
        container = await anyio.to_thread.run_sync(warm.hand_over, entry, settings, str(flow_run.id))
        self._logger.info("run %s starts in warm container %s (%s)", flow_run.id, container.name, container.id[:12])
        created_event = self._emit_container_status_change_event(container, configuration)
        identifier = self._get_infrastructure_pid(container_id=container.id)
        task_status.started(identifier)
        container = await anyio.to_thread.run_sync(self._watch_container_safe, container, configuration,
                                                   created_event)
        exit_code = container.attrs["State"].get("ExitCode")
        return DockerWorkerResult(status_code=exit_code if exit_code is not None else -1, identifier=identifier)

    async def _fill_warm(self, key: str, shape: dict[str, Any], labels: dict[str, str]) -> None:
        try:
            if self._warm is not None:
                await anyio.to_thread.run_sync(self._warm.fill, key, shape, labels)
        except Exception as exc:
            self._logger.warning("could not start a warm container: %s", exc)

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        if self._warm_checked or self._work_pool is None:
            return
        self._warm_checked = True
        scope = anyio.CancelScope()
        self._scheduled_task_scopes.add(scope)
        self._runs_task_group.start_soon(self._in_scope, scope, self._cancel_watch_loop)
        spec = queue_spec_of(self.work_pool)
        try:
            pool = WarmContainers(self.docker(), spec.warm_containers if spec else 0, self.name,
                                  self._work_pool_name)
            stale = await anyio.to_thread.run_sync(pool.remove_stale)
            if stale:
                self._logger.info("removed %d unused warm container(s) of an earlier run of this agent", stale)
            if pool.size > 0:
                self._warm = pool
                scope = anyio.CancelScope()
                self._scheduled_task_scopes.add(scope)
                self._runs_task_group.start_soon(self._in_scope, scope, self._expire_warm_loop)
        except Exception as exc:
            self._logger.warning("warm containers off: %s", exc)

    async def _cancel_watch_loop(self, every_s: float = 1.0) -> None:
        """Stop the container of a run the user cancelled (Prefect's Cancelling state).

        The container runs Prefect's engine itself (`container_engine`), not ``prefect flow-run execute``,
        whose runner used to watch for the cancel inside the container; so the agent does: SIGTERM, the grace,
        then kill, and the run ends Cancelled with who stopped it."""
        from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, FlowRunFilterState,
                                                    FlowRunFilterStateType)
        from prefect.client.schemas.objects import StateType
        from prefect.states import Cancelled

        while True:
            await anyio.sleep(every_s)
            ids = [rid for rid in self._active.having("handle") if self._active.get(rid).end_state is None]
            if not ids:
                continue
            try:
                runs = await self.client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=ids),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING]))))
            except Exception as exc:
                self._logger.debug("cancel watch: %s", exc)
                continue
            for fr in runs:
                handle = self._active.get(fr.id).handle
                if handle is not None and self._active.get(fr.id).end_state is None:
                    state = Cancelled(message=f"cancelled: agent {self.name} stopped the run's container after "
                                              f"the cancel request")
                    self._runs_task_group.start_soon(self._stop_run, fr, handle, state)

    async def _expire_warm_loop(self, every_s: float = 30.0) -> None:
        """Warm containers unused for their time to live are removed even when no run comes."""
        while self._warm is not None:
            await anyio.sleep(every_s)
            try:
                await anyio.to_thread.run_sync(self._warm.expire)
            except Exception as exc:
                self._logger.debug("warm containers: %s", exc)

    async def teardown(self, *exc_info: Any) -> None:
        if self._warm is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._warm.close)
        await super().teardown(*exc_info)

    # ------------------------------------------------ cluster runs (single-node; multi-node: see cluster/follow.py)
    def _member_base_env(self, configuration: LaunchDockerJobConfiguration) -> dict[str, str]:
        """A member container's environment starts from the run's only (the agent's PATH is not the image's)."""
        return {k: v for k, v in configuration.env.items() if v is not None}

    def _new_cluster(self, flow_run: "FlowRun", configuration: LaunchDockerJobConfiguration) -> ClusterContainers:
        settings = self._build_container_settings(self.docker(), configuration)
        return ClusterContainers(run_id=str(flow_run.id), docker=self.docker(), main_settings=settings,
                                 send_gpus=self.gpus_sent(), keep=configuration.keep_container)

    def _adopt_followed_members(self, run_id: str, members: list, log_of) -> ClusterContainers:
        """A restarted follower's member containers of another agent's multi-node run, found by their labels."""
        return adopt_member_containers(self.docker(), run_id, members, log_of)

    async def _follower_members(self, fr: "FlowRun", alloc: Allocation,
                                dvars: dict[str, Any]) -> tuple[ClusterContainers, dict[str, str]]:
        """This agent's members of another agent's multi-node run: containers shaped from the run's own docker
        configuration (image, volumes, env, as its worker would build main1's), each limited to its share."""
        configuration = await self.job_configuration.resolve_for_flow_run(
            fr, client=self.client, work_pool=self.work_pool, worker_name=self.name, worker_id=self.backend_id)
        self.apply_allocation(configuration, alloc, str(fr.id))
        procs = await anyio.to_thread.run_sync(self._new_cluster, fr, configuration)
        return procs, self._member_base_env(configuration)

    def _adopt_cluster_members(self, run_id: str, subs: list, log_of: Any) -> ClusterContainers:
        """After a restart: the run's member containers, found by their labels."""
        return adopt_member_containers(self.docker(), run_id, subs, log_of)

    def apply_allocation(self, configuration: LaunchDockerJobConfiguration, alloc: Allocation, run_id: str) -> None:
        """Write the run's limits into the configuration prefect-docker turns into a container.

        A cluster run's container is main1: its own member's share, not the members' sum."""
        if alloc.members:
            m = alloc.members[0]
            alloc = alloc.model_copy(update={"resources": m.resources, "gpu_indices": m.gpu_indices,
                                             "cpu_cores": m.cpu_cores})
        resources = alloc.resources
        send = self.gpus_sent()
        kw = container_kwargs(resources, alloc, run_id, self.name, alloc.queue or self._work_pool_name, send,
                              uuids=host_gpu_uuids() if send else None)
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

    def _build_container_settings(self, docker_client: Any, configuration: Any) -> dict[str, Any]:
        """prefect-docker's settings; a container given GPUs names them as it sees them (`container_gpu_env`),
        not by the host's indices, which the run's environment carries."""
        settings = super()._build_container_settings(docker_client, configuration)
        ids = [str(d) for r in settings.get("device_requests") or [] for d in (r.get("DeviceIDs") or [])]
        if ids:
            settings["environment"] = {**(settings.get("environment") or {}), **container_gpu_env(ids)}
        return settings

    def _watch_container_safe(self, container: Any, configuration: Any, created_event: Any) -> Any:
        """prefect-docker's watch, with the container read again at its end: its exit code is read from the
        container it returns, whose state is otherwise the one seen before the wait (exit code 0)."""
        container = super()._watch_container_safe(container, configuration, created_event)
        try:
            container.reload()
        except Exception:  # removed meanwhile: the exit code is unknown
            pass
        return container

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

    def _infrastructure_pid(self, handle: RunHandle) -> Optional[str]:
        """``base_url:container``: prefect-docker's own `kill_infrastructure` stops it (docker stop, grace)."""
        return f"{self.docker().api.base_url}:{handle.container}" if handle.container else None

    def _containers_of(self, run_id: str) -> list[Any]:
        """The run's container: by its run-id label, or (warm-started, labels fixed before the run) by its name."""
        found = [c for c in self.docker().containers.list(all=True, filters={"label": f"{RUN_ID_LABEL}={run_id}"})
                 if MEMBER_LABEL not in (c.labels or {})]  # a cluster run's sub members carry the run id too
        named = self.docker().containers.list(all=True, filters={"name": run_container_name(run_id)})
        return found + [c for c in named if c.name == run_container_name(run_id) and c.id not in {f.id for f in found}]

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
        await self.clusters.adopted_end(run_id, strays=False)  # a re-adopted cluster run: its members end with main1
        alloc = self.ledger.get(run_id)
        if alloc is None or not handle.container:
            return None
        return await anyio.to_thread.run_sync(self._end_of, handle.container, alloc, False)
