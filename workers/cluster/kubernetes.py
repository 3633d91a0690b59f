"""A cluster run on a Kubernetes queue: one indexed Job plus a headless Service (pure).

From the Job manifest the single-run path renders (`kubernetes_manifest.apply_run`: the preset's
requests = limits, ``nvidia.com/gpu``, ``/dev/shm``, selectors, env, labels) this makes

- a ``batch/v1`` Job with ``completionMode: Indexed`` and ``completions = parallelism = size``: the Job
  controller makes one pod per member index, each with hostname ``<job>-<index>``, and sets the
  ``batch.kubernetes.io/job-completion-index`` annotation that the env reads (``JOB_COMPLETION_INDEX``,
  ``RANK``);
- a headless Service (``clusterIP: None``, selecting the Job's pods by their ``job-name`` label,
  ``publishNotReadyAddresses`` so members resolve each other before any is Ready) named like the Job,
  which the pods use as their ``subdomain``: member ``i`` is ``<job>-<i>.<service>`` in DNS.

One member failing fails the run, as on the process back end. ``backoffLimit: 0`` does that on every
cluster that has indexed Jobs (any pod failure fails the whole Job and the controller stops the other
pods); the ``podFailurePolicy`` (``FailJob`` on a non-zero exit or a disruption) only makes it immediate
and names the failing pod in the Job's condition. ``backoffLimitPerIndex`` / ``maxFailedIndexes: 0`` are
not used: they need a newer API (beta until 1.33), an API server without them drops them silently, and
they would let the other members run on after one failed index, which a cluster run does not want.

Members get the variables of the process back end (`cluster_env.cluster_variables`): the per-member
ones (rank) come from the completion index by ``fieldRef``, the rest are the same for every member; the
member's own name (main1, sub1, ...) and which program it runs (the Prefect engine for main1,
`cluster_member` for the others) are set by the shell-free launcher `kubernetes_member`, since a pod
template cannot differ by index.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from prefect_launch.workers.cluster.env import cluster_variables
from prefect_launch.workers.cluster.fit import member_names
from prefect_launch.workers.scheduling.resources import LaunchValidationError
from prefect_launch.workers.agent.tags import RUN_ID_LABEL

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "job-name"  # set by the Job controller on its pods (every version with indexed Jobs)
RENDEZVOUS_PORT = 29500  # torch.distributed's default; every member has its own pod IP
LAUNCHER = ["python", "-m", "prefect_launch.workers.cluster.kubernetes_member", "--"]
PER_MEMBER = ("JOB_COMPLETION_INDEX", "LAUNCH_CLUSTER_RANK", "RANK")  # from the pod's completion index
SET_BY_LAUNCHER = ("LAUNCH_CLUSTER_MEMBER",)
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label
MAX_LABEL = 63


class ClusterJob(BaseModel):
    """What names a cluster run's Job and Service and how its members are spread."""

    run_id: str
    job_name: str
    size: int = Field(ge=2)
    mode: Literal["single-node", "multi-node"] = "single-node"
    port: int = Field(default=RENDEZVOUS_PORT, ge=1, le=65535)

    @property
    def service_name(self) -> str:
        return self.job_name  # one name for both: a re-attached worker finds the Service from the Job

    def host(self, index: int) -> str:
        """Member ``index``'s DNS name inside the namespace (pod hostname . subdomain)."""
        return f"{self.job_name}-{index}.{self.service_name}"


class ClusterManifests(BaseModel):
    job: dict[str, Any]
    service: dict[str, Any]


def check_dns_label(name: str, what: str, rfc1035: bool = False) -> None:
    """Raise a clear error unless ``name`` is an RFC 1123 label (RFC 1035 - a leading letter - for Services)."""
    problems = []
    if len(name) > MAX_LABEL:
        problems.append(f"{len(name)} characters (at most {MAX_LABEL})")
    if not _LABEL.match(name):
        problems.append("only lower-case letters, digits and '-', starting and ending with a letter or digit")
    elif rfc1035 and not name[0].isalpha():
        problems.append("must start with a letter")
    if problems:
        raise LaunchValidationError(f"{what} {name!r} is not a valid Kubernetes name: {'; '.join(problems)}")


def cluster_job_name(base: str, suffix: str, size: int) -> str:
    """A Job (and Service) name from the run's job name: a valid label that leaves room for ``-<index>``."""
    stem = re.sub(r"[^a-z0-9-]+", "-", (base or "").lower()).strip("-")
    if not stem or not stem[0].isalpha():
        stem = f"launch-{stem}".rstrip("-")
    room = MAX_LABEL - len(str(size - 1)) - 1 - len(suffix) - 1
    name = f"{stem[:room].rstrip('-')}-{suffix}"
    check_cluster_names(name, size)
    return name


def check_cluster_names(job_name: str, size: int) -> None:
    check_dns_label(job_name, "the cluster's Job/Service name", rfc1035=True)
    check_dns_label(f"{job_name}-{size - 1}", f"the hostname of member {member_names(size)[-1]}")


def member_of_index(index: int) -> str:
    """main1 for index 0, sub<i> for index i (the process back end's names)."""
    return "main1" if index == 0 else f"sub{index}"


def cluster_env(c: ClusterJob) -> list[dict[str, Any]]:
    """The members' env entries: the process back end's names, the per-member ones read from the index."""
    static = cluster_variables(size=c.size, rank=0, member="main1", mode=c.mode, hosts=member_names(c.size),
                               addrs=[c.host(i) for i in range(c.size)], main_addr=c.host(0), port=c.port)
    index = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
    out: list[dict[str, Any]] = [{"name": k, **copy.deepcopy(index)} for k in PER_MEMBER]
    out += [{"name": k, "value": v} for k, v in static.items() if k not in PER_MEMBER + SET_BY_LAUNCHER]
    return out


def _placement(c: ClusterJob) -> dict[str, Any]:
    """single-node: every member on the node of the others (required; the scheduler lets the first pod of a
    term that matches itself go anywhere). multi-node: spread over nodes where it can (preferred, like the
    process back end's one-per-agent-first)."""
    term = {"labelSelector": {"matchLabels": {RUN_ID_LABEL: c.run_id}}, "topologyKey": "kubernetes.io/hostname"}
    if c.mode == "single-node":
        return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def _wrap_command(container: dict[str, Any]) -> None:
    """Run the container's program through the launcher; the image's entrypoint still runs when only
    ``args`` were set."""
    key = "command" if container.get("command") else "args"
    program = list(container.get(key) or [])
    if program[:len(LAUNCHER)] != LAUNCHER:
        container[key] = LAUNCHER + program


def render_cluster(manifest: dict[str, Any], c: ClusterJob) -> ClusterManifests:
    """The indexed Job and headless Service of a cluster run, from the single run's Job manifest (not changed)."""
    check_cluster_names(c.job_name, c.size)
    job = copy.deepcopy(manifest)
    meta = job.setdefault("metadata", {})
    meta.pop("generateName", None)
    meta["name"] = c.job_name
    namespace = meta.get("namespace") or "default"
    spec = job.setdefault("spec", {})
    spec.update({"completionMode": "Indexed", "completions": c.size, "parallelism": c.size, "backoffLimit": 0,
                 "podFailurePolicy": {"rules": [
                     {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
                     {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}})
    pod = spec.setdefault("template", {}).setdefault("spec", {})
    pod["restartPolicy"] = "Never"  # podFailurePolicy needs it; a member is not restarted on its own
    pod["subdomain"] = c.service_name
    pod["affinity"] = {**(pod.get("affinity") or {}), **_placement(c)}
    container = pod.setdefault("containers", [{"name": "prefect-job"}])[0]
    _wrap_command(container)
    ours = cluster_env(c)
    names = {e["name"] for e in ours}
    container["env"] = ours + [e for e in container.get("env") or [] if e.get("name") not in names]
    ports = list(container.get("ports") or [])
    if all(p.get("containerPort") != c.port for p in ports):
        container["ports"] = ports + [{"name": "rendezvous", "containerPort": c.port}]
    labels = dict(meta.get("labels") or {})
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": c.service_name, "namespace": namespace, "labels": labels},
        "spec": {"clusterIP": "None", "selector": {JOB_NAME_LABEL: c.job_name}, "publishNotReadyAddresses": True,
                 "ports": [{"name": "rendezvous", "port": c.port, "targetPort": c.port, "protocol": "TCP"}]},
    }
    return ClusterManifests(job=job, service=service)


def owned_by(service: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """``service`` owned by the created ``job``: the cluster's garbage collector deletes it with the Job (its
    TTL, or a worker that died before deleting it)."""
    meta = job.get("metadata") or {}
    out = copy.deepcopy(service)
    out["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": meta.get("name"),
                                           "uid": meta.get("uid")}]
    return out
