"""Restart recovery, journal, timeouts and pinned-agent reasons: pure parts and real processes, no server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import psutil
import pytest

from prefect_launch.workers.agent.registry import AgentState, offline_reasons
from prefect_launch.times import duration_seconds, format_duration
from prefect_launch.workers.scheduling.ledger import Allocation, Ledger
from prefect_launch.workers.scheduling.placement import Candidate, plan
from prefect_launch.workers.agent.recovery import Found, decide, find_run_processes, pid_start_time, process_is_run
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.scheduling.queue_spec import Preset, QueueSpec
from prefect_launch.workers.scheduling.resources import LaunchValidationError, Resources
from prefect_launch.workers.agent.journal import RunJournal, alloc_label, parse_alloc_label


def _alloc(run_id: str, gpus: list[int]) -> Allocation:
    return Allocation(run_id=run_id, resources=Resources(cpu=1, memory=2**30, gpu=len(gpus)), gpu_indices=gpus,
                      cpu_cores=[0], queue="q", preset="p")


def test_decide_covers_every_case():
    found = [
        Found(run_id="alive", state="RUNNING", alloc=_alloc("alive", [0]), pid=10),
        Found(run_id="gone", state="RUNNING", alloc=_alloc("gone", [1]), pid=11),
        Found(run_id="cancelling", state="CANCELLING", alloc=_alloc("cancelling", []), pid=12),
        Found(run_id="claimed", state="PENDING", alloc=_alloc("claimed", []), pid=None),
        Found(run_id="started-died", state="PENDING", alloc=_alloc("started-died", []), pid=13),
        Found(run_id="done", state="COMPLETED", alloc=_alloc("done", []), pid=14),
        Found(run_id="deleted", state=None, alloc=_alloc("deleted", []), pid=15),
        Found(run_id="done-but-exiting", state="COMPLETED", alloc=_alloc("done-but-exiting", [2]), pid=16),
        Found(run_id="unknown-alloc", state="RUNNING", alloc=None, pid=17),
    ]
    alive = {"alive": True, "done-but-exiting": True, "unknown-alloc": True}
    got = {r.run_id: r for r in decide(found, alive, "box")}
    assert got["alive"].action == "adopt" and got["alive"].alloc.gpu_indices == [0]
    assert got["gone"].action == "crash" and got["gone"].reason == "agent box restarted; the run's process was gone"
    assert got["cancelling"].action == "crash"
    assert got["claimed"].action == "requeue" and "back in its queue" in got["claimed"].reason
    assert got["started-died"].action == "crash"
    assert got["done"].action == "forget" and got["deleted"].action == "forget"
    assert got["done-but-exiting"].action == "adopt"  # its process still holds GPU 2 until it exits
    assert got["unknown-alloc"].action == "forget"


def test_process_identity_rejects_recycled_pid_and_other_runs():
    env = dict(os.environ, PREFECT__FLOW_RUN_ID="run-a")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.time() + 20  # between fork and exec the child still shows the test's environment
        while psutil.Process(proc.pid).environ().get("PREFECT__FLOW_RUN_ID") != "run-a" and time.time() < deadline:
            time.sleep(0.05)
        started = pid_start_time(proc.pid)
        assert started is not None
        assert process_is_run(proc.pid, started, "run-a")
        assert not process_is_run(proc.pid, started - 5.0, "run-a")  # same pid, other start: recycled
        assert not process_is_run(proc.pid, started, "run-b")  # its environment names another run
        assert find_run_processes({"run-a", "run-x"}) == {"run-a": (proc.pid, started)}
    finally:
        proc.kill()
        proc.wait()
    assert not process_is_run(proc.pid, started, "run-a")
    assert not process_is_run(None, None, "run-a")


def test_journal_survives_and_round_trips(tmp_path):
    j = RunJournal("box/1", tmp_path)
    a = _alloc("r1", [0, 1])
    j.record(a)
    j.set_pid("r1", 1234, 99.5)
    again = RunJournal("box/1", tmp_path)  # a new agent process reads what the old one wrote
    (entry,) = again.entries()
    assert entry.allocation == a and entry.pid == 1234 and entry.pid_started == 99.5 and entry.started_at
    (tmp_path / "foreign.json").write_text("{not json")
    assert [e.run_id for e in again.entries()] == ["r1"]
    again.remove("r1")
    again.remove("r1")  # idempotent
    assert [e.run_id for e in again.entries()] == []


def test_alloc_label_round_trip_and_garbage():
    a = _alloc("r2", [3])
    agent, back, pid, started = parse_alloc_label(alloc_label(a, "box", 42, 1.5))
    assert (agent, back, pid, started) == ("box", a, 42, 1.5)
    assert parse_alloc_label("agent box: cpu=1") is None and parse_alloc_label('{"x": 1}') is None


def test_ledger_adopt_restores_exact_gpus_and_refuses_clash():
    led = Ledger(Resources(cpu=4, memory=8 * 2**30, gpu=2))
    led.adopt(_alloc("old", [1]))
    new = led.try_allocate("new", Resources(cpu=1, memory=2**30, gpu=1))
    assert new.gpu_indices == [0]  # never the adopted run's GPU
    assert led.try_allocate("more", Resources(cpu=1, memory=2**30, gpu=1)) is None
    with pytest.raises(ValueError, match="GPUs \\[0\\]"):
        led.adopt(_alloc("clash", [0]))


def test_durations():
    assert duration_seconds("90") == 90 and duration_seconds("90s") == 90 and duration_seconds("1h30m") == 5400
    assert duration_seconds(2.5) == 2.5 and duration_seconds(None) is None and duration_seconds("2d") == 172800
    for bad in ("soon", "-5", "0", "5x", "h", True):
        with pytest.raises(LaunchValidationError, match="timeout"):
            duration_seconds(bad)
    assert format_duration(5400) == "1h30m" and format_duration(3) == "3s"


def test_timeout_resolves_queue_default_then_run():
    spec = QueueSpec(name="q", presets={"p": Preset()}, default_preset="p", timeout="2h")
    assert resolve_request(spec).timeout_s == 7200
    assert resolve_request(spec, {"timeout": "30m"}).timeout_s == 1800
    assert resolve_request(spec, {"timeout": "30m"}, {"timeout": "45s"}).timeout_s == 45
    with pytest.raises(LaunchValidationError, match="timeout in the submission"):
        resolve_request(spec, {}, {"timeout": "forever"})
    with pytest.raises(ValueError, match="timeout"):
        QueueSpec(name="q", presets={"p": Preset()}, default_preset="p", timeout="whenever")


def test_pinned_run_says_its_agent_is_offline():
    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    ghost = AgentState(name="ghost", queues=["q"], capacity=Resources(cpu=1, memory=1), free=Resources(cpu=1, memory=1),
                       heartbeat=now - timedelta(minutes=10))
    live = ghost.model_copy(update={"name": "live", "heartbeat": now})
    offline = offline_reasons([ghost, live], now)
    assert offline == {"ghost": "offline since 2026-11-30 11:50:00 UTC"}
    req = lambda agent: ResolvedRequest(preset="p", resources=Resources(cpu=1, memory=1), agent=agent)  # noqa: E731
    cands = [Candidate(run_id="a", request=req("ghost")), Candidate(run_id="b", request=req("nobody")),
             Candidate(run_id="c", request=req("live2"))]
    got = {d.run_id: d.reason for d in plan(cands, Resources(cpu=4, memory=4), Resources(cpu=4, memory=4), "me",
                                            agents_offline=offline, agents_known={"ghost", "live", "live2"})}
    assert got["a"] == "waiting: pinned to agent ghost, which is offline since 2026-11-30 11:50:00 UTC"
    assert got["b"] == "waiting: pinned to agent nobody, which has never been seen on this server"
    assert got["c"] == "waiting: pinned to agent live2"


@pytest.mark.parametrize("heartbeat_s, silent_s, online", [
    (None, 89, True), (None, 91, False),  # an agent that does not publish its interval: 90 s (3 x Prefect's 30 s)
    (10, 29, True), (10, 31, False),  # one that beats every 10 s is offline after missing three beats
    (60, 170, True), (60, 181, False),
])
def test_an_agent_is_offline_after_missing_three_of_its_own_heartbeats(heartbeat_s, silent_s, online):
    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    agent = AgentState(name="a", queues=["q"], capacity=Resources(cpu=1), free=Resources(cpu=1),
                       heartbeat=now - timedelta(seconds=silent_s), heartbeat_s=heartbeat_s)
    assert agent.online(now) is online
    since = f"{agent.heartbeat:%Y-%m-%d %H:%M:%S} UTC"
    assert agent.offline_since(now) == (None if online else since)
    assert offline_reasons([agent], now) == ({} if online else {"a": f"offline since {since}"})


def test_eta_replays_placement_forward():
    from prefect_launch.deployments.eta import AgentCap, Running, Waiting, median_runtime, predict

    now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    g = lambda n: Resources(cpu=1, memory=2**30, gpu=n)  # noqa: E731
    agents = [AgentCap(name="a", queues=["q"], capacity=Resources(cpu=4, memory=8 * 2**30, gpu=2))]
    running = [Running(run_id="r1", agent="a", resources=g(1), started=now - timedelta(seconds=60), expected_s=100),
               Running(run_id="r2", agent="a", resources=g(1), started=now - timedelta(seconds=10), expected_s=100)]
    waiting = [Waiting(run_id="w1", queue="q", resources=g(1), submitted=now, expected_s=50),
               Waiting(run_id="w2", queue="q", resources=g(2), submitted=now + timedelta(seconds=1), expected_s=10),
               Waiting(run_id="w3", queue="q", resources=g(0), submitted=now + timedelta(seconds=2), expected_s=10)]
    got = predict(now, agents, running, waiting)
    assert got["w1"] == now + timedelta(seconds=40)  # r1 frees a GPU at +40
    assert got["w2"] == now + timedelta(seconds=90)  # needs both: r2 ends +90, w1 ends +90
    assert got["w3"] == now + timedelta(seconds=90)  # strict FIFO: behind w2 though it fits now
    got_bf = predict(now, agents, running, waiting, backfill={"q": True})
    assert got_bf["w3"] == now  # backfill lets it pass
    unknown = [running[0].model_copy(update={"expected_s": None}), running[1]]
    got_u = predict(now, agents, unknown, waiting)
    assert got_u["w1"] == now + timedelta(seconds=90) and got_u["w2"] is None  # never guesses an unknown end
    later = [Waiting(run_id="s", queue="q", resources=g(0), submitted=now, not_before=now + timedelta(hours=1))]
    assert predict(now, agents, [], later)["s"] == now + timedelta(hours=1)
    assert median_runtime([3, 1, 2]) == 2 and median_runtime([]) is None
