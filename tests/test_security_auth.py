"""Prefect's API auth string end to end, and `setup` keeping the store's password out of sight.

A second Prefect server of this module's own is started with
PREFECT_SERVER_API_AUTH_STRING; the CLI, an agent (with its event subscription), a job
run and the monitor's data layer all talk to it with PREFECT_API_AUTH_STRING, and are
refused without it. Everything runs as subprocesses with their own environment, so the
session's server (and other test modules) are not touched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from fixtures_pg import pg_server  # noqa: F401  (session PostgreSQL; skips without one)
from launch_helpers import CLI, ROOT
from prefect_launch.local_server import background_process, local_prefect_server

pytestmark = pytest.mark.server  # its own server, with an auth string

AUTH = f"launch:pw-{uuid.uuid4().hex[:12]}"


def _env(server: dict, auth: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY"))}
    env.update(PREFECT_API_URL=server["api"], PREFECT_HOME=str(server["home"]), LAUNCH_POLL_SECONDS="1")
    env.pop("LAUNCH_METRICS_BLOCK", None)
    if auth:
        env["PREFECT_API_AUTH_STRING"] = AUTH
    return env


def _run(env: dict, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _cli(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(env, *CLI, *args, check=check)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home-auth")
    with local_prefect_server(home, export=False, auth_string=AUTH) as api:
        yield {"api": api, "home": home, "tmp": tmp_path_factory.mktemp("auth-work")}


def test_server_refuses_requests_without_the_auth_string(server):
    assert httpx.get(server["api"] + "/health", timeout=10).status_code == 200  # probes stay open
    assert httpx.post(server["api"] + "/flows/filter", json={}, timeout=10).status_code == 401
    assert httpx.post(server["api"] + "/flows/filter", json={}, auth=("launch", "wrong"), timeout=10).status_code == 401
    user, password = AUTH.split(":", 1)
    assert httpx.post(server["api"] + "/flows/filter", json={}, auth=(user, password), timeout=10).status_code == 200

    wrong = dict(_env(server), PREFECT_API_AUTH_STRING="launch:wrong")
    for env in (_env(server, auth=False), wrong):
        refused = _cli(env, "queue", "ls", "--json", check=False)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "refused the request (401 Unauthorized)" in refused.stderr
        assert "export PREFECT_API_AUTH_STRING=user:password" in refused.stderr
        assert "Traceback" not in refused.stderr


def test_cli_agent_job_and_monitor_work_with_the_auth_string(server):
    env = _env(server)
    tmp = server["tmp"]
    u = uuid.uuid4().hex[:6]
    out = json.loads(_cli(env, "setup", "--json").stdout)
    assert out["action"] in ("created", "kept")
    queue = f"auth-{u}"
    qfile = tmp / "queues.yaml"
    qfile.write_text(yaml.safe_dump({"queues": [{"name": queue, "presets": {"s": {"cpu": 1, "memory": "512Mi"}},
                                                 "default_preset": "s"}]}))
    _cli(env, "queue", "apply", str(qfile))
    code = (
        "from prefect import flow\n"
        f"flow.from_source(source={str(ROOT / 'flows')!r}, entrypoint='probe.py:probe').deploy("
        f"name='auth-{u}', work_pool_name={queue!r}, work_queue_name='medium', build=False, push=False,"
        " print_next_steps=False)\n"
    )
    _run(env, sys.executable, "-c", code)
    records = tmp / "records"
    agent_args = [*CLI, "agent", "--name", f"auth-agent-{u}", "--capacity", "cpu=1,memory=1Gi,gpu=0", "--queue", queue]
    with background_process(agent_args, tmp / "agent.log", env=env) as agent:
        deadline = time.time() + 60
        while True:
            agents = {a["name"]: a for a in json.loads(_cli(env, "agent", "ls", "--json").stdout)}
            if agents.get(f"auth-agent-{u}", {}).get("online"):
                break
            assert agent.poll() is None, (tmp / "agent.log").read_text()[-3000:]
            assert time.time() < deadline, "the agent never came online on the auth-string server"
            time.sleep(0.5)
        sub = json.loads(_cli(env, "submit", f"probe/auth-{u}", "--queue", queue, "--param",
                              f"record_dir={records}", "--param", "seconds=0.2", "--json").stdout)
        (run_id,) = sub["run_ids"]
        deadline = time.time() + 150
        while True:
            runs = {r["run_id"]: r for r in json.loads(_cli(env, "runs", "ls", "--queue", queue, "--json").stdout)}
            state = (runs.get(run_id, {}).get("state") or "").upper()
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert time.time() < deadline, f"run stuck in {state}:\n{(tmp / 'agent.log').read_text()[-3000:]}"
            time.sleep(1)
        assert state == "COMPLETED", (tmp / "agent.log").read_text()[-3000:]
    assert json.loads((records / f"{run_id}.json").read_text())["run_id"] == run_id
    shown = json.loads(_cli(env, "runs", "show", run_id, "--json").stdout)
    assert json.dumps(shown).count(run_id) >= 1
    log = (tmp / "agent.log").read_text()
    # a 401 status, not the digits inside a run id or a timestamp's milliseconds (…-a61d-c99dd4011a07, 46.401)
    assert not re.search(r"(?<![\w.:-])401(?![\w.:-])", log) and "Unauthorized" not in log, log[-3000:]

    # the monitor's data layer with and without the auth string
    probe = (
        "import datetime as dt, json, sys\n"
        "from prefect_launch.dashboard.spec import ViewSpec\n"
        "from prefect_launch.dashboard.view import load_view, options\n"
        "now = dt.datetime.now(dt.timezone.utc)\n"
        f"v = load_view(ViewSpec(since=now - dt.timedelta(hours=1), until=now + dt.timedelta(minutes=1), "
        f"queues=({queue!r},), interval_s=300), use_cache=False)\n"
        "print(json.dumps({'runs': [str(i) for i in v.runs['id']], 'queues': options()['queues']}))\n"
    )
    seen = json.loads(_run(env, sys.executable, "-c", probe).stdout.strip().splitlines()[-1])
    assert run_id in seen["runs"] and queue in seen["queues"]
    refused = _run(_env(server, auth=False), sys.executable, "-c", probe, check=False)
    assert refused.returncode != 0 and "401" in refused.stderr


# ------------------------------------------------------------------------ setup and the store's password
def test_setup_never_prints_the_store_password(server, pg_server):
    from prefect_launch.local_server import create_database, pg_url

    env = _env(server)
    db = "sec_" + uuid.uuid4().hex[:8]
    create_database(pg_server["port"], db)
    password = f"Pw{uuid.uuid4().hex[:10]}!x"
    base = pg_url(pg_server["port"], db)  # postgresql+psycopg://launch@127.0.0.1:port/db (trust auth)
    with_password = base.replace("launch@", f"launch:{password.replace('!', '%21')}@")
    env["LAUNCH_METRICS_BLOCK"] = f"store-{uuid.uuid4().hex[:6]}"

    for args in (["setup", "--metrics-url", with_password], ["setup", "--metrics-url", with_password, "--json"], ["setup"]):
        proc = _cli(env, *args)
        text = proc.stdout + proc.stderr
        assert password not in text and password.replace("!", "%21") not in text, text
    out = json.loads(_cli(env, "setup", "--json").stdout)
    assert out["password"] == "block" and out["action"] == "kept"
    assert out["url"] == base  # shown without any password

    # what is stored: the URL without the password; the password only in the encrypted field
    read = (
        "import json; from prefect_launch.blocks.metrics_store import RunMetricsStore as S\n"
        "import os; s = S.load(os.environ['LAUNCH_METRICS_BLOCK'])\n"
        "print(json.dumps({'url': s.url, 'pw': s.password.get_secret_value() if s.password else None,"
        " 'secret': s.password_secret, 'v': s.schema_version()}))\n"
    )
    stored = json.loads(_run(env, sys.executable, "-c", read).stdout.strip().splitlines()[-1])
    assert stored["url"] == base and stored["pw"] == password and stored["v"] >= 1
    raw = httpx.post(server["api"] + "/block_documents/filter", auth=tuple(AUTH.split(":", 1)), timeout=10,
                     json={"block_documents": {"name": {"any_": [env["LAUNCH_METRICS_BLOCK"]]}}}).text
    assert password not in raw  # the API obfuscates it

    # the password from a Secret block instead
    secret = f"store-pw-{uuid.uuid4().hex[:6]}"
    _run(env, sys.executable, "-c",
         f"from prefect.blocks.system import Secret; Secret(value={password!r}).save({secret!r})")
    proc = _cli(env, "setup", "--metrics-password-secret", secret, "--json")
    assert password not in proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["action"] == "updated" and out["password"] == f"secret:{secret}" and out["url"] == base
    stored = json.loads(_run(env, sys.executable, "-c", read).stdout.strip().splitlines()[-1])
    assert stored == {"url": base, "pw": None, "secret": secret, "v": stored["v"]}
    resolved = _run(env, sys.executable, "-c",
                    "import os; from prefect_launch.blocks.metrics_store import RunMetricsStore as S; "
                    "print(S.load(os.environ['LAUNCH_METRICS_BLOCK']).resolved_url())").stdout.strip()
    import sqlalchemy as sa

    assert sa.engine.make_url(resolved).password == password  # connects with the Secret's password

    # bad input: both at once, a missing Secret block, a malformed URL (never echoed back)
    both = _cli(env, "setup", "--metrics-url", with_password, "--metrics-password-secret", secret, check=False)
    assert both.returncode != 0 and "not both" in both.stderr and password not in both.stderr + both.stdout
    missing = _cli(env, "setup", "--metrics-password-secret", "no-such-secret", check=False)
    assert missing.returncode != 0 and "no Secret block named 'no-such-secret'" in missing.stderr
    bad = _cli(env, "setup", "--metrics-url", f"postgresql+psycopg://u:{password}@host:notaport/db", check=False)
    assert bad.returncode != 0 and "malformed metrics store URL" in bad.stderr and password not in bad.stderr
