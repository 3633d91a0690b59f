"""What a cluster run's indexed Job, its member pods and their events say (pure).

Each member (main1 = index 0, sub<i> = index i) is read with `kubernetes_events.observe` on its own
pods; the cluster is then

- ``ended``: a member failed, was evicted, preempted or OOM-killed (the earliest such member names the
  reason: ``cluster-member-failed: member sub2: ...``, as on the process back end), the Job failed
  without a pod left (the member is read from the pod name in its events or condition), the Job
  completed, or every member exited 0;
- ``waiting``: some member cannot start (the reason names it);
- ``running``: every member runs (or main1 is done and the others still run);
- ``creating``: the rest (the message says which members are placed so far).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from prefect_launch.workers.cluster.kubernetes import INDEX_ANNOTATION, member_of_index
from prefect_launch.workers.backends.kubernetes.events import Observation, observe

FAILED_PREFIX = "cluster-member-failed"


def index_of_pod_name(pod_name: str, job_name: str) -> Optional[int]:
    """The index in an indexed Job's pod name ``<job>-<index>-<suffix>``."""
    m = re.match(rf"^{re.escape(job_name)}-(\d+)-[a-z0-9]+$", pod_name or "")
    return int(m.group(1)) if m else None


def member_index(pod: dict[str, Any], job_name: str) -> Optional[int]:
    """A member pod's index: its annotation (or label, 1.28+), else its hostname, else its name."""
    meta = pod.get("metadata") or {}
    for where in (meta.get("annotations") or {}, meta.get("labels") or {}):
        value = str(where.get(INDEX_ANNOTATION, ""))
        if value.isdigit():
            return int(value)
    host = str((pod.get("spec") or {}).get("hostname") or "")
    if host.startswith(f"{job_name}-") and host[len(job_name) + 1:].isdigit():
        return int(host[len(job_name) + 1:])
    return index_of_pod_name(str(meta.get("name") or ""), job_name)


def _finished_at(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("finishedAt"):
            return str(term["finishedAt"])
    return "~"  # unknown: after every known time


def _failed(name: str, obs: Observation) -> Observation:
    return Observation("ended", f"{FAILED_PREFIX}: member {name}: {obs.message}", obs.end, obs.exit_code, obs.pod,
                       obs.node)


def _job_failed_member(job: dict[str, Any], events: list[dict[str, Any]], job_name: str) -> Optional[int]:
    """Which member a failed Job without pods failed by: a pod named in its condition or its pods' events."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed":
            for word in re.findall(r"[a-z0-9.-]+", (c.get("message") or "").replace("/", " ")):
                i = index_of_pod_name(word, job_name)
                if i is not None:
                    return i
    ended = [e for e in events if (e.get("involvedObject") or {}).get("kind") == "Pod"
             and e.get("reason") in ("Evicted", "Preempted", "PreemptionByScheduler", "Preempting", "OOMKilled")]
    for e in sorted(ended, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or "")):
        i = index_of_pod_name(str((e.get("involvedObject") or {}).get("name") or ""), job_name)
        if i is not None:
            return i
    return None


def observe_cluster(job: Optional[dict[str, Any]], pods: list[dict[str, Any]], events: list[dict[str, Any]],
                    size: int) -> Observation:
    """What the cluster run's Job, member pods and events say now (see the module doc)."""
    if job is None:
        return observe(None, [], events)
    job_name = str((job.get("metadata") or {}).get("name") or "")
    by_index: dict[int, list[dict[str, Any]]] = {}
    for p in pods:
        i = member_index(p, job_name)
        if i is not None and 0 <= i < size:
            by_index.setdefault(i, []).append(p)
    members = {i: observe(job, ps, events) for i, ps in sorted(by_index.items())}
    bad = [i for i, o in members.items() if o.kind == "ended" and o.end != "completed"]
    if bad:
        first = min(bad, key=lambda i: (_finished_at(next(p for p in pods if p["metadata"]["name"] == members[i].pod))
                                        if members[i].pod else "~", i))
        return _failed(member_of_index(first), members[first])
    whole = observe(job, [], events)  # the Job's own conditions (and FailedCreate)
    if whole.kind == "ended" and whole.end != "completed":
        code = re.search(r"failed with exit code (\d+)", whole.message)  # the podFailurePolicy's FailJob rule
        if code and whole.message.startswith("the Kubernetes job failed (PodFailurePolicy)"):
            whole = Observation("ended", whole.message, "failed", int(code.group(1)))
        i = _job_failed_member(job, events, job_name)
        return _failed(member_of_index(i), whole) if i is not None else \
            Observation("ended", f"{FAILED_PREFIX}: {whole.message}", whole.end)
    done = [i for i, o in members.items() if o.kind == "ended"]
    if (whole.kind == "ended" and whole.end == "completed") or len(done) == size:
        return Observation("ended", f"every member of the cluster of {size} exited with code 0", "completed", 0)
    waiting = [(i, o) for i, o in members.items() if o.kind == "waiting"]
    if waiting:
        i, o = waiting[0]
        why = o.message.removeprefix("waiting: ")
        return Observation("waiting", f"waiting: cluster member {member_of_index(i)}: {why}", pod=o.pod, node=o.node)
    if not members and whole.kind == "waiting":
        return whole
    placed = [f"{member_of_index(i)} on node {o.node}" for i, o in members.items() if o.node]
    up = [i for i, o in members.items() if o.kind == "running" or (o.kind == "ended" and o.end == "completed")]
    if len(up) == size:
        return Observation("running", f"kubernetes: cluster of {size}: {', '.join(placed)}", pod=members[0].pod,
                           node=members[0].node)
    return Observation("creating", f"kubernetes: cluster of {size}: {len(placed)} of {size} members placed "
                                   f"({', '.join(placed)})" if placed else "")
