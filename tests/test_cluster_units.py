"""Cluster runs without servers: validation, all-or-nothing booking, the dispatch cycle's cluster runs, member env,
and the example all-reduce over loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from uuid import uuid4

import pytest

from prefect_launch.workers.cluster.env import free_port, member_env
from prefect_launch.workers.cluster.process import describe_exit
from prefect_launch.workers.cluster.spec import MAX_CLUSTER_SIZE, check_fits_one_agent, cluster_of
from prefect_launch.workers.scheduling.dispatch import DispatchHooks, dispatch_cycle
from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.queue_spec import Preset, QueueSpec
from prefect_launch.workers.scheduling.resolve import resolve_request
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources

SPEC = QueueSpec(name="q", presets={"g1": Preset(cpu=1, memory="1Gi", gpu=1)}, default_preset="g1")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
GIB = 1 << 30


@pytest.mark.parametrize("layer,why", [
    ({"cluster_size": 0}, "at least 1"),
    ({"cluster_size": MAX_CLUSTER_SIZE + 1}, f"limit of {MAX_CLUSTER_SIZE}"),
    ({"cluster_size": "three"}, "whole number"),
    ({"cluster_size": True}, "whole number"),
    ({"cluster_size": 2, "cluster_mode": "ring"}, "cluster_mode must be one of"),
])
def test_cluster_validation_says_what_is_wrong(layer, why):
    with pytest.raises(LaunchValidationError, match=why):
        cluster_of([(layer, "in the submission")])
    assert cluster_of([({"cluster_size": 2, "cluster_mode": "multi-node"}, "x")]).mode == "multi-node"


def test_docker_queues_take_both_cluster_modes_and_size_one_is_a_plain_run():
    assert cluster_of([({"cluster_size": 2}, "x")], target="docker").size == 2
    assert cluster_of([({"cluster_size": 2, "cluster_mode": "multi-node"}, "x")], target="docker").mode == "multi-node"
    assert not cluster_of([({"cluster_size": 1}, "x")], target="docker").is_cluster


def test_resolve_carries_the_cluster_and_the_run_holds_every_member():
    req = resolve_request(SPEC, {"cluster_size": 2}, {"cluster_size": 3})  # the run's layer wins
    assert (req.cluster.size, req.cluster.mode) == (3, "single-node")
    assert req.resources.gpu == 1 and req.held() == Resources(cpu=3, memory=3 * GIB, gpu=3)


def test_a_cluster_that_no_agent_could_ever_hold_is_refused_up_front():
    c = cluster_of([({"cluster_size": 3}, "x")])
    one = Resources(cpu=1, memory=GIB, gpu=1)
    assert "needs gpu=3 (agent a has 2 in total)" in check_fits_one_agent(c, one, {"a": Resources(cpu=8, memory=8 * GIB, gpu=2)})
    assert check_fits_one_agent(c, one, {"a": Resources(cpu=8, memory=8 * GIB, gpu=4)}) is None


def test_cluster_booking_gives_each_member_its_own_gpus_and_cores_or_nothing():
    ledger = Ledger(Resources(cpu=4, memory=8 * GIB, gpu=3))
    member = Resources(cpu=1, memory=GIB, gpu=1)
    a = ledger.try_allocate_cluster("r1", member, 2)
    assert [m.name for m in a.members] == ["main1", "sub1"]
    assert [m.gpu_indices for m in a.members] == [[0], [1]]
    assert not set(a.members[0].cpu_cores) & set(a.members[1].cpu_cores)
    assert a.resources.gpu == 2 and ledger.free().gpu == 1
    assert ledger.try_allocate_cluster("r2", member, 2) is None  # half fits: nothing is booked
    assert [x.run_id for x in ledger.allocations()] == ["r1"] and ledger.free().gpu == 1
    ledger.release("r1")  # one release gives every member's capacity back
    assert ledger.free() == ledger.capacity


def _run(i: int, **jv):
    return SimpleNamespace(id=uuid4(), name=f"r{i}", deployment_id=None, job_variables=jv,
                           expected_start_time=T0 + timedelta(seconds=i), work_queue_name="default", labels={})


def test_dispatch_places_one_cluster_and_the_other_waits_holding_nothing():
    ledger = Ledger(Resources(cpu=4, memory=8 * GIB, gpu=3))
    started, waiting, history = [], {}, []

    async def dvars(_):
        return {}

    async def pinned():
        return {}, set()

    async def wait(fr, reason):
        waiting[fr.name] = reason

    async def reject(fr, reason):
        raise AssertionError(reason)

    hooks = DispatchHooks(deployment_vars=dvars, pinned_agents=pinned, wait=wait, reject=reject,
                          start=lambda fr, alloc, req: started.append((fr.name, alloc)), history=history.append)
    runs = [_run(0, cluster_size=2), _run(1, cluster_size=2), _run(2)]
    asyncio.run(dispatch_cycle(runs, SPEC, ledger, "q", "a1", {"default": 1}, hooks))
    assert [n for n, _ in started] == ["r0"]
    assert "cluster of 2 (single-node) needs 2 x cpu=1" in waiting["r1"]
    assert "room for 1 member(s); nothing is held while it waits" in waiting["r1"]
    assert waiting["r2"].endswith("(FIFO)")  # strict FIFO: the waiting cluster run is the head
    assert len(ledger.allocations()) == 1 and ledger.free().gpu == 1
    placed = next(r for r in history if r.run_id == str(runs[0].id) and r.result == "SUCCESS")
    assert "main1: gpus 0" in placed.message and "sub1: gpus 1" in placed.message


def test_member_env_names_the_cluster_and_pins_each_member():
    ledger = Ledger(Resources(cpu=3, memory=8 * GIB, gpu=3))
    alloc = ledger.try_allocate_cluster("r", Resources(cpu=1, memory=GIB, gpu=1), 3)
    port = free_port()
    envs = [member_env(alloc, m, "a1", "single-node", port) for m in alloc.members]
    assert [e["LAUNCH_CLUSTER_MEMBER"] for e in envs] == ["main1", "sub1", "sub2"]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2"]
    assert {e["MASTER_PORT"] for e in envs} == {str(port)} and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert envs[2]["LAUNCH_CLUSTER_HOSTS"] == "main1,sub1,sub2" and envs[1]["LAUNCH_CPU"] == "1"
    assert describe_exit(-9) == "code -9 (SIGKILL)" and describe_exit(3) == "code 3"


def test_example_all_reduce_sums_over_loopback():
    path = Path(__file__).resolve().parents[1] / "flows" / "allreduce.py"
    spec = importlib.util.spec_from_file_location("allreduce_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    port, world, out = free_port(), 3, {}

    def member(rank: int) -> None:
        out[rank] = mod.all_reduce_sum([rank + 1.0, 2.0 * (rank + 1)], rank, world, "127.0.0.1", port, timeout_s=20)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {r: [6.0, 12.0] for r in range(world)}


def test_a_restarted_agent_finds_and_stops_sub_members_by_command_line():
    import subprocess
    import sys

    from prefect_launch.workers.cluster.process import MEMBER_MODULE, find_members, stop_found

    run_id = str(uuid4())
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", MEMBER_MODULE, run_id],
                            start_new_session=True)
    try:
        found = []
        for _ in range(50):
            found = find_members(run_id)
            if found:
                break
            import time

            time.sleep(0.1)
        assert [p.pid for p in found] == [proc.pid] and find_members(str(uuid4())) == []
        asyncio.run(stop_found(found, grace_s=2))
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()


def test_multi_node_plan_puts_main1_on_the_leader_and_spreads_the_rest():
    from prefect_launch.workers.cluster.placement import multi_node_plan

    one = Resources(cpu=1, memory=GIB, gpu=1)
    free = {"a": Resources(cpu=2, memory=4 * GIB, gpu=1), "b": Resources(cpu=2, memory=4 * GIB, gpu=2),
            "c": Resources(cpu=2, memory=4 * GIB, gpu=1)}
    ranks, why = multi_node_plan(4, one, "a", free)
    assert ranks == {0: "a", 1: "b", 2: "c", 3: "b"} and why == ""
    ranks, why = multi_node_plan(5, one, "a", free)
    assert ranks == {} and "room for 4 member(s)" in why and "nothing is held" in why
    c = cluster_of([({"cluster_size": 3, "cluster_mode": "multi-node"}, "x")])
    assert check_fits_one_agent(c, one, {"a": free["a"], "c": free["c"]}).startswith("a cluster of 3")
    assert check_fits_one_agent(c, one, free) is None


def test_cluster_plan_label_round_trip_and_answers():
    from prefect_launch.workers.cluster.protocol import ClusterPlan, ack_key, answers, plan_of

    plan = ClusterPlan(leader="a", port=29500, size=3, members={"main1": "a", "sub1": "b", "sub2": "c"})
    labels = {**plan.label(), ack_key("b"): "ok", ack_key("c"): "no: agent c has gpu=0 free"}
    assert plan_of(labels) == plan and plan.ranks_on("c") == [2] and plan.followers() == ["b", "c"]
    assert answers(labels, plan) == (["b"], {"c": "agent c has gpu=0 free"})
    assert plan_of({"launch.cluster.plan": ""}) is None


def test_ledger_books_only_this_agents_ranks_of_a_multi_node_cluster():
    ledger = Ledger(Resources(cpu=2, memory=4 * GIB, gpu=1))
    a = ledger.try_allocate_cluster("r", Resources(cpu=1, memory=GIB, gpu=1), 3, ranks=[2])
    assert [(m.rank, m.name, m.gpu_indices) for m in a.members] == [(2, "sub2", [0])] and a.cluster_size == 3
    a.remote_members = {"main1": "x", "sub1": "y"}
    env = member_env(a, a.members[0], "b", "multi-node", 1234)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LAUNCH_CLUSTER_HOSTS"]) == \
        ("2", "3", "0", "main1,sub1,sub2")


class _Labels:
    """A fake Prefect client holding one run's labels; ``answer`` plays the other agents."""

    def __init__(self, answer):
        self.labels, self.answer, self.reads = {}, answer, 0

    async def update_flow_run_labels(self, run_id, labels):
        self.labels.update(labels)

    async def read_flow_run(self, run_id):
        self.reads += 1
        self.answer(self.labels, self.reads)
        return SimpleNamespace(labels=dict(self.labels))


def _leader(answer):
    """The leader's part over a worker of just what it reads: its name, a client, and its notes."""
    from prefect_launch.workers.cluster.lifecycle import ClusterRuns

    notes: list = []
    worker = SimpleNamespace(name="a", client=_Labels(answer), notes=notes, work_pool=SimpleNamespace(id=uuid4()),
                             _logger=__import__("logging").getLogger("test-leader"),
                             _note=lambda *args, **kwargs: notes.append(kwargs.get("message") or args))

    ledger = Ledger(Resources(cpu=2, memory=4 * GIB, gpu=1))
    alloc = ledger.try_allocate_cluster("r", Resources(cpu=1, memory=GIB, gpu=1), 3, ranks=[0])
    alloc.remote_members = {"sub1": "b", "sub2": "c"}
    return ClusterRuns(worker), alloc


def test_leader_starts_only_when_every_other_agent_said_ok_and_gives_up_on_a_no(monkeypatch):
    from prefect_launch.workers.cluster.lifecycle import ClusterAborted
    from prefect_launch.workers.cluster.protocol import ack_key, plan_of

    def all_ok(labels, reads):
        if reads >= 2:
            labels.update({ack_key("b"): "ok", ack_key("c"): "ok"})

    emitted: list = []  # the plan's event (a real emit would need a Prefect server: the e2e tests have one)
    monkeypatch.setattr("prefect.events.emit_event", lambda **kw: emitted.append(kw))
    leader, alloc = _leader(all_ok)
    asyncio.run(leader.gather(SimpleNamespace(id="r"), alloc, 4242))
    assert [(e["event"], e["payload"]["followers"]) for e in emitted] == [("launch.cluster.planned", ["b", "c"])]
    plan = plan_of(leader.w.client.labels)
    assert plan.members == {"main1": "a", "sub1": "b", "sub2": "c"} and plan.port == 4242
    assert any("started their members" in str(n) for n in leader.w.notes)

    def c_refuses(labels, reads):
        labels.update({ack_key("b"): "ok", ack_key("c"): "no: agent c has gpu=0 free"})

    leader, alloc = _leader(c_refuses)
    with pytest.raises(ClusterAborted, match="agent c said agent c has gpu=0 free"):
        asyncio.run(leader.gather(SimpleNamespace(id="r"), alloc, 4242))

    monkeypatch.setenv("LAUNCH_CLUSTER_ACK_SECONDS", "0.5")
    leader, alloc = _leader(lambda labels, reads: labels.update({ack_key("b"): "ok"}))
    with pytest.raises(ClusterAborted, match=r"no answer from agent\(s\) c in 0.5 s"):
        asyncio.run(leader.gather(SimpleNamespace(id="r"), alloc, 4242))


def test_a_restarted_follower_adopts_only_live_runs_it_had_answered():
    from prefect_launch.workers.cluster.protocol import (ClusterPlan, booking_key, decide_followed, run_of_booking)

    plan = ClusterPlan(leader="a", port=1234, size=3, members={"main1": "a", "sub1": "b", "sub2": "b"})
    rid = str(uuid4())
    assert run_of_booking(booking_key(rid)) == rid and run_of_booking(rid) is None
    assert decide_followed("RUNNING", plan, "b", "ok", ["sub1", "sub2"]) == ("adopt", "member(s) sub1, sub2 still running")
    assert decide_followed("PENDING", plan, "b", "ok", [])[0] == "adopt"  # the exit files decide
    for state, p, ack, why in (
            (None, plan, "ok", "gone from the server"), ("COMPLETED", plan, "ok", "the run is completed"),
            ("SCHEDULED", plan, "ok", "the run is scheduled"), ("RUNNING", None, "ok", "no longer names this agent"),
            ("RUNNING", plan.model_copy(update={"members": {"main1": "a", "sub1": "c", "sub2": "c"}}), "ok",
             "no longer names this agent"),
            ("PENDING", plan, None, "had not answered"), ("PENDING", plan, "no: full", "had not answered")):
        action, reason = decide_followed(state, p, "b", ack, ["sub1"])
        assert action == "stop" and why in reason, (state, reason)


def test_adopted_members_read_their_exit_status_from_their_exit_file(tmp_path):
    """A member not started by this agent's life: alive while it runs; then its recorded exit code, or no
    exit status when it was killed and left none."""
    import subprocess
    import sys
    import time

    from prefect_launch.workers.cluster.member import record_exit
    from prefect_launch.workers.cluster.process import (MEMBER_MODULE, NO_EXIT_STATUS, adopt_members, describe_exit,
                                                        exit_file)
    from prefect_launch.workers.scheduling.ledger import MemberAlloc

    run_id = str(uuid4())
    log_of = lambda m: tmp_path / f"{run_id}.{m}.log"  # noqa: E731
    members = [MemberAlloc(rank=i, name=n, resources=Resources(cpu=1, memory=GIB)) for i, n in ((1, "sub1"), (2, "sub2"))]
    env = lambda n: {**os.environ, "LAUNCH_CLUSTER_MEMBER": n, "LAUNCH_MEMBER_EXIT_FILE": str(exit_file(log_of(n)))}  # noqa: E731
    code = "import sys, time; from prefect_launch.workers.cluster.member import record_exit; time.sleep(float(sys.argv[1])); record_exit(3)"
    p1 = subprocess.Popen([sys.executable, "-c", code, "1.5", MEMBER_MODULE, run_id], env=env("sub1"), start_new_session=True)
    p2 = subprocess.Popen([sys.executable, "-c", code, "60", MEMBER_MODULE, run_id], env=env("sub2"), start_new_session=True)
    try:
        time.sleep(0.5)
        procs = adopt_members(run_id, members, log_of)
        assert [s.name for s in procs.alive()] == ["sub1", "sub2"] and procs.first_failure() is None
        p1.wait(timeout=30)
        os.killpg(p2.pid, 9)
        p2.wait(timeout=10)
        assert procs.alive() == [] and procs.first_failure() == ("sub1", 3)
        assert procs.subs[1].proc.poll() == NO_EXIT_STATUS and "killed by a signal" in describe_exit(NO_EXIT_STATUS)
        procs.forget_files()
        assert not exit_file(log_of("sub1")).exists()
        # a member that is gone before the agent looks: its file alone tells how it ended
        os.environ["LAUNCH_MEMBER_EXIT_FILE"] = str(exit_file(log_of("sub1")))
        try:
            record_exit(0)
        finally:
            del os.environ["LAUNCH_MEMBER_EXIT_FILE"]
        again = adopt_members(run_id, members[:1], log_of)
        assert again.alive() == [] and again.first_failure() is None and again.subs[0].proc.poll() == 0
    finally:
        for p in (p1, p2):
            p.kill()


def test_the_plan_event_names_the_run_its_pool_and_the_followers():
    from prefect_launch.workers.cluster.protocol import PLANNED_EVENT, ClusterPlan, planned_event

    plan = ClusterPlan(leader="a", port=29500, size=3, members={"main1": "a", "sub1": "b", "sub2": "c"})
    kw = planned_event("run-1", "pool-9", plan)
    assert kw["event"] == PLANNED_EVENT == "launch.cluster.planned"
    assert kw["resource"] == {"prefect.resource.id": "prefect.flow-run.run-1"}
    # the followers' subscription filters on the pool as a related resource in the role "work-pool"
    assert kw["related"] == [{"prefect.resource.id": "prefect.work-pool.pool-9", "prefect.resource.role": "work-pool"}]
    assert kw["payload"]["followers"] == ["b", "c"] and kw["payload"]["leader"] == "a"
    from prefect.events import Event  # Prefect takes it as an event (the names' shapes are its own)
    Event(id=__import__("uuid").uuid4(), occurred=datetime.now(timezone.utc), **kw)


class _LossyLabels:
    """Prefect's label merge under two writers at once: the first ``lose`` writes are undone by another's."""

    def __init__(self, labels, lose):
        self.labels, self.lose, self.writes = dict(labels), lose, 0

    async def update_flow_run_labels(self, run_id, labels):
        self.writes += 1
        if self.writes > self.lose:
            self.labels.update(labels)

    async def read_flow_run(self, run_id):
        return SimpleNamespace(labels=dict(self.labels))


def test_a_followers_answer_undone_by_another_label_write_is_written_again_while_its_plan_stands(monkeypatch):
    from prefect_launch.workers.cluster import follow
    from prefect_launch.workers.cluster.protocol import ClusterPlan, ack_key

    monkeypatch.setattr(follow.random, "uniform", lambda a, b: 0.0)
    plan = ClusterPlan(leader="a", port=1, size=2, members={"main1": "a", "sub1": "b"})

    def follower(client):
        worker = SimpleNamespace(name="b", client=client, _logger=__import__("logging").getLogger("test-follower"))
        return follow.ClusterFollower(worker)

    client = _LossyLabels(plan.label(), lose=2)
    asyncio.run(follower(client).answer(SimpleNamespace(id="r"), "ok", plan))
    assert client.labels[ack_key("b")] == "ok" and client.writes == 3  # two lost, the third kept

    other = ClusterPlan(leader="c", port=2, size=2, members={"main1": "c", "sub1": "b"})
    client = _LossyLabels(other.label(), lose=10)  # the run was re-planned meanwhile: this answer is moot
    asyncio.run(follower(client).answer(SimpleNamespace(id="r"), "ok", plan))
    assert client.writes == 1 and ack_key("b") not in client.labels

    client = _LossyLabels(plan.label(), lose=100)  # never kept: gives up after ANSWER_TRIES writes
    asyncio.run(follower(client).answer(SimpleNamespace(id="r"), "ok", plan))
    assert client.writes == follow.ANSWER_TRIES
