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

from prefect_launch.workers.scheduling.resources import Resources
from prefect_launch.workers.agent.tags import AGENT_LABEL, QUEUE_LABEL, RUN_ID_LABEL

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


def _by_name(items: list[dict[str, Any]], new: list[dict[str, Any]], key: str = "name") -> list[dict[str, Any]]:
    """``items`` with ``new`` appended, an item of ``new`` replacing the one of the same ``key``."""
    names = {n[key] for n in new}
    return [i for i in items if i.get(key) not in names] + list(new)


def apply_run(
    manifest: dict[str, Any],
    *,
    run_id: str,
    resources: Resources,
    queue: str,
    agent: str = "",
    env: Optional[dict[str, str]] = None,
    env_from_secret: Optional[tuple[str, list[str]]] = None,  # (Secret name, keys): env read from a Secret
    node_selector: Optional[dict[str, str]] = None,
    tolerations: Optional[list[dict[str, Any]]] = None,
    ports: Optional[list[int]] = None,
    pvc_mounts: Optional[dict[str, str]] = None,  # claim name -> mount path
    image_pull_secrets: Optional[list[str]] = None,
    labels: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """Write a run's request into a Job manifest (in place, also returned).

    The manifest may be a pool's own (a user-edited base job template): what it
    already holds is kept unless the run sets the same thing - resources are
    overwritten key by key (an ``ephemeral-storage`` limit stays), volumes, mounts
    and env entries are replaced by name, node selectors merged (the preset wins),
    tolerations, ports and pull secrets appended without duplicates.
    """
    run_labels = {**(labels or {}), RUN_ID_LABEL: run_id, QUEUE_LABEL: queue}
    if agent:
        run_labels[AGENT_LABEL] = agent
    spec = manifest.setdefault("spec", {})
    template = spec.setdefault("template", {})
    pod_spec = template.setdefault("spec", {})
    containers = pod_spec.setdefault("containers", [{"name": "prefect-job"}])
    container = containers[0]
    # requests == limits: Guaranteed QoS for cpu/memory, and an extended resource needs both equal
    res = container.get("resources") or {}
    want = pod_resources(resources)
    for kind in ("requests", "limits"):
        have = {k: v for k, v in (res.get(kind) or {}).items() if v not in (None, "")}
        if not resources.gpu:
            have.pop(GPU_RESOURCE, None)
        res[kind] = {**have, **want[kind]}
    container["resources"] = res
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if resources.shm_size:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": quantity_bytes(resources.shm_size)}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    for i, (claim, path) in enumerate(sorted((pvc_mounts or {}).items())):
        volumes.append({"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"pvc-{i}", "mountPath": path})
    if volumes:
        pod_spec["volumes"] = _by_name(pod_spec.get("volumes") or [], volumes)
        container["volumeMounts"] = _by_name(container.get("volumeMounts") or [], mounts)
    new_env = [{"name": k, "value": str(v)} for k, v in sorted((env or {}).items())]
    if env_from_secret:
        secret, keys = env_from_secret
        new_env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in sorted(keys)]
    if new_env or "env" not in container or not isinstance(container.get("env"), list):
        old_env = container.get("env") if isinstance(container.get("env"), list) else []
        container["env"] = _by_name(old_env, new_env)
    if ports:
        have_ports = {p.get("containerPort") for p in container.get("ports") or []}
        container["ports"] = list(container.get("ports") or []) + [
            {"containerPort": int(p)} for p in ports if int(p) not in have_ports]
    pod_spec["restartPolicy"] = "Never"  # a failed run is Prefect's to retry, not the kubelet's
    for key in ("parallelism", "completions"):  # Job fields prefect-kubernetes's template puts in the pod spec
        if key in pod_spec:
            spec.setdefault(key, pod_spec.pop(key))
    if node_selector:
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **node_selector}
    if tolerations:
        have_t = list(pod_spec.get("tolerations") or [])
        pod_spec["tolerations"] = have_t + [dict(t) for t in tolerations if dict(t) not in have_t]
    if image_pull_secrets:
        have_s = list(pod_spec.get("imagePullSecrets") or [])
        known = {s.get("name") for s in have_s}
        pod_spec["imagePullSecrets"] = have_s + [{"name": s} for s in image_pull_secrets if s not in known]
    metadata = manifest.setdefault("metadata", {})
    metadata["labels"] = {**(metadata.get("labels") or {}), **run_labels}
    pod_meta = template.setdefault("metadata", {})
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **run_labels}
    return manifest


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
    """The run's Job from scratch (plain dict in the API's camelCase), one pod, no retries (Prefect retries runs)."""
    container: dict[str, Any] = {"name": "prefect-job", "image": image, "env": []}
    if command:
        container["args"] = list(command)
    manifest: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"generateName": f"{name}-", "namespace": namespace},
        "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}},
    }
    return apply_run(manifest, run_id=run_id, resources=resources, queue=queue, agent=agent, env=env,
                     node_selector=node_selector, tolerations=tolerations, ports=ports, pvc_mounts=pvc_mounts,
                     image_pull_secrets=image_pull_secrets, labels=labels)


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
