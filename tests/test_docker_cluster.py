"""Cluster runs on a docker queue (single-node), against a real dockerd: one container per member.

A 3-member all-reduce (flows/allreduce.py) computes the right sum with each member in its own
container, limited to one member's share (read back with docker inspect while it runs), on host
networking with the rendezvous env of the process back end; the members' containers are gone once
the run ends. A sub member's container killed mid-run fails the run naming it, stops main1, removes
every member container and gives all capacity back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import os
from pathlib import Path

import pytest

from launch_helpers import ROOT, apply_queue, cli_json, wait_agent_free, wait_final, wait_for
from prefect_launch.workers.cluster.docker import MEMBER_LABEL
from prefect_launch.workers.agent.tags import RUN_ID_LABEL
from test_docker_backend import MiB, agent
from test_docker_backend import docker_client, docker_host, image  # noqa: F401  # session fixtures

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.timeout(1500)]
PRESETS = {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}}


def _allreduce_on_docker(tmp: Path, name: str, image: str, out: Path) -> str:
    q = apply_queue(tmp, {"name": name, "target": "docker", "image": image, "presets": PRESETS,
                          "default_preset": "g1"})
    out.mkdir(parents=True, exist_ok=True)
    flows = str(ROOT / "flows")
    variables = {"image": image, "volumes": [f"{flows}:{flows}:ro", f"{out}:{out}"], "stream_output": False}
    code = ("from prefect import flow\n"
            f"flow.from_source(source={flows!r}, entrypoint='allreduce.py:allreduce').deploy(name={name!r}, "
            f"work_pool_name={q!r}, work_queue_name='medium', build=False, push=False, image={image!r}, "
            f"print_next_steps=False, job_variables={variables!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=os.environ.copy(), timeout=120)
    return f"allreduce/{name}"


def _run_containers(client, run_id: str) -> dict[str, object]:
    """The run's containers by member: main1 is the run's own container (no member label)."""
    found = client.containers.list(all=True, filters={"label": f"{RUN_ID_LABEL}={run_id}"})
    return {c.labels.get(MEMBER_LABEL, "main1"): c for c in found}


def test_docker_cluster_all_reduces_in_one_container_per_member_then_a_killed_member_fails_the_run(
        tmp_path: Path, unique_name: str, docker_client, image: str):  # noqa: F811
    name = f"dkc-{unique_name}"
    out = tmp_path / "out"
    job = _allreduce_on_docker(tmp_path, name, image, out)
    log = tmp_path / f"agent-{name}.log"
    with agent([name], name, "cpu=2,memory=4Gi,gpu=3", tmp_path):
        run_id = cli_json("submit", job, "--cluster-size", "3", "--param", f"out_dir={out}",
                          "--param", "hold_s=4")["run_ids"][0]
        members = wait_for(lambda: (lambda m: m if len(m) == 3 else None)(_run_containers(docker_client, run_id)),
                        120, lambda: log.read_text()[-3000:])
        assert sorted(members) == ["main1", "sub1", "sub2"]
        for c in members.values():
            c.reload()
            hc = c.attrs["HostConfig"]
            assert hc["Memory"] == 256 * MiB and hc["NanoCpus"] == int(0.5e9)  # one member's share, not the sum
            assert hc["NetworkMode"] == "host"
        assert members["sub1"].name == f"launch-{run_id}-sub1"
        (run,) = wait_final([run_id], timeout=240)
        assert run.state_name == "Completed", run.state.message
        recs = {p.name[len(run_id) + 1:-5]: json.loads(p.read_text()) for p in out.glob(f"{run_id}-*.json")
                if not p.name.endswith(".started.json")}
        assert sorted(recs) == ["main1", "sub1", "sub2"], recs
        assert all(r["ok"] and r["sum"] == [6.0, 12.0, 18.0, 24.0] for r in recs.values()), recs
        assert sorted(r["rank"] for r in recs.values()) == [0, 1, 2]
        assert sorted(r["env"]["CUDA_VISIBLE_DEVICES"] for r in recs.values()) == ["0", "1", "2"]
        wait_agent_free(name, 3, timeout=120)
        wait_for(lambda: not _run_containers(docker_client, run_id), 60,
              lambda: f"member containers left: {list(_run_containers(docker_client, run_id))}")
        # the run's figures per member container (their sum is the run's), each on its own GPU
        shown = wait_for(lambda: (lambda s: s if (s.get("cluster") or {}).get("members") else None)(
            cli_json("runs", "show", run_id)), 30, lambda: "no per-member figures")
        per = {m["member"]: m for m in shown["cluster"]["members"]}
        assert sorted(per) == ["main1", "sub1", "sub2"] and all(m["samples"] >= 1 for m in per.values()), per
        assert sorted(tuple(m["gpu_indices"]) for m in per.values()) == [(0,), (1,), (2,)]

        # a sub member's container dies: the run fails naming it, main1 is stopped, all capacity comes back
        doomed = cli_json("submit", job, "--cluster-size", "3", "--param", f"out_dir={out}",
                          "--param", "hold_s=60")["run_ids"][0]
        wait_for(lambda: len(list(out.glob(f"{doomed}-*.started.json"))) == 3, 120, lambda: log.read_text()[-3000:])
        _run_containers(docker_client, doomed)["sub1"].kill()
        (run,) = wait_final([doomed], timeout=120)
        assert run.state_name == "Failed" and "member sub1" in run.state.message, run.state.message
        wait_agent_free(name, 3, timeout=120)
        wait_for(lambda: not _run_containers(docker_client, doomed), 60,
              lambda: f"containers left: {list(_run_containers(docker_client, doomed))}")


def test_docker_multi_node_run_spreads_its_member_containers_over_two_agents(
        tmp_path: Path, unique_name: str, docker_client, image: str):  # noqa: F811
    """Two agents with one GPU each serve one docker queue: a 2-member multi-node all-reduce puts main1 in a
    container of the agent that placed it and sub1 in a container of the other, both limited to one
    member's share; the sum is right, and both agents end with their GPU free and no container left."""
    from prefect_launch.workers.agent.tags import AGENT_LABEL

    name = f"dkm-{unique_name}"
    out = tmp_path / "out"
    job = _allreduce_on_docker(tmp_path, name, image, out)
    a, b = f"{name}-a", f"{name}-b"
    with agent([name], a, "cpu=1,memory=2Gi,gpu=1", tmp_path), agent([name], b, "cpu=1,memory=2Gi,gpu=1", tmp_path):
        run_id = cli_json("submit", job, "--cluster-size", "2", "--cluster-mode", "multi-node",
                          "--param", f"out_dir={out}", "--param", "hold_s=4")["run_ids"][0]
        members = wait_for(lambda: (lambda m: m if len(m) == 2 else None)(_run_containers(docker_client, run_id)),
                           180, lambda: (tmp_path / f"agent-{a}.log").read_text()[-2000:]
                           + (tmp_path / f"agent-{b}.log").read_text()[-2000:])
        assert sorted(members) == ["main1", "sub1"]
        for c in members.values():
            c.reload()
            hc = c.attrs["HostConfig"]
            assert hc["Memory"] == 256 * MiB and hc["NanoCpus"] == int(0.5e9) and hc["NetworkMode"] == "host"
        hosts = {m: c.labels.get(AGENT_LABEL) for m, c in members.items()}
        assert set(hosts.values()) == {a, b}, hosts  # one member on each agent
        (run,) = wait_final([run_id], timeout=240)
        assert run.state_name == "Completed", run.state.message
        recs = {p.name[len(run_id) + 1:-5]: json.loads(p.read_text()) for p in out.glob(f"{run_id}-*.json")
                if not p.name.endswith(".started.json")}
        assert sorted(recs) == ["main1", "sub1"], recs
        assert all(r["ok"] and r["sum"] == [3.0, 6.0, 9.0, 12.0] for r in recs.values()), recs
        assert {r["env"]["LAUNCH_AGENT"] for r in recs.values()} == {a, b}
        assert {r["env"]["LAUNCH_CLUSTER_MODE"] for r in recs.values()} == {"multi-node"}
        wait_agent_free(a, 1, timeout=120)
        wait_agent_free(b, 1, timeout=120)
        wait_for(lambda: not _run_containers(docker_client, run_id), 60,
                 lambda: f"member containers left: {list(_run_containers(docker_client, run_id))}")
