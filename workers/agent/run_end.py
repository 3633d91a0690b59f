"""A run's end: why it ended, its sampler's summary, its ``terminate`` record, its capacity back.

A part of `LaunchWorkerCore` (``worker.ends``): called by the back end once the run's process or
container is gone (`on_finished`), and by recovery for a re-adopted run. Capacity goes back as soon as
the process is gone, before the bookkeeping, so the next placement does not wait for it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID

import anyio

from prefect.states import Crashed, State


if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_launch.workers.agent.core import LaunchWorkerCore


LATE_STATE_S = 1.0  # how long after a signalled run is gone a state its engine sent late may still land


class RunEnds:
    """The ends of one worker's (``w``) runs."""

    def __init__(self, worker: "LaunchWorkerCore") -> None:
        self.w = worker

    async def on_finished(self, flow_run: "FlowRun", status_code: Optional[int], limits: Any = None,
                          reason: Optional[str] = None) -> None:
        """Record why the agent ended the run (limits, timeout, cancel), stop sampling, publish the summary."""
        reason = (limits.finish() if limits is not None else None) or reason
        if limits is not None:
            self.note_peak(flow_run.id, limits)
        self.w._active.take(flow_run.id, "limits")
        self.w._active.take(flow_run.id, "request")
        with anyio.CancelScope(shield=True) as scope:  # shielded from the agent's stop; `cut_ending` may end it
            self.w._active.of(flow_run.id).ending = scope
            if self.w._cut_ends:
                scope.cancel()
            try:
                read: Optional[State] = None  # the run's state as after_finish read it: note_end reuses a final one
                try:
                    if reason:
                        self.w._active.of(flow_run.id).kill_reason = reason
                        await self.mark_stopped(flow_run, Crashed(message=reason))
                    elif self.w._active.get(flow_run.id).end_state is not None:
                        await self.mark_stopped(flow_run, self.w._active.get(flow_run.id).end_state)
                    self.w._free_capacity(flow_run.id)  # its process is gone: the next run need not wait for the summary
                    read = await self.after_finish(flow_run, status_code)  # cut short: still writes the summary locally
                finally:
                    self.w._free_capacity(flow_run.id)  # also when cut short: the hardware is free either way
                    sampler = self.w._active.take(flow_run.id, "sampler")
                    if sampler is not None:  # cut short before its summary: it still reaches the local store
                        await self.stop_sampler(sampler, "UNKNOWN")
                    if self.w._active.get(flow_run.id).handle is not None:  # it ran: record its end (a failed start: the caller records it)
                        await self.note_end(flow_run, status_code, reason, known=read)
                    self.revoke_key_soon(flow_run.id)
            finally:
                self.w._active.take(flow_run.id, "ending")

    def revoke_key_soon(self, run_id: Any) -> None:
        """The run's process is gone: its run key goes too (off the end's path; no gateway: nothing to do)."""
        from prefect_launch.workers.agent.run_keys import behind_gateway, revoke_run_keys

        if not behind_gateway():
            return
        if self.w._runs_task_group is not None:
            self.w._runs_task_group.start_soon(revoke_run_keys, run_id)

    async def note_end(self, flow_run: "FlowRun", status_code: Optional[int], reason: Optional[str],
                       known: Optional[State] = None) -> None:
        """``terminate``: how the run ended and that its capacity goes back (the release follows at once).
        ``known``: the state just read for the summary; a final one is not read again."""
        agent_state = Crashed(message=reason) if reason else self.w._active.get(flow_run.id).end_state
        if known is not None and known.is_final():
            self.write_end_note(flow_run, status_code, reason, agent_state, known)
            return
        try:
            state = (await self.w.client.read_flow_run(flow_run.id)).state
        except Exception:
            state = None
        except BaseException:  # cut short by the agent's stop (`cut_ending`): the history still gets the end
            self.write_end_note(flow_run, status_code, reason, agent_state, None, unread=True)
            raise
        self.write_end_note(flow_run, status_code, reason, agent_state, state)

    def write_end_note(self, flow_run: "FlowRun", status_code: Optional[int], reason: Optional[str],
                       agent_state: Optional[State], state: Optional[State], unread: bool = False) -> None:
        if state is not None and state.is_final():  # after mark_stopped: the agent's reason, unless it ended first
            end, message = state.type.value, state.message
        elif agent_state is not None:
            end, message = agent_state.type.value, agent_state.message
        else:
            end = "CRASHED" if status_code not in (0, None) else (state.type.value if state else "UNKNOWN")
            message = f"exit status {status_code}" if status_code is not None else None
        unread_note = ""
        if unread:
            unread_note = "; its Prefect state was not read: the agent stopped while the server did not answer"
            if not reason:  # only the agent's own kill (limit, timeout) is known without the server
                asked = f" after agent {self.w.name} asked it to stop ({message})" if agent_state is not None else ""
                end, message = "UNKNOWN", (f"its process ended{asked}" if asked else
                                           f"its process ended (exit status {status_code})")
        code = None
        if end != "COMPLETED":
            head = (message or "").split(":", 1)[0].strip()
            code = head if head and " " not in head and len(head) <= 64 else end.lower()
        self.w._note(flow_run.id, "terminate", "SUCCESS", error_code=code, from_state="RUNNING", to_state=end,
                   message=f"ended {end.capitalize()}{': ' + message if message else ''}; agent {self.w.name} "
                           f"released its capacity{unread_note}",
                   sub_steps=self.w.stops.stop_steps(flow_run.id))

    async def mark_stopped(self, flow_run: "FlowRun", state: State) -> None:
        """The run's executor already reported a bare signal; record the agent's reason instead.

        When the agent signalled the run, it reads once more a moment later, off the end's path (the
        capacity is not held for it): a state the engine sent just before it was killed (a session that
        reports Completed on SIGTERM, slowed past the grace on a loaded box) can reach the server after the
        process is gone, over the agent's reason.
        """
        self.w._active.of(flow_run.id).ended = True
        signalled = self.w._active.get(flow_run.id).signalled_at
        try:
            current = (await self.w.client.read_flow_run(flow_run.id)).state
            if current is not None and current.is_completed() and (
                    signalled is None or current.timestamp.timestamp() < signalled):
                return  # it finished before the signal landed (after it: it ended because of it)
            if not (current is not None and current.is_final() and current.type == state.type
                    and current.message == state.message):  # else already recorded (e.g. a member's failure)
                self.w.get_flow_run_logger(flow_run).error(state.message)
                await self.w.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception as exc:
            self.w._logger.warning("could not record why run %s was stopped: %s", flow_run.id, exc)
            return
        if signalled is not None and state.is_final() and self.w._runs_task_group is not None:
            try:
                self.w._runs_task_group.start_soon(self._mark_late, flow_run, state, signalled)
            except RuntimeError:  # the worker is stopping: its task group takes nothing new
                pass

    async def _mark_late(self, flow_run: "FlowRun", state: State, signalled: float) -> None:
        """`mark_stopped` once more (its ``signalled`` kept: the run's record may be gone by then)."""
        await asyncio.sleep(LATE_STATE_S)
        try:
            current = (await self.w.client.read_flow_run(flow_run.id)).state
            if current is not None and current.is_completed() and current.timestamp.timestamp() >= signalled:
                self.w._logger.info("run %s reported Completed after agent %s stopped it: its reason again",
                                    flow_run.id, self.w.name)
                await self.w.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception as exc:
            self.w._logger.debug("could not re-check run %s's end: %s", flow_run.id, exc)

    def note_peak(self, run_id: UUID, limits: Any) -> None:
        """The kernel's final peak reaches the summary (finish() removes the cgroup before the last sample)."""
        sampler = self.w._active.get(run_id).sampler
        if sampler is not None and getattr(limits, "peak_rss", None):
            sampler.note_peak_memory(limits.peak_rss)

    async def after_finish(self, flow_run: "FlowRun", status_code: Optional[int]) -> Optional[State]:
        """Stop sampling, write the summary, and attach it to the Prefect run as a table; returns the run's
        state as read for it (None when not read)."""
        sampler = self.w._active.take(flow_run.id, "sampler")
        if sampler is None:
            return None
        state: Optional[State] = None
        from prefect_launch.workers.metrics.run_sampling import publish_summary_artifact

        exit_state = "UNKNOWN"  # stays so when cut short by the agent's stop (the state was not read)
        try:
            state = (await self.w.client.read_flow_run(flow_run.id)).state
            exit_state = state.type.value if state else "UNKNOWN"
            if state is None or not state.is_final():  # the worker marks crashes after this point
                exit_state = "CRASHED" if status_code not in (0, None) else exit_state
        except Exception:
            exit_state = "CRASHED" if status_code not in (0, None) else "UNKNOWN"
        finally:  # also when cut short: the summary reaches the local metrics store
            summary = await self.stop_sampler(sampler, exit_state)
        try:
            await publish_summary_artifact(self.w.client, flow_run.id, summary, sampler.record)
        except Exception as exc:
            self.w._logger.debug("could not attach the metrics summary to run %s: %s", flow_run.id, exc)
        return state

    @staticmethod
    async def stop_sampler(sampler: Any, exit_state: str) -> Any:
        """Stop sampling and write the run's summary to the metrics store (local: done even while stopping)."""
        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(sampler.stop, exit_state)
