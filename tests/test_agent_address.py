"""The address an agent publishes for its cluster members (issue 41 §2), and how multi-node members use it (pure).

The end-to-end check, agents in network namespaces with their own addresses, is test_hosts_e2e.py."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from prefect_launch.workers.agent.address import agent_address, bind_host, check_address, detect_address
from prefect_launch.workers.agent.registry import TAG, AgentState, _agents_of
from prefect_launch.workers.cluster.env import member_env
from prefect_launch.workers.cluster.protocol import ClusterPlan, plan_of
from prefect_launch.workers.scheduling.ledger import Ledger
from prefect_launch.workers.scheduling.resources import Resources

GIB = 1024 ** 3


@pytest.mark.parametrize("api_url, want", [
    ("http://127.0.0.1:4200/api", "127.0.0.1"),  # a server on this host's loopback: members stay on it
    ("http://localhost:4200/api", "127.0.0.1"),
    ("", "127.0.0.1"),
    (None, "127.0.0.1"),
])
def test_the_detected_address_is_the_route_source_to_the_server(api_url, want):
    assert detect_address(api_url) == want


def test_a_server_elsewhere_gives_the_source_address_of_the_route_to_it():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.10", 80))  # TEST-NET-1: only a route lookup, nothing is sent
        except OSError:
            pytest.skip("no route to a non-local address on this machine")
        want = s.getsockname()[0]
    assert detect_address("http://192.0.2.10:4200/api") == want != "0.0.0.0"


def test_advertise_address_wins_and_is_checked():
    assert agent_address("10.1.2.3", api_url="http://127.0.0.1:1/api") == "10.1.2.3"
    assert agent_address(" gpu-box-7.lab ", api_url="http://127.0.0.1:1/api") == "gpu-box-7.lab"
    assert agent_address(None, api_url="http://127.0.0.1:1/api") == "127.0.0.1"
    with pytest.raises(ValueError, match="neither an IP address nor a host name"):
        check_address("10.0.0.1:80")


def test_a_rendezvous_binds_the_address_when_it_is_this_hosts_else_every_address():
    assert bind_host("127.0.0.1") == "127.0.0.1"
    assert bind_host("203.0.113.9") == "0.0.0.0"  # advertised (NAT), not on this host


def test_agent_state_carries_the_address_and_reads_states_published_before_it():
    now = datetime.now(timezone.utc)
    new = AgentState(name="a", queues=["q"], capacity=Resources(cpu=1), free=Resources(cpu=1), heartbeat=now,
                     address="10.77.0.2")
    old = new.model_dump(mode="json")
    old.pop("address")
    old["name"] = "b"
    var = lambda v: SimpleNamespace(tags=[TAG], value=v)  # noqa: E731
    got = {a.name: a.address for a in _agents_of([var(new.model_dump(mode="json")), var(old)])}
    assert got == {"a": "10.77.0.2", "b": None}


def test_multi_node_members_get_each_members_host_address():
    plan = ClusterPlan(leader="a", port=29500, size=3, members={"main1": "a", "sub1": "b", "sub2": "c"},
                       addrs={"a": "10.77.0.2", "b": "10.77.0.3"})
    assert plan_of(plan.label()) == plan  # the addresses travel in the run's plan label
    assert plan.member_addrs() == {"main1": "10.77.0.2", "sub1": "10.77.0.3", "sub2": "127.0.0.1"}  # c: none
    ledger = Ledger(Resources(cpu=2, memory=4 * GIB, gpu=1))
    alloc = ledger.try_allocate_cluster("r", Resources(cpu=1, memory=GIB, gpu=1), 3, ranks=[1])
    env = member_env(alloc, alloc.members[0], "b", "multi-node", 29500, main_addr=plan.addr_of("main1"),
                     addrs=plan.member_addrs())
    assert (env["MASTER_ADDR"], env["LAUNCH_CLUSTER_MAIN_ADDR"], env["MASTER_PORT"]) == ("10.77.0.2",) * 2 + ("29500",)
    assert env["LAUNCH_CLUSTER_ADDRS"] == "10.77.0.2,10.77.0.3,127.0.0.1" and env["RANK"] == "1"
    # a plan written before agents published addresses (no "addrs"): every member on the loopback
    legacy = ClusterPlan.model_validate({"leader": "a", "port": 1, "size": 2, "members": {"main1": "a", "sub1": "b"}})
    assert legacy.member_addrs() == {"main1": "127.0.0.1", "sub1": "127.0.0.1"}


def test_the_leader_puts_its_own_and_the_other_agents_published_addresses_in_the_plan():
    from prefect_launch.workers.cluster.lifecycle import ClusterRuns

    now = datetime.now(timezone.utc)
    states = [AgentState(name=n, queues=["q"], capacity=Resources(cpu=1), free=Resources(cpu=1), heartbeat=now,
                         address=addr).model_dump(mode="json")
              for n, addr in (("b", "10.77.0.3"), ("c", None), ("z", "10.77.0.9"))]

    class Client:
        async def read_variables(self):
            return [SimpleNamespace(tags=[TAG], value=v) for v in states]

    leader = ClusterRuns(SimpleNamespace(name="a", client=Client(), agent=SimpleNamespace(address="10.77.0.2")))

    ledger = Ledger(Resources(cpu=2, memory=4 * GIB, gpu=1))
    alloc = ledger.try_allocate_cluster("r", Resources(cpu=1, memory=GIB, gpu=1), 3, ranks=[0])
    alloc.remote_members = {"sub1": "b", "sub2": "c"}
    assert asyncio.run(leader.addresses(alloc)) == {"a": "10.77.0.2", "b": "10.77.0.3"}


def test_the_leader_counts_an_agent_lost_only_when_its_beat_stops_while_the_leader_itself_is_heard():
    from prefect_launch.workers.cluster.protocol import BeatWatch, beat_key

    w = BeatWatch(["b", "c"], lost_s=20, now=0.0)
    assert w.lost({}, 10.0) == []
    assert w.lost({beat_key("b"): "1-1"}, 15.0) == []  # b beats; c has not yet
    assert w.lost({beat_key("b"): "1-2"}, 21.0) == ["c"]  # c silent for 20 s
    w = BeatWatch(["b"], lost_s=20, now=0.0)
    w.lost({beat_key("b"): "1-1"}, 1.0)
    w.blind()  # the leader could not read the run for a while (its own link down)
    assert w.lost({beat_key("b"): "1-1"}, 60.0) == []  # b's clock starts again
    assert w.lost({beat_key("b"): "1-1"}, 79.0) == [] and w.lost({beat_key("b"): "1-1"}, 80.5) == ["b"]
    # the leader's read retried across a 40-s outage (the server restarting): b's own writes were retrying
    # across it too, with Prefect's back-off, so b gets those 40 s on top of its 20
    w = BeatWatch(["b"], lost_s=20, now=0.0)
    w.blind(40.0)
    assert w.lost({beat_key("b"): "1-1"}, 50.0) == []
    assert w.lost({beat_key("b"): "1-1"}, 109.0) == [] and w.lost({beat_key("b"): "1-1"}, 110.5) == ["b"]
    w.blind(600.0)  # at most 60 s on top, however long the outage
    assert w.lost({beat_key("b"): "1-1"}, 200.0) == [] and w.lost({beat_key("b"): "1-1"}, 280.5) == ["b"]
