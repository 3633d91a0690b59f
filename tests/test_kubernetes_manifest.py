"""Kubernetes Job manifests for every preset, and pod events as waiting / end reasons (no cluster needed).

Each manifest is also deserialised into the models of kubernetes_asyncio (the client
prefect-kubernetes uses; the `dev` extra installs it) and read back from them.
"""

from __future__ import annotations

import pytest

from prefect_launch.workers.backends.kubernetes.manifest import (GPU_RESOURCE, job_manifest, pod_event_outcome,
                                                         quantity_bytes, quantity_cpu)
from prefect_launch.workers.scheduling.queue_spec import load_queues_file
from prefect_launch.workers.scheduling.resources import Resources
from prefect_launch.workers.agent.tags import RUN_ID_LABEL

from launch_helpers import ROOT


def _presets():
    for q in load_queues_file(str(ROOT / "deployments" / "queues.yaml")).queues:
        for name, preset in q.presets.items():
            yield f"{q.name}/{name}", preset.to_resources()
    yield "fraction", Resources(cpu=0.25, memory=300 * 10**6, gpu=0)


@pytest.mark.parametrize("label,res", list(_presets()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_preset_renders_requests_limits_shm_and_labels(label: str, res: Resources):
    m = job_manifest(run_id="0b6f8a52-1111-4e3c-9d1f-5a3c2b1a0e9d", name="run", image="img:1", resources=res,
                     queue="q", agent="a1", env={"A": "1"}, node_selector={"gpu": "a100"},
                     tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}], ports=[8080],
                     pvc_mounts={"data": "/data"}, image_pull_secrets=["regcred"])
    pod = m["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    r = c["resources"]
    assert r["requests"] == r["limits"]
    assert r["limits"]["cpu"] == quantity_cpu(res.cpu) and r["limits"]["memory"] == quantity_bytes(res.memory)
    assert r["limits"].get(GPU_RESOURCE) == (str(res.gpu) if res.gpu else None)
    shm = [v for v in pod.get("volumes", []) if v["name"] == "launch-shm"]
    if res.shm_size:
        assert shm == [{"name": "launch-shm", "emptyDir": {"medium": "Memory",
                                                           "sizeLimit": quantity_bytes(res.shm_size)}}]
        assert {"name": "launch-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    else:
        assert shm == []
    assert m["spec"]["template"]["metadata"]["labels"][RUN_ID_LABEL] == "0b6f8a52-1111-4e3c-9d1f-5a3c2b1a0e9d"
    assert pod["nodeSelector"] == {"gpu": "a100"} and pod["tolerations"][0]["key"] == "gpu"
    assert pod["restartPolicy"] == "Never" and m["spec"]["backoffLimit"] == 0
    assert {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "data"}} in pod["volumes"]
    assert c["ports"] == [{"containerPort": 8080}] and pod["imagePullSecrets"] == [{"name": "regcred"}]


def _as_model(m: dict) -> tuple:
    """``m`` as the V1Job of kubernetes_asyncio (the client prefect-kubernetes uses; the `dev` extra installs it),
    and that model serialised back to the API's JSON."""
    import asyncio

    from kubernetes_asyncio.client import ApiClient

    async def convert():
        async with ApiClient() as api:  # its connection pool wants a running loop; nothing is sent
            job = api._ApiClient__deserialize(m, "V1Job")
            return job, api.sanitize_for_serialization(job)

    return asyncio.run(convert())


def test_manifests_deserialise_into_kubernetes_models():
    for label, res in _presets():
        m = job_manifest(run_id="r1", name="run", image="img:1", resources=res, queue="q", ports=[8888],
                         pvc_mounts={"data": "/data"}, env={"A": "1"}, image_pull_secrets=["regcred"])
        job, back = _as_model(m)
        c = job.spec.template.spec.containers[0]
        assert c.resources.limits["cpu"] == quantity_cpu(res.cpu), label
        if res.shm_size:
            shm = next(v for v in job.spec.template.spec.volumes if v.name == "launch-shm")
            assert shm.empty_dir.medium == "Memory" and shm.empty_dir.size_limit == quantity_bytes(res.shm_size)
        assert back == m, label  # nothing the models do not know, nothing lost


def _pool_template(spec) -> dict:
    from prefect_launch.workers.backends.kubernetes.worker import LaunchKubernetesWorker

    template = LaunchKubernetesWorker.get_default_base_job_template()
    template["job_configuration"]["launch"] = spec.model_dump(mode="json")
    return template


def _k8s_specs():
    """Every queue of queues.yaml as a Kubernetes queue (same presets), plus one with selectors and tolerations."""
    from prefect_launch.workers.scheduling.queue_spec import QueueSpec

    for q in load_queues_file(str(ROOT / "deployments" / "queues.yaml")).queues:
        yield q.model_copy(update={"target": "kubernetes"})
    yield QueueSpec.model_validate({
        "name": "k8s-a100", "target": "kubernetes", "default_preset": "a100",
        "presets": {"a100": {"cpu": 8, "memory": "64Gi", "gpu": 1, "shm_size": "8Gi",
                             "node_selector": {"nvidia.com/gpu.product": "A100"},
                             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                              "effect": "NoSchedule"}]},
                    "cpu": {"cpu": 0.5, "memory": "512Mi"}}})


class _NoServer:
    """Templating without block or variable references needs no server; any call would be a test bug."""

    def __getattr__(self, name):
        raise AssertionError(f"the render asked the server for {name}")


def _render(spec, template: dict, job_variables: dict, pool_type: str = "launch-kubernetes") -> dict:
    """The pool template -> configuration -> prepared for a run -> the run's request written in (no server)."""
    import asyncio
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun, WorkPool

    from prefect_launch.workers.backends.kubernetes.worker import (LaunchKubernetesJobConfiguration,
                                                          kubernetes_run_environment)

    cfg = asyncio.run(LaunchKubernetesJobConfiguration.from_template_and_values(
        template, {"image": "reg.example/job:1", "namespace": "ml"}, client=_NoServer()))
    run = FlowRun(id=uuid4(), flow_id=uuid4(), name="brave-otter", job_variables=job_variables)
    cfg.prepare_for_flow_run(run, work_pool=WorkPool(name=spec.name, type=pool_type, base_job_template=template),
                             worker_name="agent-1")
    req = cfg._request
    return cfg.apply_request(req, run_id=str(run.id), queue=spec.name, agent="agent-1",
                             env=kubernetes_run_environment(req, spec.name, "agent-1"),
                             env_secret=("prefect-launch-env-x", ["API_TOKEN"]), pull_secrets=["prefect-launch-pull-reg"])


@pytest.mark.parametrize("spec", list(_k8s_specs()), ids=lambda s: s.name)
def test_every_preset_through_the_pool_template_is_a_valid_v1job(spec):
    """The launch-kubernetes pool template, rendered for each preset, read back through the client's V1Job."""
    for preset_name, preset in spec.presets.items():
        res = preset.to_resources()
        m = _render(spec, _pool_template(spec), {"preset": preset_name, "ports": [8888],
                                                 "pvc_mounts": {"datasets": "/data"}})
        job, back = _as_model(m)
        assert back == m, preset_name
        pod = job.spec.template.spec
        (c,) = pod.containers
        want = {"cpu": quantity_cpu(res.cpu), "memory": quantity_bytes(res.memory),
                **({GPU_RESOURCE: str(res.gpu)} if res.gpu else {})}
        assert c.resources.requests == want and c.resources.limits == want, preset_name
        assert c.image == "reg.example/job:1" and job.metadata.namespace == "ml"
        assert c.args == ["prefect", "flow-run", "execute"]
        shm = [v for v in pod.volumes or [] if v.name == "launch-shm"]
        if res.shm_size:
            assert shm[0].empty_dir.medium == "Memory" and shm[0].empty_dir.size_limit == quantity_bytes(res.shm_size)
            assert any(vm.mount_path == "/dev/shm" for vm in c.volume_mounts)
        else:
            assert not shm
        assert pod.node_selector == (preset.node_selector or None)
        assert [t.key for t in pod.tolerations or []] == [t["key"] for t in preset.tolerations]
        assert [p.container_port for p in c.ports] == [8888]
        pvc = next(v for v in pod.volumes if v.persistent_volume_claim)
        assert pvc.persistent_volume_claim.claim_name == "datasets"
        assert {"pvc-0": "/data"}.items() <= {vm.name: vm.mount_path for vm in c.volume_mounts}.items()
        assert [s.name for s in pod.image_pull_secrets] == ["prefect-launch-pull-reg"]
        env = {e.name: e for e in c.env}
        assert env["LAUNCH_PRESET"].value == preset_name and env["OMP_NUM_THREADS"].value == str(max(1, int(res.cpu)))
        assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin's to set
        assert env["API_TOKEN"].value is None and env["API_TOKEN"].value_from.secret_key_ref.name == \
            "prefect-launch-env-x"
        assert "PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR" not in env  # an eviction is recorded, not rescheduled
        labels = job.spec.template.metadata.labels
        assert labels[RUN_ID_LABEL] == job.metadata.labels[RUN_ID_LABEL] and labels["io.prefect-launch.queue"]
        assert labels["prefect.io/flow-run-name"] == "brave-otter"
        assert pod.restart_policy == "Never" and job.spec.backoff_limit == 0


def test_queue_apply_template_of_today_works_too():
    """A pool made by `queue apply` from prefect-kubernetes's own template (type kubernetes) renders the same."""
    from prefect_launch.workers.scheduling.template import build_base_job_template

    spec = list(_k8s_specs())[-1]
    template = build_base_job_template(spec)
    m = _render(spec, template, {"preset": "a100", "ports": [8080]}, pool_type=spec.pool_type)
    job, back = _as_model(m)
    c = job.spec.template.spec.containers[0]
    assert c.resources.limits == {"cpu": "8", "memory": "64Gi", GPU_RESOURCE: "1"} == c.resources.requests
    assert job.spec.template.spec.node_selector == {"nvidia.com/gpu.product": "A100"}
    assert [p.container_port for p in c.ports] == [8080]


def test_apply_run_keeps_what_the_pool_template_adds():
    """A user-edited pool manifest keeps its own limits, volumes and tolerations; the run's are added."""
    from prefect_launch.workers.backends.kubernetes.manifest import apply_run

    m = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"labels": {"team": "vision"}},
         "spec": {"template": {"spec": {
             "containers": [{"name": "prefect-job", "env": [{"name": "A", "value": "old"}],
                             "resources": {"limits": {"ephemeral-storage": "10Gi", "cpu": "99"}},
                             "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}],
             "volumes": [{"name": "cache", "emptyDir": {}}],
             "tolerations": [{"key": "spot", "operator": "Exists"}],
             "nodeSelector": {"pool": "gpu"}}}}}
    apply_run(m, run_id="r", resources=Resources(cpu=2, memory=1 << 30, gpu=0, shm_size=64 << 20), queue="q",
              env={"A": "new"}, node_selector={"zone": "a"}, tolerations=[{"key": "gpu", "operator": "Exists"}])
    pod = m["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"ephemeral-storage": "10Gi", "cpu": "2", "memory": "1Gi"}
    assert c["env"] == [{"name": "A", "value": "new"}]
    assert [v["name"] for v in pod["volumes"]] == ["cache", "launch-shm"]
    assert pod["nodeSelector"] == {"pool": "gpu", "zone": "a"} and len(pod["tolerations"]) == 2
    assert m["metadata"]["labels"]["team"] == "vision" and m["metadata"]["labels"][RUN_ID_LABEL] == "r"
    _as_model(m)


@pytest.mark.parametrize("quantity,value,text", [
    (quantity_cpu, 2, "2"), (quantity_cpu, 0.5, "500m"), (quantity_cpu, 1.25, "1250m"),
    (quantity_bytes, 1 << 30, "1Gi"), (quantity_bytes, 512 << 20, "512Mi"), (quantity_bytes, 1000, "1000"),
], ids=["cpu-2", "cpu-0.5", "cpu-1.25", "bytes-1Gi", "bytes-512Mi", "bytes-1000"])
def test_quantities(quantity, value, text):
    assert quantity(value) == text


def test_pod_events_become_waiting_or_end_reasons():
    msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.  preemption: 0/3 nodes are available."
    assert pod_event_outcome("FailedScheduling", msg) == (
        "waiting", "waiting: unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu. "
                   "preemption: 0/3 nodes are available.")
    kind, why = pod_event_outcome("Evicted", "The node was low on resource: memory.")
    assert kind == "ended" and why.startswith("evicted by the kubelet: The node was low")
    assert pod_event_outcome("Preempted", "by default/high-prio")[0] == "ended"
    assert pod_event_outcome("OOMKilled")[0] == "ended"
    assert pod_event_outcome("Scheduled", "assigned") is None and pod_event_outcome("Pulled") is None


def test_preset_node_selector_and_tolerations_reach_the_pod():
    from prefect_launch.workers.scheduling.queue_spec import QueueSpec

    spec = QueueSpec.model_validate({
        "name": "k8s", "target": "kubernetes", "default_preset": "a100",
        "presets": {"a100": {"cpu": 8, "memory": "64Gi", "gpu": 1, "shm_size": "8Gi",
                             "node_selector": {"nvidia.com/gpu.product": "A100"},
                             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                              "effect": "NoSchedule"}]}}})
    p = spec.presets["a100"]
    m = job_manifest(run_id="r", name="run", image="img", resources=p.to_resources(), queue="k8s",
                     node_selector=p.node_selector, tolerations=p.tolerations)
    pod = m["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "A100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["containers"][0]["resources"]["limits"] == {"cpu": "8", "memory": "64Gi", GPU_RESOURCE: "1"}
