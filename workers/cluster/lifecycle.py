"""Cluster runs: one worker-side lifecycle for all members of a run (`ClusterRuns`, a part of the agent core).

The process and docker back ends call it (``worker.clusters``); what differs between them (a member is a
process or a container) is the worker's back-end hooks: ``_member_base_env``, ``_new_cluster`` and
``_adopt_cluster_members``. Before the run's engine (main1) starts, the sub members start
(so the run is Running only once every member runs), each with its own pinning and the cluster's
env (`cluster_env`); the memory group of the run takes them in, so the run's memory limit covers
every member, and the run's sampler measures them with main1 (the run's metrics are their sum).
One member exiting non-zero fails the run with its name and exit code and stops the others;
main1 ending (completed, failed, cancelled, stopped by the agent) ends the rest; the
run's capacity is one allocation, released once for all members by the core's release path.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from prefect.states import Failed, StateType

from prefect_launch.workers.agent.address import bind_host
from prefect_launch.workers.cluster.env import LOOPBACK, free_port, member_env
from prefect_launch.workers.cluster.process import ClusterProcesses, describe_exit, find_members, pin_cores, stop_found
from prefect_launch.workers.cluster.protocol import BeatWatch, ClusterPlan, ack_key, answers, plan_of, planned_event
from prefect_launch.workers.scheduling.ledger import Allocation
from prefect_launch.workers.agent.queued_state import queued
from prefect_launch.workers.agent.tags import CLUSTER_PLAN_LABEL, WAIT_LABEL

from prefect_launch.settings import env_seconds

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun



def cluster_stop_grace_s() -> float:
    """SIGTERM -> SIGKILL grace when sub members are stopped (LAUNCH_CLUSTER_STOP_GRACE_SECONDS)."""
    return env_seconds("LAUNCH_CLUSTER_STOP_GRACE_SECONDS", 5)


def cluster_drain_s() -> float:
    """How long sub members may run on after main1 ended (LAUNCH_CLUSTER_DRAIN_SECONDS)."""
    return env_seconds("LAUNCH_CLUSTER_DRAIN_SECONDS", 30)


def cluster_beat_s() -> float:
    """How often an agent following a multi-node run tells its leader it is there (LAUNCH_CLUSTER_BEAT_SECONDS)."""
    return env_seconds("LAUNCH_CLUSTER_BEAT_SECONDS", 5)


def cluster_lost_s() -> float:
    """Multi-node: how long the leader waits for a silent agent of a run before failing it (LAUNCH_CLUSTER_LOST_SECONDS)."""
    return env_seconds("LAUNCH_CLUSTER_LOST_SECONDS", 20)


def cluster_ack_s() -> float:
    """Multi-node: how long the leader waits for the other agents' answers (LAUNCH_CLUSTER_ACK_SECONDS)."""
    return env_seconds("LAUNCH_CLUSTER_ACK_SECONDS", 30)


class ClusterAborted(Exception):
    """Another agent of a multi-node run refused (or did not answer): the run goes back to its queue."""


def member_log(journal_dir: Path, run_id: Any, member: str) -> Path:
    """``<journal dir>/<run id>.<member>.log``: a sub member's output (and, beside it, its exit file),
    on the leader's host and on followers' alike."""
    return journal_dir / f"{run_id}.{member}.log"


class ClusterRuns:
    """The leader's side of a cluster run, for the worker ``w`` (a `LaunchWorkerCore`): its sub members,
    the multi-node plan and answers, member failures, the end and re-adoption after a restart."""

    def __init__(self, worker: Any):
        self.w = worker
        self.adopted: dict[str, ClusterProcesses] = {}  # re-adopted runs' sub members, by run id

    def member_log(self, run_id: Any, member: str) -> Path:
        return member_log(self.w.journal.dir, run_id, member)

    async def start(self, flow_run: "FlowRun", alloc: Allocation, configuration: Any) -> ClusterProcesses:
        """Start this agent's sub members now (multi-node: once every other agent started its own);
        give main1's env to the engine's configuration. Raises `ClusterAborted` when another agent refused."""
        request = self.w._active.get(flow_run.id).request
        mode = request.cluster.mode if request is not None else "single-node"
        main_addr, addrs = LOOPBACK, None  # single-node: every member on this host
        if alloc.remote_members:  # members on other agents: each reached at its agent's published address
            mode = "multi-node"
            agent_addrs = await self.addresses(alloc)
            main_addr = agent_addrs.get(self.w.name, LOOPBACK)
            port = free_port(bind_host(main_addr))
            plan = await self.gather(flow_run, alloc, port, agent_addrs)
            addrs = plan.member_addrs()
        else:
            port = free_port()
        base = self.w._member_base_env(configuration)
        configuration.env.update(member_env(alloc, alloc.members[0], self.w.name, mode, port, main_addr, addrs))
        procs = self.w._new_cluster(flow_run, configuration)
        try:
            for m in alloc.members[1:]:
                env = {**base, **member_env(alloc, m, self.w.name, mode, port, main_addr, addrs),
                       "PREFECT__FLOW_RUN_ID": str(flow_run.id)}
                procs.start(m, env, self.member_log(flow_run.id, m.name))
        except Exception:
            for s in procs.alive():
                s.proc.kill()
            raise
        here = ", ".join(["main1 (this engine)"] + [f"{s.name} (pid {s.proc.pid})" for s in procs.subs])
        away = ", ".join(f"{m} (agent {a})" for m, a in alloc.remote_members.items())
        self.w.get_flow_run_logger(flow_run).info(
            f"cluster of {alloc.cluster_size or len(alloc.members)} ({mode}): rendezvous {main_addr}:{port}; "
            f"on agent {self.w.name}: {here}" + (f"; on other agents: {away}" if away else ""))
        return procs

    async def addresses(self, alloc: Allocation) -> dict[str, str]:
        """Agent -> address for this agent and the agents hosting the run's other members: this agent's own,
        the others' as they published it (an agent that published none is left out: loopback)."""
        from prefect_launch.workers.agent.registry import read_agents

        addrs = {self.w.name: self.w.agent.address or LOOPBACK}
        wanted = set(alloc.remote_members.values())
        try:
            for a in await read_agents(self.w.client):
                if a.name in wanted and a.address:
                    addrs[a.name] = a.address
        except Exception as exc:
            self.w._logger.warning("could not read the other agents' addresses: %s", exc)
        return addrs

    async def gather(self, flow_run: "FlowRun", alloc: Allocation, port: int,
                              addrs: Optional[dict[str, str]] = None) -> ClusterPlan:
        """Leader of a multi-node run: publish the plan, wait until every other agent booked and started
        its members (`cluster/protocol.py`); returns the plan."""
        plan = ClusterPlan(leader=self.w.name, port=port, size=alloc.cluster_size,
                           members={**{m.name: self.w.name for m in alloc.members}, **alloc.remote_members},
                           addrs=addrs or {})
        await self.w.client.update_flow_run_labels(flow_run.id, {**plan.label(),
                                                               **{ack_key(a): "" for a in plan.followers()}})
        self.announce(flow_run, plan)
        deadline = time.monotonic() + cluster_ack_s()
        while True:
            labels = (await self.w.client.read_flow_run(flow_run.id)).labels
            ok, no = answers(labels, plan)
            if no:
                raise ClusterAborted("; ".join(f"agent {a} said {why}" for a, why in no.items()))
            if len(ok) == len(plan.followers()):
                self.w._note(flow_run.id, "schedule", "SUCCESS", message=f"multi-node cluster: agents "
                           f"{', '.join(ok)} started their members; main1 starts on agent {self.w.name} "
                           f"({plan.addr_of('main1')}:{port})")
                return plan
            if time.monotonic() > deadline:
                missing = sorted(set(plan.followers()) - set(ok))
                raise ClusterAborted(f"no answer from agent(s) {', '.join(missing)} in {cluster_ack_s():g} s")
            await asyncio.sleep(0.3)

    def announce(self, flow_run: "FlowRun", plan: ClusterPlan) -> None:
        """Tell the followers now (`protocol.PLANNED_EVENT`) rather than at their next slow poll."""
        from prefect.events import emit_event

        try:
            emit_event(**planned_event(flow_run.id, self.w.work_pool.id, plan))
        except Exception as exc:  # the followers' poll still finds the plan
            self.w._logger.debug("run %s: cluster plan event not emitted: %s", flow_run.id, exc)

    async def requeue(self, flow_run: "FlowRun", why: str) -> None:
        """The cluster could not be completed: the run goes back to its queue (submit time kept), holding nothing."""
        reason = f"waiting: cluster (multi-node) could not be placed: {why}; nothing is held while it waits"
        self.w._note(flow_run.id, "schedule", "NEED_RETRY", error_code="cluster-incomplete", from_state="PENDING",
                   to_state="SCHEDULED", message=reason)
        try:
            await self.w.client.set_flow_run_state(
                flow_run.id, queued(flow_run.expected_start_time, reason), force=True)
            await self.w.client.update_flow_run_labels(flow_run.id, {CLUSTER_PLAN_LABEL: "", WAIT_LABEL: reason})
        except Exception as exc:
            self.w._logger.warning("could not put cluster run %s back in its queue: %s", flow_run.id, exc)

    async def watch_state(self, flow_run: "FlowRun") -> None:
        """Leader: a member on another agent that fails marks the run Failed; then main1 is stopped too. An
        agent of the run not heard from for `cluster_lost_s` (its host cut off or down) fails it here."""
        run_id = str(flow_run.id)
        watch: Optional[BeatWatch] = None
        last_read = time.monotonic()
        while self.w.ledger.get(run_id) is not None:
            await asyncio.sleep(0.5)
            asked = time.monotonic()
            try:
                now = await self.w.client.read_flow_run(flow_run.id)
            except Exception:
                if watch is not None:
                    watch.blind(time.monotonic() - last_read)  # this agent's own outage: nobody is blamed for it
                continue
            if watch is not None and time.monotonic() - asked > cluster_lost_s() / 2:  # not a slow answer: the
                watch.blind(time.monotonic() - last_read)  # read retried across an outage (the server restarting)
            last_read = time.monotonic()
            state = now.state
            plan = plan_of(now.labels)
            if watch is None and plan is not None:
                watch = BeatWatch(plan.followers(), cluster_lost_s(), time.monotonic())
            if watch is not None and plan is not None and state is not None and not state.is_final():
                lost = watch.lost(now.labels, time.monotonic())
                if lost:
                    await self.agents_lost(flow_run, plan, lost)
                    continue  # read again: the run is Failed, main1 is stopped below
            if state is not None and state.is_final():
                handle = self.w._active.get(flow_run.id).handle
                if state.type == StateType.FAILED and (state.message or "").startswith("cluster-member-failed") \
                        and handle is not None and await self.w._handle_alive(run_id, handle):
                    await self.w._stop_run(flow_run, handle, Failed(message=state.message), grace_s=0)
                return

    async def agents_lost(self, flow_run: "FlowRun", plan: ClusterPlan, lost: list[str]) -> None:
        """Agents of the run fell silent: fail the run naming their members (main1 is then stopped)."""
        members = sorted(m for m, a in plan.members.items() if a in lost)
        who = ", ".join(f"{a} ({plan.addrs.get(a, '?')})" for a in lost)
        reason = (f"cluster-member-failed: member(s) {', '.join(members)} lost: agent(s) {who} not heard from for "
                  f"{cluster_lost_s():g} s (host cut off or down); agent {self.w.name} stopped the other members")
        self.w._note(flow_run.id, "terminate", "FAILURE", error_code="cluster-member-lost", from_state="RUNNING",
                   to_state="FAILED", message=reason)
        self.w.get_flow_run_logger(flow_run).error(reason)
        try:
            await self.w.client.set_flow_run_state(flow_run.id, Failed(message=reason), force=True)
        except Exception as exc:
            self.w._logger.warning("could not fail cluster run %s: %s", flow_run.id, exc)

    def on_main(self, flow_run: "FlowRun", alloc: Allocation, procs: ClusterProcesses, pid: int,
                         limits: Any) -> None:
        """main1 exists: pin it to its own cores, bring the subs under the run's memory group, watch them."""
        pin_cores(pid, alloc.members[0].cpu_cores)
        group = getattr(limits, "group", None)
        sampler = self.w._active.get(flow_run.id).sampler
        gpus_of = {m.name: m.gpu_indices for m in alloc.members}
        if sampler is not None:  # main1 is the run's own process: named, so its figures are also kept apart
            sampler.track(pid, member="main1", gpu_indices=gpus_of.get("main1"))
        for s in procs.subs:
            if group is not None:  # the run's memory limit covers every member
                group.add(s.proc.pid)
            if sampler is not None:  # the run's metrics are the sum over its members; each is also kept apart
                sampler.track(s.proc.pid, member=s.name, gpu_indices=gpus_of.get(s.name))
        self.w._note(flow_run.id, "start", "SUCCESS", from_state="PENDING", to_state="RUNNING",
                   message=f"agent {self.w.name} started cluster members main1 (process {pid}), "
                           + ", ".join(f"{s.name} (process {s.proc.pid})" for s in procs.subs))

        async def on_failure(name: str, code: int) -> None:
            await self.member_failed(flow_run, procs, name, code)

        self.w._runs_task_group.start_soon(procs.watch, on_failure)
        if alloc.remote_members:
            self.w._runs_task_group.start_soon(self.watch_state, flow_run)

    async def main_completed(self, flow_run: "FlowRun") -> bool:
        try:
            state = (await self.w.client.read_flow_run(flow_run.id)).state
        except Exception:
            return False
        return state is not None and state.is_completed()

    def failure_reason(self, name: str, code: int) -> str:
        return (f"cluster-member-failed: member {name} exited with {describe_exit(code)}; "
                f"agent {self.w.name} stopped the other members")

    async def member_failed(self, flow_run: "FlowRun", procs: ClusterProcesses, name: str,
                                     code: int) -> None:
        """A sub member died while main1 runs: fail the run with why, stop main1 and the rest."""
        reason = self.failure_reason(name, code)
        self.w._note(flow_run.id, "terminate", "FAILURE", error_code="cluster-member-failed", from_state="RUNNING",
                   to_state="FAILED", message=reason)
        self.w.get_flow_run_logger(flow_run).error(reason + _log_tail(self.member_log(flow_run.id, name)))
        try:  # first, so readers see why at once; main1 is then killed without a SIGTERM, on which its
            # engine would force "Crashed ... termination signal" over this for a moment
            await self.w.client.set_flow_run_state(flow_run.id, Failed(message=reason), force=True)
        except Exception as exc:
            self.w._logger.warning("could not fail cluster run %s: %s", flow_run.id, exc)
        await procs.stop(cluster_stop_grace_s())
        handle = self.w._active.get(flow_run.id).handle
        if handle is not None:
            await self.w._stop_run(flow_run, handle, Failed(message=reason), grace_s=0)

    async def end(self, flow_run: "FlowRun", procs: ClusterProcesses, status_code: Optional[int]) -> None:
        """main1 has exited: let the subs finish (main1 completed) or stop them; a late failure fails the run."""
        late: Optional[str] = None
        if status_code == 0 and procs.failed is None and self.w._active.get(flow_run.id).end_state is None \
                and await self.main_completed(flow_run):  # cancelled or failed: no waiting for the rest
            if not await procs.wait(cluster_drain_s()):
                late = (f"cluster-member-failed: member(s) {', '.join(s.name for s in procs.alive())} still ran "
                        f"{cluster_drain_s():g} s after main1 ended; agent {self.w.name} stopped them")
            else:
                bad = procs.first_failure()
                if bad is not None:
                    late = self.failure_reason(*bad)
        await procs.stop(cluster_stop_grace_s())
        if late is not None:  # main1 reported Completed, but the run is the whole cluster
            self.w._note(flow_run.id, "terminate", "FAILURE", error_code="cluster-member-failed",
                       from_state="RUNNING", to_state="FAILED", message=late)
            self.w.get_flow_run_logger(flow_run).error(late)
            try:
                await self.w.client.set_flow_run_state(flow_run.id, Failed(message=late), force=True)
                self.w._active.of(flow_run.id).ended = True
            except Exception as exc:
                self.w._logger.warning("could not fail cluster run %s: %s", flow_run.id, exc)
        if procs.failed is None and late is None:
            procs.forget_files()


    async def adopted_end(self, run_id: str, strays: bool = True) -> None:
        """A re-adopted cluster run's main1 is gone: its sub members go with it (with ``strays``, processes
        found by command line too, should any have escaped the watch)."""
        procs = self.adopted.pop(run_id, None)
        if procs is not None:
            await procs.stop(cluster_stop_grace_s())
            await asyncio.to_thread(procs.remove)  # containers: gone once their ends are read
            if procs.failed is None:
                procs.forget_files()
        left = await asyncio.to_thread(find_members, run_id) if strays else []
        if left:
            self.w._logger.warning("run %s: main1 ended; stopping %d sub member(s) left from before the restart",
                                   run_id, len(left))
            await stop_found(left, cluster_stop_grace_s())

    def watch_adopted(self, flow_run: "FlowRun", alloc: Allocation) -> None:
        """After a restart the sub members on this host are not the agent's children: the back end finds them
        (processes by command line, containers by label) and a sub that fails while main1 runs still fails the
        run, with the exit code from its exit file (none: killed by a signal), as before the restart."""
        run_id = str(flow_run.id)
        subs = [m for m in alloc.members if m.name != "main1"]
        if not subs or self.w._runs_task_group is None:
            return
        procs = self.w._adopt_cluster_members(run_id, subs, lambda name: self.member_log(run_id, name))
        sampler = self.w._active.get(flow_run.id).sampler
        gpus_of = {m.name: m.gpu_indices for m in alloc.members}
        if sampler is not None:
            sampler.track(sampler.pid, member="main1", gpu_indices=gpus_of.get("main1"))
        for s in procs.subs:
            if sampler is not None and s.proc.pid:
                sampler.track(s.proc.pid, member=s.name, gpu_indices=gpus_of.get(s.name))
        self.adopted[run_id] = procs

        async def on_failure(name: str, code: int) -> None:
            await self.member_failed(flow_run, procs, name, code)

        self.w._runs_task_group.start_soon(procs.watch, on_failure)
        if alloc.remote_members:
            self.w._runs_task_group.start_soon(self.watch_state, flow_run)


def _log_tail(path: Any, lines: int = 15) -> str:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return ("\nlast lines of its output:\n" + "\n".join(tail)) if tail else ""
