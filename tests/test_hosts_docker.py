"""Docker queues across hosts (issue 41 §2): a multi-node run whose member containers run on two hosts.

Each of two network-namespace hosts (tests/netns_hosts.py) runs a ``dockerd`` of its own inside its namespace
(tests/docker_env.py ``host_dockerd``: own data root and socket; the base image copied in from the suite's
daemon, as no registry is reachable) and an agent of a docker queue pointed at it. A 2-member multi-node
all-reduce (flows/allreduce.py) puts main1 in a container on one host and sub1 in a container on the other,
each on its host's network (host networking: the container's network namespace is its host's), each started
by its own host's daemon and limited to one member's share; MASTER_ADDR is main1's host address, the
collective crosses the bridge and gives the right sum; every agent ends with its GPU free and no member
container left on either daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

import netns_hosts as N
from docker_env import copy_image, host_dockerd
from fixtures_hosts import netns_hosts, prefect_server_hosts  # noqa: F401
from launch_helpers import CLI, cli_json, wait_agent_free, wait_agent_online, wait_final, wait_for
from prefect_launch.local_server import background_process
from test_docker_backend import MiB
from test_docker_backend import docker_client, docker_host, image  # noqa: F401  # session fixtures
from test_docker_cluster import _allreduce_on_docker, _run_containers

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]
HOSTS = 2  # netns_hosts: two hosts, one dockerd and one agent each


def _netns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def _docker_agent(host: N.Host, docker_url: str, queue: str, name: str, log_dir: Path):
    """An agent of ``queue`` inside ``host``, its docker back end talking to the host's own daemon."""
    args = N.host_agent_args(host, ["env", f"DOCKER_HOST={docker_url}", *CLI], [queue], name,
                             "cpu=1,memory=2Gi,gpu=1")
    with background_process(args, log_dir / f"agent-{name}.log") as proc:
        yield proc


def test_a_docker_multi_node_run_puts_its_member_containers_on_two_hosts(
        prefect_server_hosts, docker_client, docker_host, image, tmp_path: Path, unique_name: str):  # noqa: F811
    import docker

    hosts = prefect_server_hosts["hosts"]
    name = f"dkh-{unique_name}"
    out = tmp_path / "out"
    job = _allreduce_on_docker(tmp_path, name, image, out)
    agents = [f"{name}-0", f"{name}-1"]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(host_dockerd(h.exec)) for h in hosts]
        for url in urls:
            copy_image(image, docker_host, url)
        daemons = [stack.enter_context(contextlib.closing(docker.DockerClient(base_url=u, timeout=120))) for u in urls]
        for h, url, agent in zip(hosts, urls, agents):
            stack.enter_context(_docker_agent(h, url, name, agent, tmp_path))
        for agent in agents:
            wait_agent_online(agent, [name], timeout=240)
        shown = {a["name"]: a for a in cli_json("agent", "ls")}
        assert [shown[a]["address"] for a in agents] == [h.addr for h in hosts], shown

        def tail() -> str:
            return "\n".join((tmp_path / f"agent-{a}.log").read_text()[-2000:] for a in agents)

        run_id = cli_json("submit", job, "--cluster-size", "2", "--cluster-mode", "multi-node",
                          "--param", f"out_dir={out}", "--param", "hold_s=4")["run_ids"][0]
        # each daemon runs one member's container: main1 on the leader's host, sub1 on the other

        def running() -> list | None:
            found = [_run_containers(d, run_id) for d in daemons]
            return found if all(f and all(c.status == "running" for c in f.values()) for f in found) else None

        found = wait_for(running, 240, tail)
        member_host = {}
        for h, containers in zip(hosts, found):
            assert len(containers) == 1, containers
            (member, c), = containers.items()
            c.reload()
            hc = c.attrs["HostConfig"]
            assert hc["Memory"] == 256 * MiB and hc["NanoCpus"] == int(0.5e9) and hc["NetworkMode"] == "host"
            # its processes are on this host's network (the members hold 4 s: it still runs)
            assert _netns_of(c.attrs["State"]["Pid"]) == h.name, (member, h.name, c.attrs["State"])
            member_host[member] = h
        assert sorted(member_host) == ["main1", "sub1"], member_host
        assert not _run_containers(docker_client, run_id)  # nothing ran on the suite's own daemon

        (run,) = wait_final([run_id], timeout=240)
        assert run.state_name == "Completed", (run.state.message, tail())
        recs = {p.name[len(run_id) + 1:-5]: json.loads(p.read_text()) for p in out.glob(f"{run_id}-*.json")
                if not p.name.endswith(".started.json")}
        assert sorted(recs) == ["main1", "sub1"], recs
        assert all(r["ok"] and r["sum"] == [3.0, 6.0, 9.0, 12.0] for r in recs.values()), recs
        main_addr = member_host["main1"].addr
        for member, r in recs.items():
            assert r["env"]["MASTER_ADDR"] == main_addr, (member, r["env"])
            assert r["env"]["LAUNCH_CLUSTER_ADDRS"] == f"{main_addr},{member_host['sub1'].addr}", r["env"]
        assert {r["env"]["LAUNCH_AGENT"] for r in recs.values()} == set(agents)
        for agent in agents:
            wait_agent_free(agent, 1, timeout=120)
        wait_for(lambda: not any(_run_containers(d, run_id) for d in daemons), 60,
                 lambda: f"member containers left: {[list(_run_containers(d, run_id)) for d in daemons]}")
