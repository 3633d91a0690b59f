"""What a Kubernetes Job, its pod and their events say about a run (pure).

The `launch-kubernetes` worker reads the run's Job, the pods labelled with the
run id and the events of those objects, and asks `observe` what they mean:

- ``creating``: no pod yet, or a pod placed on a node whose container is being
  set up (the message then names the node);
- ``waiting``: the pod cannot start, with the one-line reason the run carries
  in its ``launch.waiting`` label - ``Unschedulable`` / ``FailedScheduling``
  (not enough nvidia.com/gpu, no node matching the preset's selector, untolerated
  taints), an image that cannot be pulled, a missing Secret, a quota that
  forbids the pod;
- ``running``: the pod runs on a node (the run's ``launch.placement``);
- ``ended``: the run's end as Kubernetes knows it: Succeeded, a non-zero exit
  code, an OOM kill, eviction by the kubelet, preemption by the scheduler or a
  drain (the pod's ``DisruptionTarget`` condition or its events), a job that
  failed without a pod (``DeadlineExceeded``, ``BackoffLimitExceeded``), or a
  job that was deleted.

Input is the API's JSON (camelCase dicts, as ``ApiClient.sanitize_for_serialization``
writes the client's models), so every case is tested from literal dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from prefect_launch.workers.backends.kubernetes.manifest import pod_event_outcome

Kind = Literal["creating", "waiting", "running", "ended"]
EndState = Literal["completed", "failed", "crashed"]

# container "waiting" reasons that mean the pod will not start by itself
STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
DISRUPTIONS = {
    "PreemptionByScheduler": "preempted by the scheduler",  # a higher-priority pod needed the node
    "EvictionByEvictionAPI": "evicted through the eviction API (e.g. a node drain)",
    "DeletionByTaintManager": "deleted by the taint manager (the node got a NoExecute taint)",
    "DeletionByPodGC": "deleted by the pod garbage collector (its node is gone)",
    "TerminationByKubelet": "terminated by the kubelet (node pressure or shutdown)",
}


@dataclass(frozen=True)
class Observation:
    kind: Kind
    message: str = ""  # waiting reason, placement, or why the run ended
    end: Optional[EndState] = None
    exit_code: Optional[int] = None
    pod: Optional[str] = None
    node: Optional[str] = None


def _one_line(text: Any) -> str:
    return " ".join(str(text or "").split())


def _with(msg: str, detail: Any) -> str:
    detail = _one_line(detail)
    return f"{msg}: {detail}" if detail else msg


def _when(obj: dict[str, Any]) -> str:
    """Sort key of an event or object: its latest timestamp (RFC 3339 strings sort as times)."""
    meta = obj.get("metadata") or {}
    return str(obj.get("lastTimestamp") or obj.get("eventTime") or obj.get("firstTimestamp")
               or meta.get("creationTimestamp") or "")


def _condition(obj: dict[str, Any], ctype: str) -> Optional[dict[str, Any]]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def _events_of(events: list[dict[str, Any]], name: Optional[str], kind: str) -> list[dict[str, Any]]:
    out = [e for e in events if (e.get("involvedObject") or {}).get("name") == name
           and (e.get("involvedObject") or {}).get("kind", kind) == kind]
    return sorted(out, key=_when)


def _disruption(pod: dict[str, Any], events: list[dict[str, Any]]) -> Optional[str]:
    """Why Kubernetes took the pod away (eviction, preemption, drain), if it did."""
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return _with("evicted by the kubelet", status.get("message"))
    cond = _condition(pod, "DisruptionTarget")
    if cond is not None and cond.get("status") == "True":
        what = DISRUPTIONS.get(cond.get("reason") or "", f"disrupted ({cond.get('reason')})")
        return _with(what, cond.get("message"))
    for ev in reversed(_events_of(events, (pod.get("metadata") or {}).get("name"), "Pod")):
        outcome = pod_event_outcome(ev.get("reason") or "", ev.get("message") or "")
        if outcome and outcome[0] == "ended" and ev.get("reason") != "OOMKilled":
            return outcome[1]
    return None


def _terminated(pod: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The first container's terminated state (the job's container is the first one)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term:
            return term
    return None


def _memory_limit(pod: dict[str, Any]) -> str:
    for c in (pod.get("spec") or {}).get("containers") or []:
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if limit:
            return f" {limit}"
    return ""


def _pod_end(pod: dict[str, Any], events: list[dict[str, Any]]) -> Observation:
    name = (pod.get("metadata") or {}).get("name")
    node = (pod.get("spec") or {}).get("nodeName")
    phase = (pod.get("status") or {}).get("phase")
    disrupted = _disruption(pod, events)
    term = _terminated(pod) or {}
    code = term.get("exitCode")
    if disrupted:
        return Observation("ended", f"{disrupted} (pod {name}{' on node ' + node if node else ''})", "crashed",
                           code, name, node)
    if term.get("reason") == "OOMKilled":
        return Observation("ended", (f"out of memory: the container exceeded its memory limit{_memory_limit(pod)} "
                                     f"and was OOM-killed (exit code {code}); ask for more memory (--memory or a "
                                     "larger preset)"), "crashed", code, name, node)
    if phase == "Succeeded" or (code == 0 and phase != "Failed"):
        return Observation("ended", "the job's container exited with code 0", "completed", 0, name, node)
    if code is not None:
        why = _one_line(term.get("message")) or _one_line(term.get("reason"))
        return Observation("ended", f"the job's container exited with code {code}" + (f" ({why})" if why else ""),
                           "failed", int(code), name, node)
    status = pod.get("status") or {}
    return Observation("ended", _with(f"the pod failed ({status.get('reason') or 'no exit code'})",
                                      status.get("message")), "crashed", None, name, node)


def _pod_waiting(pod: dict[str, Any], events: list[dict[str, Any]]) -> Optional[str]:
    """Why a Pending pod does not start, or None while it is only being set up."""
    name = (pod.get("metadata") or {}).get("name")
    scheduled = _condition(pod, "PodScheduled")
    node = (pod.get("spec") or {}).get("nodeName")
    if not node and not (scheduled and scheduled.get("status") == "True"):
        if scheduled and scheduled.get("reason") == "Unschedulable":
            return pod_event_outcome("FailedScheduling", scheduled.get("message") or "")[1]
        failed = [e for e in _events_of(events, name, "Pod") if e.get("reason") == "FailedScheduling"]
        if failed:
            return pod_event_outcome("FailedScheduling", failed[-1].get("message") or "")[1]
        return None
    statuses = list((pod.get("status") or {}).get("initContainerStatuses") or []) + \
        list((pod.get("status") or {}).get("containerStatuses") or [])
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            return _with(f"waiting: {waiting['reason']}", waiting.get("message"))
    for ev in reversed(_events_of(events, name, "Pod")):
        if ev.get("reason") in ("FailedMount", "FailedAttachVolume"):
            return _with(f"waiting: {ev['reason']}", ev.get("message"))
        if ev.get("reason") in ("Scheduled", "Pulling", "Pulled", "Created", "Started"):
            break
    return None


def observe(job: Optional[dict[str, Any]], pods: list[dict[str, Any]], events: list[dict[str, Any]]) -> Observation:
    """What the run's Job, pods and events say now (see the module doc)."""
    if job is None:
        return Observation("ended", "the run's Kubernetes job was deleted before the run ended", "crashed")
    pods = sorted(pods, key=_when)
    pod = pods[-1] if pods else None
    if pod is not None:
        phase = (pod.get("status") or {}).get("phase")
        name = (pod.get("metadata") or {}).get("name")
        node = (pod.get("spec") or {}).get("nodeName")
        if phase in ("Succeeded", "Failed") or _disruption(pod, events):
            return _pod_end(pod, events)
        if phase == "Running":
            return Observation("running", f"kubernetes: pod {name} on node {node}", pod=name, node=node)
        waiting = _pod_waiting(pod, events)
        if waiting:
            return Observation("waiting", waiting, pod=name, node=node)
        if node:  # placed, container being set up
            return Observation("creating", f"kubernetes: pod {name} on node {node} (starting)", pod=name, node=node)
        return Observation("creating", pod=name)
    # no pod: a job that already ended (its pod deleted by a preemption, a deadline), or one that cannot make one
    job_name = (job.get("metadata") or {}).get("name")
    for ctype in ("Failed", "Complete"):
        cond = _condition(job, ctype)
        if cond is not None and cond.get("status") == "True":
            if ctype == "Complete":
                return Observation("ended", "the job completed", "completed", 0)
            pod_events = sorted((e for e in events if (e.get("involvedObject") or {}).get("kind") == "Pod"), key=_when)
            for ev in reversed(pod_events):  # the events of its pods outlive them (about an hour)
                outcome = pod_event_outcome(ev.get("reason") or "", ev.get("message") or "")
                if outcome and outcome[0] == "ended":
                    return Observation("ended", outcome[1], "crashed")
            if cond.get("reason") == "DeadlineExceeded":
                return Observation("ended", _with("the job ran past its activeDeadlineSeconds", cond.get("message")),
                                   "failed")
            return Observation("ended", _with(f"the Kubernetes job failed ({cond.get('reason')})",
                                              cond.get("message")), "crashed")
    failed = [e for e in _events_of(events, job_name, "Job") if e.get("reason") == "FailedCreate"]
    if failed:
        return Observation("waiting", _with("waiting: the job cannot create its pod", failed[-1].get("message")))
    return Observation("creating")
