"""Pod, job and event snapshots as the API returns them -> what the launch-kubernetes worker records (pure)."""

from __future__ import annotations

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


def test_unschedulable_condition_is_the_waiting_reason():
    p = pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHED}])
    obs = observe(JOB, [p], [])
    assert obs.kind == "waiting" and obs.message == f"waiting: unschedulable: {UNSCHED}"


def test_failed_scheduling_event_alone_is_enough():
    obs = observe(JOB, [pod()], [event("run-abcde-x1", "FailedScheduling",
                                       "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector.")])
    assert obs.kind == "waiting" and "didn't match Pod's node affinity/selector" in obs.message


def test_old_failed_scheduling_is_ignored_once_placed():
    p = pod(node="gpu-node-1", conditions=[{"type": "PodScheduled", "status": "True"}])
    obs = observe(JOB, [p], [event("run-abcde-x1", "FailedScheduling", UNSCHED)])
    assert obs.kind == "creating" and obs.message == "kubernetes: pod run-abcde-x1 on node gpu-node-1 (starting)"


def test_image_pull_and_missing_secret_stalls_are_waiting_reasons():
    p = pod(node="n1", containerStatuses=[{"name": "prefect-job", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "reg/x:1"'}}}])
    assert observe(JOB, [p], []).message == 'waiting: ImagePullBackOff: Back-off pulling image "reg/x:1"'
    p = pod(node="n1", containerStatuses=[{"name": "prefect-job", "state": {"waiting": {
        "reason": "CreateContainerConfigError", "message": 'secret "x" not found'}}}])
    assert observe(JOB, [p], []).message.startswith("waiting: CreateContainerConfigError: secret")


def test_quota_forbidding_the_pod_is_a_waiting_reason():
    obs = observe(JOB, [], [event("run-abcde", "FailedCreate", 'pods "run-abcde-x" is forbidden: exceeded quota: gpu',
                                  kind="Job")])
    assert obs.kind == "waiting" and "exceeded quota" in obs.message
    assert observe(JOB, [], []).kind == "creating"


def test_running_names_the_node():
    obs = observe(JOB, [pod("Running", node="gpu-node-2")], [])
    assert obs.kind == "running" and obs.message == "kubernetes: pod run-abcde-x1 on node gpu-node-2"


def test_succeeded_and_exit_codes():
    ok = observe(JOB, [pod("Succeeded", node="n", **terminated(0, "Completed"))], [])
    assert (ok.kind, ok.end, ok.exit_code) == ("ended", "completed", 0)
    bad = observe(JOB, [pod("Failed", node="n", **terminated(3, "Error", "boom"))], [])
    assert (bad.end, bad.exit_code) == ("failed", 3)
    assert bad.message == "the job's container exited with code 3 (boom)"


def test_oom_kill():
    obs = observe(JOB, [pod("Failed", node="n", **terminated(137, "OOMKilled"))], [])
    assert obs.end == "crashed" and obs.message.startswith("out of memory: the container exceeded its memory limit 4Gi")


def test_eviction_by_the_kubelet():
    p = pod("Failed", node="n7", reason="Evicted", message="The node was low on resource: memory.")
    obs = observe(JOB, [p], [])
    assert obs.end == "crashed"
    assert obs.message == "evicted by the kubelet: The node was low on resource: memory. (pod run-abcde-x1 on node n7)"


def test_preemption_from_the_disruption_condition_or_the_event():
    p = pod("Failed", node="n1", conditions=[{"type": "DisruptionTarget", "status": "True",
                                              "reason": "PreemptionByScheduler",
                                              "message": "default-scheduler: preempting to accommodate a higher "
                                                         "priority pod"}])
    obs = observe(JOB, [p], [])
    assert obs.end == "crashed" and obs.message.startswith("preempted by the scheduler: default-scheduler")
    # still Running, but the scheduler already announced the preemption
    obs = observe(JOB, [pod("Running", node="n1")], [event("run-abcde-x1", "Preempted", "Preempted by pod 1234")])
    assert obs.kind == "ended" and obs.message.startswith("preempted by the scheduler: Preempted by pod 1234")


def test_job_failed_after_its_pod_was_deleted():
    failed = {**JOB, "status": {"conditions": [{"type": "Failed", "status": "True",
                                                "reason": "BackoffLimitExceeded", "message": "Job has reached the "
                                                "specified backoff limit"}]}}
    obs = observe(failed, [], [event("run-abcde-x1", "Preempted", "Preempted by pod 99 on node n1")])
    assert obs.end == "crashed" and obs.message.startswith("preempted by the scheduler")
    obs = observe(failed, [], [])
    assert obs.message.startswith("the Kubernetes job failed (BackoffLimitExceeded)")
    deadline = {**JOB, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}
    assert observe(deadline, [], []).end == "failed"


def test_deleted_job():
    obs = observe(None, [], [])
    assert obs.kind == "ended" and obs.end == "crashed" and "deleted" in obs.message


def test_latest_pod_counts():
    old = pod("Failed", name="a", created="2026-01-01T00:00:00Z", **terminated(1))
    new = pod("Running", node="n2", name="b", created="2026-01-01T00:01:00Z")
    assert observe(JOB, [new, old], []).kind == "running"
