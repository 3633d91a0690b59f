"""Idle reclaim: a queue's idle checks fed by each run's sampler, published on the run, acted on.

A part of `LaunchWorkerCore` (``worker.idle``): the checker (`metrics.idle_checks.IdleChecker`) decides;
this arms it on the sampling thread, writes its status as the run's idle label, and stops the run
through `RunStops.stop_run` when a check expires.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID


from prefect.states import Cancelled

from prefect_launch.workers.agent.tags import IDLE_LABEL, tag_value
from prefect_launch.workers.metrics.idle_checks import IdleChecker, Verdict, app_activity
from prefect_launch.workers.scheduling.ledger import Allocation

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.agent.core import LaunchWorkerCore


def idle_publish_s() -> float:
    """How often moving idle deadlines are re-published at most (LAUNCH_IDLE_PUBLISH_SECONDS, read when used)."""
    return float(os.environ.get("LAUNCH_IDLE_PUBLISH_SECONDS", "30"))


class IdleReclaim:
    """The idle checks of one worker's (``w``) runs."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    def arm_idle_checks(self, flow_run: "FlowRun", alloc: Allocation, sampler: Any,
                        started_at: Optional[datetime]) -> None:
        """Feed the queue's idle checkers from the sampler's ``on_sample`` hook (sampling thread)."""
        try:
            policy = self.w.queue_spec().idle
            session_type = tag_value(flow_run.tags, "session-type")
            if policy is None or not policy.applies(session_type):
                return
            loop = asyncio.get_running_loop()
        except Exception as exc:
            self.w._logger.debug("idle checks not armed for run %s: %s", flow_run.id, exc)
            return
        started = started_at.timestamp() if started_at else time.time()
        scheduled = flow_run.expected_start_time.timestamp() if flow_run.expected_start_time else None
        checker = IdleChecker(policy, started=started, session_type=session_type,
                              requested_gpu=alloc.resources.gpu, allocated_memory=alloc.resources.memory,
                              interval_s=sampler.interval_s, scheduled=scheduled)
        self.w._active.of(flow_run.id).idle = checker
        ports = [int(p) for p in str((flow_run.labels or {}).get("launch.session.ports") or "").split(",")
                 if p.strip().isdigit()]
        watch_net = bool(policy.network_idle_timeout and session_type == "interactive" and ports)
        published: dict[str, Any] = {"at": 0.0, "kind": None, "full": None}
        publish_every = idle_publish_s()
        fired: list[Verdict] = []

        def on_sample(sample: Any) -> None:
            now = time.time()
            ready, conns = app_activity(ports) if watch_net else (None, 0)
            total = getattr(sampler, "gpu_mem_total_bytes", None)
            gpu_mem_pct = (100.0 * sample.gpu_mem_bytes / total) if total and sample.gpu_mem_bytes is not None else None
            checker.observe(now, cpu_share_pct=sample.cpu_share_pct, rss_bytes=sample.rss_bytes,
                            gpu_util_pct=sample.gpu_util_pct, gpu_mem_pct=gpu_mem_pct, connections=conns,
                            app_ready=ready)
            verdict = checker.check(now)
            if verdict is not None and not fired:
                fired.append(verdict)
                asyncio.run_coroutine_threadsafe(self.reclaim_idle(flow_run, verdict), loop)
                return
            status = checker.status(now)
            # a change of kind (grace over, window full, app up) at once; moving deadlines and averages at most
            # every idle_publish_s(); nothing while nothing changes (readers compute the time left themselves)
            full = json.dumps(status["checks"], sort_keys=True)
            kind = json.dumps([{k: v for k, v in c.items() if k not in ("deadline", "averages", "connections")}
                               for c in status["checks"]], sort_keys=True)
            if kind != published["kind"] or (full != published["full"] and now - published["at"] >= publish_every):
                published.update(at=now, kind=kind, full=full)
                asyncio.run_coroutine_threadsafe(self.publish_idle(flow_run.id, status), loop)

        sampler.on_sample = on_sample

    async def publish_idle(self, run_id: UUID, status: dict[str, Any]) -> None:
        """The live idle-check state on the run (label ``launch.idle``), for `session show`."""
        try:
            await self.w.client.update_flow_run_labels(run_id, {IDLE_LABEL: json.dumps(status, separators=(",", ":"))})
        except Exception as exc:
            self.w._logger.debug("could not publish idle checks of run %s: %s", run_id, exc)

    async def reclaim_idle(self, flow_run: "FlowRun", verdict: Verdict) -> None:
        """An idle checker said so: end the run Cancelled with the checker's reason (the timeout's stop path)."""
        run_id = str(flow_run.id)
        handle = self.w._active.get(flow_run.id).handle
        if handle is None or self.w.ledger.get(run_id) is None or not await self.w._handle_alive(run_id, handle) \
                or await self.w.stops.reported_end(flow_run):
            return  # ended meanwhile, or reported its end and is only exiting
        message = f"{verdict.message}; reclaimed by agent {self.w.name}"
        self.w._note(flow_run.id, "idle_check", "EXPIRED", error_code=verdict.reason, from_state="RUNNING",
                   to_state="CANCELLED", message=message)
        await self.w.stops.stop_run(flow_run, handle, Cancelled(message=message))
