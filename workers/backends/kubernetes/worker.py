"""The `launch-kubernetes` worker: prefect-kubernetes's KubernetesWorker that carries the queue's presets.

(About 550 lines with its job configuration and variables; the thin Kubernetes API client is api.py, the
manifest manifest.py, the events' meaning events.py, the run's Secrets secrets.py, re-attaching after a
restart reattach.py, cluster runs cluster/kubernetes_run.py.)

Start it with ``prefect worker start --pool Q --type launch-kubernetes`` or
``prefect-launch agent --queue Q`` (one agent may serve process, docker and
kubernetes queues). Placement is the cluster's: this back end holds no ledger
and books nothing locally. Per run it

1. resolves the request once (queue default < deployment < run, the same
   `resolve_request` as every back end) before claiming the run, and fails a run
   the queue can never serve with the reason;
2. writes the request into the pool's Job manifest (`kubernetes_manifest.apply_run`):
   requests = limits for cpu/memory, ``nvidia.com/gpu``, a memory-backed
   ``/dev/shm`` (emptyDir, medium Memory, sizeLimit = ``shm_size``), the preset's
   node selector and tolerations, ports, PVC mounts, env (``secret_env`` through a
   per-run Kubernetes Secret, never in the manifest), image pull secrets made
   from Prefect Secret blocks, and the run's labels;
3. creates the Job with prefect-kubernetes's ``_create_job`` (its API-key Secret,
   retries and error hints) and then watches the Job, the pod labelled with the
   run id and their events (`kubernetes_events.observe`): ``Unschedulable`` /
   ``FailedScheduling`` (and image-pull or missing-Secret stalls) become the run's
   ``launch.waiting`` label, the node it lands on its ``launch.placement``, and
   eviction, preemption, OOM kill, a non-zero exit or a deleted Job its recorded
   end state with the reason;
4. deletes the Job when the run is cancelled (Prefect Cancelling, or the agent
   stopping with ``--on-exit cancel``) or runs past its timeout.

A cluster run (``cluster_size`` > 1) becomes an indexed Job and a headless Service
(`kubernetes_cluster`, `kubernetes_cluster_run`): one pod per member, followed member by
member (`kubernetes_cluster_events`); one member failing fails the run with its name.

A restarted worker re-attaches to the Jobs of its Pending/Running runs (the
``infrastructure_pid`` Prefect stores, ``namespace:job``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio
import anyio.abc
from pydantic import Field, PrivateAttr

from prefect.states import Cancelled, Crashed, Failed, State
from prefect.workers.base import BaseWorker
from prefect_launch.settings import env_seconds
from prefect_launch.compat.prefect_kubernetes import slugify_label_value
from prefect_kubernetes.worker import (
    KubernetesWorker,
    KubernetesWorkerJobConfiguration,
    KubernetesWorkerResult,
    KubernetesWorkerVariables,
)

from prefect_launch.workers.cluster.spec import MAX_CLUSTER_SIZE
from prefect_launch.workers.agent.intake import DEFAULT_SPEC, QueueIntake
from prefect_launch.times import format_duration
from prefect_launch.workers.cluster.kubernetes_events import observe_cluster
from prefect_launch.workers.cluster.kubernetes_run import KubernetesClusterRuns
from prefect_launch.workers.backends.kubernetes.events import Observation, observe
from prefect_launch.workers.backends.kubernetes.api import KubeApi
from prefect_launch.workers.backends.kubernetes.manifest import apply_run
from prefect_launch.workers.backends.kubernetes.reattach import Reattach
from prefect_launch.workers.backends.kubernetes.secrets import RunSecrets
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.limits import run_environment
from prefect_launch.workers.scheduling.queue_spec import QueueSpec, queue_spec_of
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.scheduling.resources import LaunchValidationError
from prefect_launch.workers.agent.tags import PLACED_LABEL, RUN_ID_LABEL, WAIT_LABEL

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import WorkerFlowRunResponse


# The pool's variables that the preset replaces (prefect-kubernetes >= 0.8 has them; the preset owns resources).
PRESET_OWNED = ("cpu_request", "cpu_limit", "memory_request", "memory_limit")


def kubernetes_run_environment(request: ResolvedRequest, queue: str, agent: str) -> dict[str, str]:
    """The launch env every back end gives a run, less what the node decides (GPU ids, cores)."""
    env = run_environment(Allocation(run_id="", resources=request.resources, queue=queue, preset=request.preset),
                          agent)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the NVIDIA device plugin sets it for the GPUs it grants
    env.pop("LAUNCH_CPU_CORES", None)
    return env


class LaunchKubernetesJobConfiguration(KubernetesWorkerJobConfiguration):
    """prefect-kubernetes's configuration plus what a launch run adds; the resolved request travels with it."""

    ports: list[int] = Field(default_factory=list)
    pvc_mounts: dict[str, str] = Field(default_factory=dict)
    image_pull_secrets: list[str] = Field(default_factory=list)
    launch: dict[str, Any] = Field(default_factory=dict)
    _request: Optional[ResolvedRequest] = PrivateAttr(default=None)
    _spec: Optional[QueueSpec] = PrivateAttr(default=None)
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
        self._spec = (queue_spec_of(work_pool) if work_pool is not None else None) or (
            QueueSpec.model_validate(self.launch) if self.launch else None)
        if self._spec is not None:
            try:
                self._request = resolve_request(self._spec, dep_vars, run_vars)
            except LaunchValidationError:
                self._request = None  # dispatch rejected it already; a cancel still needs this configuration
        self._secret_env = {**(dep_vars.get("secret_env") or {}), **(run_vars.get("secret_env") or {})} or None
        # a pool made from prefect-kubernetes's own template has no placeholders for these: read the job variables
        for key in ("ports", "pvc_mounts", "image_pull_secrets"):
            if not getattr(self, key):
                value = run_vars.get(key, dep_vars.get(key))
                if value:
                    setattr(self, key, value)

    def _configure_eviction_handling(self) -> None:
        """prefect-kubernetes tells the engine to reschedule its run on SIGTERM (``backoffLimit: 0``), so an
        evicted or preempted run silently goes back to Scheduled. Launch queues record that end instead (the
        worker reads why from the pod); set PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR yourself to opt back in."""

    def apply_request(self, request: ResolvedRequest, *, run_id: str, queue: str, agent: str,
                      env: Optional[dict[str, str]] = None, env_secret: Optional[tuple[str, list[str]]] = None,
                      pull_secrets: Optional[list[str]] = None) -> dict[str, Any]:
        """Write the resolved request into this configuration's Job manifest (see kubernetes_manifest.apply_run)."""
        spec = self._spec or DEFAULT_SPEC
        preset = spec.presets.get(request.preset)
        return apply_run(
            self.job_manifest, run_id=run_id, resources=request.resources,
            queue=slugify_label_value(queue), agent=slugify_label_value(agent) if agent else "",
            env=env, env_from_secret=env_secret,
            node_selector=preset.node_selector if preset else None,
            tolerations=preset.tolerations if preset else None,
            ports=self.ports, pvc_mounts=self.pvc_mounts, image_pull_secrets=pull_secrets,
        )


class LaunchKubernetesVariables(KubernetesWorkerVariables):
    """The pool form: prefect-kubernetes's variables, launch's resources, and ports, PVC mounts and pull secrets."""

    preset: Optional[str] = Field(default=None, description="Resource preset of the queue.")
    cpu: Optional[float] = Field(default=None, gt=0, description="CPUs; overrides the preset.")
    memory: Optional[str] = Field(default=None, description="Memory limit, e.g. 4Gi; overrides the preset.")
    gpu: Optional[int] = Field(default=None, ge=0, description="nvidia.com/gpu; overrides the preset.")
    shm_size: Optional[str] = Field(default=None, description="Size of the memory-backed /dev/shm, e.g. 1Gi.")
    agent: Optional[str] = Field(default=None, description="Run only through the agent with this name.")
    timeout: Optional[str] = Field(default=None, description="Delete the job and end the run Failed after it "
                                   "has run this long, e.g. 90s, 30m, 2h.")
    secret_env: Optional[dict[str, str]] = Field(
        default=None, description="Environment from Prefect Secret blocks: NAME -> Secret block name (the "
        "agent puts the values in a per-run Kubernetes Secret; the Job manifest only references it).")
    ports: Optional[list[int]] = Field(default=None, description="Container ports to declare.")
    pvc_mounts: Optional[dict[str, str]] = Field(
        default=None, description="PersistentVolumeClaims to mount: claim name -> mount path.")
    image_pull_secrets: Optional[list[str]] = Field(
        default=None, description="Prefect Secret blocks holding registry credentials (a docker config or "
        "registry/username/password); the agent turns each into a kubernetes.io/dockerconfigjson Secret.")
    cluster_size: Optional[int] = Field(
        default=None, ge=1, le=MAX_CLUSTER_SIZE, description="Members of a cluster run (main1, sub1, ...), each "
        "a pod of one indexed Job with the run's preset; a headless Service lets them find each other.")
    cluster_mode: Optional[str] = Field(
        default=None, description="single-node (every member on one node, required pod affinity) or multi-node "
        "(members spread over nodes, preferred pod anti-affinity).")


class LaunchKubernetesWorker(QueueIntake, KubernetesWorker):
    type = "launch-kubernetes"
    job_configuration = LaunchKubernetesJobConfiguration
    job_configuration_variables = LaunchKubernetesVariables
    _description = (
        "Kubernetes worker of prefect-launch: runs each flow run as a Job sized by the queue's preset "
        "(cpu/memory requests = limits, nvidia.com/gpu, memory-backed /dev/shm, node selector, tolerations) "
        "and records why runs wait (Unschedulable) or end (eviction, preemption, OOM)."
    )
    _display_name = "Launch Kubernetes"
    _documentation_url = "https://github.com/prefect-launch/prefect-launch"

    def __init__(self, *args: Any, agent: Any = None, capacity: Optional[str] = None, use_cgroups: bool = True,
                 **kwargs: Any):
        kwargs.setdefault("name", socket.gethostname())
        super().__init__(*args, **kwargs)
        self.agent = agent  # the agent's shared context: only its draining flag matters here (no ledger)
        self.poll_seconds = float(os.environ.get("LAUNCH_POLL_SECONDS", "2"))
        self.watch_seconds = env_seconds("LAUNCH_KUBERNETES_POLL_SECONDS", 3)
        self.clusters = KubernetesClusterRuns(self)  # indexed Job + headless Service of a cluster run
        self.secrets = RunSecrets(self)  # a run's secret_env and image pull Secrets
        self.reattach = Reattach(self)  # after a restart: the Jobs of this worker's live runs
        self._watching: dict[UUID, tuple[str, str]] = {}  # run -> (namespace, job)
        self._stop: dict[UUID, State] = {}  # runs the worker is ending (cancel, timeout), with their end state
        self._background_started = False
        self._reattached = False

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        template = super().get_default_base_job_template()
        container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
        container.pop("resources", None)  # the preset's, written per run
        props = template["variables"]["properties"]
        for key in PRESET_OWNED:
            props.pop(key, None)
        return template

    # ------------------------------------------------------------------ set-up
    async def __aenter__(self) -> "LaunchKubernetesWorker":
        """Without prefect-kubernetes's cluster-wide (kopf) observer: this worker follows its own Jobs, which
        namespaced RBAC allows, and records the ends itself."""
        return await BaseWorker.__aenter__(self)

    async def __aexit__(self, *exc_info: Any) -> None:
        await BaseWorker.__aexit__(self, *exc_info)

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        if self._work_pool is None or self._runs_task_group is None:
            return
        if not self._background_started:
            self._background_started = True
            scope = anyio.CancelScope()
            self._scheduled_task_scopes.add(scope)
            self._runs_task_group.start_soon(self._in_scope, scope, self._poll_loop)
        if not self._reattached:
            self._reattached = True
            self._runs_task_group.start_soon(self.reattach.start)

    async def _poll_loop(self) -> None:
        """Claim runs every few seconds (Prefect's own 10 s poll keeps running underneath)."""
        while True:
            await anyio.sleep(self.poll_seconds)
            try:
                await self.get_and_submit_flow_runs()
            except Exception:
                self._logger.exception("poll failed; polling continues")

    # ---------------------------------------------------------------- dispatch
    async def get_and_submit_flow_runs(self) -> list["FlowRun"]:
        if self.agent is not None and getattr(self.agent, "draining", False):
            return []
        return await super().get_and_submit_flow_runs()

    async def _submit_scheduled_flow_runs(self, flow_run_response: list["WorkerFlowRunResponse"]) -> list["FlowRun"]:
        """Resolve each run once; fail the ones the queue can never serve; the cluster places the rest."""
        spec = self.queue_spec()
        accepted = []
        for entry in flow_run_response:
            fr = entry.flow_run
            if fr.id in self._submitting_flow_run_ids:
                continue
            try:
                request = resolve_request(spec, await self._deployment_vars(fr.deployment_id), fr.job_variables or {})
            except LaunchValidationError as exc:
                await self._reject(fr, str(exc))
                continue
            except Exception as exc:  # deployment gone or unreadable: leave the run for Prefect
                self._logger.debug("skipping run %s: %s", fr.id, exc)
                continue
            if request.agent and request.agent != self.name:
                await self._note_waiting(fr, f"waiting: pinned to agent {request.agent}")
                continue
            self._active.of(fr.id).request = request
            accepted.append(entry)
        return await super()._submit_scheduled_flow_runs(accepted)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        super()._release_limit_slot(flow_run_id)
        self._active.take(flow_run_id, "request")  # a run accepted but never started (its Pending claim lost)

    async def _note_placed(self, flow_run: "FlowRun", placement: str) -> None:
        self._wait_notes.forget(flow_run.id)
        try:
            await self.client.update_flow_run_labels(flow_run.id, {PLACED_LABEL: placement, WAIT_LABEL: ""})
        except Exception as exc:
            self._logger.debug("could not label run %s: %s", flow_run.id, exc)

    async def _give_worker_labels_to_flow_run(self, flow_run_id: UUID) -> None:
        """Prefect's worker labels, retried: a busy server's 503 must not crash the run (as on every back end)."""
        for attempt in range(4):
            try:
                return await super()._give_worker_labels_to_flow_run(flow_run_id)
            except Exception as exc:
                if attempt == 3:
                    self._logger.warning("could not label run %s with its worker (%s)", flow_run_id, exc)
                    return
                await asyncio.sleep(0.5 * 2 ** attempt)

    # ------------------------------------------------------------------ run
    async def run(self, flow_run: "FlowRun", configuration: LaunchKubernetesJobConfiguration,
                  task_status: Optional[anyio.abc.TaskStatus[str]] = None) -> KubernetesWorkerResult:
        logger = self.get_flow_run_logger(flow_run)
        request = self._active.take(flow_run.id, "request") or configuration._request
        if request is None:
            request = resolve_request(configuration._spec or self.queue_spec(),
                                      await self._deployment_vars(flow_run.deployment_id), flow_run.job_variables)
        queue = self._work_pool_name
        namespace = configuration.namespace
        job_image = await self._job_image(flow_run, configuration)  # None: no environment declared
        if job_image is not None and job_image.error:  # recorded Failed with the builder's words; no job created
            if task_status is not None:
                task_status.started(None)
            return KubernetesWorkerResult(identifier="environment-build-failed", status_code=0)
        async with self._get_configured_kubernetes_client(configuration) as client:
            api = KubeApi(client)
            env = kubernetes_run_environment(request, queue, self.name)
            env_secret = await self.secrets.env_secret(api, namespace, flow_run, configuration._secret_env)
            pulls = [await self.secrets.pull_secret(api, namespace, b) for b in configuration.image_pull_secrets]
            configuration.apply_request(request, run_id=str(flow_run.id), queue=queue, agent=self.name, env=env,
                                        env_secret=env_secret, pull_secrets=pulls)
            cluster = self.clusters.render(flow_run, configuration, request)  # None for a single run
            logger.info(f"Agent '{self.name}' creating a Kubernetes job with {request.resources.describe()} "
                        f"(preset {request.preset})" + (f" per member, cluster of {request.cluster.describe()}"
                                                        if cluster else ""))
            try:
                job = await self._create_job(configuration, client)
                if cluster is not None:
                    await self.clusters.create_service(api, flow_run, job, cluster)
            except BaseException:
                if env_secret:
                    await self.secrets.forget(api, namespace, env_secret[0])
                raise
            name, namespace = job.metadata.name, job.metadata.namespace
            pid = f"{namespace}:{name}"
            logger.info(f"Kubernetes job '{name}' created in namespace '{namespace}'")
            if task_status is not None:
                task_status.started(pid)
            end: Optional[Observation] = None
            try:
                end = await self._watch(api, flow_run, namespace, name, request.timeout_s, size=request.cluster.size)
            finally:
                if cluster is not None and end is not None:  # not when the worker stops: it re-attaches later
                    await self.clusters.end(api, flow_run, namespace, name, end)
                if env_secret:
                    await self.secrets.forget(api, namespace, env_secret[0])
                if end is not None:  # the Job ended (not the worker stopping: it re-attaches later): its key too
                    from prefect_launch.workers.agent.run_keys import revoke_run_keys

                    with anyio.CancelScope(shield=True):
                        await revoke_run_keys(flow_run.id)
        status = await self._record_end(flow_run, end)
        if status == 0:
            self._active.take(flow_run.id, "ended")  # no crash proposal follows a zero status
        return KubernetesWorkerResult(identifier=pid, status_code=status)

    async def _job_image(self, flow_run: "FlowRun", configuration: LaunchKubernetesJobConfiguration) -> Any:
        """The run's job environment as an image built on the agent's Docker daemon and pushed to the queue's
        ``registry``; the Job's container names it by digest (workers/environments/run_image.py)."""
        from prefect_launch.workers.environments.image import push
        from prefect_launch.workers.environments.run_image import prepare_job_image

        containers = configuration.job_manifest["spec"]["template"]["spec"]["containers"]
        spec = configuration._spec or self.queue_spec()
        registry = getattr(spec, "registry", None)
        logger = self.get_flow_run_logger(flow_run)
        opened: list[Any] = []

        def docker_client() -> Any:
            import docker

            if not registry:
                raise ValueError(f"queue {self._work_pool_name} has no registry: a kubernetes queue pushes job "
                                 "environment images to its registry (set registry: in the queue's definition)")
            opened.append(docker.from_env(timeout=600))
            return opened[-1]

        def pushed(client: Any, built: Any) -> str:
            return push(client, built.id, str(registry), built.tag, log=logger.info)

        try:
            job = await prepare_job_image(self, flow_run, None, containers[0].get("image"), docker_client,
                                          after_build=pushed)
        finally:
            for c in opened:
                c.close()
        if job is not None and not job.error:
            containers[0]["image"] = job.reference
        return job

    # ---------------------------------------------------------------- watch
    async def _watch(self, api: KubeApi, flow_run: "FlowRun", namespace: str, job: str,
                     timeout_s: Optional[float], running_since: Optional[float] = None, size: int = 1) -> Observation:
        """Follow the run's Job until it ends or the worker ends it; label why it waits and where it runs
        (``size`` > 1: a cluster run's indexed Job, read member by member). The run stays in
        ``_watching`` (drain, cancel_running, re-attach) until :meth:`_record_end` has recorded its end."""
        run_id = flow_run.id
        self._watching[run_id] = (namespace, job)
        selector = f"{RUN_ID_LABEL}={run_id}"
        seen_pods: list[str] = []
        placed = None
        failures = 0
        try:
            while True:
                stop = self._stop.get(run_id)
                if stop is None:
                    stop = await self._stop_requested(flow_run, running_since, timeout_s)
                if stop is not None:
                    return await self._end_job(api, flow_run, namespace, job, stop)
                try:
                    body = await api.read_job(namespace, job)
                    pods = await api.list_pods(namespace, selector) if body is not None else []
                    for p in pods:
                        if p["metadata"]["name"] not in seen_pods:
                            seen_pods.append(p["metadata"]["name"])
                    phases = {(p.get("status") or {}).get("phase") for p in pods}
                    events: list[dict[str, Any]] = []
                    if body is not None and (not pods or phases - {"Running"}):  # events explain waits and ends
                        events = await api.list_events(namespace, [job, *seen_pods])
                        if not pods:  # pods gone (or never seen): their events still say why
                            known = {(e.get("metadata") or {}).get("name") for e in events}
                            events += [e for e in await api.list_job_pod_events(namespace, job)
                                       if (e.get("metadata") or {}).get("name") not in known]
                    failures = 0
                except Exception as exc:  # the API server is away for a while: the pod is not, keep following
                    failures += 1
                    if failures in (1, 10) or failures % 100 == 0:
                        self._logger.warning("reading Kubernetes job %s/%s failed (%d in a row): %s",
                                             namespace, job, failures, exc)
                    await anyio.sleep(min(30.0, self.watch_seconds * 2 ** min(failures, 5)))
                    continue
                obs = observe_cluster(body, pods, events, size) if size > 1 else observe(body, pods, events)
                if obs.kind == "ended":
                    if body is None and self._stop.get(run_id) is not None:  # deleted by our own cancel
                        return await self._end_job(api, flow_run, namespace, job, self._stop[run_id])
                    self.get_flow_run_logger(flow_run).info(f"Kubernetes job {namespace}/{job} ended: {obs.message}")
                    return obs
                if obs.kind == "running" and running_since is None:
                    running_since = time.time()  # the timeout counts from here, as on every back end
                if obs.kind == "waiting":
                    await self._note_waiting(flow_run, obs.message)
                elif obs.message and placed != obs.message:
                    placed = obs.message
                    await self._note_placed(flow_run, obs.message)
                await anyio.sleep(self.watch_seconds)
        except BaseException:  # the worker stops (it re-attaches later) or the watch failed: nothing to record
            self._watching.pop(run_id, None)
            raise

    async def _stop_requested(self, flow_run: "FlowRun", running_since: Optional[float],
                              timeout_s: Optional[float]) -> Optional[State]:
        """A cancel from Prefect, or a timeout: the end state the worker will record after deleting the Job."""
        if timeout_s and running_since is not None and time.time() - running_since > timeout_s:
            message = (f"timeout after {timeout_s:g} s ({format_duration(timeout_s)}): the run's Kubernetes job "
                       f"was deleted by agent {self.name}; submit with a longer --timeout or split the job")
            self._stop[flow_run.id] = Failed(message=message)
            return self._stop[flow_run.id]
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception:
            return None
        if state is not None and state.type.value in ("CANCELLING", "CANCELLED"):
            self._stop[flow_run.id] = Cancelled(message=state.message or "cancelled; the Kubernetes job was deleted")
            return self._stop[flow_run.id]
        return None

    async def _end_job(self, api: KubeApi, flow_run: "FlowRun", namespace: str, job: str,
                       state: State) -> Observation:
        with anyio.CancelScope(shield=True):
            deleted = await api.delete_job(namespace, job)
            self.get_flow_run_logger(flow_run).info(
                f"Deleted Kubernetes job {namespace}/{job}" if deleted else f"Kubernetes job {namespace}/{job} was gone")
        return Observation("ended", state.message or "", "failed" if state.is_failed() else "crashed")

    async def _record_end(self, flow_run: "FlowRun", end: Observation) -> int:
        """The run's end state where Kubernetes knows better than the engine; the status code for Prefect.
        The run leaves ``_watching`` only after this: whoever waits for it (a drain, a cancel on exit, the
        tests) sees its end recorded."""
        try:
            return await self._record_end_state(flow_run, end)
        finally:
            self._watching.pop(flow_run.id, None)

    async def _record_end_state(self, flow_run: "FlowRun", end: Observation) -> int:
        stop = self._stop.pop(flow_run.id, None)
        self._wait_notes.forget(flow_run.id)
        with anyio.CancelScope(shield=True):
            if stop is not None:
                await self._mark(flow_run, stop)
                return 0 if stop.is_cancelled() else 1
            if end.end == "completed":
                await asyncio.sleep(1.0)  # the engine's own final state lands before its container exits
                state = await self._state_of(flow_run)
                if state is not None and not state.is_final() and not state.is_scheduled():
                    await self._mark(flow_run, Crashed(message=(
                        "the job's container exited with code 0 but the run never reported a final state")))
                return 0
            state = await self._state_of(flow_run)
            if end.end == "failed" and state is not None and state.is_failed():
                # the engine recorded the failure (the flow's own error): keep it. Not its Crashed: that is the
                # engine stopped with the Job, and the Job's reason (e.g. which member failed) says why
                self._active.of(flow_run.id).ended = True
            elif end.end == "failed":
                await self._mark(flow_run, Failed(message=end.message))
            else:
                await self._mark(flow_run, Crashed(message=end.message))
        return end.exit_code if end.exit_code not in (None, 0) else 1

    async def _state_of(self, flow_run: "FlowRun") -> Optional[State]:
        try:
            return (await self.client.read_flow_run(flow_run.id)).state
        except Exception:
            return None

    async def _mark(self, flow_run: "FlowRun", state: State) -> None:
        """Record the worker's reason, unless the run completed or was rescheduled before it."""
        self._active.of(flow_run.id).ended = True
        current = await self._state_of(flow_run)
        if current is not None and (current.is_completed() or current.is_scheduled()):
            return
        if current is not None and current.is_cancelled() and state.is_cancelled():
            return
        logger = self.get_flow_run_logger(flow_run)
        (logger.info if state.is_cancelled() else logger.error)(state.message)
        try:
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception as exc:
            self._logger.warning("could not record why run %s ended: %s", flow_run.id, exc)

    async def _propose_crashed_state(self, flow_run: "FlowRun", message: str, client: Any = None) -> None:
        if self._active.get(flow_run.id).ended:  # the worker already recorded why (eviction, exit code, cancel, timeout)
            self._active.take(flow_run.id, "ended")
            return
        await super()._propose_crashed_state(flow_run, message, client)

    # ------------------------------------------------------------- stopping
    def running(self) -> int:
        return len(self._watching)

    async def cancel_running(self, reason: str, grace_s: float = 10.0) -> None:
        """Agent stop with cancel: delete every watched run's Job and record the runs Cancelled with why."""
        for run_id in list(self._watching):
            self._stop[run_id] = Cancelled(message=reason)
        deadline = time.time() + grace_s + self.watch_seconds + 15
        while self._watching and time.time() < deadline:
            await asyncio.sleep(0.2)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: Any, grace_seconds: int = 30) -> None:
        """Prefect's cancel of a Pending run: the watch must not read the deleted Job as a crash."""
        for run_id, (ns, job) in list(self._watching.items()):
            if f"{ns}:{job}" == infrastructure_pid:
                self._stop.setdefault(run_id, Cancelled(message="cancelled; the Kubernetes job was deleted"))
        await super().kill_infrastructure(infrastructure_pid, configuration, grace_seconds)


__all__ = ["KubeApi", "LaunchKubernetesJobConfiguration", "LaunchKubernetesVariables", "LaunchKubernetesWorker",
           "kubernetes_run_environment"]
