"""A run's start on any back end: the environment it starts with, and what follows once its process is up.

The process and docker back ends call it (``worker.starts``) from their ``run``; recovery calls
`RunStarts.after_start` for a re-adopted run.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

from prefect_launch.workers.agent.active_run import RunHandle
from prefect_launch.workers.agent.limits import run_environment
from prefect_launch.workers.agent.run_keys import run_key_env
from prefect_launch.workers.agent.secrets import resolve_secret_env
from prefect_launch.workers.agent.stops import preempt_deadline_file
from prefect_launch.workers.scheduling.ledger import Allocation

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.agent.core import LaunchWorkerCore


class RunStarts:
    """Starts of the runs of one worker (``w``): the run's environment, journal, limits, sampler, deadline."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    async def env(self, alloc: Allocation, secret_env: Optional[dict[str, str]]) -> dict[str, str]:
        """Pinning (GPUs, threads, the allocation), secrets read now, the run's key (behind a gateway), and
        heartbeats for the zombie automation."""
        env = run_environment(alloc, self.w.name)
        if alloc.preemptible:  # the job may checkpoint between SIGTERM and the kill
            env.update(LAUNCH_PREEMPTIBLE="1", LAUNCH_PREEMPT_GRACE_SECONDS=f"{self.w.queue_spec().preempt_grace_s:g}",
                       LAUNCH_PREEMPT_DEADLINE_FILE=str(preempt_deadline_file(alloc.run_id)))
        env.update(await resolve_secret_env({"secret_env": secret_env}))
        env.update(await run_key_env(alloc.run_id))  # behind a gateway: the run's own key, not the agent's
        # Prefect's minimum; the zombie automation waits 3x
        env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", os.environ.get("LAUNCH_HEARTBEAT_SECONDS", "30"))
        return env

    def on_started(self, flow_run: "FlowRun", alloc: Allocation, handle: RunHandle, limits: Any = None) -> None:
        """The run exists: journal its handle, apply limits, start the sampler and the deadline."""
        run_id = flow_run.id
        self.w._active.of(run_id).handle = handle
        self.w._active.of(run_id).ever_started = True
        where = f"container {handle.container[:12]}" if handle.container else f"process {handle.pid}"
        self.w._note(run_id, "start", "SUCCESS", from_state="PENDING", to_state="RUNNING",
                     message=f"agent {self.w.name} started the run ({where})")
        if handle.pid:
            self.w.journal.set_pid(str(run_id), handle.pid, handle.pid_started, container=handle.container)
        if limits is not None:
            self.w._active.of(run_id).limits = limits
            if handle.pid:
                limits.apply(handle.pid)
        if handle.pid:
            self.after_start(flow_run, alloc, handle.pid)
        request = self.w._active.take(run_id, "request")
        self.w.stops.arm_deadline(flow_run, handle, request.timeout_s if request else None, time.time())

    def after_start(self, flow_run: "FlowRun", alloc: Allocation, pid: int,
                    started_at: Optional[datetime] = None) -> None:
        """Start sampling the run's process tree from outside (no change to the job)."""
        from prefect_launch.workers.metrics.run_sampling import start_sampler

        sampler = start_sampler(self.w._metrics_store, flow_run, alloc, self.w.name,
                                alloc.queue or self.w._work_pool_name, pid, self.w._logger, started_at=started_at)
        if sampler is not None:
            self.w._active.of(flow_run.id).sampler = sampler
            self.w.idle.arm_idle_checks(flow_run, alloc, sampler, started_at)
        if self.w._runs_task_group is not None:  # off the start path: the run is already running
            worker_labels = self.w._active.get(flow_run.id).unlabelled
            self.w._active.take(flow_run.id, "unlabelled")
            self.w._runs_task_group.start_soon(self.w.labels.label_placement, flow_run, alloc, worker_labels)
        if alloc.members and not self.w._active.get(flow_run.id).ever_started:  # a cluster run re-adopted after a
            self.w.clusters.watch_adopted(flow_run, alloc)  # restart: its sub members are measured and watched again
