"""Kubernetes back end, the pure half: a run's Job manifest and what its pod events mean.

Placement is the cluster's on Kubernetes queues: the agent holds no local ledger
for them. A run becomes a ``batch/v1`` Job whose pod asks for exactly its preset
(requests = limits for cpu and memory, ``nvidia.com/gpu``), gets a memory-backed
``/dev/shm`` of its ``shm_size``, the preset's node selector and tolerations, the
run's ports, PVC mounts, env and labels. The scheduler's and kubelet's events
are turned into the run's waiting reason (``FailedScheduling``) or a recorded end
reason (eviction, preemption, OOM kill) by `pod_event_outcome`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from prefect_launch.workers.resources import Resources
from prefect_launch.workers.run_tags import AGENT_LABEL, QUEUE_LABEL, RUN_ID_LABEL

GPU_RESOURCE = "nvidia.com/gpu"
SHM_VOLUME = "launch-shm"


def quantity_cpu(cpu: float) -> str:
    """Kubernetes CPU quantity: whole cores as ``"2"``, fractions in millicores (``"1500m"``)."""
    milli = int(round(cpu * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def quantity_bytes(n: int) -> str:
    """Bytes as the largest exact binary unit (``"256Mi"``), else plain bytes."""
    for unit, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def pod_resources(res: Resources) -> dict[str, dict[str, str]]:
    """requests == limits (Guaranteed QoS for cpu/memory); GPUs as an extended resource."""
    want = {"cpu": quantity_cpu(res.cpu), "memory": quantity_bytes(res.memory)}
    if res.gpu:
        want[GPU_RESOURCE] = str(res.gpu)
    return {"requests": dict(want), "limits": dict(want)}


def job_manifest(
    *,
    run_id: str,
    name: str,
    image: str,
    resources: Resources,
    queue: str,
    agent: str = "",
    command: Optional[list[str]] = None,
    env: Optional[dict[str, str]] = None,
    namespace: str = "default",
    node_selector: Optional[dict[str, str]] = None,
    tolerations: Optional[list[dict[str, Any]]] = None,
    ports: Optional[list[int]] = None,
    pvc_mounts: Optional[dict[str, str]] = None,  # claim name -> mount path
    image_pull_secrets: Optional[list[str]] = None,
    labels: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """The run's Job (plain dict in the API's camelCase), one pod, no retries (Prefect retries runs)."""
    run_labels = {**(labels or {}), RUN_ID_LABEL: run_id, QUEUE_LABEL: queue}
    if agent:
        run_labels[AGENT_LABEL] = agent
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if resources.shm_size:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": quantity_bytes(resources.shm_size)}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    for i, (claim, path) in enumerate(sorted((pvc_mounts or {}).items())):
        volumes.append({"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"pvc-{i}", "mountPath": path})
    container: dict[str, Any] = {
        "name": "prefect-job",
        "image": image,
        "env": [{"name": k, "value": str(v)} for k, v in sorted((env or {}).items())],
        "resources": pod_resources(resources),
    }
    if command:
        container["args"] = list(command)
    if mounts:
        container["volumeMounts"] = mounts
    if ports:
        container["ports"] = [{"containerPort": int(p)} for p in ports]
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if volumes:
        pod_spec["volumes"] = volumes
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod_spec["tolerations"] = [dict(t) for t in tolerations]
    if image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"generateName": f"{name}-", "namespace": namespace, "labels": run_labels},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": run_labels}, "spec": pod_spec},
        },
    }


Outcome = Literal["waiting", "ended"]


def pod_event_outcome(reason: str, message: str = "") -> Optional[tuple[Outcome, str]]:
    """What a pod event means for the run: a waiting reason, an end reason, or nothing (None)."""
    msg = " ".join((message or "").split())
    if reason == "FailedScheduling":
        return "waiting", f"waiting: unschedulable: {msg}" if msg else "waiting: unschedulable"
    if reason == "Evicted":
        return "ended", f"evicted by the kubelet: {msg}" if msg else "evicted by the kubelet"
    if reason in ("Preempted", "PreemptionByScheduler", "Preempting"):
        return "ended", f"preempted by the scheduler: {msg}" if msg else "preempted by the scheduler"
    if reason == "OOMKilled":
        return "ended", "out of memory: the container exceeded its memory limit and was OOM-killed"
    return None
