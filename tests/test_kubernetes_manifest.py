"""Kubernetes Job manifests for every preset, and pod events as waiting / end reasons (no cluster needed).

Where the `kubernetes` client is installed (extra `kubernetes`), each manifest is also
deserialised into its models (V1Job) and read back from them.
"""

from __future__ import annotations

import pytest

from prefect_launch.workers.kubernetes_manifest import (GPU_RESOURCE, job_manifest, pod_event_outcome,
                                                         quantity_bytes, quantity_cpu)
from prefect_launch.workers.queue_spec import load_queues_file
from prefect_launch.workers.resources import Resources
from prefect_launch.workers.run_tags import RUN_ID_LABEL

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


def test_manifests_deserialise_into_kubernetes_models():
    k8s = pytest.importorskip("kubernetes", reason="kubernetes client not installed (extra 'kubernetes')")
    api = k8s.client.ApiClient()
    for label, res in _presets():
        m = job_manifest(run_id="r1", name="run", image="img:1", resources=res, queue="q")
        job = api._ApiClient__deserialize(m, "V1Job")
        c = job.spec.template.spec.containers[0]
        assert c.resources.limits["cpu"] == quantity_cpu(res.cpu), label
        assert api.sanitize_for_serialization(job)["spec"]["template"]["spec"]["containers"][0]["resources"] \
            == m["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_quantities():
    assert quantity_cpu(2) == "2" and quantity_cpu(0.5) == "500m" and quantity_cpu(1.25) == "1250m"
    assert quantity_bytes(1 << 30) == "1Gi" and quantity_bytes(512 << 20) == "512Mi" and quantity_bytes(1000) == "1000"


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
    from prefect_launch.workers.queue_spec import QueueSpec

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
