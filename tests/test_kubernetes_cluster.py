"""Cluster runs on Kubernetes queues without a cluster: the indexed Job and headless Service rendered for every
preset, sizes 2 and 3, both modes, read back through kubernetes_asyncio's models; names; what member pods say;
the member launcher."""

from __future__ import annotations

import asyncio
import sys

import pytest

from prefect_launch.workers.cluster.env import member_env
from prefect_launch.workers.cluster.spec import cluster_of
from prefect_launch.workers.cluster.kubernetes import (INDEX_ANNOTATION, LAUNCHER, ClusterJob, check_dns_label,
                                                       cluster_job_name, member_of_index, owned_by, render_cluster)
from prefect_launch.workers.cluster.kubernetes_events import index_of_pod_name, member_index, observe_cluster
from prefect_launch.workers.backends.kubernetes.manifest import GPU_RESOURCE, job_manifest, quantity_bytes, quantity_cpu
from prefect_launch.workers.cluster.kubernetes_member import MEMBER_MODULE, main as launcher_main
from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.queue_spec import load_queues_file
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources
from prefect_launch.workers.agent.tags import RUN_ID_LABEL

from launch_helpers import ROOT

RUN = "0b6f8a52-1111-4e3c-9d1f-5a3c2b1a0e9d"


def _presets():
    for q in load_queues_file(str(ROOT / "deployments" / "queues.yaml")).queues:
        for name, preset in q.presets.items():
            yield f"{q.name}/{name}", preset.to_resources()
    yield "fraction", Resources(cpu=0.25, memory=300 * 10**6, gpu=0)


def _models(job: dict, service: dict) -> tuple:
    """The Job as V1Job and the Service as V1Service, and both serialised back to the API's JSON."""
    from kubernetes_asyncio.client import ApiClient

    async def convert():
        async with ApiClient() as api:  # its connection pool wants a running loop; nothing is sent
            j = api._ApiClient__deserialize(job, "V1Job")
            s = api._ApiClient__deserialize(service, "V1Service")
            return j, s, api.sanitize_for_serialization(j), api.sanitize_for_serialization(s)

    return asyncio.run(convert())


def _single(res: Resources) -> dict:
    return job_manifest(run_id=RUN, name="train-run", image="img:1", resources=res, queue="q", agent="a1",
                        env={"A": "1"}, namespace="ml", ports=[8888], pvc_mounts={"data": "/data"},
                        node_selector={"gpu": "a100"})


CASES = [(label, res, size, mode) for label, res in _presets() for size in (2, 3)
         for mode in ("single-node", "multi-node")]


@pytest.mark.parametrize("label,res,size,mode", CASES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_every_preset_renders_a_valid_indexed_job_and_headless_service(label, res, size, mode):
    single = _single(res)
    before = repr(single)
    c = ClusterJob(run_id=RUN, job_name=cluster_job_name("train-run", "ab12c", size), size=size, mode=mode)
    out = render_cluster(single, c)
    assert repr(single) == before  # the single run's manifest is left as it was
    job, svc, job_back, svc_back = _models(out.job, out.service)
    assert job_back == out.job and svc_back == out.service  # nothing the models do not know, nothing lost
    s = job.spec
    assert (s.completion_mode, s.completions, s.parallelism, s.backoff_limit) == ("Indexed", size, size, 0)
    assert [r.action for r in s.pod_failure_policy.rules] == ["FailJob", "FailJob"]
    assert s.pod_failure_policy.rules[0].on_exit_codes.operator == "NotIn"
    assert s.pod_failure_policy.rules[0].on_exit_codes.values == [0]
    assert job.metadata.name == c.job_name and job.metadata.generate_name is None
    pod = s.template.spec
    assert pod.subdomain == svc.metadata.name == c.job_name and pod.restart_policy == "Never"
    # each member gets the run's preset, as a single run does
    (ct,) = pod.containers
    want = {"cpu": quantity_cpu(res.cpu), "memory": quantity_bytes(res.memory),
            **({GPU_RESOURCE: str(res.gpu)} if res.gpu else {})}
    assert ct.resources.requests == want == ct.resources.limits, label
    shm = [v for v in pod.volumes or [] if v.name == "launch-shm"]
    assert bool(shm) == bool(res.shm_size)
    if res.shm_size:
        assert shm[0].empty_dir.medium == "Memory" and shm[0].empty_dir.size_limit == quantity_bytes(res.shm_size)
    assert pod.node_selector == {"gpu": "a100"}
    assert [p.container_port for p in ct.ports] == [8888, 29500]
    # the headless Service
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    assert svc.spec.selector == {"job-name": c.job_name} and svc.metadata.namespace == "ml"
    assert [(p.port, p.target_port) for p in svc.spec.ports] == [(29500, 29500)]
    # placement
    term_of = (lambda a: a.pod_affinity.required_during_scheduling_ignored_during_execution[0]) \
        if mode == "single-node" else \
        (lambda a: a.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution[0].pod_affinity_term)
    term = term_of(pod.affinity)
    assert term.topology_key == "kubernetes.io/hostname"
    assert term.label_selector.match_labels == {RUN_ID_LABEL: RUN} == \
        {RUN_ID_LABEL: s.template.metadata.labels[RUN_ID_LABEL]}  # the selector matches the members themselves
    assert (pod.affinity.pod_anti_affinity is None) == (mode == "single-node")
    # env: the cluster's, per member from the completion index
    env = {e.name: e for e in ct.env}
    hosts = [f"{c.job_name}-{i}.{c.job_name}" for i in range(size)]
    assert env["LAUNCH_CLUSTER_ADDRS"].value == ",".join(hosts)
    assert env["MASTER_ADDR"].value == env["LAUNCH_CLUSTER_MAIN_ADDR"].value == hosts[0]
    assert env["WORLD_SIZE"].value == env["LAUNCH_CLUSTER_SIZE"].value == str(size)
    assert env["LAUNCH_CLUSTER_MODE"].value == mode and env["A"].value == "1"
    for k in ("RANK", "LAUNCH_CLUSTER_RANK", "JOB_COMPLETION_INDEX"):
        assert env[k].value is None
        assert env[k].value_from.field_ref.field_path == f"metadata.annotations['{INDEX_ANNOTATION}']"


def test_member_env_has_the_process_back_ends_names():
    """The same variables as a process-queue member (names and the shared values), so launchers work unchanged."""
    ledger = Ledger(Resources(cpu=4, memory=8 << 30, gpu=2))
    alloc = ledger.try_allocate_cluster("r", Resources(cpu=1, memory=1 << 30, gpu=1), 2)
    proc = member_env(alloc, alloc.members[1], "a1", "multi-node", 29500)
    c = ClusterJob(run_id=RUN, job_name="job-x", size=2, mode="multi-node")
    kube = {e["name"]: e for e in render_cluster(_single(Resources(cpu=1, memory=1 << 30)), c).job
            ["spec"]["template"]["spec"]["containers"][0]["env"]}
    cluster_keys = {k for k in proc if k.startswith("LAUNCH_CLUSTER_")} | {
        "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    assert cluster_keys - {"LAUNCH_CLUSTER_MEMBER"} <= set(kube)  # the member's name: set by the launcher
    for k in ("LAUNCH_CLUSTER_SIZE", "LAUNCH_CLUSTER_HOSTS", "LAUNCH_CLUSTER_MODE", "LAUNCH_CLUSTER_PORT",
              "WORLD_SIZE", "MASTER_PORT"):
        assert kube[k]["value"] == proc[k], k
    assert (kube["LOCAL_RANK"]["value"], kube["LOCAL_WORLD_SIZE"]["value"]) == ("0", "1")  # one member per pod


def test_the_engine_runs_through_the_launcher_and_a_pool_command_is_wrapped_once():
    m = _single(Resources(cpu=1, memory=1 << 30))
    m["spec"]["template"]["spec"]["containers"][0]["args"] = ["prefect", "flow-run", "execute"]
    c = ClusterJob(run_id=RUN, job_name="job-x", size=2)
    out = render_cluster(m, c).job["spec"]["template"]["spec"]["containers"][0]
    assert out["args"] == LAUNCHER + ["prefect", "flow-run", "execute"] and "command" not in out
    again = render_cluster(render_cluster(m, c).job, c).job["spec"]["template"]["spec"]["containers"][0]
    assert again["args"] == out["args"]
    m["spec"]["template"]["spec"]["containers"][0]["command"] = ["/bin/run"]
    out = render_cluster(m, c).job["spec"]["template"]["spec"]["containers"][0]
    assert out["command"] == LAUNCHER + ["/bin/run"] and out["args"] == ["prefect", "flow-run", "execute"]


def test_names_are_valid_labels_or_refused_clearly():
    long = cluster_job_name("My_Very.Long-Flow-Run-Name-" * 4, "ab12c", 64)
    assert len(f"{long}-63") <= 63 and long.endswith("-ab12c") and long.startswith("my-very-long")
    assert cluster_job_name("42-otters", "ab12c", 2) == "launch-42-otters-ab12c"  # a Service starts with a letter
    assert cluster_job_name("", "ab12c", 2) == "launch-ab12c"
    with pytest.raises(LaunchValidationError, match="'Job-X' is not a valid Kubernetes name: only lower-case"):
        check_dns_label("Job-X", "the job name")
    with pytest.raises(LaunchValidationError, match="64 characters"):
        render_cluster({}, ClusterJob(run_id=RUN, job_name="a" * 64, size=2))
    with pytest.raises(LaunchValidationError, match="hostname of member sub10"):  # room for the index
        render_cluster({}, ClusterJob(run_id=RUN, job_name="a" * 61, size=11))
    with pytest.raises(LaunchValidationError, match="must start with a letter"):
        render_cluster({}, ClusterJob(run_id=RUN, job_name="1job", size=2))
    assert [member_of_index(i) for i in range(3)] == ["main1", "sub1", "sub2"]


def test_the_service_is_owned_by_the_created_job():
    c = ClusterJob(run_id=RUN, job_name="job-x", size=2)
    out = render_cluster(_single(Resources(cpu=1, memory=1 << 30)), c)
    svc = owned_by(out.service, {"metadata": {"name": "job-x", "uid": "u-1"}})
    assert svc["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": "job-x",
                                                   "uid": "u-1"}]
    assert "ownerReferences" not in out.service["metadata"]
    _models(out.job, svc)


def test_kubernetes_queues_accept_cluster_runs_in_both_modes():
    for mode in ("single-node", "multi-node"):
        assert cluster_of([({"cluster_size": 3, "cluster_mode": mode}, "x")], target="kubernetes").size == 3


# ------------------------------------------------------------------------------------------ observing


JOB = {"metadata": {"name": "job-x", "namespace": "default"}, "status": {}}


def _pod(i: int, phase: str = "Running", node: str = "n1", **status) -> dict:
    return {"metadata": {"name": f"job-x-{i}-q{i}z9k", "annotations": {INDEX_ANNOTATION: str(i)},
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": node, "hostname": f"job-x-{i}", "containers": [{"name": "prefect-job"}]},
            "status": {"phase": phase, **status}}


def _exit(code: int, at: str = "2026-01-01T00:01:00Z", reason: str = "Error") -> list:
    return [{"name": "prefect-job", "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": at}}}]


@pytest.mark.parametrize("pod,index", [
    pytest.param(_pod(2), 2, id="annotation"),
    pytest.param({"metadata": {"name": "x", "labels": {INDEX_ANNOTATION: "1"}}}, 1, id="label"),
    pytest.param({"metadata": {"name": "x"}, "spec": {"hostname": "job-x-4"}}, 4, id="hostname"),
    pytest.param({"metadata": {"name": "job-x-3-ab1cd"}}, 3, id="name"),
])
def test_member_index_reads_annotation_label_hostname_or_name(pod, index):
    assert member_index(pod, "job-x") == index


def test_a_pod_name_without_a_member_index_gives_none():
    assert index_of_pod_name("job-x-ab1cd", "job-x") is None and index_of_pod_name("job-xy-1-ab", "job-x") is None


def test_one_member_failing_ends_the_cluster_naming_it_the_earliest_first():
    pods = [_pod(0), _pod(1, "Failed", containerStatuses=_exit(137, "2026-01-01T00:02:00Z")),
            _pod(2, "Failed", containerStatuses=_exit(3, "2026-01-01T00:01:00Z"))]
    obs = observe_cluster(JOB, pods, [], 3)
    assert (obs.kind, obs.end, obs.exit_code) == ("ended", "failed", 3)
    assert obs.message == "cluster-member-failed: member sub2: the job's container exited with code 3 (Error)"
    evicted = [_pod(0), _pod(1, "Failed", reason="Evicted", message="low on memory")]
    obs = observe_cluster(JOB, evicted, [], 2)
    assert obs.end == "crashed" and obs.message.startswith("cluster-member-failed: member sub1: evicted by the kubelet")


def test_a_failed_job_without_pods_names_the_member_from_its_condition_or_events():
    why = "Container prefect-job for pod default/job-x-1-ab1cd failed with exit code 2 matching FailJob rule at index 0"
    failed = {**JOB, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                                "message": why}]}}
    obs = observe_cluster(failed, [], [], 2)
    assert obs.kind == "ended" and obs.message.startswith("cluster-member-failed: member sub1: the Kubernetes job "
                                                          "failed (PodFailurePolicy)")
    assert (obs.end, obs.exit_code) == ("failed", 2)  # a member's exit, not a crash of the cluster
    backoff = {**JOB, "status": {"conditions": [{"type": "Failed", "status": "True",
                                                 "reason": "BackoffLimitExceeded"}]}}
    ev = {"involvedObject": {"kind": "Pod", "name": "job-x-0-zz9q1"}, "reason": "Preempted",
          "message": "Preempted by pod 77aa", "lastTimestamp": "2026-01-01T00:00:05Z"}
    obs = observe_cluster(backoff, [], [ev], 2)
    assert obs.message == "cluster-member-failed: member main1: preempted by the scheduler: Preempted by pod 77aa"
    assert observe_cluster(backoff, [], [], 2).message == \
        "cluster-member-failed: the Kubernetes job failed (BackoffLimitExceeded)"


def test_waiting_running_creating_and_completed():
    unsched = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                               "message": "0/3 nodes: Insufficient nvidia.com/gpu"}]}
    pending = _pod(1, "Pending", node="")
    pending["spec"].pop("nodeName")
    pending["status"].update(unsched)
    obs = observe_cluster(JOB, [_pod(0), pending], [], 2)
    assert obs.kind == "waiting"
    assert obs.message == "waiting: cluster member sub1: unschedulable: 0/3 nodes: Insufficient nvidia.com/gpu"
    obs = observe_cluster(JOB, [_pod(0, node="a"), _pod(1, node="b"), _pod(2, node="c")], [], 3)
    assert obs.kind == "running" and obs.message == "kubernetes: cluster of 3: main1 on node a, sub1 on node b, " \
                                                    "sub2 on node c"
    obs = observe_cluster(JOB, [_pod(0, node="a")], [], 3)
    assert obs.kind == "creating" and obs.message == "kubernetes: cluster of 3: 1 of 3 members placed (main1 on node a)"
    # main1 done, sub1 still running: the run still runs
    done0 = _pod(0, "Succeeded", containerStatuses=_exit(0, reason="Completed"))
    assert observe_cluster(JOB, [done0, _pod(1)], [], 2).kind == "running"
    done1 = _pod(1, "Succeeded", containerStatuses=_exit(0, reason="Completed"))
    obs = observe_cluster(JOB, [done0, done1], [], 2)
    assert (obs.kind, obs.end) == ("ended", "completed")
    complete = {**JOB, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert observe_cluster(complete, [], [], 2).end == "completed"
    assert observe_cluster(None, [], [], 2).message == "the run's Kubernetes job was deleted before the run ended"


# ------------------------------------------------------------------------------------------ launcher


def test_launcher_runs_the_engine_for_main1_and_cluster_member_for_the_others():
    env = {"JOB_COMPLETION_INDEX": "0", "PREFECT__FLOW_RUN_ID": RUN}
    assert launcher_main(["--", "prefect", "flow-run", "execute"], env) == ["prefect", "flow-run", "execute"]
    assert env["LAUNCH_CLUSTER_MEMBER"] == "main1"
    env = {"JOB_COMPLETION_INDEX": "2", "PREFECT__FLOW_RUN_ID": RUN}
    assert launcher_main(["--", "prefect", "flow-run", "execute"], env) == [sys.executable, "-m", MEMBER_MODULE, RUN]
    assert env["LAUNCH_CLUSTER_MEMBER"] == "sub2"
    with pytest.raises(SystemExit, match="not an index"):
        launcher_main(["--", "x"], {})
    with pytest.raises(SystemExit, match="PREFECT__FLOW_RUN_ID"):
        launcher_main(["--", "x"], {"JOB_COMPLETION_INDEX": "1"})


def test_launcher_execs_without_a_shell(tmp_path):
    """The real module as the pod runs it: main1 becomes the given program (exec: its env, its exit status)."""
    import os
    import subprocess

    env = {**os.environ, "JOB_COMPLETION_INDEX": "0", "PREFECT__FLOW_RUN_ID": RUN}
    probe = [sys.executable, "-c", "import os,sys; print(os.environ['LAUNCH_CLUSTER_MEMBER']); sys.exit(7)"]
    cmd = [sys.executable] + LAUNCHER[1:] + probe
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (7, "main1"), out.stderr


# ------------------------------------------------------------------------------------------ pool template


def _k8s_specs_list():
    from test_kubernetes_manifest import _k8s_specs

    return list(_k8s_specs())


@pytest.mark.parametrize("spec", _k8s_specs_list(), ids=lambda s: s.name)
def test_every_preset_through_the_pool_template_renders_a_valid_cluster(spec):
    """What the worker renders: the launch-kubernetes pool template for a run with cluster_size/cluster_mode, the
    request resolved from it, then the indexed Job and Service, read back through the client's models."""
    from test_kubernetes_manifest import _pool_template, _render

    for preset_name, preset in spec.presets.items():
        res = preset.to_resources()
        for size in (2, 3):
            for mode in ("single-node", "multi-node"):
                m = _render(spec, _pool_template(spec), {"preset": preset_name, "cluster_size": size,
                                                         "cluster_mode": mode})
                run_id = m["metadata"]["labels"][RUN_ID_LABEL]
                c = ClusterJob(run_id=run_id, job_name=cluster_job_name(m["metadata"]["generateName"], "ab12c",
                                                                         size), size=size, mode=mode)
                out = render_cluster(m, c)
                job, svc, job_back, svc_back = _models(out.job, out.service)
                assert job_back == out.job and svc_back == out.service, (preset_name, size, mode)
                (ct,) = job.spec.template.spec.containers
                assert ct.args == LAUNCHER + ["prefect", "flow-run", "execute"]
                assert ct.resources.limits.get(GPU_RESOURCE) == (str(res.gpu) if res.gpu else None)
                env = {e.name: e for e in ct.env}
                assert env["PREFECT__FLOW_RUN_ID"].value == run_id and env["WORLD_SIZE"].value == str(size)
                assert env["API_TOKEN"].value_from.secret_key_ref.name == "prefect-launch-env-x"
                assert job.metadata.namespace == svc.metadata.namespace == "ml"
                assert job.spec.template.spec.node_selector == (preset.node_selector or None)


def test_the_worker_reads_the_cluster_from_the_runs_job_variables():
    from test_kubernetes_manifest import _pool_template

    from prefect_launch.workers.scheduling.resolve import resolve_request

    spec = _k8s_specs_list()[-1]
    assert "cluster_size" in _pool_template(spec)["variables"]["properties"]  # in the pool's form
    req = resolve_request(spec, {"cluster_size": 2}, {"cluster_size": 3, "cluster_mode": "multi-node"})
    assert (req.cluster.size, req.cluster.mode) == (3, "multi-node")
