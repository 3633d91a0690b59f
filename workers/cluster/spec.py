"""What a cluster run asks for: how many members and how they are spread.

Pure. A run is a cluster run when ``cluster_size`` > 1 (job variable, ``submit --cluster-size``).
Read from the same layers as the resources (deployment < run) and checked in the CLI before
anything is enqueued and again by the agent, so both refuse with the same message.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel

from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources

ClusterMode = Literal["single-node", "multi-node"]
CLUSTER_MODES: tuple[str, ...] = ("single-node", "multi-node")
MAX_CLUSTER_SIZE = 64  # a sanity bound: a typo like 1000 is refused instead of waiting forever
# Where members run: processes or containers (host networking) of one agent (single-node) or of several
# agents (multi-node), or the pods of one indexed Job on a kubernetes queue (placed together or spread by pod affinity).
SUPPORTED: dict[str, tuple[str, ...]] = {"process": ("single-node", "multi-node"),
                                         "docker": ("single-node", "multi-node"),  # a container per member
                                         "kubernetes": ("single-node", "multi-node")}  # an indexed Job


class ClusterSpec(BaseModel):
    """``size`` members (main1, sub1, ...), each with the run's preset, placed all-or-nothing."""

    size: int = 1
    mode: ClusterMode = "single-node"

    @property
    def is_cluster(self) -> bool:
        return self.size > 1

    def total(self, member: Resources) -> Resources:
        """What the whole cluster holds on one agent (single-node): ``size`` x the preset."""
        return member.times(self.size)

    def describe(self) -> str:
        return f"{self.size} members ({self.mode})" if self.is_cluster else "single run"


def _size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
        raise LaunchValidationError(f"cluster_size must be a whole number {where}, got {value!r}")
    n = int(value)
    if n < 1:
        raise LaunchValidationError(f"cluster_size must be at least 1 {where}, got {n}")
    if n > MAX_CLUSTER_SIZE:
        raise LaunchValidationError(f"cluster_size {n} {where} is above the limit of {MAX_CLUSTER_SIZE} members; "
                                    "split the job or ask for bigger members (a larger preset)")
    return n


def cluster_of(layers: list[tuple[dict[str, Any], str]], target: str = "process") -> ClusterSpec:
    """The cluster a run asks for: later layers win; ``target`` is the queue's back end."""
    size, mode = 1, "single-node"
    for layer, where in layers:
        if layer.get("cluster_size") is not None:
            size = _size(layer["cluster_size"], where)
        if layer.get("cluster_mode") not in (None, ""):
            mode = str(layer["cluster_mode"])
            if mode not in CLUSTER_MODES:
                raise LaunchValidationError(f"cluster_mode must be one of {', '.join(CLUSTER_MODES)} {where}, "
                                            f"got {mode!r}")
    spec = ClusterSpec(size=size, mode=mode)  # type: ignore[arg-type]
    if spec.is_cluster:
        allowed = SUPPORTED.get(target, ())
        if not allowed:
            raise LaunchValidationError(f"cluster runs are not supported on {target} queues yet; "
                                        "use a process queue")
        if mode not in allowed:
            raise LaunchValidationError(f"cluster mode {mode!r} is not supported on {target} queues yet; "
                                        f"use --cluster-mode {allowed[0]}")
    return spec


def check_fits_one_agent(cluster: ClusterSpec, member: Resources, capacities: dict[str, Resources]) -> Optional[str]:
    """Why no agent (single-node) or no set of agents (multi-node) could ever hold the whole cluster, or None
    (empty ``capacities``: unknown yet)."""
    if not cluster.is_cluster or not capacities:
        return None
    if cluster.mode == "multi-node":
        from prefect_launch.workers.cluster.fit import fit_count

        room = sum(min(fit_count(member, c), cluster.size) for c in capacities.values())
        if room >= cluster.size:
            return None
        return (f"a cluster of {cluster.size} x {member.describe()} (multi-node) fits {room} member(s) on all the "
                f"queue's agents together ({', '.join(sorted(capacities))}); lower --cluster-size")
    total = cluster.total(member)
    if any(total.fits(c) for c in capacities.values()):
        return None
    best = max(capacities, key=lambda a: (capacities[a].gpu, capacities[a].cpu, capacities[a].memory))
    short = "; ".join(f"{n}={need} (agent {best} has {have} in total)" for n, need, have in total.shortfall(capacities[best]))
    return (f"a cluster of {cluster.size} x {member.describe()} ({cluster.mode}) needs {short}; "
            "lower --cluster-size or choose a smaller preset")
