"""Restart recovery: a new life of the agent finds the runs its previous life left and adopts them.

A part of `LaunchWorkerCore` (``worker.adoption``): the ledger is rebuilt from the journal and the live
runs before anything is placed; each run still alive is watched again (limits, sampler, timeout), one
that ended while the agent was away is recorded with why, and its capacity goes back.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio

from prefect.states import Crashed

from prefect_launch.workers.agent.active_run import RunHandle
from prefect_launch.workers.agent.journal import JournalEntry
from prefect_launch.workers.agent.recovery import Recovery
from prefect_launch.workers.scheduling.resolve import resolve_request

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.agent.core import LaunchWorkerCore


def _entry_for(rec: Recovery, agent: str) -> JournalEntry:
    return JournalEntry(run_id=rec.run_id, agent=agent, allocation=rec.alloc, pid=rec.pid,
                        pid_started=rec.pid_started, started_at=rec.started_at, container=rec.container)


class RunAdoption:
    """Recovery of one worker's (``w``) runs after a restart."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    async def recover(self) -> None:
        """Rebuild the ledger from Prefect and the live processes/containers before placing anything."""
        from prefect_launch.workers.agent.recovery import apply_end, decide, gather

        pools = sorted(self.w.agent.queues)
        found = await gather(self.w.client, self.w.name, pools, self.w.journal)
        alive = {f.run_id: await self.w._owner_of(f.queue)._found_alive(f) for f in found}
        for rec in decide(found, alive, self.w.name):
            self.w._logger.warning("recovery: run %s -> %s (%s)", rec.run_id, rec.action, rec.reason)
            if rec.action == "adopt":
                if self.w.ledger.get(rec.run_id) is not None:  # adopted by an earlier, interrupted attempt
                    continue
                try:
                    self.w.ledger.adopt(rec.alloc)
                except ValueError as exc:
                    self.w._logger.error("recovery: %s", exc)
                    continue
                self.w.journal.write(self.w.journal.get(rec.run_id) or _entry_for(rec, self.w.name))
                owner = self.w._owner_of(rec.alloc.queue)
                self.w._runs_task_group.start_soon(owner.adoption.watch_adopted, rec, self.w._runs_task_group)
                continue
            try:
                await apply_end(self.w.client, self.w._metrics_store, rec)
            except Exception as exc:  # leave the journal entry: the next start tries again
                self.w._logger.error("recovery: could not record run %s as %s: %s", rec.run_id, rec.action, exc)
                continue
            self.w.journal.remove(rec.run_id)
        if found:
            print(f"agent {self.w.name!r}: recovered {sum(alive.values())} live run(s), "
                  f"{len(found) - sum(alive.values())} ended while it was away", flush=True)

    async def watch_adopted(self, rec: Recovery, task_group: Any = None) -> None:
        """A run started by a previous life of this agent: limits, sampler, timeout, end state, release."""
        run_id = UUID(rec.run_id)
        alloc = rec.alloc
        try:
            flow_run = await self.w.client.read_flow_run(run_id)
        except Exception:
            flow_run = None
        try:
            handle, limits = await self.w._adopt_handle(rec)
            self.w._active.of(run_id).handle = handle
            self.w._note(run_id, "start", "SUCCESS", message=f"agent {self.w.name} re-adopted the running run after a "
                                                           "restart (its capacity is held again)")
            if limits is not None:
                self.w._active.of(run_id).limits = limits
            if flow_run is not None:
                if handle.pid:
                    self.w.starts.after_start(flow_run, alloc, handle.pid, started_at=rec.started_at)
                timeout = await self.timeout_of(flow_run)
                started = (rec.started_at or flow_run.start_time)
                self.w.stops.arm_deadline(flow_run, handle, timeout, started.timestamp() if started else time.time(),
                                   task_group=task_group)
            while await self.w._handle_alive(rec.run_id, handle):
                await asyncio.sleep(0.5)
            with anyio.CancelScope() as scope:  # its end is recorded now; `cut_ending` may give up on it
                self.w._active.of(run_id).ending = scope
                await self.record_adopted_end(rec, run_id, flow_run, handle, limits)
        except Exception:
            self.w._logger.exception("watching re-adopted run %s failed", rec.run_id)
        finally:
            self.w._active.take(run_id, "ending")
            self.w._active.take(run_id, "limits")
            self.w._release_allocation(run_id)

    async def record_adopted_end(self, rec: Recovery, run_id: UUID, flow_run: Optional["FlowRun"],
                                 handle: RunHandle, limits: Any) -> None:
        reason = await self.w._adopted_end(rec.run_id, handle, limits)
        if limits is not None:
            self.w.ends.note_peak(run_id, limits)
        if flow_run is None:  # deleted from the server meanwhile: only the hardware to give back
            return
        await asyncio.sleep(1.0)  # the engine reports its own final state as it exits
        state = (await self.w.client.read_flow_run(run_id)).state
        if reason:
            await self.w.ends.mark_stopped(flow_run, Crashed(message=reason))
        elif self.w._active.get(run_id).end_state is not None:
            await self.w.ends.mark_stopped(flow_run, self.w._active.get(run_id).end_state)
        elif state is None or not state.is_final():
            await self.w.ends.mark_stopped(flow_run, Crashed(message=(
                f"the run's {'container' if handle.container else 'process'} ended without reporting a final "
                f"state; agent {self.w.name} had re-adopted it after a restart, so its exit code is unknown")))
        await self.w.ends.after_finish(flow_run, None)
        await self.w.ends.note_end(flow_run, None, reason)

    async def timeout_of(self, flow_run: "FlowRun") -> Optional[float]:
        try:
            req = resolve_request(self.w.queue_spec(), await self.w._deployment_vars(flow_run.deployment_id),
                                  flow_run.job_variables or {})
            return req.timeout_s
        except Exception:
            return None
