"""Pod, job and event snapshots as the API returns them -> what the launch-kubernetes worker records (pure)."""

from __future__ import annotations

import pytest

from prefect_launch.workers.backends.kubernetes.events import observe

JOB = {"metadata": {"name": "run-abcde", "namespace": "default"}, "status": {"active": 1}}


def pod(phase="Pending", node=None, name="run-abcde-x1", created="2026-01-01T00:00:00Z", **status):
    return {"metadata": {"name": name, "creationTimestamp": created},
            "spec": {"nodeName": node, "containers": [{"name": "prefect-job",
                                                        "resources": {"limits": {"memory": "4Gi"}}}]},
            "status": {"phase": phase, **status}}


def event(name, reason, message, kind="Pod", at="2026-01-01T00:00:05Z"):
    return {"involvedObject": {"kind": kind, "name": name}, "reason": reason, "message": message,
            "lastTimestamp": at}


def terminated(code, reason="Error", message=None):
    return {"containerStatuses": [{"name": "prefect-job", "state": {"terminated": {
        "exitCode": code, "reason": reason, **({"message": message} if message else {})}}}]}


UNSCHED = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
FAILED_JOB = {**JOB, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                "message": "Job has reached the specified backoff limit"}]}}
DEADLINE_JOB = {**JOB, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}


def waiting(reason, message):
    return {"containerStatuses": [{"name": "prefect-job",
                                   "state": {"waiting": {"reason": reason, "message": message}}}]}


def case(id, pods, events=(), job=JOB, **want):
    """One snapshot and what ``observe`` makes of it: ``kind``, ``end``, ``exit_code``, ``message`` are compared
    exactly; ``starts`` and ``has`` are checked in the message."""
    return pytest.param(job, pods, list(events), want, id=id)


CASES = [
    case("unschedulable-condition-is-the-waiting-reason",
         [pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHED}])],
         kind="waiting", message=f"waiting: unschedulable: {UNSCHED}"),
    case("failed-scheduling-event-alone-is-enough",
         [pod()], [event("run-abcde-x1", "FailedScheduling",
                         "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector.")],
         kind="waiting", has="didn't match Pod's node affinity/selector"),
    case("old-failed-scheduling-is-ignored-once-placed",
         [pod(node="gpu-node-1", conditions=[{"type": "PodScheduled", "status": "True"}])],
         [event("run-abcde-x1", "FailedScheduling", UNSCHED)],
         kind="creating", message="kubernetes: pod run-abcde-x1 on node gpu-node-1 (starting)"),
    case("image-pull-stall-is-a-waiting-reason",
         [pod(node="n1", **waiting("ImagePullBackOff", 'Back-off pulling image "reg/x:1"'))],
         message='waiting: ImagePullBackOff: Back-off pulling image "reg/x:1"'),
    case("missing-secret-stall-is-a-waiting-reason",
         [pod(node="n1", **waiting("CreateContainerConfigError", 'secret "x" not found'))],
         starts="waiting: CreateContainerConfigError: secret"),
    case("quota-forbidding-the-pod-is-a-waiting-reason",
         [], [event("run-abcde", "FailedCreate", 'pods "run-abcde-x" is forbidden: exceeded quota: gpu', kind="Job")],
         kind="waiting", has="exceeded quota"),
    case("no-pod-and-no-event-yet-is-creating", [], kind="creating"),
    case("running-names-the-node",
         [pod("Running", node="gpu-node-2")], kind="running", message="kubernetes: pod run-abcde-x1 on node gpu-node-2"),
    case("succeeded", [pod("Succeeded", node="n", **terminated(0, "Completed"))],
         kind="ended", end="completed", exit_code=0),
    case("failed-with-its-exit-code", [pod("Failed", node="n", **terminated(3, "Error", "boom"))],
         end="failed", exit_code=3, message="the job's container exited with code 3 (boom)"),
    case("oom-kill", [pod("Failed", node="n", **terminated(137, "OOMKilled"))],
         end="crashed", starts="out of memory: the container exceeded its memory limit 4Gi"),
    case("eviction-by-the-kubelet",
         [pod("Failed", node="n7", reason="Evicted", message="The node was low on resource: memory.")],
         end="crashed",
         message="evicted by the kubelet: The node was low on resource: memory. (pod run-abcde-x1 on node n7)"),
    case("preemption-from-the-disruption-condition",
         [pod("Failed", node="n1", conditions=[{"type": "DisruptionTarget", "status": "True",
                                                "reason": "PreemptionByScheduler",
                                                "message": "default-scheduler: preempting to accommodate a higher "
                                                           "priority pod"}])],
         end="crashed", starts="preempted by the scheduler: default-scheduler"),
    # still Running, but the scheduler already announced the preemption
    case("preemption-from-the-event-while-running",
         [pod("Running", node="n1")], [event("run-abcde-x1", "Preempted", "Preempted by pod 1234")],
         kind="ended", starts="preempted by the scheduler: Preempted by pod 1234"),
    case("job-failed-after-its-preempted-pod-was-deleted",
         [], [event("run-abcde-x1", "Preempted", "Preempted by pod 99 on node n1")], job=FAILED_JOB,
         end="crashed", starts="preempted by the scheduler"),
    case("job-failed-after-its-pod-was-deleted", [], job=FAILED_JOB,
         starts="the Kubernetes job failed (BackoffLimitExceeded)"),
    case("job-past-its-deadline", [], job=DEADLINE_JOB, end="failed"),
    case("deleted-job", [], job=None, kind="ended", end="crashed", has="deleted"),
    case("latest-pod-counts",
         [pod("Running", node="n2", name="b", created="2026-01-01T00:01:00Z"),
          pod("Failed", name="a", created="2026-01-01T00:00:00Z", **terminated(1))],
         kind="running"),
]


@pytest.mark.parametrize("job,pods,events,want", CASES)
def test_observe(job, pods, events, want):
    obs = observe(job, pods, events)
    exact = {k: want[k] for k in ("kind", "end", "exit_code", "message") if k in want}
    assert {k: getattr(obs, k) for k in exact} == exact
    assert obs.message.startswith(want.get("starts", "")), obs.message
    assert want.get("has", "") in obs.message, obs.message
