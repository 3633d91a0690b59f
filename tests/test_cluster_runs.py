"""Cluster runs end to end (issue 12 §1, process queue, single-node): a real server, a real agent, real
member processes. One agent (3 declared GPUs) serves the three tests in turn:

- a 3-member all-reduce over TCP (flows/allreduce.py) computes the right sum; each member got its own
  rank, GPU and the shared rendezvous;
- all-or-nothing placement: with room for one of two 2-member runs, the second waits with the cluster reason and
  holds nothing (the agent shows 1 GPU free and only the first run), then runs;
- a SIGKILLed sub member fails the run (the reason names it and its exit code), the other members are
  stopped, all capacity comes back and the next cluster run is placed; cancelling that one stops all
  its members and frees the capacity again.

A fourth test starts two agents of one GPU each on a queue of its own: a 2-member multi-node run places
main1 on one and sub1 on the other (they agree through the run's labels) and the all-reduce completes;
then sub1 of a second one is killed: the run fails naming it, main1 on the other agent is stopped, both
agents are free again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest

from launch_helpers import (ROOT, _agents, agent, apply_queue, cli, cli_json, read_runs, wait_agent_free,
                            wait_agent_online, wait_final)

PRESETS = {"g1": {"cpu": 0.5, "memory": "256Mi", "gpu": 1}}


def _allreduce_queue(tmp: Path, prefix: str) -> tuple[str, str]:
    """A fresh queue (``prefix``-<random>) with the all-reduce job deployed as ``allreduce/<name>``."""
    import prefect.context
    from prefect import flow

    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    q = apply_queue(tmp, {"name": name, "presets": PRESETS, "default_preset": "g1"})
    prefect.context.refresh_global_settings_context()
    flow.from_source(source=str(ROOT / "flows"), entrypoint="allreduce.py:allreduce").deploy(
        name=name, work_pool_name=q, work_queue_name="medium", build=False, push=False, print_next_steps=False)
    return name, q


@pytest.fixture(scope="module")
def cluster_env(prefect_server, tmp_path_factory):
    """Queue, the all-reduce job and one agent with 3 GPUs, shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("cluster")
    name, q = _allreduce_queue(tmp, "cl")
    with agent([q], name, "cpu=2,memory=4Gi,gpu=3", tmp):
        yield {"queue": q, "job": f"allreduce/{name}", "agent": name, "tmp": tmp}


def _submit(env: dict, out: Path, size: int, hold_s: float = 0.0) -> str:
    return cli_json("submit", env["job"], "--cluster-size", str(size), "--param", f"out_dir={out}",
                    "--param", f"hold_s={hold_s}")["run_ids"][0]


def _records(out: Path, run_id: str) -> dict[str, dict]:
    return {p.name[len(run_id) + 1:-len(".json")]: json.loads(p.read_text())
            for p in out.glob(f"{run_id}-*.json") if not p.name.endswith(".started.json")}


def _agent_state(name: str) -> dict:
    return {a["name"]: a for a in _agents()}[name]


@pytest.mark.timeout(180)
def test_three_members_all_reduce_to_the_right_sum(cluster_env):
    out = cluster_env["tmp"] / "sum"
    dry = cli("submit", cluster_env["job"], "--cluster-size", "3", "--param", f"out_dir={out}", "--dry-run").stdout
    assert "cluster: 3 members (single-node): main1, sub1, sub2" in dry
    run_id = _submit(cluster_env, out, 3)
    [run] = wait_final([run_id], timeout=150)
    assert run.state_name == "Completed", run.state.message
    recs = _records(out, run_id)
    assert sorted(recs) == ["main1", "sub1", "sub2"]
    assert all(r["ok"] and r["sum"] == [6.0, 12.0, 18.0, 24.0] for r in recs.values()), recs
    assert sorted(r["rank"] for r in recs.values()) == [0, 1, 2]
    envs = [r["env"] for r in recs.values()]
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "1", "2"]  # one GPU each, disjoint
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({r["pid"] for r in recs.values()}) == 3
    shown = cli_json("runs", "show", run_id)["cluster"]
    assert shown["size"] == 3 and shown["mode"] == "single-node" and "sub2: gpus" in shown["placement"]


@pytest.mark.timeout(180)
def test_cluster_waits_for_room_and_holds_nothing_meanwhile(cluster_env):
    out = cluster_env["tmp"] / "cluster"
    # the first holds its GPUs 12 s: time enough, on a loaded box, to see the second wait with its reason
    first = _submit(cluster_env, out, 2, hold_s=12)
    second = _submit(cluster_env, out, 2)
    deadline, seen, ok = time.time() + 60, None, False
    while time.time() < deadline and not ok:
        runs = {str(r.id): r for r in read_runs([first, second])}
        reason = (runs[second].labels or {}).get("launch.waiting", "")
        if runs[first].state_name == "Running" and "cluster of 2" in reason:
            state = _agent_state(cluster_env["agent"])  # published within ~1 s of a change
            seen = (reason, runs[second].state_name, state["free"]["gpu"], [r["run_id"] for r in state["runs"]])
            ok = ("nothing is held while it waits" in reason and "room for 1 member(s)" in reason
                  and seen[1:] == ("Queued", 1, [first]))  # the spare GPU is not held by the waiting cluster run
        time.sleep(0.5)
    assert ok, f"the second cluster run never waited holding nothing (reason, state, free GPUs, runs): {seen}"
    runs = {str(r.id): r for r in wait_final([first, second], timeout=150)}
    assert all(r.state_name == "Completed" for r in runs.values()), {k: r.state.message for k, r in runs.items()}
    assert runs[second].start_time >= runs[first].end_time  # it ran only once the first gave its GPUs back
    # the scheduling history explains both decisions, each member's placement included
    waited = cli_json("history", second, "--phase", "schedule", "--result", "NEED_RETRY")
    assert any("cluster of 2 (single-node)" in r["message"] for r in waited), waited
    placed = cli_json("history", first, "--phase", "schedule", "--result", "SUCCESS")
    assert any("main1: gpus" in r["message"] and "sub1: gpus" in r["message"] for r in placed), placed


@pytest.mark.timeout(180)
def test_a_killed_member_fails_the_run_and_frees_all_capacity(cluster_env):
    out = cluster_env["tmp"] / "kill"
    victim_run = _submit(cluster_env, out, 3, hold_s=120)
    started = _wait_started(out, victim_run)
    os.kill(started["sub1"]["pid"], signal.SIGKILL)
    t0 = time.time()
    [run] = wait_final([victim_run], timeout=60)
    assert run.state_name == "Failed", (run.state_name, run.state.message)
    assert "member sub1 exited with code -9 (SIGKILL)" in run.state.message
    _assert_gone(started, ("main1", "sub2"))  # the others were stopped, not left running
    deadline, ended = time.time() + 20, []
    while not ended and time.time() < deadline:  # the agent's history writer stores its notes once a second
        ended = cli_json("history", victim_run, "--error-code", "cluster-member-failed")
        time.sleep(0 if ended else 0.5)
    assert ended and "member sub1" in ended[0]["message"], ended
    wait_agent_free(cluster_env["agent"], gpu=3)
    assert time.time() - t0 < 45
    # the next cluster run is placed on the freed GPUs; cancelling it stops every member and frees them again
    nxt = _submit(cluster_env, out, 3, hold_s=120)
    members = _wait_started(out, nxt)
    from prefect import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(nxt, Cancelling(), force=True)
    [after] = wait_final([nxt], timeout=60)
    assert after.state_name == "Cancelled", (after.state_name, after.state.message)
    _assert_gone(members, ("main1", "sub1", "sub2"))
    wait_agent_free(cluster_env["agent"], gpu=3)


def _wait_started(out: Path, run_id: str, timeout: float = 90,
                  members: tuple[str, ...] = ("main1", "sub1", "sub2")) -> dict[str, dict]:
    """Each member's start record (its pid), once every member runs the job."""
    started: dict[str, dict] = {}
    deadline = time.time() + timeout
    while time.time() < deadline and len(started) < len(members):
        started = {p.name.split("-")[-1].split(".")[0]: json.loads(p.read_text())
                   for p in out.glob(f"{run_id}-*.started.json")}
        time.sleep(0.3)
    assert sorted(started) == sorted(members), started
    return started


def _assert_gone(started: dict[str, dict], members: tuple[str, ...]) -> None:
    for member in members:
        pid = started[member]["pid"]
        for _ in range(75):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"{member} (pid {pid}) still runs after the run ended")


@pytest.mark.timeout(300)
def test_a_restarted_agent_still_fails_the_run_when_a_sub_member_dies(prefect_server, tmp_path):
    """The agent running a single-node cluster run is SIGKILLed and restarted: it re-adopts main1 and finds
    sub1 by its command line; when sub1 then dies (no longer the agent's child, it left no exit status) the
    run fails at once naming it, main1 is stopped, and every GPU comes back - not 120 s later, when main1
    would have reached the collective on its own."""
    name, q = _allreduce_queue(tmp_path, "cr")
    out = tmp_path / "out"
    cap = "cpu=2,memory=2Gi,gpu=2"
    with agent([q], name, cap, tmp_path) as first:
        run_id = cli_json("submit", f"allreduce/{name}", "--cluster-size", "2", "--param", f"out_dir={out}",
                          "--param", "hold_s=120")["run_ids"][0]
        started = _wait_started(out, run_id, members=("main1", "sub1"))
        os.killpg(first.pid, signal.SIGKILL)
    restarted = dt.datetime.now(dt.timezone.utc)
    log = tmp_path / "agent-again.log"
    with agent([q], name, cap, tmp_path, log_name=log.name, wait_online=False):
        deadline = time.time() + 120
        while True:  # the restarted agent has published what it holds
            now = _agents_by_name().get(name) or {}
            if dt.datetime.fromisoformat(now.get("heartbeat", "2000-01-01T00:00:00+00:00")) > restarted \
                    and [r["run_id"] for r in now.get("runs", [])] == [run_id]:
                break
            assert time.time() < deadline, f"the restarted agent never showed the run as held: {now}"
            time.sleep(0.5)
        assert now["free"]["gpu"] == 0, now
        assert psutil.pid_exists(started["sub1"]["pid"]) and psutil.pid_exists(started["main1"]["pid"])
        time.sleep(1.0)  # the re-adopted run's watch is armed right after its recovery is published
        os.kill(started["sub1"]["pid"], signal.SIGKILL)
        t0 = time.time()
        [run] = wait_final([run_id], timeout=60)
        _assert_gone(started, ("main1",))
        wait_agent_free(name, gpu=2, log=log)
        [run] = read_runs([run_id])
        assert run.state_name == "Failed" and "member sub1 exited with no exit status" in run.state.message, \
            (run.state_name, run.state.message, log.read_text()[-3000:])
        assert time.time() - t0 < 60


def _agents_by_name() -> dict[str, dict]:
    return {a["name"]: a for a in _agents()}


@pytest.mark.timeout(120)
def test_bad_cluster_requests_are_refused_before_anything_is_enqueued(cluster_env):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    def count() -> int:
        with get_client(sync_client=True) as client:
            return len(client.read_flow_runs(deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(any_=[cluster_env["agent"]]))))

    before = count()
    for args, why in ((("--cluster-size", "0"), "cluster_size must be at least 1"),
                      (("--cluster-size", "65"), "above the limit of 64 members"),
                      (("--cluster-size", "2", "--cluster-mode", "ring"), "cluster_mode must be one of"),
                      (("--cluster-size", "4", "--cluster-mode", "multi-node"), "fits 3 member(s) on all the queue's"),
                      (("--cluster-size", "4"), "needs gpu=4 (agent")):  # the agent has 3 GPUs
        res = cli("submit", cluster_env["job"], "--param", "out_dir=/tmp/x", *args, check=False)
        assert res.returncode != 0 and why in res.stdout + res.stderr, (args, res.stdout, res.stderr)
    assert count() == before


@pytest.mark.timeout(420)
def test_multi_node_run_spreads_over_two_agents(prefect_server, tmp_path, monkeypatch):
    """Two agents stand in for two hosts: the all-reduce completes; a member killed fails the run; the agent
    hosting a member survives its own SIGKILL and restart without handing the member's GPU out twice."""
    # the follower's restart below may take longer than the leader's default wait for a silent agent (20 s)
    # on a loaded box; that case (a host cut off) is test_hosts_e2e's
    monkeypatch.setenv("LAUNCH_CLUSTER_LOST_SECONDS", "180")
    name, q = _allreduce_queue(tmp_path, "mn")
    out = tmp_path / "mn"
    cap = "cpu=1,memory=1Gi,gpu=1"
    with agent([q], f"{name}-a", cap, tmp_path, wait_online=False) as pa, \
            agent([q], f"{name}-b", cap, tmp_path, wait_online=False) as pb:
        for a in ("a", "b"):  # both start at once (half the wait on a loaded box)
            wait_agent_online(f"{name}-{a}", [q], timeout=120)
        run_id = cli_json("submit", f"allreduce/{name}", "--cluster-size", "2", "--cluster-mode", "multi-node",
                          "--param", f"out_dir={out}")["run_ids"][0]
        [run] = wait_final([run_id], timeout=180)
        assert run.state_name == "Completed", run.state.message
        # a member killed on the other agent fails the run there, and the leader stops main1
        held = cli_json("submit", f"allreduce/{name}", "--cluster-size", "2", "--cluster-mode", "multi-node",
                        "--param", f"out_dir={out}", "--param", "hold_s=120")["run_ids"][0]
        started = _wait_started(out, held, members=("main1", "sub1"))
        os.kill(started["sub1"]["pid"], signal.SIGKILL)
        wait_final([held], timeout=60)
        _assert_gone(started, ("main1",))
        wait_agent_free(f"{name}-a", gpu=1)
        wait_agent_free(f"{name}-b", gpu=1)
        # the run is Failed with the member's reason before main1 is killed (at once, no SIGTERM its engine
        # could answer with "Crashed"), and stays so after both agents let go
        [failed] = read_runs([held])
        assert failed.state_name == "Failed" and "member sub1 exited with code -9" in failed.state.message, \
            (failed.state_name, failed.state.message)

        # the agent hosting sub1 is SIGKILLed mid-run and restarted: it books sub1's GPU again (nothing is
        # handed out twice) and still fails the run when sub1 dies afterwards, then gives everything back
        held = cli_json("submit", f"allreduce/{name}", "--cluster-size", "2", "--cluster-mode", "multi-node",
                        "--param", f"out_dir={out}", "--param", "hold_s=120")["run_ids"][0]
        started = _wait_started(out, held, members=("main1", "sub1"))
        follower = started["sub1"]["env"]["LAUNCH_AGENT"]
        os.killpg((pa if follower.endswith("-a") else pb).pid, signal.SIGKILL)
        restarted = dt.datetime.now(dt.timezone.utc)
        with agent([q], follower, cap, tmp_path, log_name="follower-again.log", wait_online=False):
            deadline = time.time() + 120
            while True:  # what the new agent publishes (the old one's last state says the same, but earlier)
                now = {x["name"]: x for x in _agents()}.get(follower) or {}
                if dt.datetime.fromisoformat(now.get("heartbeat", "2000-01-01T00:00:00+00:00")) > restarted \
                        or time.time() > deadline:
                    break
                time.sleep(0.5)
            assert now["free"]["gpu"] == 0 and [r["run_id"] for r in now["runs"]] == [f"{held}:members"], \
                f"the restarted agent forgot sub1's GPU: {now}"
            assert f"re-adopted cluster member(s) sub1 of run {held} (member(s) sub1 still running)" \
                in (tmp_path / "follower-again.log").read_text()
            assert psutil.pid_exists(started["sub1"]["pid"]) and psutil.pid_exists(started["main1"]["pid"])
            os.kill(started["sub1"]["pid"], signal.SIGKILL)  # no longer the agent's child: no exit code to read
            wait_final([held], timeout=60)
            _assert_gone(started, ("main1",))
            for a in ("a", "b"):  # the restarted follower logs to follower-again.log
                wait_agent_free(f"{name}-{a}", gpu=1, log=tmp_path / ("follower-again.log" if follower.endswith(a)
                                                                     else f"agent-{name}-{a}.log"))
            [failed] = read_runs([held])
            assert failed.state_name == "Failed" and "member sub1 exited with no exit status" in failed.state.message \
                and follower in failed.state.message, (failed.state_name, failed.state.message)
    recs = _records(out, run_id)
    assert sorted(recs) == ["main1", "sub1"]
    assert all(r["ok"] and r["sum"] == [3.0, 6.0, 9.0, 12.0] for r in recs.values()), recs
    agents = {m: r["env"]["LAUNCH_AGENT"] for m, r in recs.items()}
    assert sorted(agents.values()) == [f"{name}-a", f"{name}-b"], agents  # one member on each agent
    assert {r["env"]["LAUNCH_CLUSTER_MODE"] for r in recs.values()} == {"multi-node"}
    assert {r["env"]["LOCAL_RANK"] for r in recs.values()} == {"0"}


@pytest.mark.timeout(180)
def test_per_member_figures_match_each_members_own_cpu_time(cluster_env):
    """Each member burns a different amount of CPU; `runs show` gives each member's figures (checked
    against the CPU time the member's own process reported) and the run's figure is their sum."""
    out = cluster_env["tmp"] / "burn"
    run_id = cli_json("submit", cluster_env["job"], "--cluster-size", "3", "--param", f"out_dir={out}",
                      "--param", "burn_s=1.0")["run_ids"][0]
    [run] = wait_final([run_id], timeout=150)
    assert run.state_name == "Completed", run.state.message
    recs = _records(out, run_id)
    deadline = time.time() + 30
    shown: dict = {}
    while time.time() < deadline:  # the summary is written just after the run's process ends
        shown = cli_json("runs", "show", run_id)
        if (shown.get("cluster") or {}).get("members") and shown.get("summary"):
            break
        time.sleep(0.5)
    members = {m["member"]: m for m in shown["cluster"]["members"]}
    assert sorted(members) == ["main1", "sub1", "sub2"], shown["cluster"]
    for name, rec in recs.items():
        m = members[name]
        assert m["pid"] == rec["pid"], (name, m, rec["pid"])
        # the member's own CPU time when it wrote its record; the agent samples once a second, so the
        # member's last second (its engine's teardown) may or may not be in the figure
        assert rec["cpu_s"] - 1.0 <= m["cpu_seconds"] <= rec["cpu_s"] + 1.5, (name, m["cpu_seconds"], rec["cpu_s"])
        assert m["peak_memory_bytes"] and m["memory_measure"] in ("pss", "rss")
    gpus = [tuple(m["gpu_indices"]) for m in members.values()]
    assert sorted(gpus) == [(0,), (1,), (2,)]  # each member's own GPU, as placed
    total = sum(m["cpu_seconds"] for m in members.values())
    assert abs(shown["summary"]["cpu_seconds"] - total) <= 0.05 * total + 0.5, (shown["summary"]["cpu_seconds"], total)
    text = cli("runs", "show", run_id).stdout
    assert "per member" in text and "sub2" in text
