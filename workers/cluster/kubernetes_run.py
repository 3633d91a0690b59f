"""Cluster runs on the `launch-kubernetes` worker: make, follow and clean up the indexed Job and its Service.

`KubernetesClusterRuns` is a part of `LaunchKubernetesWorker` (``worker.clusters``; it reads the worker's
``_stop``, ``watch_seconds`` and ``get_flow_run_logger``). The
run's Job manifest, already written for one member, becomes the indexed Job (`kubernetes_cluster`); the Job
is created through prefect-kubernetes's ``_create_job`` like a single run's, then the headless Service, owned
by the Job so the cluster deletes it with the Job even if this worker dies first. When the run ends the
Service is deleted, and the Job too unless every member completed (then it is left to the pool's
``finished_job_ttl``, like a single run's, for its logs). A member that failed fails the run with its name;
the worker records that after the Job is gone, so main1's engine, stopped by the deletion, cannot record a
"termination signal" crash over it.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

import anyio
from prefect.states import Crashed, Failed

from prefect_launch.workers.cluster.kubernetes import (ClusterJob, ClusterManifests, cluster_job_name, owned_by,
                                                       render_cluster)
from prefect_launch.workers.cluster.kubernetes_events import FAILED_PREFIX
from prefect_launch.workers.backends.kubernetes.events import Observation

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.backends.kubernetes.api import KubeApi
    from prefect_launch.workers.scheduling.resolve import ResolvedRequest

GONE_WAIT_S = 45.0  # how long the worker waits for a deleted cluster Job (its pods' grace period) to go


def failed_sub_member(end: Observation) -> Optional[str]:
    """The sub member (sub1, ...) whose failure ended the run, if one did; None for main1 or no member."""
    head = f"{FAILED_PREFIX}: member "
    if end.kind != "ended" or not end.message.startswith(head):
        return None
    name = end.message[len(head):].split(":", 1)[0]
    return name if name != "main1" else None


class KubernetesClusterRuns:
    """The cluster half of the Kubernetes worker ``w``: nothing happens for a single run (`render` gives None)."""

    def __init__(self, worker: Any):
        self.w = worker

    def render(self, flow_run: "FlowRun", configuration: Any,
                        request: "ResolvedRequest") -> Optional[ClusterManifests]:
        """Turn the configuration's Job manifest into the cluster's indexed Job (in place); the Service to make."""
        if not request.cluster.is_cluster:
            return None
        meta = configuration.job_manifest.get("metadata") or {}
        base = meta.get("name") or str(meta.get("generateName") or "").rstrip("-") or "launch"
        spec = ClusterJob(run_id=str(flow_run.id), job_name=cluster_job_name(base, uuid.uuid4().hex[:5],
                                                                             request.cluster.size),
                          size=request.cluster.size, mode=request.cluster.mode)
        rendered = render_cluster(configuration.job_manifest, spec)
        configuration.job_manifest = rendered.job
        return rendered

    async def create_service(self, api: "KubeApi", flow_run: "FlowRun", job: Any,
                                      rendered: ClusterManifests) -> None:
        """The headless Service, owned by the created Job; the Job is deleted when the Service cannot be made."""
        body = api._json(job)
        meta = body["metadata"]
        try:
            await api.create_service(meta["namespace"], owned_by(rendered.service, body))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await api.delete_job(meta["namespace"], meta["name"])
            raise
        spec = rendered.job["spec"]
        env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
        self.w.get_flow_run_logger(flow_run).info(
            f"cluster of {spec['completions']} ({env['LAUNCH_CLUSTER_MODE']}): indexed job {meta['name']} with "
            f"headless service {rendered.service['metadata']['name']}; members {env['LAUNCH_CLUSTER_HOSTS']} "
            f"at {env['LAUNCH_CLUSTER_ADDRS']}; rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}")

    async def end(self, api: "KubeApi", flow_run: "FlowRun", namespace: str, job: str,
                           end: Observation) -> None:
        """Delete the Service, and the Job unless every member completed; a failed sub member's reason is the
        run's end state (recorded after the Job, main1's engine included, is gone). Not called when the watch
        did not end (the worker stopping): the members run on and a restarted worker re-attaches."""
        with anyio.CancelScope(shield=True):
            try:
                if end.end != "completed":
                    if await api.delete_job(namespace, job):
                        self.w.get_flow_run_logger(flow_run).info(f"Deleted the cluster's job {namespace}/{job}")
                    deadline = time.monotonic() + GONE_WAIT_S
                    while time.monotonic() < deadline and await api.read_job(namespace, job) is not None:
                        await anyio.sleep(min(1.0, self.w.watch_seconds))
            except Exception as exc:
                self.w._logger.warning("could not delete the cluster's job %s/%s: %s", namespace, job, exc)
            try:
                await api.delete_service(namespace, job)
            except Exception as exc:  # owned by the Job: the garbage collector deletes it with the Job
                self.w._logger.warning("could not delete the cluster's service %s/%s: %s", namespace, job, exc)
        if failed_sub_member(end):
            self.w._stop.setdefault(flow_run.id, (Failed if end.end == "failed" else Crashed)(message=end.message))
