"""An agent that is killed, restarted, stopped or outlived by its runs: end to end on a real server.

Ground truth is the jobs' own records (CUDA_VISIBLE_DEVICES, start/end), the processes
that exist, and Prefect's state histories - never what the agent says about itself.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import pytest

from launch_helpers import (CLI, agent, apply_queue, cli, cli_json, deploy_probe, read_runs, records,
                            wait_agent_free, wait_final, wait_running)
from prefect_launch.local_server import background_process

pytestmark = pytest.mark.usefixtures("prefect_server")

PRESETS = {"g1": {"cpu": 0.5, "memory": "512Mi", "gpu": 1}, "c1": {"cpu": 0.5, "memory": "512Mi", "gpu": 0}}


def _submit(job: str, q: str, rec: Path, *extra: str, **params) -> str:
    args = ["submit", job, "--queue", q, "--param", f"record_dir={rec}", *extra]
    for k, v in params.items():
        args += ["--param", f"{k}={v}"]
    return cli_json(*args)["run_ids"][0]


def _gpu_overlaps(recs: list[dict]) -> list[tuple[str, str, set]]:
    bad = []
    for a, b in itertools.combinations(recs, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            ga = set(filter(None, (a["cuda_visible_devices"] or "").split(",")))
            gb = set(filter(None, (b["cuda_visible_devices"] or "").split(",")))
            if ga & gb:
                bad.append((a["tag"], b["tag"], ga & gb))
    return bad


def _label(run_id: str, key: str) -> str:
    return (read_runs([run_id])[0].labels or {}).get(key) or ""


def test_sigkilled_agent_readopts_live_runs_and_crashes_vanished_ones(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"rs-{unique_name}", "presets": PRESETS, "default_preset": "g1"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    name = f"rs-{unique_name}"
    cap = "cpu=2,memory=4Gi,gpu=2"
    args = [*CLI, "agent", "--name", name, "--capacity", cap, "--queue", q]
    release = tmp_path / "release"
    with background_process(args, tmp_path / "agent-first.log") as first:
        from launch_helpers import wait_agent_online

        wait_agent_online(name, [q])
        # a and b live until released below (once the next agent has re-adopted them and held the new runs
        # back), 300 s at most
        a = _submit(job, q, rec, "--preset", "g1", seconds=300, release_file=release, tag="old-a")
        b = _submit(job, q, rec, "--preset", "g1", seconds=300, release_file=release, tag="old-b")
        c = _submit(job, q, rec, "--preset", "c1", seconds=120, tag="old-c")
        pids = {rid: wait_running(rid) for rid in (a, b, c)}
        deadline = time.time() + 15  # the machine-readable placement label follows the start by ~1 s
        while not all(_label(r, "launch.alloc") for r in (a, b, c)) and time.time() < deadline:
            time.sleep(0.3)
        os.killpg(first.pid, signal.SIGKILL)  # an OOM kill or a crash of the agent looks like this
        first.wait()
    # the runs live on in their own sessions; one of them dies while no agent is there
    assert all(psutil.pid_exists(p) for p in pids.values())
    os.killpg(os.getpgid(pids[c]), signal.SIGKILL)

    with agent([q], name, cap, tmp_path, log_name="agent-second.log"):
        # new GPU runs, submitted after the restart, must wait for the GPUs the old runs still hold
        new = [_submit(job, q, rec, "--preset", "g1", seconds=1, tag=f"new-{i}") for i in range(2)]
        # the old runs end only once the agent has re-adopted them and looked at the new ones (its waiting
        # labels on them): what it then did with the GPUs is checked from the records below
        log_path = tmp_path / "agent-second.log"
        deadline = time.time() + 120
        while time.time() < deadline and not ("recovered" in log_path.read_text()
                                              and all(_label(n, "launch.waiting") for n in new)):
            time.sleep(0.3)
        release.touch()
        runs = {str(r.id): r for r in wait_final([a, b, c, *new], timeout=120)}
        wait_agent_free(name, gpu=2)
    log = (tmp_path / "agent-second.log").read_text()
    assert "recovered 2 live run(s), 1 ended while it was away" in log, log[-3000:]

    assert runs[a].state.is_completed() and runs[b].state.is_completed(), "re-adopted runs finish normally"
    assert runs[c].state.is_crashed()
    assert runs[c].state.message == f"agent {name} restarted; the run's process was gone"
    assert all(runs[n].state.is_completed() for n in new)
    recs = list(records(rec).values())
    assert {r["tag"] for r in recs} == {"old-a", "old-b", "new-0", "new-1"}
    assert _gpu_overlaps(recs) == [], "a GPU was handed out twice across the restart"
    # both GPUs were held by the re-adopted runs: no new run started before the first of them ended
    first_free = min(r["end"] for r in recs if r["tag"].startswith("old"))
    assert all(r["start"] >= first_free - 0.5 for r in recs if r["tag"].startswith("new"))
    # the orphans' metrics records were closed with their real end, not left RUNNING
    for rid in (a, b):
        report = cli_json("runs", "show", rid)
        assert report["run"]["state"] == "COMPLETED", report["run"]
        assert report["summary"]["exit_state"] == "COMPLETED"
    crashed = cli_json("runs", "show", c)["run"]
    assert crashed["state"] == "CRASHED" and crashed["ended_at"]
    # what the user reads: the reason is on `runs ls`
    listed = {r["run_id"]: r for r in cli_json("runs", "ls", "--queue", q)}
    assert "the run's process was gone" in listed[c]["note"]


def test_agent_drains_on_sigterm_and_cancels_on_second_signal(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"dr-{unique_name}", "presets": PRESETS, "default_preset": "c1"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    name = f"dr-{unique_name}"
    with agent([q], name, "cpu=2,memory=4Gi", tmp_path, on_exit="drain") as proc:
        short = _submit(job, q, rec, seconds=4, tag="short")
        wait_running(short)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        late = _submit(job, q, rec, seconds=0.1, tag="late")  # submitted while draining: not claimed
        assert proc.wait(60) == 0
    runs = {str(r.id): r for r in read_runs([short, late])}
    assert runs[short].state.is_completed(), "drain lets the running run finish"
    assert runs[late].state.is_scheduled(), "a draining agent claims nothing new"
    log = (tmp_path / f"agent-{name}.log").read_text()
    assert "draining" in log and "drained" in log

    with agent([q], name, "cpu=2,memory=4Gi", tmp_path, on_exit="drain", log_name="agent-2.log") as proc:
        wait_final([late])
        long = _submit(job, q, rec, seconds=120, tag="long")
        wait_running(long)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)  # second signal: cancel
        assert proc.wait(60) == 0
    run = read_runs([long])[0]
    assert run.state.is_cancelled(), run.state
    assert run.state.message == f"cancelled: agent {name} was stopped (SIGINT)"


def test_timeout_from_queue_default_and_per_run(tmp_path: Path, unique_name: str):
    q = apply_queue(tmp_path, {"name": f"to-{unique_name}", "presets": PRESETS, "default_preset": "c1",
                               "timeout": "3s"})
    job = deploy_probe(q, f"probe-{unique_name}")
    rec = tmp_path / "records"
    name = f"to-{unique_name}"
    bad = cli("submit", job, "--queue", q, "--timeout", "soon", "--param", f"record_dir={rec}", check=False)
    assert bad.returncode == 2 and "timeout in the submission must be a duration" in bad.stderr + bad.stdout
    with agent([q], name, "cpu=2,memory=4Gi", tmp_path):
        slow = _submit(job, q, rec, seconds=60, tag="slow")  # the queue's 3 s applies
        ok = _submit(job, q, rec, "--timeout", "1m", seconds=4, tag="ok")  # a longer per-run timeout
        runs = {str(r.id): r for r in wait_final([slow, ok], timeout=90)}
        wait_agent_free(name, gpu=0)
    assert runs[slow].state.is_failed(), runs[slow].state
    assert runs[slow].state.message.startswith("task-timeout: timeout after 3 s"), runs[slow].state.message
    assert runs[ok].state.is_completed()
    from prefect import get_client

    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(slow)
    claimed = [s.timestamp for s in states if s.name == "Pending"][0]
    ended = states[-1].timestamp
    # stopped near its deadline (counted from its process start, just after the claim), not at the job's end
    assert 3.0 <= (ended - claimed).total_seconds() <= 30
    assert "slow" not in {r["tag"] for r in records(rec).values()}, "the timed-out job never reached its end"
    listed = {r["run_id"]: r for r in cli_json("runs", "ls", "--queue", q)}
    assert listed[slow]["note"].startswith("task-timeout: timeout after 3 s")
    shown = cli_json("runs", "show", slow)
    assert shown["state"] == "Failed" and shown["reason"].startswith("task-timeout: timeout after 3 s")
    # ... and the monitor's errors panel (API path: the same state message)
    from datetime import datetime, timedelta, timezone

    from prefect_launch.dashboard.spec import ViewSpec
    from prefect_launch.dashboard.view import load_view

    now = datetime.now(timezone.utc)
    view = load_view(ViewSpec(since=now - timedelta(hours=1), until=now + timedelta(minutes=1), queues=(q,)),
                       use_cache=False, store=None, source="api")
    errors = {row["id"]: row for row in view.errors.to_dict("records")}
    assert errors[slow]["message"].startswith("task-timeout: timeout after 3 s") and ok not in errors


def test_pinned_run_to_offline_agent_says_so(tmp_path: Path, unique_name: str):
    from prefect import get_client

    from prefect_launch.workers.agent.registry import AgentState, publish
    from prefect_launch.workers.scheduling.resources import Resources

    q = apply_queue(tmp_path, {"name": f"pin-{unique_name}", "presets": PRESETS, "default_preset": "c1"})
    job = deploy_probe(q, f"probe-{unique_name}")
    ghost = f"ghost-{unique_name}"
    gone = datetime.now(timezone.utc) - timedelta(minutes=10)
    import anyio

    async def register_ghost():  # an agent that served the queue and stopped heart-beating 10 minutes ago
        async with get_client() as client:
            await publish(client, AgentState(name=ghost, queues=[q], capacity=Resources(cpu=2, memory=2**31),
                                             free=Resources(cpu=2, memory=2**31), heartbeat=gone))
    anyio.run(register_ghost)
    rid = _submit(job, q, tmp_path, "--agent", ghost, seconds=0.1)
    with agent([q], f"live-{unique_name}", "cpu=2,memory=4Gi", tmp_path):
        want = f"waiting: pinned to agent {ghost}, which is offline since {gone:%Y-%m-%d %H:%M:%S} UTC"
        deadline = time.time() + 30
        while _label(rid, "launch.waiting") != want and time.time() < deadline:
            time.sleep(0.5)
        assert _label(rid, "launch.waiting") == want
        assert read_runs([rid])[0].state.is_scheduled()


@pytest.fixture
def own_server(tmp_path_factory):
    """A second server for a test that changes server-wide automations; the session's server is restored after."""
    from launch_helpers import restored_prefect_env
    from prefect_launch.local_server import local_prefect_server

    with restored_prefect_env(), local_prefect_server(tmp_path_factory.mktemp("zombie-home")) as url:
        yield url


def test_run_whose_engine_and_agent_both_die_is_crashed_by_zombie_automation(tmp_path: Path, unique_name: str,
                                                                            own_server: str):
    env_within = "40"  # heartbeats come every 30 s (Prefect's minimum); the product default waits 90 s
    os.environ["LAUNCH_ZOMBIE_AFTER_SECONDS"] = env_within
    try:
        setup = cli_json("setup")
        again = cli_json("setup")
    finally:
        os.environ.pop("LAUNCH_ZOMBIE_AFTER_SECONDS")
    assert setup["zombie_automation"]["within_s"] == 40 and setup["zombie_automation"]["action"] == "created"
    assert again["zombie_automation"]["action"] == "kept"  # idempotent
    q = apply_queue(tmp_path, {"name": f"zb-{unique_name}", "presets": PRESETS, "default_preset": "c1"})
    job = deploy_probe(q, f"probe-{unique_name}")
    name = f"zb-{unique_name}"
    args = [*CLI, "agent", "--name", name, "--capacity", "cpu=2,memory=4Gi", "--queue", q]
    with background_process(args, tmp_path / "agent.log") as proc:
        from launch_helpers import wait_agent_online

        wait_agent_online(name, [q])
        rid = _submit(job, q, tmp_path, seconds=600)
        pid = wait_running(rid)
        time.sleep(3)  # the engine's first heartbeat goes out as the flow starts
        os.killpg(proc.pid, signal.SIGKILL)  # the host "dies": agent and engine at once
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        proc.wait()
    killed = time.time()
    deadline = killed + 150
    run = read_runs([rid])[0]
    while not run.state.is_final() and time.time() < deadline:
        time.sleep(0.5)
        run = read_runs([rid])[0]
    assert run.state.is_crashed(), run.state
    assert "no heartbeat for 40 s" in run.state.message
    assert time.time() - killed >= 10  # crashed for its silence, not by anything at kill time
