"""Cluster runs on the launch-kubernetes worker against the fake Kubernetes API (tests/kube_fake.py) and a real
Prefect server: the indexed Job and headless Service are created, members are followed one by one, one failed
member fails the run with its name, and both objects are deleted when the run ends or is cancelled."""

from __future__ import annotations

import asyncio

from typing import Any

from prefect_launch.workers.cluster.kubernetes import INDEX_ANNOTATION, LAUNCHER
from prefect_launch.workers.agent.tags import PLACED_LABEL, WAIT_LABEL

import pytest

from kube_fake import fake_kube
from test_kubernetes_worker import UNSCHED, Scene, scene

UNSCHEDULABLE = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHED}]


def _exit(code: int, reason: str = "Error", at: str = "2026-01-01T00:01:00Z") -> list[dict[str, Any]]:
    return [{"name": "prefect-job", "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": at}}}]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake API, found by the worker through a kubeconfig (as test_kubernetes_worker's ``kube``)."""
    import kubernetes_asyncio.config.kube_config as kube_config

    with fake_kube(tmp_path) as (api, kubeconfig):
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        yield api


def go(coro_fn, kube) -> None:
    """Run ``coro_fn`` in a scene, then send the logs still queued for the API while the server is up (left for
    the exit, they are retried against a stopped server for over a minute)."""
    async def main():
        from prefect.logging.handlers import APILogHandler

        async with scene(kube) as s:
            await coro_fn(s)
        await APILogHandler.aflush()
    asyncio.run(main())


async def _gone(s: Scene, key: tuple[str, str], where: str) -> None:
    async def check():
        return key not in getattr(s.fake, where)
    await s.until(check)


def test_cluster_run_makes_an_indexed_job_and_service_and_a_failed_member_fails_it(prefect_server, fake):
    from prefect.states import Crashed, Running

    async def body(s: Scene):
        fr = await s.submit(cluster_size=3, cluster_mode="multi-node")
        job = await s.job_of(fr)
        name = job["metadata"]["name"]
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == \
            ("Indexed", 3, 3, 0)
        assert pod["subdomain"] == name and "podAntiAffinity" in pod["affinity"]
        (c,) = pod["containers"]
        want = {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}  # each member: the run's preset
        assert c["resources"] == {"requests": want, "limits": want}
        assert {"name": "launch-shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert c["args"][:len(LAUNCHER)] == LAUNCHER and c["args"][len(LAUNCHER):] == ["prefect", "flow-run",
                                                                                       "execute"]
        env = {e["name"]: e for e in c["env"]}
        assert env["MASTER_ADDR"]["value"] == f"{name}-0.{name}" and env["WORLD_SIZE"]["value"] == "3"
        assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_ANNOTATION}']"
        assert env["PREFECT__FLOW_RUN_ID"]["value"] == str(fr.id)
        svc = await s.until(lambda: s.fake.services.get(("default", name)))  # made right after the Job
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"job-name": name}
        assert svc["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]

        # two members placed, sub2 cannot be: the run waits, naming the member
        pods = [s.fake.add_pod(job, "Running", index=i, node=f"gpu-{i}") for i in range(2)]
        pods.append(s.fake.add_pod(job, "Pending", index=2, conditions=UNSCHEDULABLE))
        await s.label_is(fr, WAIT_LABEL, f"waiting: cluster member sub2: unschedulable: {UNSCHED}")
        s.fake.set_pod(pods[2], "Running", node="gpu-2", conditions=[{"type": "PodScheduled", "status": "True"}])
        await s.client.set_flow_run_state(fr.id, Running())
        await s.label_is(fr, PLACED_LABEL, "kubernetes: cluster of 3: main1 on node gpu-0, sub1 on node gpu-1, "
                                           "sub2 on node gpu-2")
        # sub1 dies; main1's engine, stopped with the Job, records a crash of its own: the member's reason wins
        await s.client.set_flow_run_state(fr.id, Crashed(message="Execution was aborted by a termination signal."),
                                          force=True)
        s.fake.set_pod(pods[1], "Failed", containerStatuses=_exit(3))
        state = await s.final(fr)
        assert state.is_failed()
        assert state.message == "cluster-member-failed: member sub1: the job's container exited with code 3 (Error)"
        await _gone(s, ("default", name), "services")
        assert ("default", name) not in s.fake.jobs  # the other members are stopped with the Job
        assert ("DELETE", "job") in s.fake.calls and ("DELETE", "service") in s.fake.calls

    go(body, fake)


def test_completed_cluster_keeps_its_job_for_the_ttl_and_a_cancel_deletes_both(prefect_server, fake):
    from prefect.states import Cancelling, Completed, Running

    async def body(s: Scene):
        done = await s.submit(cluster_size=2, preset="small")
        cancel = await s.submit(cluster_size=2, cluster_mode="single-node", preset="small")
        jobs = {fr.id: await s.job_of(fr) for fr in (done, cancel)}
        assert "podAffinity" in jobs[cancel.id]["spec"]["template"]["spec"]["affinity"]
        pods = {fr.id: [s.fake.add_pod(jobs[fr.id], "Running", index=i, node="n1") for i in range(2)]
                for fr in (done, cancel)}
        for fr in (done, cancel):
            await s.client.set_flow_run_state(fr.id, Running())
        await s.client.set_flow_run_state(done.id, Completed())
        for p in pods[done.id]:
            s.fake.set_pod(p, "Succeeded", containerStatuses=_exit(0, "Completed"))
        await s.client.set_flow_run_state(cancel.id, Cancelling(), force=True)
        assert (await s.final(done)).is_completed()
        assert (await s.final(cancel)).is_cancelled()
        for fr in (done, cancel):
            await _gone(s, ("default", jobs[fr.id]["metadata"]["name"]), "services")
        assert ("default", jobs[done.id]["metadata"]["name"]) in s.fake.jobs  # left to the pool's TTL
        assert ("default", jobs[cancel.id]["metadata"]["name"]) not in s.fake.jobs

    go(body, fake)


def test_a_failed_job_whose_pods_are_gone_names_the_member_from_the_condition(prefect_server, fake):
    from prefect.states import Running

    async def body(s: Scene):
        fr = await s.submit(cluster_size=2, preset="small")
        job = await s.job_of(fr)
        name = job["metadata"]["name"]
        await s.client.set_flow_run_state(fr.id, Running())
        s.fake.set_job_condition(job, "Failed", "PodFailurePolicy", f"Container prefect-job for pod default/"
                                 f"{name}-1-ab1cd failed with exit code 2 matching FailJob rule at index 0")
        state = await s.final(fr)
        assert state.is_failed() and state.message.startswith(
            "cluster-member-failed: member sub1: the Kubernetes job failed (PodFailurePolicy)"), state.message

    go(body, fake)


def test_cluster_runs_use_only_the_documented_verbs_plus_services(prefect_server, fake):
    async def body(s: Scene):
        fr = await s.submit(cluster_size=2, preset="small")
        job = await s.job_of(fr)
        p = s.fake.add_pod(job, index=0)
        s.fake.set_pod(p, "Failed", node="n", containerStatuses=_exit(1))
        await s.final(fr)
        assert set(s.fake.calls) <= {("POST", "jobs"), ("GET", "job"), ("GET", "jobs"), ("DELETE", "job"),
                                     ("GET", "pods"), ("GET", "events"), ("GET", "secret"), ("POST", "secrets"),
                                     ("PUT", "secret"), ("DELETE", "secret"), ("POST", "services"),
                                     ("DELETE", "service")}
        assert ("POST", "services") in s.fake.calls

    go(body, fake)


def test_restarted_worker_follows_a_cluster_job_again(prefect_server, fake):
    """A cluster run whose Job and Service a previous life of the agent made: the new worker reads it member by
    member, fails the run naming the member, and deletes both."""
    from prefect.states import Pending, Running

    from prefect_launch.workers.cluster.kubernetes import ClusterJob, owned_by, render_cluster
    from prefect_launch.workers.backends.kubernetes.manifest import job_manifest
    from prefect_launch.workers.scheduling.resources import Resources
    from prefect_launch.workers.agent.tags import WORKER_LABEL

    from test_kubernetes_worker import AGENT

    async def body(s: Scene):
        fr = await s.client.create_flow_run_from_deployment(s.deployment_id, job_variables={
            "preset": "small", "cluster_size": 2})
        single = job_manifest(run_id=str(fr.id), name="left-over", image="img", queue="q", agent=AGENT,
                              resources=Resources(cpu=1, memory=1 << 30))
        out = render_cluster(single, ClusterJob(run_id=str(fr.id), job_name="left-over-ab12c", size=2))
        code, job = s.fake.handle("POST", "/apis/batch/v1/namespaces/default/jobs", {}, out.job)
        assert code == 201
        code, _ = s.fake.handle("POST", "/api/v1/namespaces/default/services", {}, owned_by(out.service, job))
        assert code == 201
        pods = [s.fake.add_pod(job, "Running", index=i, node=f"n{i}") for i in range(2)]
        await s.client.set_flow_run_state(fr.id, Pending(), force=True)
        await s.client.set_flow_run_state(fr.id, Running(), force=True)
        await s.client.update_flow_run_labels(fr.id, {WORKER_LABEL: AGENT})
        await s.client.update_flow_run(fr.id, infrastructure_pid="default:left-over-ab12c")
        s.worker._reattached = False  # as at the start of a new agent
        await s.worker.sync_with_backend()
        await s.label_is(fr, PLACED_LABEL, "kubernetes: cluster of 2: main1 on node n0, sub1 on node n1")
        s.fake.set_pod(pods[1], "Failed", reason="Evicted", message="The node had condition: [DiskPressure].")
        state = await s.final(fr)
        assert state.is_crashed() and state.message.startswith(
            "cluster-member-failed: member sub1: evicted by the kubelet: The node had condition"), state.message
        await _gone(s, ("default", "left-over-ab12c"), "services")
        assert ("default", "left-over-ab12c") not in s.fake.jobs

    go(body, fake)


def test_a_watch_that_ends_without_an_end_leaves_the_cluster_running(prefect_server, fake):
    """The watch stopped from outside (the agent stopping without --on-exit cancel, or an error in the worker):
    no end is known, so the members run on and the Job and Service stay (a restarted agent re-attaches)."""
    async def body(s: Scene):
        asked: list[Any] = []

        async def stopping(flow_run, *args, **kwargs):
            asked.append(flow_run.id)
            raise RuntimeError("the worker is stopping")

        s.worker._stop_requested = stopping
        fr = await s.submit(cluster_size=2, preset="small")
        job = await s.job_of(fr)
        key = ("default", job["metadata"]["name"])
        await s.until(lambda: fr.id in asked and fr.id not in s.worker._watching)
        await asyncio.sleep(1.0)  # the run's clean-up, had it run, would be done by now
        assert key in s.fake.jobs and key in s.fake.services
        assert ("DELETE", "job") not in s.fake.calls and ("DELETE", "service") not in s.fake.calls

    go(body, fake)
