"""What a run's Prefect labels say about its placement: where it runs, its machine-readable booking, the
worker labels Prefect's BaseWorker would have written, in one write once its process is up.

A part of `LaunchWorkerCore` (``worker.labels``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from uuid import UUID

from prefect_launch.workers.agent.journal import alloc_label
from prefect_launch.workers.agent.publishing import PUBLISH_DEBOUNCE_S
from prefect_launch.workers.agent.tags import ALLOC_LABEL, PLACED_LABEL, WAIT_LABEL
from prefect_launch.workers.scheduling.ledger import Allocation

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.agent.core import LaunchWorkerCore


class RunLabels:
    """The placement labels of one worker's (``w``) runs."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    def placement_text(self, alloc: Allocation) -> str:
        text = (f"agent {self.w.name}: {alloc.resources.describe()}; gpus "
                f"{','.join(map(str, alloc.gpu_indices)) or 'none'}; cores {','.join(map(str, alloc.cpu_cores))}")
        if alloc.members:  # a cluster run: where each member runs
            from prefect_launch.workers.cluster.placement import members_text

            text += f"; members {members_text(alloc)}"
        return text

    async def label_placement(self, flow_run: "FlowRun", alloc: Allocation, worker_labels: bool = False) -> None:
        """Show on the Prefect run where it runs, and clear its old waiting reason.

        Deferred a moment: on a SQLite server a write that collides with the engine's own
        Running transition makes one of them wait out a 2 s client retry.
        """
        await asyncio.sleep(PUBLISH_DEBOUNCE_S)
        entry = self.w.journal.get(str(flow_run.id))
        machine = alloc_label(alloc, self.w.name, entry.pid if entry else None, entry.pid_started if entry else None)
        labels = {PLACED_LABEL: self.placement_text(alloc), WAIT_LABEL: "", ALLOC_LABEL: machine}
        if worker_labels:  # Prefect's worker labels ride along (see LaunchWorkerCore._give_worker_labels_to_flow_run)
            labels.update(self.worker_labels())
        await self.write_labels(flow_run.id, labels)

    def worker_labels(self) -> dict[str, str]:
        """The labels Prefect's BaseWorker gives each run it submits (worker, work pool)."""
        labels = {"prefect.worker.name": self.w.name, "prefect.worker.type": self.w.type}
        if self.w._work_pool is not None:
            pool = self.w.work_pool
            labels.update({"prefect.work-pool.name": pool.name, "prefect.work-pool.id": str(pool.id)})
        return labels

    async def write_labels(self, flow_run_id: UUID, labels: dict[str, str]) -> bool:
        """Labels written off the run's start path with the client's retries (api_retry's quick 503 retries,
        then Prefect's back-off): on a SQLite server Prefect's label endpoint fails (503) whenever another
        write commits between its read and its write."""
        try:
            await self.w.client.update_flow_run_labels(flow_run_id, labels)
            return True
        except Exception as exc:
            self.w._logger.warning("could not label run %s: %s", flow_run_id, exc)
            return False
