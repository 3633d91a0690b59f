"""Idle checks reclaim held hardware: each checker fires on a really idle session and not on a busy one.

One agent (sampling every 0.5 s) serves three queues, one checker each: a session past its
maximum lifetime (and not before), a batch session that sleeps through the utilisation window,
and an interactive session whose JupyterLab nobody talks to are ended Cancelled with the
checker's reason in their state and history; a CPU-bound session and an interactive one while
it has an open connection are left alone. Truth is the runs' own states, the
history table and the app's port, not what `session show` says about itself (that is checked
too, for the time left).
"""

from __future__ import annotations

import json
import socket
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from prefect_launch.workers.metrics.idle_checks import (IdleChecker, IdlePolicy, UtilizationPolicy, app_activity,
                                                describe_status)

from launch_helpers import agent, apply_queue, cli, cli_json, read_runs, wait_final

PRESETS = {"one": {"cpu": 1, "memory": "1Gi"}}


# ------------------------------------------------------------------ pure parts

def test_app_activity_reads_listening_and_connected_sockets():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        assert app_activity([port]) == (False, 0)
        srv.listen()
        assert app_activity([port]) == (True, 0)
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = srv.accept()
            with conn:
                listening, conns = app_activity([port])
                assert listening and conns == 1  # the server side, counted once
    assert app_activity([]) == (False, 0)


def test_network_clock_starts_when_the_app_listens_and_policy_scope():
    c = IdleChecker(IdlePolicy(network_idle_timeout="10s"), started=0.0, session_type="interactive")
    for t in range(0, 30, 5):  # a slow app start is not idleness
        c.observe(float(t), app_ready=False)
    c.observe(30.0, app_ready=True)
    assert c.check(39.0) is None and c.check(40.0).reason == "idle-timeout"  # 10 s from the first listen
    c.observe(46.0, app_ready=False)  # the app going away later is not use
    assert c.check(46.0).reason == "idle-timeout"
    assert IdlePolicy(max_lifetime="1h").applies("batch") and not IdlePolicy(max_lifetime="1h").applies(None)
    assert IdlePolicy(max_lifetime="1h", apply_to=["job"]).applies(None) and not IdlePolicy().applies("batch")
    late = IdleChecker(IdlePolicy(max_lifetime="10s", lifetime_from="starts_at"), started=100.0,
                       session_type="batch", scheduled=95.0)
    assert late.check(104.0) is None and late.check(105.0).reason == "idle-session-lifetime"


def test_status_gives_deadlines_and_lines_with_the_time_left():
    pol = IdlePolicy(max_lifetime="1m", network_idle_timeout="30s",
                     utilization=UtilizationPolicy(grace_period="10s", window="20s", cpu=5, gpu_util=10))
    c = IdleChecker(pol, started=1000.0, session_type="interactive", requested_gpu=0)
    c.observe(1001.0, cpu_share_pct=2.0, connections=2, app_ready=True)
    st = json.loads(json.dumps(c.status(1001.0)))  # what the label carries
    by = {x["name"]: x for x in st["checks"]}
    assert by["session_lifetime"]["deadline"] == 1060.0 and by["network_timeout"]["deadline"] == 1031.0
    assert by["utilization"]["thresholds"] == {"cpu": 5, "gpu_util": 10} and by["utilization"]["averages"] == {"cpu": 2.0}
    lines = describe_status(st, 1011.0)
    assert lines[0] == "session_lifetime: limit 1m, 49s left"
    assert lines[1].startswith("network_timeout: limit 30s, 20s left; 2 open connection(s)")
    assert lines[2] == "utilization: window 20s, filling the window" and "10s ago" in lines[3]


# ------------------------------------------------------------------ end to end

def _queue(tmp_path: Path, name: str, idle: dict) -> str:
    return apply_queue(tmp_path, {"name": name, "presets": PRESETS, "default_preset": "one", "idle": idle})


def _history(run_id: str, timeout: float = 20) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        rows = cli_json("history", run_id)
        if any(r["phase"] == "terminate" for r in rows) or time.time() > deadline:
            return rows
        time.sleep(0.5)


@pytest.mark.usefixtures("prefect_server")
def test_idle_checkers_reclaim_idle_sessions_and_spare_busy_ones(tmp_path, unique_name, monkeypatch):
    monkeypatch.setenv("LAUNCH_SAMPLE_INTERVAL", "0.5")
    monkeypatch.setenv("LAUNCH_IDLE_PUBLISH_SECONDS", "2")
    u = unique_name
    life = _queue(tmp_path, f"il-{u}", {"max_lifetime": "8s"})
    # 3%: a CPU-bound loop gets far more even on a loaded box; a sleeping session far less once started
    util = _queue(tmp_path, f"iu-{u}", {"utilization": {"grace_period": "1s", "window": "3s", "cpu": 3}})
    net = _queue(tmp_path, f"in-{u}", {"network_idle_timeout": "6s"})
    owner = f"i{u}"

    def start(queue: str, name: str, *args: str) -> str:
        return cli_json("session", "start", "--queue", queue, "--owner", owner, "--name", name, *args,
                        "--json")["run_ids"][0]

    busy_loop = "python3 -c 'import time\nt = time.time()\nwhile time.time() - t < 12: pass'"
    ids = {
        "lifetime": start(life, f"long-{u}", "--type", "batch", "--startup-command", "sleep 60"),
        "idle-cpu": start(util, f"sleepy-{u}", "--type", "batch", "--startup-command", "sleep 60"),
        "busy-cpu": start(util, f"busy-{u}", "--type", "batch", "--startup-command", busy_loop),
        "lab": start(net, f"lab-{u}", "--type", "interactive"),
    }
    lab = f"lab-{u}"
    with agent([life, util, net], f"ia-{u}", "cpu=8,memory=16Gi", tmp_path):
        deadline = time.time() + 150
        show = {}
        while time.time() < deadline and not show.get("app_urls"):
            time.sleep(1)
            show = cli_json("session", "show", lab, "--owner", owner)
        assert show.get("app_urls"), show
        url = show["app_urls"][0]
        port, token = int(url.split(":")[2].split("/")[0]), url.split("token=", 1)[1]
        with httpx.Client(headers={"Authorization": f"token {token}"}, timeout=10) as client:  # keep-alive: in use
            until = time.time() + 9  # longer than the 6 s network timeout
            while time.time() < until:
                assert client.get(f"http://127.0.0.1:{port}/api/status").status_code == 200
                time.sleep(1)
            in_use = cli_json("session", "show", lab, "--owner", owner)
            assert in_use["status"] == "Running", in_use
            checks = {c["name"]: c for c in in_use["idle_checks"]["checks"]}
            assert 0 <= checks["network_timeout"]["remaining_s"] <= 6 and checks["network_timeout"]["app_ready"]
            assert "network_timeout: limit 6s" in cli("session", "show", lab, "--owner", owner).stdout
        # the connection is closed: nobody uses the app now
        runs = {k: r for k, r in zip(ids, wait_final(list(ids.values()), timeout=120))}
        hist = {k: _history(rid) for k, rid in ids.items() if k in ("lifetime", "idle-cpu", "lab")}
    runs = {k: read_runs([rid])[0] for k, rid in ids.items()}
    for key, reason in (("lifetime", "idle-session-lifetime"), ("idle-cpu", "idle-utilization"), ("lab", "idle-timeout")):
        state = runs[key].state
        assert state.is_cancelled() and state.message.startswith(reason), (key, state)
        idle = [r for r in hist[key] if r["phase"] == "idle_check"]
        assert [(r["result"], r["error_code"], r["to_state"]) for r in idle] == [("EXPIRED", reason, "CANCELLED")]
        assert hist[key][-1]["phase"] == "terminate" and hist[key][-1]["error_code"] == reason
    assert runs["busy-cpu"].state.is_completed(), runs["busy-cpu"].state
    started = next(r for r in hist["lifetime"] if r["phase"] == "start")["created"]
    reclaimed = next(r for r in hist["lifetime"] if r["phase"] == "idle_check")["created"]
    lived = (datetime.fromisoformat(reclaimed) - datetime.fromisoformat(started)).total_seconds()
    assert 8 <= lived < 20, lived  # not before its lifetime, and soon after (0.5 s samples; a loaded box is slow)
    assert "idle-utilization" in runs["idle-cpu"].state.message and "cpu" in runs["idle-cpu"].state.message
    with pytest.raises(httpx.HTTPError):  # the reclaimed session's app is gone
        httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=3)
