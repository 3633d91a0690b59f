"""The other agents of a multi-node cluster run: book, start and watch the members the leader asked for.

`ClusterFollower`, a part of the agent core (``worker.follower``) for the process and docker back ends; the
worker's back-end hooks start the members as processes or containers (`_follower_members`,
`_adopt_followed_members`). When a leader's ``launch.cluster.planned`` event for its pool arrives (`wake`, from
the agent's event subscription), and every ``LAUNCH_CLUSTER_POLL_SECONDS`` (10) besides, the
agent reads its queue's Pending runs; one whose ``launch.cluster.plan`` plan names it gets its answer
(`cluster/protocol.py`): its members booked in this agent's ledger and started (``ok``), or why not
(``no: ...``). It then follows the run: a member of its own that exits non-zero fails the run
(the leader stops main1 when it sees that), the run back in its queue (the leader gave up) or
ended stops them (after the drain when the run completed), and its capacity goes back. While it follows,
it raises its beat label every ``LAUNCH_CLUSTER_BEAT_SECONDS``: a follower cut off from the server
falls silent, and the leader fails the run naming its members (`protocol.BeatWatch`); when its link
returns it finds the run ended and stops its members.
The booking is journaled like a run's (under `booking_key`): a follower that restarts (SIGKILL, OOM)
books its live members again and follows them to the run's end (`decide_followed`), reading the exit
status each member left in its exit file, so their hardware is never handed out twice.
Prefect merges a run's labels read-then-write, so two agents writing labels of one run at once can undo each
other's: an answer is read back and written again while it is missing (`answer`), and a beat lost that way
is raised again at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import anyio
from typing import TYPE_CHECKING, Any

from prefect.states import Failed, StateType

from prefect_launch.workers.agent.run_keys import run_key_env
from prefect_launch.workers.cluster.env import member_env
from prefect_launch.workers.cluster.lifecycle import cluster_beat_s, cluster_drain_s, cluster_stop_grace_s, member_log
from prefect_launch.workers.cluster.process import ClusterProcesses, describe_exit
from prefect_launch.workers.cluster.protocol import (ClusterPlan, ack_key, beat_key, booking_key, decide_followed,
                                                     plan_of, run_of_booking)
from prefect_launch.workers.scheduling.resolve import resolve_request
from prefect_launch.workers.agent.tags import OWNER, tag_value

from prefect_launch.settings import env_seconds

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun



ANSWER_TRIES = 5  # writes of one answer to a plan, each read back (see `ClusterFollower.answer`)


class ClusterFollower:
    """The follower's side of multi-node runs, for the worker ``w`` (a `LaunchWorkerCore`): answer plans
    that name this agent, run and watch its members, and re-adopt them after a restart."""

    def __init__(self, worker: Any):
        self.w = worker
        self.followed: dict[Any, ClusterProcesses] = {}  # run id -> this agent's members of it
        self._started = False
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A leader announced a plan on this agent's pool: read the Pending runs now."""
        self._wake.set()

    def start(self) -> None:
        """Once the pool is known (after recovery): the loop that reads Pending runs for plans naming this agent."""
        if self._started or self.w._work_pool is None or self.w._runs_task_group is None:
            return
        self._started = True
        scope = anyio.CancelScope()  # cancelled with the worker's other loops (teardown, --run-once)
        self.w._scheduled_task_scopes.add(scope)
        self.w._runs_task_group.start_soon(self.w._in_scope, scope, self.follow_loop)

    async def recover(self) -> None:
        from uuid import UUID

        from prefect.exceptions import ObjectNotFound

        for entry in self.w.journal.entries():
            run_id = run_of_booking(entry.run_id)
            if run_id is None or self.w.ledger.get(entry.run_id) is not None:
                continue
            try:
                fr = await self.w.client.read_flow_run(UUID(run_id))
            except ObjectNotFound:
                fr = None
            members = entry.allocation.members
            procs = await asyncio.to_thread(self.w._adopt_followed_members, run_id, members,
                                            lambda m: self.member_log(run_id, m))
            plan = plan_of(fr.labels) if fr is not None else None
            action, why = decide_followed(fr.state.type.value if fr is not None and fr.state else None, plan, self.w.name,
                                          (fr.labels or {}).get(ack_key(self.w.name)) if fr is not None else None,
                                          [s.name for s in procs.alive()])
            self.w._logger.warning("recovery: cluster members of run %s -> %s (%s)", run_id, action, why)
            if action == "adopt":
                try:
                    self.w.ledger.adopt(entry.allocation)
                except ValueError as exc:
                    self.w._logger.error("recovery: %s", exc)
                    action, why = "stop", str(exc)
            if action == "stop":
                await procs.stop(1.0)
                procs.forget_files()
                self.w.journal.remove(entry.run_id)
                continue
            self.followed[fr.id] = procs
            print(f"agent {self.w.name!r}: re-adopted cluster member(s) {', '.join(m.name for m in members)} of run "
                  f"{run_id} ({why})", flush=True)
            self.w._note(fr.id, "start", "SUCCESS", message=f"agent {self.w.name} re-adopted its cluster members "
                                                           f"{', '.join(m.name for m in members)} after a restart "
                                                           f"(their capacity is held again): {why}")
            self.w._runs_task_group.start_soon(self.follow, fr, plan, procs)

    def member_log(self, run_id: Any, member: str) -> Path:
        return member_log(self.w.journal.dir, run_id, member)

    async def follow_loop(self) -> None:
        await self.w.agent.recovered.wait()  # never book from a ledger that is not rebuilt yet
        while True:
            # events are the fast path; the slow poll bounds the delay when one lags or is lost (well inside the
            # leader's LAUNCH_CLUSTER_ACK_SECONDS, 30)
            with anyio.move_on_after(env_seconds("LAUNCH_CLUSTER_POLL_SECONDS", 10)):
                await self._wake.wait()
            self._wake.clear()
            if self.w.agent.draining:
                continue
            try:
                await self.follow_once()
            except Exception as exc:
                self.w._logger.debug("multi-node follow: %s", exc)

    async def follow_once(self) -> None:
        from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                    WorkPoolFilter, WorkPoolFilterName)

        runs = await self.w.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PENDING]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self.w._work_pool_name])), limit=50)
        for fr in runs:
            plan = plan_of(fr.labels)
            if plan is None or self.w.name not in plan.followers() or fr.id in self.followed \
                    or (fr.labels or {}).get(ack_key(self.w.name)):
                continue
            await self.join(fr, plan)

    async def join(self, fr: "FlowRun", plan: ClusterPlan) -> None:
        """Book this agent's members of ``fr`` and start them, or say why not."""
        run_id = str(fr.id)
        ranks = plan.ranks_on(self.w.name)
        try:
            dvars = await self.w._deployment_vars(fr.deployment_id)
            req = resolve_request(self.w.queue_spec(), dvars, fr.job_variables or {})
        except Exception as exc:
            await self.answer(fr, f"no: {exc}", plan)
            return
        async with self.w.agent.plan_lock:
            alloc = self.w.ledger.try_allocate_cluster(booking_key(run_id), req.resources, plan.size,
                                                  queue=self.w._work_pool_name,
                                                  preset=req.preset, owner=tag_value(fr.tags, OWNER), ranks=ranks)
        if alloc is None:
            await self.answer(fr, f"no: agent {self.w.name} has {self.w.ledger.free().describe()} free, needs "
                                   f"{len(ranks)} x {req.resources.describe()}", plan)
            return
        alloc.remote_members = {m: a for m, a in plan.members.items() if a != self.w.name}
        self.w.journal.record(alloc)  # before any member starts: a restart finds what this agent may hold
        procs = ClusterProcesses(run_id=run_id)
        self.followed[fr.id] = procs
        try:
            procs, base = await self.w._follower_members(fr, alloc, dvars)
            base = {**base, **await run_key_env(run_id, revoked_here=False)}  # behind a gateway: the run's own key
            self.followed[fr.id] = procs
            for m in alloc.members:
                procs.start(m, {**base, "PREFECT__FLOW_RUN_ID": run_id,
                                **member_env(alloc, m, self.w.name, "multi-node", plan.port,
                                             main_addr=plan.addr_of("main1"), addrs=plan.member_addrs())},
                            self.member_log(run_id, m.name))
        except Exception as exc:
            await procs.stop(1.0)
            procs.remove()
            self.followed.pop(fr.id, None)
            self.w.ledger.release(booking_key(run_id))
            self.w.journal.remove(booking_key(run_id))
            await self.answer(fr, f"no: agent {self.w.name} could not start its members: {exc}", plan)
            return
        self.w._publish_soon()
        self.w._note(fr.id, "start", "SUCCESS", from_state="PENDING", to_state="RUNNING",
                   message=f"agent {self.w.name} started cluster members "
                           + ", ".join(f"{s.name} (process {s.proc.pid})" for s in procs.subs)
                           + f" of the run led by agent {plan.leader}")
        await self.answer(fr, "ok", plan)
        self.w._runs_task_group.start_soon(self.follow, fr, plan, procs)

    async def answer(self, fr: "FlowRun", value: str, plan: ClusterPlan) -> None:
        """Write this agent's answer to ``plan``, read it back, and write it again while another agent's label
        write undid it (Prefect merges labels read-then-write: the followers of one plan, woken by the same
        event, answer at the same moment) and the plan still stands."""
        key = ack_key(self.w.name)
        try:
            for attempt in range(ANSWER_TRIES):
                await self.w.client.update_flow_run_labels(fr.id, {key: value})
                labels = (await self.w.client.read_flow_run(fr.id)).labels or {}
                if labels.get(key) == value or plan_of(labels) != plan:
                    return
                self.w._logger.info("run %s: this agent's cluster answer was overwritten by another label write; "
                                    "writing it again", fr.id)
                await asyncio.sleep(random.uniform(0.05, 0.3) * (attempt + 1))
            self.w._logger.warning("could not keep this agent's answer on run %s after %d writes", fr.id, ANSWER_TRIES)
        except Exception as exc:
            self.w._logger.warning("could not answer the cluster of run %s: %s", fr.id, exc)

    async def follow(self, fr: "FlowRun", plan: ClusterPlan, procs: ClusterProcesses) -> None:
        """Until the run ends (or goes back to its queue): fail it when a member here fails; stop them then."""
        run_id = str(fr.id)
        failed_here = False
        beats, next_beat, beat = 0, 0.0, None
        try:
            while True:
                await asyncio.sleep(0.5)
                if time.monotonic() >= next_beat:  # the leader counts this agent lost when its beat stops
                    beats += 1
                    try:
                        beat = f"{os.getpid()}-{beats}"
                        await self.w.client.update_flow_run_labels(fr.id, {beat_key(self.w.name): beat})
                        # a little apart from the other followers (started by one event, they would beat together)
                        next_beat = time.monotonic() + cluster_beat_s() * random.uniform(0.8, 1.0)
                    except Exception as exc:
                        self.w._logger.debug("run %s: cluster beat not written: %s", run_id, exc)
                try:
                    now = await self.w.client.read_flow_run(fr.id)
                except Exception:
                    continue
                if beat is not None and (now.labels or {}).get(beat_key(self.w.name)) != beat \
                        and plan_of(now.labels) == plan:
                    # another agent's label write undid this beat (labels are merged read-then-write): again soon
                    next_beat = min(next_beat, time.monotonic() + random.uniform(0.0, 0.5))
                    beat = None
                state = now.state
                bad = procs.first_failure()
                if bad is not None and not (state and state.is_final()):
                    reason = (f"cluster-member-failed: member {bad[0]} exited with {describe_exit(bad[1])} on agent "
                              f"{self.w.name}; the run's agents stopped the other members")
                    await self.fail(fr, reason)
                    failed_here = True
                    break
                if state is None:
                    continue
                if state.type == StateType.SCHEDULED or plan_of(now.labels) != plan:
                    break  # the leader gave up placing it: give back what was booked
                if state.is_final():
                    if state.is_completed() and procs.failed is None:
                        late = None
                        if not await procs.wait(cluster_drain_s()):
                            late = (f"cluster-member-failed: member(s) {', '.join(s.name for s in procs.alive())} on "
                                    f"agent {self.w.name} still ran {cluster_drain_s():g} s after main1 ended; stopped")
                        elif procs.first_failure() is not None:
                            name, code = procs.first_failure()
                            late = f"cluster-member-failed: member {name} exited with {describe_exit(code)} on agent {self.w.name}"
                        if late:
                            await self.fail(fr, late)
                            failed_here = True
                    break
            await procs.stop(cluster_stop_grace_s())
        finally:
            for s in procs.alive():  # cancelled mid-stop (agent shutting down): no member is left behind
                s.proc.kill()
            self.followed.pop(fr.id, None)
            if not failed_here:  # a failed member's log stays for the reader
                procs.forget_files()
            procs.remove()  # containers: gone once their ends are read (processes: nothing to do)
            if self.w.ledger.release(booking_key(run_id)) is not None:
                self.w.agent.released()
                self.w._publish_soon()
            self.w.journal.remove(booking_key(run_id))
            self.w._logger.info("run %s: stopped this agent's cluster members and released their capacity", run_id)
            self.w._note(fr.id, "terminate", "SUCCESS", message=f"agent {self.w.name} stopped its cluster members and "
                                                              "released their capacity")

    async def fail(self, fr: "FlowRun", reason: str) -> None:
        self.w._note(fr.id, "terminate", "FAILURE", error_code="cluster-member-failed", from_state="RUNNING",
                   to_state="FAILED", message=reason)
        try:
            self.w.get_flow_run_logger(fr).error(reason)
            await self.w.client.set_flow_run_state(fr.id, Failed(message=reason), force=True)
        except Exception as exc:
            self.w._logger.warning("could not fail cluster run %s: %s", fr.id, exc)
