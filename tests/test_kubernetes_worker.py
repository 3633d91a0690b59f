"""The launch-kubernetes worker against a tiny fake Kubernetes API (tests/kube_fake.py) and a real Prefect server.

The worker's whole path runs: Prefect claims the run, the pool template is rendered
for it, prefect-kubernetes creates the Job through kubernetes_asyncio over HTTP, and
the worker follows the Job, its pod and their events. The fake only stores objects
and plays the cluster when the test says so (a pod Unschedulable, Running, Failed,
evicted, ...); the Prefect run's labels and states are read back from the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from typing import Any, Optional

import anyio
import pytest

from prefect_launch.workers.backends.kubernetes.secrets import pull_secret_name
from prefect_launch.workers.backends.kubernetes.worker import LaunchKubernetesWorker
from prefect_launch.workers.agent.tags import PLACED_LABEL, RUN_ID_LABEL, WAIT_LABEL

from kube_fake import fake_kube

AGENT = "k8s-agent"
UNSCHED = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."


def _spec(pool: str) -> dict[str, Any]:
    return {"name": pool, "target": "kubernetes", "default_preset": "a100",
            "presets": {"a100": {"cpu": 2, "memory": "4Gi", "gpu": 1, "shm_size": "1Gi",
                                 "node_selector": {"nvidia.com/gpu.product": "A100"},
                                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                  "effect": "NoSchedule"}]},
                        "small": {"cpu": 0.5, "memory": "512Mi"}},
            "bounds": {"gpu": {"max": 2}}}


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """The fake API and the worker pointed at it the way a real one finds its cluster (a kubeconfig)."""
    import kubernetes_asyncio.config.kube_config as kube_config

    with fake_kube(tmp_path) as (fake, kubeconfig):
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: read the kubeconfig
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        yield fake


class Scene:
    """One queue (pool + deployment) on the server, the worker, and helpers to read the run back."""

    def __init__(self, client, worker: LaunchKubernetesWorker, fake, deployment_id):
        self.client, self.worker, self.fake, self.deployment_id = client, worker, fake, deployment_id

    async def submit(self, **job_variables) -> Any:
        fr = await self.client.create_flow_run_from_deployment(self.deployment_id, job_variables=job_variables)
        await self.worker.get_and_submit_flow_runs()
        return fr

    async def until(self, what, timeout: float = 30.0, every: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            value = await value if asyncio.iscoroutine(value) else value
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {getattr(what, '__name__', what)}")
            await asyncio.sleep(every)

    async def job_of(self, fr) -> dict[str, Any]:
        def created():
            return next((j for j in list(self.fake.jobs.values())
                         if j["metadata"]["labels"].get(RUN_ID_LABEL) == str(fr.id)), None)
        return await self.until(created)

    async def labels(self, fr) -> dict[str, Any]:
        return (await self.client.read_flow_run(fr.id)).labels or {}

    async def label_is(self, fr, key: str, value: str) -> None:
        async def check():
            return (await self.labels(fr)).get(key) == value
        await self.until(check)

    async def final(self, fr):
        async def done():
            if fr.id in self.worker._watching:  # before the read: a run leaves it once its end is recorded
                return None
            state = (await self.client.read_flow_run(fr.id)).state
            return state if state is not None and state.is_final() else None
        return await self.until(done)


@contextlib.asynccontextmanager
async def scene(kube, job_variables: Optional[dict] = None):
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = f"k8s-{uuid.uuid4().hex[:8]}"
    template = LaunchKubernetesWorker.get_default_base_job_template()
    template["job_configuration"]["launch"] = _spec(pool)
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="launch-kubernetes",
                                                     base_job_template=template))
        flow_id = await client.create_flow_from_name("k8s-probe")
        dep = await client.create_deployment(flow_id=flow_id, name=pool, work_pool_name=pool,
                                             job_variables={"image": "reg.example/job:1", **(job_variables or {})})
        worker = LaunchKubernetesWorker(work_pool_name=pool, name=AGENT, create_pool_if_not_found=False)
        worker.watch_seconds = 0.1
        worker.poll_seconds = 3600  # the test claims with get_and_submit_flow_runs
        with anyio.fail_after(120):
            async with worker:
                yield Scene(client, worker, kube, dep)


def go(coro_fn, kube):
    async def main():
        async with scene(kube) as s:
            await coro_fn(s)
    asyncio.run(main())


# ----------------------------------------------------------------------------------------------


def test_job_manifest_waiting_placement_and_completion(prefect_server, kube):
    """Created with the preset; Unschedulable -> waiting label; Running -> placement; Succeeded -> Completed."""
    from prefect.blocks.system import Secret
    from prefect.states import Completed, Running

    async def body(s: Scene):
        tag = uuid.uuid4().hex[:6]
        await Secret(value="s3cr3t").asave(f"tok-{tag}")
        await Secret(value={"registry": "reg.example", "username": "u", "password": "p"}).asave(f"reg-{tag}")
        fr = await s.submit(ports=[8888], pvc_mounts={"datasets": "/data"}, secret_env={"API_TOKEN": f"tok-{tag}"},
                            image_pull_secrets=[f"reg-{tag}"])
        job = await s.job_of(fr)
        pod = job["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        want = {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}
        assert c["resources"] == {"requests": want, "limits": want}
        assert {"name": "launch-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod["volumes"]
        assert {"name": "launch-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "A100"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert c["ports"] == [{"containerPort": 8888}] and c["image"] == "reg.example/job:1"
        assert {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "datasets"}} in pod["volumes"]
        env = {e["name"]: e for e in c["env"]}
        assert env["PREFECT__FLOW_RUN_ID"]["value"] == str(fr.id) and env["LAUNCH_PRESET"]["value"] == "a100"
        assert env["API_TOKEN"] == {"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": f"prefect-launch-env-{fr.id}", "key": "API_TOKEN"}}}
        assert "s3cr3t" not in json.dumps(job)  # the value lives in the per-run Secret only
        env_secret = s.fake.secrets[("default", f"prefect-launch-env-{fr.id}")]
        assert env_secret["stringData"] == {"API_TOKEN": "s3cr3t"}
        assert pod["imagePullSecrets"] == [{"name": pull_secret_name(f"reg-{tag}")}]
        pull = s.fake.secrets[("default", pull_secret_name(f"reg-{tag}"))]
        assert pull["type"] == "kubernetes.io/dockerconfigjson"
        auth = json.loads(pull["stringData"][".dockerconfigjson"])["auths"]["reg.example"]
        assert base64.b64decode(auth["auth"]).decode() == "u:p"
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert labels[RUN_ID_LABEL] == str(fr.id) and labels["io.prefect-launch.agent"] == AGENT
        async def pid():
            return (await s.client.read_flow_run(fr.id)).infrastructure_pid
        assert await s.until(pid) == f"default:{job['metadata']['name']}"

        # the scheduler cannot place it
        name = s.fake.add_pod(job, conditions=[{"type": "PodScheduled", "status": "False",
                                                "reason": "Unschedulable", "message": UNSCHED}])
        await s.label_is(fr, WAIT_LABEL, f"waiting: unschedulable: {UNSCHED}")
        # a GPU node frees up: placed, then running (the engine in the pod reports Running itself)
        s.fake.set_pod(name, "Running", node="gpu-node-3",
                       conditions=[{"type": "PodScheduled", "status": "True"}])
        await s.client.set_flow_run_state(fr.id, Running())
        await s.label_is(fr, PLACED_LABEL, f"kubernetes: pod {name} on node gpu-node-3")
        assert (await s.labels(fr))[WAIT_LABEL] == ""
        # the engine reports Completed and exits 0
        await s.client.set_flow_run_state(fr.id, Completed())
        s.fake.set_pod(name, "Succeeded", containerStatuses=[{"name": "prefect-job", "state": {
            "terminated": {"exitCode": 0, "reason": "Completed"}}}])
        state = await s.final(fr)
        assert state.is_completed()
        for _ in range(100):  # deleted at the end (the worker's cleanup follows the final state)
            if ("default", f"prefect-launch-env-{fr.id}") not in s.fake.secrets:
                break
            await asyncio.sleep(0.1)
        assert ("default", f"prefect-launch-env-{fr.id}") not in s.fake.secrets
        assert ("DELETE", "job") not in s.fake.calls  # finished jobs are the pool's finished_job_ttl's

    go(body, kube)


def test_exit_code_eviction_preemption_and_oom_are_recorded(prefect_server, kube):
    from prefect.states import Running

    async def body(s: Scene):
        runs = [await s.submit(preset="small") for _ in range(4)]
        jobs = [await s.job_of(fr) for fr in runs]
        pods = [s.fake.add_pod(j, "Running") for j in jobs]
        for fr, p in zip(runs, pods):
            s.fake.set_pod(p, node="n1")
            await s.client.set_flow_run_state(fr.id, Running())
        # 1: the container exits 3 without the engine reporting (e.g. an import error before the flow)
        s.fake.set_pod(pods[0], "Failed", containerStatuses=[{"name": "prefect-job", "state": {"terminated": {
            "exitCode": 3, "reason": "Error", "message": "ModuleNotFoundError: no module named 'torch'"}}}])
        # 2: the kubelet evicts the pod
        s.fake.set_pod(pods[1], "Failed", reason="Evicted", message="The node was low on resource: memory.")
        # 3: the scheduler preempts it: the pod is deleted, the job fails (backoffLimit 0), the event stays
        s.fake.add_event(pods[2], "Preempted", "Preempted by pod 5e1f on node n1")
        s.fake.delete_pod(pods[2])
        s.fake.set_job_condition(jobs[2], "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff "
                                 "limit")
        # 4: OOM kill
        s.fake.set_pod(pods[3], "Failed", containerStatuses=[{"name": "prefect-job", "state": {"terminated": {
            "exitCode": 137, "reason": "OOMKilled"}}}])
        # 5: a pod made and preempted between two of the worker's polls: only its events are left
        unseen = await s.submit(preset="small")
        unseen_job = await s.job_of(unseen)
        s.fake.add_event(f"{unseen_job['metadata']['name']}-zz9q1", "Preempted", "Preempted by pod 77aa on node n2")
        s.fake.set_job_condition(unseen_job, "Failed", "BackoffLimitExceeded", "Job has reached the specified "
                                 "backoff limit")
        states = [await s.final(fr) for fr in runs]
        late = await s.final(unseen)
        assert late.is_crashed() and late.message.startswith("preempted by the scheduler: Preempted by pod 77aa"), \
            late.message
        assert states[0].is_failed()
        assert states[0].message == "the job's container exited with code 3 (ModuleNotFoundError: no module " \
                                    "named 'torch')"
        assert states[1].is_crashed() and states[1].message.startswith(
            "evicted by the kubelet: The node was low on resource: memory. (pod")
        assert states[2].is_crashed() and states[2].message.startswith(
            "preempted by the scheduler: Preempted by pod 5e1f on node n1")
        assert states[3].is_crashed() and states[3].message.startswith(
            "out of memory: the container exceeded its memory limit 512Mi")

    go(body, kube)


def test_cancel_and_timeout_delete_the_job(prefect_server, kube):
    from prefect.states import Cancelling, Running

    async def body(s: Scene):
        cancel = await s.submit(preset="small")
        slow = await s.submit(preset="small", timeout="1s")
        jobs = {fr.id: await s.job_of(fr) for fr in (cancel, slow)}
        for fr in (cancel, slow):
            p = s.fake.add_pod(jobs[fr.id], "Running")
            s.fake.set_pod(p, node="n2")
            await s.client.set_flow_run_state(fr.id, Running())
        await s.client.set_flow_run_state(cancel.id, Cancelling(), force=True)
        state = await s.final(cancel)
        assert state.is_cancelled()
        states = {fr.id: await s.final(fr) for fr in (slow,)}
        assert states[slow.id].is_failed() and states[slow.id].message.startswith("timeout after 1 s")
        assert not s.fake.jobs  # both Jobs deleted
        assert s.fake.calls.count(("DELETE", "job")) == 2

    go(body, kube)


def test_out_of_bounds_run_is_rejected_without_a_job(prefect_server, kube):
    async def body(s: Scene):
        fr = await s.submit(gpu=8)
        state = await s.final(fr)
        assert state.is_failed() and "gpu=8 is above the queue maximum 2" in state.message
        assert not s.fake.jobs and ("POST", "jobs") not in s.fake.calls

    go(body, kube)


def test_only_the_verbs_of_the_documented_rbac_are_used(prefect_server, kube):
    """The README's Role: jobs create/get/list/watch/delete, pods get/list/watch, events list/watch, secrets."""
    async def body(s: Scene):
        fr = await s.submit(preset="small")
        job = await s.job_of(fr)
        p = s.fake.add_pod(job)
        s.fake.set_pod(p, "Failed", node="n", containerStatuses=[{"name": "prefect-job", "state": {"terminated": {
            "exitCode": 1, "reason": "Error"}}}])
        await s.final(fr)
        assert set(s.fake.calls) <= {("POST", "jobs"), ("GET", "job"), ("GET", "jobs"), ("DELETE", "job"),
                                     ("GET", "pods"), ("GET", "events"), ("GET", "secret"), ("POST", "secrets"),
                                     ("PUT", "secret"), ("DELETE", "secret")}

    go(body, kube)


def test_agent_picks_the_kubernetes_worker_for_kubernetes_queues():
    from types import SimpleNamespace

    from prefect_launch.workers.agent.runner import worker_for, worker_types

    backends = worker_types()
    spec = {"job_configuration": {"launch": _spec("q")}}
    assert worker_for("q", SimpleNamespace(type="launch-kubernetes", base_job_template=spec), backends) \
        is LaunchKubernetesWorker
    # what `queue apply` writes for target: kubernetes (prefect-kubernetes's pool type, our declaration)
    assert worker_for("q", SimpleNamespace(type="kubernetes", base_job_template=spec), backends) \
        is LaunchKubernetesWorker
    assert worker_for("q", SimpleNamespace(type="launch-docker", base_job_template={}), backends).type \
        == "launch-docker"
    with pytest.raises(LookupError, match="target type 'kubernetes'"):  # a plain prefect-kubernetes pool
        worker_for("q", SimpleNamespace(type="kubernetes", base_job_template={"job_configuration": {}}), backends)


def test_prefect_finds_the_worker_type():
    from prefect.workers.base import BaseWorker

    assert BaseWorker.get_worker_class_from_type("launch-kubernetes") is LaunchKubernetesWorker


def test_agent_serves_a_kubernetes_queue_and_cancels_on_exit(prefect_server, kube, tmp_path, monkeypatch):
    """`prefect-launch agent --queue Q` on a kubernetes queue: the Job is made; stopping it with --on-exit cancel
    deletes the Job of the run still running and records it Cancelled with the reason."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Completed, Running

    from launch_helpers import agent

    import kubernetes_asyncio.config.kube_config as kube_config

    monkeypatch.setenv("KUBECONFIG", kube_config.KUBE_CONFIG_DEFAULT_LOCATION)  # for the agent's process
    monkeypatch.setenv("LAUNCH_KUBERNETES_POLL_SECONDS", "0.3")
    pool = f"k8s-{uuid.uuid4().hex[:8]}"
    template = LaunchKubernetesWorker.get_default_base_job_template()
    template["job_configuration"]["launch"] = _spec(pool)
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="launch-kubernetes", base_job_template=template))
        dep = client.create_deployment(flow_id=client.create_flow_from_name("k8s-probe"), name=pool,
                                       work_pool_name=pool, job_variables={"image": "reg.example/job:1"})
        name = f"agent-{pool}"
        with agent([pool], name, "cpu=1,memory=1Gi", tmp_path, wait_online=False) as proc:
            done, kept = (client.create_flow_run_from_deployment(dep, job_variables={"preset": "small"})
                          for _ in range(2))

            def job_of(fr, timeout=120):
                deadline = time.time() + timeout
                while time.time() < deadline:
                    for j in list(kube.jobs.values()):
                        if j["metadata"]["labels"].get(RUN_ID_LABEL) == str(fr.id):
                            return j
                    time.sleep(0.2)
                raise AssertionError(f"no Job for run {fr.id}; agent log: {(tmp_path / f'agent-{name}.log').read_text()}")

            jobs = {fr.id: job_of(fr) for fr in (done, kept)}
            for fr in (done, kept):
                pod = kube.add_pod(jobs[fr.id], "Running")
                kube.set_pod(pod, node="n1")
                client.set_flow_run_state(fr.id, Running())
                if fr is done:
                    client.set_flow_run_state(fr.id, Completed())
                    kube.set_pod(pod, "Succeeded", containerStatuses=[{"name": "prefect-job", "state": {
                        "terminated": {"exitCode": 0, "reason": "Completed"}}}])
            log_path = tmp_path / f"agent-{name}.log"
            ended = f"Kubernetes job default/{jobs[done.id]['metadata']['name']} ended"
            deadline = time.time() + 90
            while time.time() < deadline and (
                    (client.read_flow_run(kept.id).labels or {}).get(PLACED_LABEL) is None
                    or ended not in log_path.read_text()):
                time.sleep(0.3)
            time.sleep(2)  # its end recorded (1 s grace for the engine's own state)
        # leaving the block sent SIGTERM with --on-exit cancel and waited for the agent to exit
        assert proc.returncode is not None
        log = (tmp_path / f"agent-{name}.log").read_text()
        assert "placed by the cluster" in log and "cancelling 1 running run(s)" in log, log
        assert client.read_flow_run(done.id).state.is_completed()
        state = client.read_flow_run(kept.id).state
        assert state.is_cancelled() and state.message.startswith(f"cancelled: agent {name} was stopped"), state
        assert ("default", jobs[kept.id]["metadata"]["name"]) not in kube.jobs
        assert ("default", jobs[done.id]["metadata"]["name"]) in kube.jobs  # finished: left to its TTL


def test_restarted_worker_follows_its_running_jobs_again(prefect_server, kube):
    """A run whose Job a previous life of the agent created: the new worker finds it and records its eviction."""
    from prefect.states import Pending, Running

    from prefect_launch.workers.backends.kubernetes.manifest import job_manifest
    from prefect_launch.workers.scheduling.resources import Resources
    from prefect_launch.workers.agent.tags import WORKER_LABEL

    async def body(s: Scene):
        fr = await s.client.create_flow_run_from_deployment(s.deployment_id)
        m = job_manifest(run_id=str(fr.id), name="left-over", image="img", queue="q", agent=AGENT,
                         resources=Resources(cpu=1, memory=1 << 30))
        code, job = s.fake.handle("POST", "/apis/batch/v1/namespaces/default/jobs", {}, m)
        assert code == 201
        pod = s.fake.add_pod(job, "Running")
        s.fake.set_pod(pod, node="n4")
        await s.client.set_flow_run_state(fr.id, Pending(), force=True)
        await s.client.set_flow_run_state(fr.id, Running(), force=True)
        await s.client.update_flow_run_labels(fr.id, {WORKER_LABEL: AGENT})
        await s.client.update_flow_run(fr.id, infrastructure_pid=f"default:{job['metadata']['name']}")
        s.worker._reattached = False  # as at the start of a new agent
        await s.worker.sync_with_backend()
        await s.until(lambda: fr.id in s.worker._watching)
        s.fake.set_pod(pod, "Failed", reason="Evicted", message="The node had condition: [DiskPressure].")
        state = await s.final(fr)
        assert state.is_crashed() and state.message.startswith("evicted by the kubelet: The node had condition")

    go(body, kube)
