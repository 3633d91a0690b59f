"""Pure rules of issue 12: preemption victims, fair share and quotas, all-or-nothing placement. No servers."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from prefect_launch.workers.scheduling.fair_share import Quota, dominant_share, drf_order, over_quota
from prefect_launch.workers.cluster.fit import cluster_plan, member_names
from prefect_launch.workers.scheduling.preemption import Holder, choose_victims
from prefect_launch.workers.scheduling.resources import Resources

T0 = datetime(2026, 11, 30, 12, tzinfo=timezone.utc)
GI = 2**30


def R(cpu=0.0, mem=0, gpu=0) -> Resources:
    return Resources(cpu=cpu, memory=mem, gpu=gpu)


def H(rid, gpu=1, minutes=0, pre=True, stopping=False, cpu=1.0):
    return Holder(run_id=rid, resources=R(cpu, GI, gpu), preemptible=pre, started=T0 + timedelta(minutes=minutes),
                  stopping=stopping)


# ------------------------------------------------------------------ preemption
NO_GPU_FREE = R(4, 8 * GI, 0)


def fewest_then_newest():
    return [H("old2", gpu=2, minutes=0), H("mid", gpu=1, minutes=5), H("new", gpu=1, minutes=9)]


def preemptible_and_regular():
    return [H("p", minutes=1), H("reg", pre=False, minutes=9)]


def one_already_stopping():
    return [H("going", stopping=True, minutes=9), H("other", minutes=1)]


@pytest.mark.parametrize("need,free,holders,kw,victims", [
    pytest.param(R(1, GI, 1), R(2, 4 * GI, 1), [H("a")], {}, [], id="fits-already-preempts-nothing"),
    # one run freeing 2 GPUs beats two newer runs freeing 1 each (fewest first)
    pytest.param(R(1, GI, 2), NO_GPU_FREE, fewest_then_newest(), {}, ["old2"], id="fewest-first"),
    # needing one GPU: the newest one-GPU run goes
    pytest.param(R(1, GI, 1), NO_GPU_FREE, fewest_then_newest(), {}, ["new"], id="then-newest"),
    pytest.param(R(1, GI, 1), NO_GPU_FREE, preemptible_and_regular(), {"requester_preemptible": True}, None,
                 id="never-by-a-preemptible-run"),
    # two GPUs needed, only one preemptible GPU: preemption cannot make room, so nothing is preempted
    pytest.param(R(1, GI, 2), NO_GPU_FREE, preemptible_and_regular(), {}, None, id="never-a-regular-one"),
    pytest.param(R(1, GI, 1), NO_GPU_FREE, one_already_stopping(), {}, [],  # room is coming
                 id="runs-already-stopping-count"),
    pytest.param(R(1, GI, 2), NO_GPU_FREE, one_already_stopping(), {}, ["other"],
                 id="runs-already-stopping-are-not-picked-twice"),
    # a sweep of six 1-GPU trials
    pytest.param(R(1, GI, 3), NO_GPU_FREE, [H(f"t{i}", minutes=i) for i in range(6)], {}, ["t5", "t4", "t3"],
                 id="exactly-enough-not-more"),
])
def test_choose_victims(need, free, holders, kw, victims):
    assert choose_victims(need, free, holders, **kw) == victims


# ------------------------------------------------------------------ fair share
def test_drf_interleaves_a_flooding_owner():
    cap = R(8, 32 * GI, 4)
    items = [("alice", i) for i in range(6)] + [("bob", 0), ("bob", 1)]
    order = drf_order(items, owner_of=lambda x: x[0], request_of=lambda x: R(1, GI, 1), held={}, capacity=cap)
    owners = [o for o, _ in order]
    assert owners[:4] == ["alice", "bob", "alice", "bob"]
    assert [i for o, i in order if o == "alice"] == list(range(6))  # FIFO within an owner


def test_drf_counts_what_owners_hold():
    cap = R(8, 32 * GI, 4)
    held = {"alice": R(0, 0, 3)}
    order = drf_order([("alice", 0), ("bob", 0)], lambda x: x[0], lambda x: R(1, GI, 1), held, cap)
    assert order[0][0] == "bob"
    assert dominant_share(R(4, GI, 1), cap) == 0.5


def test_quota_reason():
    q = Quota(gpu=2)
    assert over_quota(R(0, 0, 1), R(1, GI, 1), q, "owner alice") is None
    why = over_quota(R(0, 0, 2), R(1, GI, 1), q, "owner alice")
    assert why and "owner alice is at its quota" in why and "gpu 2+1 > 2" in why
    assert over_quota(R(0, 0, 9), R(1, GI, 1), None, "x") is None


# --------------------------------------------------------- all or nothing
def test_single_node_all_or_nothing():
    free = {"a1": R(4, 8 * GI, 2), "a2": R(4, 8 * GI, 1)}
    p = cluster_plan(2, R(1, GI, 1), free, "single-node")
    assert [(m.name, m.agent, m.rank) for m in p.members] == [("main1", "a1", 0), ("sub1", "a1", 1)]
    p = cluster_plan(3, R(1, GI, 1), free, "single-node")  # 3 GPUs exist, but not on one agent
    assert not p.placed and "single-node" in p.reason and "2 member" in p.reason


def test_multi_node_spreads_and_waits_whole():
    free = {"a1": R(4, 8 * GI, 2), "a2": R(4, 8 * GI, 2)}
    p = cluster_plan(3, R(1, GI, 1), free, "multi-node")
    agents = [m.agent for m in p.members]
    assert sorted(set(agents)) == ["a1", "a2"] and len(agents) == 3
    p = cluster_plan(5, R(1, GI, 1), free, "multi-node")
    assert not p.placed and "fit 4 member" in p.reason
    assert member_names(3) == ["main1", "sub1", "sub2"]


def test_two_half_size_clusters_do_not_deadlock():
    """Room for one of two 2-member runs: the first is placed whole, the second waits holding nothing."""
    free = {"a1": R(4, 8 * GI, 2)}
    first = cluster_plan(2, R(1, GI, 1), free, "single-node")
    assert first.placed
    after = {"a1": R(2, 6 * GI, 0)}
    second = cluster_plan(2, R(1, GI, 1), after, "single-node")
    assert not second.placed and second.members == []


def test_quotas_count_what_other_agents_hold():
    from prefect_launch.workers.scheduling.dispatch import _quotas, held_elsewhere
    from prefect_launch.workers.scheduling.ledger import Allocation, Ledger
    from prefect_launch.workers.scheduling.queue_spec import QueueSpec

    placed = [("a1", Allocation(run_id="r1", resources=R(1, GI, 1), queue="q", owner="alice")),
              ("a2", Allocation(run_id="r2", resources=R(0.5, GI, 1), queue="q", owner="alice")),
              ("a2", Allocation(run_id="r3", resources=R(1, GI, 1), queue="other", owner="alice")),  # other queue
              ("me", Allocation(run_id="r4", resources=R(1, GI, 1), queue="q", owner="alice"))]  # in my ledger
    assert held_elsewhere(placed, "me", "q") == {"alice": R(1.5, 2 * GI, 2)}
    spec = QueueSpec.model_validate({"name": "q", "presets": {"g1": {"cpu": 1, "memory": "1Gi", "gpu": 1}},
                                     "default_preset": "g1", "owner_quota": {"gpu": 3}})
    ledger = Ledger(R(4, 8 * GI, 2))
    assert ledger.try_allocate("r4", R(1, GI, 1), queue="q", owner="alice") is not None
    quotas = _quotas(spec, ledger, "q", held_elsewhere(placed, "me", "q"))
    assert quotas.held["alice"].gpu == 3  # one here, two on the other agents
    assert over_quota(quotas.held["alice"], R(1, GI, 1), quotas.of("alice"), "owner alice")
    assert _quotas(spec, ledger, "q").held["alice"].gpu == 1  # what one agent alone would have counted


def test_how_a_queue_shares_and_what_each_owner_holds():
    from prefect_launch.dashboard.frames import pools_frame
    from prefect_launch.workers.scheduling.fair_share import owner_usage
    from prefect_launch.workers.scheduling.queue_spec import QueueSpec

    spec = QueueSpec.model_validate({"name": "q", "presets": {"g1": {"cpu": 1, "memory": "1Gi", "gpu": 1}},
                                     "default_preset": "g1", "fair_share": True, "owner_quota": {"gpu": 2},
                                     "owner_quotas": {"alice": {"gpu": 3, "memory": "8Gi"}}})
    assert spec.sharing_text() == "fair share (DRF) within a priority; owner quota gpu=2; alice: memory=8Gi gpu=3"
    plain = QueueSpec.model_validate({"name": "p", "presets": {"s": {"cpu": 1, "memory": "1Gi"}}, "default_preset": "s"})
    assert plain.sharing_text() == ""
    # the monitor reads it from the work pool's JSON
    pools = pools_frame([{"name": "q", "id": "1", "base_job_template": {"job_configuration": {"launch": spec.model_dump()}}},
                         {"name": "plain", "id": "2", "base_job_template": {}}])
    assert pools.set_index("queue")["sharing"].to_dict() == {"q": spec.sharing_text(), "plain": ""}

    def quota_of(owner):
        q = spec.quota_for(owner)
        return (q.resources(), q.describe()) if q else None

    runs = [("alice", R(1, GI, 1)), ("alice", R(1, GI, 1)), ("bob", R(1, GI, 1)), ("bob", R(1, GI, 1)), (None, R(0.5, GI, 0))]
    got = {u.owner: u for u in owner_usage(runs, R(8, 16 * GI, 4), quota_of, smallest=R(1, GI, 1))}
    assert (got["alice"].runs, got["alice"].held.gpu, got["alice"].dominant_share) == (2, 2, 0.5)
    assert got["alice"].quota == "memory=8Gi gpu=3" and not got["alice"].at_quota  # a third GPU fits her own quota
    assert got["bob"].quota == "gpu=2" and got["bob"].at_quota  # the default quota: his next run waits
    assert got["(none)"].runs == 1 and got["(none)"].dominant_share == 0.0625 and not got["(none)"].at_quota
