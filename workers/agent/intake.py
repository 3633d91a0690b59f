"""What every launch back end does with a queue's runs before placing them: read the queue's declaration,
the deployment's job variables, say why a run waits, and reject what the queue can never serve.

Shared by the process/docker core (`agent.core.LaunchWorkerCore`) and the kubernetes worker
(`backends.kubernetes.worker`), which used to carry copies of each method. Mixed in front of a
Prefect worker class; it owns the one `ActiveRuns` record per run both keep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio

from prefect.states import Failed
from prefect.utilities.engine import propose_state

from prefect_launch.api_retry import single_try
from prefect_launch.workers.agent.active_run import ActiveRuns
from prefect_launch.workers.agent.read_cache import cache_reads
from prefect_launch.workers.agent.tags import WAIT_LABEL
from prefect_launch.workers.scheduling.wait_notes import WaitNotes, reason_writer
from prefect_launch.workers.scheduling.queue_spec import Preset, QueueSpec, queue_spec_of

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

DEFAULT_SPEC = QueueSpec(name="default", presets={"default": Preset(cpu=1, memory="1Gi")}, default_preset="default")


class QueueIntake:
    """Mixin: put it before the Prefect worker class (after the core or the cluster parts)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._wait_notes = WaitNotes()
        self._active = ActiveRuns()  # one record per run: request, handle, limits, sampler, end (active_run.py)

    async def sync_with_backend(self) -> None:
        """Prefect's sync; then the worker's client keeps its deployment and flow reads a few seconds
        (`read_cache.py`: Prefect's submit and the agent read the same deployment several times a run)."""
        await super().sync_with_backend()
        if self._client is not None:
            cache_reads(self._client)

    def queue_spec(self) -> QueueSpec:
        """The queue declaration carried by the pool's base job template."""
        spec = queue_spec_of(self.work_pool) if self._work_pool is not None else None
        return spec or DEFAULT_SPEC.model_copy(update={"name": self._work_pool_name})

    async def _deployment_vars(self, deployment_id: Optional[UUID]) -> dict[str, Any]:
        """The deployment's job variables (the middle layer of `resolve_request`)."""
        if deployment_id is None:
            return {}
        deployment = await self.client.read_deployment(deployment_id)  # kept a few seconds (read_cache.py)
        return dict(deployment.job_variables or {})

    async def _note_waiting(self, flow_run: "FlowRun", reason: str) -> None:
        """Put the one-line reason on the Prefect run, only when it changes (wait_notes.WaitNotes: not over
        another agent's fresh words, at most LAUNCH_WAIT_LABEL_BUDGET writes a cycle, and where several agents
        serve the queue, by the run's one writer among them)."""
        if not self._wait_notes.changed(flow_run, reason, writer=await self._writes_reason(flow_run)):
            return
        try:
            with single_try():  # a busy server's 503 is not repeated: the next cycle decides again
                await self.client.update_flow_run_labels(flow_run.id, {WAIT_LABEL: reason})
        except Exception as exc:
            self._wait_notes.forget(flow_run.id)  # not written: the next cycle decides again
            self._logger.debug("could not label waiting run %s: %s", flow_run.id, exc)

    async def _writes_reason(self, flow_run: "FlowRun") -> bool:
        """Whether this agent writes ``flow_run``'s waiting reason: it is the run's `reason_writer` among the
        queue's online agents (a back end without a view of its peers writes them all)."""
        peers = getattr(self, "peers", None)
        if peers is None:
            return True
        return reason_writer(flow_run.id, await peers.queue_agents()) == self.name

    async def _reject(self, flow_run: "FlowRun", reason: str) -> None:
        """A run the queue can never serve as given fails now, with the reason."""
        message = f"Rejected by agent {self.name}: {reason}"
        self.get_flow_run_logger(flow_run).error(message)
        try:
            await propose_state(self.client, Failed(message=message), flow_run_id=flow_run.id)
        except Exception as exc:
            self._logger.warning("could not reject run %s: %s", flow_run.id, exc)

    async def _in_scope(self, scope: anyio.CancelScope, fn) -> None:
        """Run one of the worker's own loops inside a scope Prefect's teardown cancels."""
        with scope:
            await fn()
