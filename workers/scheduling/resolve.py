"""Resolve what a run asks for: queue default < deployment < run.

Each layer may name a preset (which replaces everything below it) and/or give
explicit cpu/memory/gpu/shm_size (which overlay the preset). The same pure
function runs in the CLI before anything is enqueued and in the worker before
a run is claimed, so both give the same answer and the same message.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.cluster.spec import ClusterSpec, cluster_of
from prefect_launch.times import duration_seconds
from prefect_launch.workers.scheduling.queue_spec import QueueSpec
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources, parse_size

RESOURCE_KEYS = ("cpu", "memory", "gpu", "shm_size")


class ResolvedRequest(BaseModel):
    """The resources a run will get, the preset they came from, and the agent pin."""

    preset: str
    resources: Resources
    agent: Optional[str] = None
    timeout_s: Optional[float] = None  # the agent ends the run Failed after this long running
    preemptible: bool = False  # may use idle capacity and give it back to a regular run (issue 12)
    cluster: ClusterSpec = ClusterSpec()  # members of a cluster run; ``resources`` is per member

    def held(self) -> Resources:
        """What the run holds on its agent: the whole cluster for a single-node cluster run."""
        single = self.cluster.is_cluster and self.cluster.mode == "single-node"
        return self.cluster.total(self.resources) if single else self.resources


def _layer_overlay(spec: QueueSpec, base: Resources, layer: dict[str, Any], where: str) -> tuple[Resources, Optional[str]]:
    preset_name = layer.get("preset")
    res = base
    if preset_name:
        if preset_name not in spec.presets:
            raise LaunchValidationError(
                f"unknown preset {preset_name!r} {where} for queue {spec.name!r}; "
                f"choose one of: {', '.join(sorted(spec.presets))}"
            )
        res = spec.presets[preset_name].to_resources()
    upd: dict[str, Any] = {}
    if layer.get("cpu") is not None:
        try:
            upd["cpu"] = float(layer["cpu"])
        except (TypeError, ValueError):
            raise LaunchValidationError(f"cpu must be a number {where}, got {layer['cpu']!r}") from None
        if upd["cpu"] <= 0:
            raise LaunchValidationError(f"cpu must be positive {where}, got {layer['cpu']!r}")
    if layer.get("memory") is not None:
        upd["memory"] = parse_size(layer["memory"], "memory")
    if layer.get("gpu") is not None:
        g = layer["gpu"]
        if isinstance(g, bool) or not (isinstance(g, int) or (isinstance(g, str) and g.isdigit())):
            raise LaunchValidationError(f"gpu must be a whole number {where}, got {g!r}")
        upd["gpu"] = int(g)
    if layer.get("shm_size") is not None:
        upd["shm_size"] = parse_size(layer["shm_size"], "shm_size")
    return res.model_copy(update=upd), preset_name


def resolve_request(
    spec: QueueSpec,
    deployment_vars: Optional[dict[str, Any]] = None,
    run_vars: Optional[dict[str, Any]] = None,
    priority: Optional[str] = None,
) -> ResolvedRequest:
    """Resolve and validate; raises LaunchValidationError with what to change.

    ``priority`` (the run's work queue) gives the queue's default for ``preemptible``."""
    res = spec.presets[spec.default_preset].to_resources()
    preset = spec.default_preset
    agent = None
    timeout = duration_seconds(spec.timeout, f"timeout of queue {spec.name!r}")
    preemptible = bool(priority and priority in spec.preemptible_priorities)
    for layer, where in ((deployment_vars or {}, "in the job's deployment"), (run_vars or {}, "in the submission")):
        res, named = _layer_overlay(spec, res, layer, where)
        preset = named or preset
        agent = layer.get("agent") or agent
        if layer.get("timeout") not in (None, ""):
            timeout = duration_seconds(layer["timeout"], f"timeout {where}")
        if layer.get("preemptible") is not None:
            if not isinstance(layer["preemptible"], bool):
                raise LaunchValidationError(f"preemptible must be true or false {where}, got {layer['preemptible']!r}")
            preemptible = layer["preemptible"]
    problems = spec.bounds.violations(res)
    if problems:
        raise LaunchValidationError(
            f"out of bounds for queue {spec.name!r}: {'; '.join(problems)}"
        )
    if res.shm_size and res.shm_size > res.memory:
        raise LaunchValidationError(
            f"shm_size ({res.shm_size} bytes) is larger than memory ({res.memory} bytes); "
            "lower --shm-size or raise --memory"
        )
    cluster = cluster_of([(deployment_vars or {}, "in the job's deployment"), (run_vars or {}, "in the submission")],
                         target=spec.target)
    return ResolvedRequest(preset=preset, resources=res, agent=agent, timeout_s=timeout, preemptible=preemptible,
                           cluster=cluster)
