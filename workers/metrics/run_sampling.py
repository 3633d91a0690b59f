"""Glue between the launch worker and the metrics sampler: one sampler per started run.

Kept apart from the worker so the worker stays about placement and pinning;
everything here is best effort - a missing or unreachable store never stops a run.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Optional

from prefect_launch.blocks.metrics_records import RunRecord
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.settings import env_text
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.tags import tag_value
from prefect_launch.workers.metrics.sampler import RunSampler

logger = logging.getLogger("prefect_launch.run_metrics")


async def load_store() -> Optional[RunMetricsStore]:
    """The store block named ``LAUNCH_METRICS_BLOCK`` (default "default"), else the local default."""
    if os.environ.get("LAUNCH_METRICS", "1") == "0":
        return None
    block = env_text("LAUNCH_METRICS_BLOCK", "default")
    try:
        return await RunMetricsStore.aload(block)
    except Exception:
        logger.info("no %r metrics-store block; using the local SQLite default", block)
        return RunMetricsStore()


def run_record(flow_run: Any, alloc: Allocation, agent: str, queue: str) -> RunRecord:
    labels = flow_run.labels or {}
    return RunRecord(
        flow_run_id=str(flow_run.id), flow_run_name=flow_run.name, queue=queue,
        work_queue=flow_run.work_queue_name, job=labels.get("prefect.deployment.name"),
        deployment_id=str(flow_run.deployment_id) if flow_run.deployment_id else None,
        flow=labels.get("prefect.flow.name"), owner=tag_value(flow_run.tags, "owner"), preset=alloc.preset,
        cpu=alloc.resources.cpu, memory_bytes=alloc.resources.memory, gpu=alloc.resources.gpu,
        gpu_indices=alloc.gpu_indices, agent=agent, host=socket.gethostname(),
        submitted_at=flow_run.created,
    )


def outage_settings() -> dict[str, Any]:
    """How a sampler rides out a metrics-store outage, from the agent's environment.

    ``LAUNCH_METRICS_BUFFER``: samples kept per run while the store is unreachable (default 3600;
    older ones are dropped and counted as lost); ``LAUNCH_METRICS_RETRY_MAX_SECONDS``: the longest wait
    between two write attempts (default 60 s; backoff starts at 1 s or this, whichever is less).
    """
    out: dict[str, Any] = {}
    if os.environ.get("LAUNCH_METRICS_BUFFER"):
        out["max_buffer"] = int(os.environ["LAUNCH_METRICS_BUFFER"])
    if os.environ.get("LAUNCH_METRICS_RETRY_MAX_SECONDS"):
        hi = float(os.environ["LAUNCH_METRICS_RETRY_MAX_SECONDS"])
        out["retry_backoff_s"] = (min(1.0, hi), hi)
    return out


def start_sampler(store: Optional[RunMetricsStore], flow_run: Any, alloc: Allocation, agent: str, queue: str,
                  pid: int, run_logger: Any = None, started_at: Any = None) -> Optional[RunSampler]:
    """``started_at`` keeps a re-adopted run's original start (else: now)."""
    try:
        interval = float(os.environ.get("LAUNCH_SAMPLE_INTERVAL", "1.0"))
        outage = outage_settings()
        record = run_record(flow_run, alloc, agent, queue)
        if started_at is not None:
            record = record.model_copy(update={"started_at": started_at})
        return RunSampler(store, record, pid, gpu_indices=alloc.gpu_indices,
                          allocated_cpus=alloc.resources.cpu, allocated_memory_bytes=alloc.resources.memory,
                          interval_s=interval, logger=run_logger, **outage).start()
    except Exception as exc:
        logger.warning("metrics sampling unavailable for run %s: %s", flow_run.id, exc)
        return None


async def publish_summary_artifact(client: Any, flow_run_id: Any, summary: Any, record: Any) -> None:
    """A table artifact with the run's resource summary on its Prefect run page."""
    from prefect.client.schemas.actions import ArtifactCreate

    from prefect_launch.workers.metrics.report import summary_artifact_rows

    await client.create_artifact(ArtifactCreate(
        key=f"launch-metrics-{str(flow_run_id)[:8]}", type="table", flow_run_id=flow_run_id,
        data=summary_artifact_rows(summary, record),
        description="Resources allocated vs used, measured from outside the job by prefect-launch"
                    + (" - flagged as waste: " + "; ".join(summary.waste_reasons) if summary.wasteful else ""),
    ))
