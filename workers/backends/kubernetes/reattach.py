"""A restarted launch-kubernetes worker watches again the Jobs of its Pending/Running runs: the cluster kept
them, and Prefect stores each run's Job as its ``infrastructure_pid`` (``namespace:job``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from prefect_launch.workers.agent.recovery import LIVE_STATES
from prefect_launch.workers.agent.tags import WORKER_LABEL
from prefect_launch.workers.backends.kubernetes.api import KubeApi
from prefect_launch.workers.backends.kubernetes.events import Observation

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


class Reattach:
    """Re-attaching of one Kubernetes worker (``w``) to its runs' Jobs after a restart."""

    def __init__(self, worker: Any):
        self.w = worker

    async def start(self) -> None:
        """After a restart: watch again the Jobs of this worker's Pending/Running runs (the cluster kept them)."""
        from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                    WorkPoolFilter, WorkPoolFilterName)
        from prefect.client.schemas.objects import StateType

        try:
            runs = await self.w.client.read_flow_runs(
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType(s) for s in LIVE_STATES]))),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self.w._work_pool_name])))
        except Exception as exc:
            self.w._logger.warning("could not list this worker's live runs to re-attach to them: %s", exc)
            return
        for fr in runs:
            pid = fr.infrastructure_pid or ""
            if (fr.labels or {}).get(WORKER_LABEL) != self.w.name or pid.count(":") != 1 or fr.id in self.w._watching:
                continue
            self.w._runs_task_group.start_soon(self.watch, fr, *pid.split(":"))

    async def watch(self, flow_run: "FlowRun", namespace: str, job: str) -> None:
        try:
            configuration = await self.w.job_configuration.resolve_for_flow_run(
                flow_run, client=self.w.client, work_pool=self.w.work_pool, worker_name=self.w.name)
            request = configuration._request
            started = flow_run.start_time.timestamp() if flow_run.start_time else None
            self.w._logger.info("re-attached to run %s (Kubernetes job %s/%s)", flow_run.id, namespace, job)
            size = request.cluster.size if request else 1
            async with self.w._get_configured_kubernetes_client(configuration) as client:
                api = KubeApi(client)
                end: Optional[Observation] = None
                try:
                    end = await self.w._watch(api, flow_run, namespace, job, request.timeout_s if request else None,
                                            running_since=started, size=size)
                finally:
                    if size > 1 and end is not None:
                        await self.w.clusters.end(api, flow_run, namespace, job, end)
            await self.w._record_end(flow_run, end)
        except Exception:
            self.w._logger.exception("watching re-attached run %s failed", flow_run.id)
