"""Base job templates for launch queues: presets, bounds and defaults as job variables.

The template is what a Prefect user sees in the UI's job-variables form for the
pool; it also carries the whole queue declaration under
``job_configuration.launch`` so the worker and CLI read one source of truth.
"""

from __future__ import annotations

import copy
from typing import Any

from prefect_launch.workers.cluster.spec import MAX_CLUSTER_SIZE
from prefect_launch.workers.scheduling.queue_spec import QueueSpec
from prefect_launch.workers.scheduling.resources import format_size, parse_size

LAUNCH_VARIABLES = ("preset", "cpu", "memory", "gpu", "shm_size", "agent", "timeout", "preemptible", "secret_env",
                    "cluster_size", "cluster_mode", "environment")


def _worker_template(pool_type: str) -> dict[str, Any]:
    if pool_type == "launch-process":
        from prefect_launch.workers.backends.process import LaunchProcessWorker

        return LaunchProcessWorker.get_default_base_job_template()
    if pool_type == "launch-docker":
        from prefect_launch.workers.backends.docker import LaunchDockerWorker

        return LaunchDockerWorker.get_default_base_job_template()
    if pool_type == "docker":
        from prefect_docker.worker import DockerWorker

        return DockerWorker.get_default_base_job_template()
    if pool_type == "kubernetes":
        try:
            from prefect_kubernetes.worker import KubernetesWorker

            return KubernetesWorker.get_default_base_job_template()
        except ImportError:
            return {"job_configuration": {}, "variables": {"type": "object", "properties": {}}}
    raise ValueError(f"unknown pool type {pool_type!r}")


def build_base_job_template(spec: QueueSpec) -> dict[str, Any]:
    """The pool's base job template for ``spec`` (pure apart from reading worker defaults)."""
    from prefect_launch.workers.backends.process import LaunchProcessVariables

    template = copy.deepcopy(_worker_template(spec.pool_type))
    props: dict[str, Any] = template["variables"].setdefault("properties", {})
    ours = LaunchProcessVariables.model_json_schema()["properties"]
    for key in LAUNCH_VARIABLES:
        props[key] = copy.deepcopy(ours[key])
        props[key].pop("anyOf", None)
        props[key].pop("default", None)
    preset_lines = ", ".join(
        f"{n} (cpu={p.cpu:g}, memory={p.memory}, gpu={p.gpu}{', shm=' + p.shm_size if p.shm_size else ''})"
        for n, p in spec.presets.items()
    )
    props["preset"].update(
        type="string", enum=sorted(spec.presets), default=spec.default_preset,
        description=f"Resource preset. {preset_lines}. Default: {spec.default_preset}.",
    )
    props["cpu"].update(type="number", exclusiveMinimum=0)
    props["gpu"].update(type="integer", minimum=0)
    props["memory"]["type"] = props["shm_size"]["type"] = props["agent"]["type"] = "string"
    props["timeout"]["type"] = "string"
    props["preemptible"]["type"] = "boolean"
    props["cluster_size"].update(type="integer", minimum=1, maximum=MAX_CLUSTER_SIZE)
    props["cluster_mode"].update(type="string", enum=["single-node", "multi-node"])
    props["secret_env"].update(type="object", additionalProperties={"type": "string"})  # NAME -> Secret block
    props["environment"].update(type="object")  # a job environment: workers/environments/spec.py
    if spec.timeout:
        props["timeout"]["description"] += f" Queue default: {spec.timeout}."
    b = spec.bounds
    if b.cpu.min is not None:
        props["cpu"]["minimum"] = b.cpu.min
    if b.cpu.max is not None:
        props["cpu"]["maximum"] = b.cpu.max
    if b.gpu.min is not None:
        props["gpu"]["minimum"] = int(b.gpu.min)
    if b.gpu.max is not None:
        props["gpu"]["maximum"] = int(b.gpu.max)
    for key, rng in (("memory", b.memory), ("shm_size", b.shm_size)):
        lo, hi = parse_size(rng.min), parse_size(rng.max)
        if lo is not None or hi is not None:
            props[key]["description"] += f" Bounds: {format_size(lo) if lo is not None else '0'}..{format_size(hi) if hi is not None else 'any'}."
    if spec.target == "process":
        for key in LAUNCH_VARIABLES:
            template["job_configuration"][key] = "{{ " + key + " }}"
    elif spec.image and "image" in props:
        props["image"]["default"] = spec.image
    template["job_configuration"]["launch"] = spec.model_dump(mode="json")
    return template
