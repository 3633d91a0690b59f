"""Compute sessions end to end: batch and interactive, on a real server and agent.

Truth comes from the runs' own states, the files the session commands write, and the
app answering (or not) on its port - not from what `session ls` says about itself.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from launch_helpers import agent, apply_queue, cli, cli_json, read_runs, wait_final

pytestmark = pytest.mark.usefixtures("prefect_server")

PRESETS = {"small": {"cpu": 1, "memory": "1Gi"}, "big": {"cpu": 2, "memory": "1Gi"}}


def _queue(tmp_path: Path, unique_name: str) -> str:
    return apply_queue(tmp_path, {"name": f"ss-{unique_name}", "presets": PRESETS, "default_preset": "small"})


def test_bad_session_requests_are_refused_with_every_error_and_nothing_created(tmp_path, unique_name):
    q = _queue(tmp_path, unique_name)
    before = cli_json("session", "ls", "--all", "--ended")
    out = cli("session", "start", "--type", "interactive", "--queue", q, "--name", "x!", "--starts-at", "1h",
              "--startup-command", "true", "--port", "80", "--port", "8888", "--port", "8888",
              "--env", "1BAD=x", "--env", "A=1", "--env", "A=2", "--mount", "relative:/data", check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 2
    for needle in ("name 'x!'", "--startup-command is for batch", "--starts-at is for batch",
                   "port 80 is outside 1024-65535", "port 8888 is given twice", "env name '1BAD'",
                   "env name 'A' is given twice", "host folder must be an absolute path"):
        assert needle in text, (needle, text)
    batch = cli("session", "start", "--type", "batch", "--queue", q, check=False)
    assert batch.returncode == 2 and "needs --startup-command" in batch.stdout + batch.stderr
    preset = cli("session", "start", "--type", "batch", "--queue", q, "--startup-command", "true",
                 "--preset", "huge", check=False)
    assert preset.returncode == 2 and "unknown preset 'huge'" in preset.stdout + preset.stderr
    assert cli_json("session", "ls", "--all", "--ended") == before, "a refused request created nothing"
    dry = cli_json("session", "start", "--type", "batch", "--queue", q, "--startup-command", "true",
                   "--preset", "big", "--count", "2", "--name", "dry-run", "--dry-run")
    assert dry["dry_run"] and dry["run_ids"] == [] and dry["names"] == ["dry-run-1", "dry-run-2"]
    assert dry["resources"].startswith("cpu=2") and any("no --mount" in w for w in dry["warnings"])
    # a cluster session: checked like a cluster job, shown per member
    clu = cli_json("session", "start", "--type", "interactive", "--queue", q, "--cluster-size", "3",
                   "--preemptible", "--dry-run")
    assert (clu["cluster_size"], clu["cluster_mode"], clu["preemptible"]) == (3, "single-node", True)
    zero = cli("session", "start", "--type", "batch", "--queue", q, "--startup-command", "true",
               "--cluster-size", "0", check=False)
    assert zero.returncode == 2 and "cluster_size must be at least 1" in zero.stdout + zero.stderr
    assert cli_json("session", "ls", "--all", "--ended") == before


def test_batch_sessions_success_failure_timeout_and_starts_at(tmp_path, unique_name):
    q = _queue(tmp_path, unique_name)
    out_dir = tmp_path / "kept"
    owner = f"o{unique_name}"
    common = ("--type", "batch", "--queue", q, "--owner", owner, "--json")
    ok = cli_json("session", "start", *common, "--name", f"ok-{unique_name}", "--mount", f"{out_dir}:/out",
                  "--omp-threads", "3", "--env", "GREETING=hi",
                  "--startup-command", 'echo "$GREETING $LAUNCH_SESSION_NAME $OMP_NUM_THREADS $LAUNCH_SESSION_ID" '
                                       '> out/result.txt; touch scratch-only.txt')
    bad = cli_json("session", "start", *common, "--name", f"bad-{unique_name}", "--startup-command", "exit 3")
    slow = cli_json("session", "start", *common, "--name", f"slow-{unique_name}", "--startup-command", "sleep 60",
                    "--timeout", "3s")
    # a batch cluster session: every member runs the command with its own rank (a distributed launcher's view)
    clu = cli_json("session", "start", *common, "--name", f"clu-{unique_name}", "--mount", f"{out_dir}:/out",
                   "--cluster-size", "2", "--startup-command",
                   'echo "$LAUNCH_CLUSTER_MEMBER $RANK $WORLD_SIZE $LAUNCH_SESSION_ID" > out/member-$RANK.txt')
    assert clu["cluster_size"] == 2 and clu["resources"].startswith("cpu=1")
    when = datetime.now(timezone.utc) + timedelta(seconds=25)
    later = cli_json("session", "start", *common, "--name", f"later-{unique_name}", "--startup-command", "true",
                     "--starts-at", when.isoformat())
    dup = cli("session", "start", *common, "--name", f"later-{unique_name}", "--startup-command", "true", check=False)
    assert dup.returncode == 2 and "is taken by another live session" in dup.stdout + dup.stderr
    ids = {k: v["run_ids"][0] for k, v in (("ok", ok), ("bad", bad), ("slow", slow), ("later", later), ("clu", clu))}
    with agent([q], f"ss-{unique_name}", "cpu=4,memory=8Gi", tmp_path):
        runs = {k: r for k, r in zip(ids, wait_final(list(ids.values()), timeout=180))}
        runs = {k: read_runs([rid])[0] for k, rid in ids.items()}
    assert runs["ok"].state.is_completed(), runs["ok"].state
    greeting, name, omp, sid = (out_dir / "result.txt").read_text().split()
    assert (greeting, name, omp, sid) == ("hi", f"ok-{unique_name}", "3", ids["ok"])
    assert not list(Path("/tmp").glob(f"prefect-launch-sessions/{ids['ok']}")), "scratch deleted at the end"
    assert runs["bad"].state.is_failed() and "task-failed" in runs["bad"].state.message
    assert "exited with code 3" in runs["bad"].state.message
    assert runs["slow"].state.is_failed() and runs["slow"].state.message.startswith("task-timeout: timeout after 3 s")
    assert runs["later"].state.is_completed()
    assert runs["later"].start_time >= when - timedelta(seconds=1), "never before --starts-at"
    assert runs["clu"].state.is_completed(), runs["clu"].state
    assert sorted(p.read_text().split() for p in out_dir.glob("member-*.txt")) == \
        [["main1", "0", "2", ids["clu"]], ["sub1", "1", "2", ids["clu"]]]
    listed = {r["name"]: r for r in cli_json("session", "ls", "--owner", owner, "--ended")}
    assert listed[f"bad-{unique_name}"]["type"] == "batch" and "task-failed" in listed[f"bad-{unique_name}"]["reason"]
    from prefect import get_client

    with get_client(sync_client=True) as client:  # elapsed shown = Running -> end in the run's own history
        states = client.read_flow_run_states(ids["ok"])
    ran = (states[-1].timestamp - [s.timestamp for s in states if s.type.value == "RUNNING"][0]).total_seconds()
    assert abs(listed[f"ok-{unique_name}"]["elapsed_s"] - ran) < 1.0, (listed[f"ok-{unique_name}"], ran)
    recent = cli_json("session", "recent", "--owner", owner)
    assert len(recent) == 5 and recent[0]["request"]["name"] == f"later-{unique_name}"
    assert recent[1]["request"]["cluster_size"] == 2  # relaunch keeps the cluster


def test_interactive_session_serves_jupyter_with_token_then_terminates(tmp_path, unique_name):
    q = _queue(tmp_path, unique_name)
    owner = f"o{unique_name}"
    name = f"lab-{unique_name}"
    started = cli_json("session", "start", "--queue", q, "--owner", owner, "--name", name, "--json")
    port = started["ports"][0]
    with agent([q], f"si-{unique_name}", "cpu=2,memory=4Gi", tmp_path):
        deadline = time.time() + 150
        urls = []
        while time.time() < deadline and not urls:
            show = cli_json("session", "show", name, "--owner", owner)
            urls = show["app_urls"]
            time.sleep(1)
        assert urls, show
        url = urls[0]
        assert url.startswith(f"http://127.0.0.1:{port}/lab?token=")
        token = url.split("token=", 1)[1]
        ok = httpx.get(f"http://127.0.0.1:{port}/api/status", headers={"Authorization": f"token {token}"}, timeout=10)
        assert ok.status_code == 200, ok.text
        denied = httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=10)
        assert denied.status_code in (401, 403), "the app refuses requests without the token"
        renamed = cli_json("session", "rename", name, f"{name}-2", "--owner", owner)
        assert renamed["name"] == f"{name}-2"
        ended = cli_json("session", "terminate", f"{name}-2", "--owner", owner)
        assert ended["status"] == "Cancelled", ended
        time.sleep(1)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=3)
    waited = cli("session", "rename", f"{name}-2", "again-name", "--owner", owner, check=False)
    assert waited.returncode == 2 and "only a running session can be renamed" in waited.stdout + waited.stderr


def test_recent_history_keeps_five_and_pinned(tmp_path, unique_name):
    from prefect import get_client

    from prefect_launch.deployments.session_recent import load, remember, update
    from prefect_launch.deployments.sessions import SessionRequest

    owner = f"r{unique_name}"
    with get_client(sync_client=True) as client:
        first = remember(client, owner, SessionRequest(type="batch", queue="q", name="first-one", startup_command="a"))
        update(client, owner, first.id, pinned=True, label="my favourite")
        for i in range(6):
            remember(client, owner, SessionRequest(type="batch", queue="q", name=f"later-{i}", startup_command="b"))
        entries = load(client, owner).entries
    assert len(entries) == 6 and sum(e.pinned for e in entries) == 1
    assert [e.request["name"] for e in entries if not e.pinned] == [f"later-{i}" for i in range(5, 0, -1)]
    listed = cli_json("session", "recent", "--owner", owner)
    assert any(e["label"] == "my favourite" and e["pinned"] for e in listed)
