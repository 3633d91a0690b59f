"""`submit --secret-env NAME=block`: the job gets the Secret's value, nothing else ever holds it.

A real agent runs a job that records its environment to a file outside Prefect; then
everything a user or another process can read back is searched for the value: the
run (job variables, labels, state history), its logs, its events, the agent's log,
`runs show` / `runs ls`, `/flow_runs/history` and the monitor's data.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from launch_helpers import agent, apply_queue, cli, cli_json, read_runs, wait_final

pytestmark = pytest.mark.usefixtures("prefect_server")

PROBE = '''
import json, os
from pathlib import Path
from prefect import flow
from prefect.runtime import flow_run


@flow(name="secret-probe", log_prints=True)
def secret_probe(record_dir: str, var: str = "JOB_SECRET") -> None:
    value = os.environ.get(var)
    Path(record_dir, f"{flow_run.id}.json").write_text(json.dumps({"value": value}))
    print(f"{var} is set: {value is not None}")  # a job that logs its secret is the job's business
'''


@pytest.fixture(scope="module")
def env(prefect_server, tmp_path_factory):
    import prefect.context
    from prefect.blocks.system import Secret

    prefect.context.refresh_global_settings_context()
    u = uuid.uuid4().hex[:6]
    tmp = tmp_path_factory.mktemp("secret-env")
    queue = apply_queue(tmp, {"name": f"secq-{u}", "presets": {"one": {"cpu": 1, "memory": "512Mi"}},
                              "default_preset": "one"})
    src = tmp / "src"
    src.mkdir()
    (src / "secret_probe.py").write_text(PROBE)
    code = (
        "from prefect import flow\n"
        f"flow.from_source(source={str(src)!r}, entrypoint='secret_probe.py:secret_probe').deploy("
        f"name='secret-{u}', work_pool_name={queue!r}, work_queue_name='medium', build=False, push=False,"
        " print_next_steps=False)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=os.environ.copy(), timeout=120)
    value = f"s3cr3t-{uuid.uuid4().hex}"
    block = f"sec-{u}"
    Secret(value=value).save(block)
    records = tmp / "records"
    records.mkdir()
    with agent([queue], f"sec-agent-{u}", "cpu=1,memory=2Gi,gpu=0", tmp) as proc:
        yield {"queue": queue, "job": f"secret-probe/secret-{u}", "value": value, "block": block,
               "records": records, "log": tmp / f"agent-sec-agent-{u}.log", "u": u, "tmp": tmp, "agent": proc}


def _runs_of(job: str) -> int:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        return client.count_flow_runs(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[job.split("/")[1]])))


def _everything_about(run_id: str, queue: str) -> dict[str, str]:
    """What Prefect, the CLI and the monitor can show about the run, as text per source."""
    import httpx
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from prefect_launch.dashboard.spec import ViewSpec
    from prefect_launch.dashboard.view import load_view

    out: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        out["run"] = run.model_dump_json()
        out["states"] = json.dumps([s.model_dump(mode="json") for s in client.read_flow_run_states(run_id)])
        out["logs"] = json.dumps([lg.model_dump(mode="json") for lg in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))])
        dep = client.read_deployment(run.deployment_id)
        out["deployment"] = dep.model_dump_json()
    api = os.environ["PREFECT_API_URL"]
    deadline = time.time() + 60  # the server persists events in batches: the last one may lag the state
    while True:
        events = httpx.post(f"{api}/events/filter", json={"filter": {
            "any_resource": {"id_prefix": [f"prefect.flow-run.{run_id}"]},
            "occurred": {"since": (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)).isoformat()}},
            "limit": 50}, timeout=30)
        pages = []
        while True:
            events.raise_for_status()
            page = events.json()
            pages.append(events.text)
            if not page.get("next_page"):
                break
            events = httpx.get(page["next_page"], timeout=30)
        if "prefect.flow-run.Completed" in "".join(pages) or time.time() > deadline:
            break
        time.sleep(1)
    assert "prefect.flow-run.Completed" in "".join(pages), "the run's events were not read"
    out["events"] = "\n".join(pages)
    now = dt.datetime.now(dt.timezone.utc)
    history = httpx.post(f"{api}/flow_runs/history", json={
        "history_start": (now - dt.timedelta(hours=1)).isoformat(), "history_end": now.isoformat(),
        "history_interval_seconds": 300, "work_pools": {"name": {"any_": [queue]}}}, timeout=30)
    history.raise_for_status()
    out["history"] = history.text
    out["runs show"] = cli("runs", "show", run_id, "--json").stdout + cli("runs", "show", run_id).stdout
    out["runs ls"] = cli("runs", "ls", "--queue", queue, "--json").stdout
    view = load_view(ViewSpec(since=now - dt.timedelta(hours=1), until=now + dt.timedelta(minutes=1),
                              queues=(queue,), interval_s=300), use_cache=False)
    frames = {k: getattr(view, k) for k in ("runs", "errors", "hist", "metrics", "agents", "workers")}
    assert run_id in frames["runs"].to_json(default_handler=str, date_format="iso"), "the monitor does not show the run at all"
    out["dashboard"] = "\n".join(f.to_json(default_handler=str, date_format="iso") for f in frames.values()) + json.dumps(view.totals,
                                                                                                         default=str)
    return out


def test_secret_reaches_the_job_and_nothing_else(env):
    before = _runs_of(env["job"])
    out = cli_json("submit", env["job"], "--queue", env["queue"], "--secret-env", f"JOB_SECRET={env['block']}",
                   "--env", "JOB_PLAIN=visible", "--param", f"record_dir={env['records']}")
    (run_id,) = out["run_ids"]
    assert _runs_of(env["job"]) == before + 1
    (run,) = wait_final([run_id], timeout=180)
    assert run.state.is_completed(), run.state.message

    # the job process got the value
    assert json.loads((env["records"] / f"{run_id}.json").read_text()) == {"value": env["value"]}
    # the run holds the reference only
    assert run.job_variables["secret_env"] == {"JOB_SECRET": env["block"]}
    assert run.job_variables["env"] == {"JOB_PLAIN": "visible"}

    deadline = time.time() + 60  # logs and events reach the server in batches, after the final state
    seen = _everything_about(run_id, env["queue"])
    while "JOB_SECRET is set: True" not in seen["logs"] and time.time() < deadline:
        time.sleep(1)
        seen = _everything_about(run_id, env["queue"])
    assert env["block"] in seen["run"]
    assert "JOB_SECRET is set: True" in seen["logs"], "the job's own log line is missing: logs were not read"
    for source, text in seen.items():
        assert env["value"] not in text, f"the secret value appears in {source}"
    agent_log = env["log"].read_text()
    assert "JOB_SECRET is set: True" in agent_log, "the agent's log does not hold the run's output"
    assert env["value"] not in agent_log


def test_run_whose_secret_block_is_gone_crashes_with_the_reason(env):
    """A run created around `submit` (Prefect UI/API) naming a missing block: the agent refuses to start it,
    says why, frees its capacity, and the next run starts."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(env["job"])
        bad = client.create_flow_run_from_deployment(
            dep.id, parameters={"record_dir": str(env["records"])}, work_queue_name="medium",
            job_variables={"secret_env": {"JOB_SECRET": f"gone-{env['u']}"}})
    (run,) = wait_final([str(bad.id)], timeout=120)
    assert run.state.type.value in ("CRASHED", "FAILED"), run.state
    assert f"Secret block 'gone-{env['u']}' for JOB_SECRET no longer exists" in (run.state.message or ""), run.state.message
    assert not (env["records"] / f"{bad.id}.json").exists()
    # capacity came back: the agent (one run at a time) runs the next one
    ok = cli_json("submit", env["job"], "--queue", env["queue"], "--secret-env", f"JOB_SECRET={env['block']}",
                  "--param", f"record_dir={env['records']}")
    (done,) = wait_final(ok["run_ids"], timeout=120)
    assert done.state.is_completed(), done.state.message


# ------------------------------------------------------------------ refused before anything is enqueued
def _refused(env, *args: str, expect: str) -> None:
    before = _runs_of(env["job"])
    proc = cli("submit", env["job"], "--queue", env["queue"], *args, "--param", f"record_dir={env['records']}",
               check=False)
    assert proc.returncode != 0, proc.stdout
    assert expect in proc.stderr, proc.stderr
    assert env["value"] not in proc.stderr + proc.stdout
    assert _runs_of(env["job"]) == before, "a refused submission enqueued a run"


def test_secret_env_missing_block(env):
    _refused(env, "--secret-env", "JOB_SECRET=no-such-block", expect="no Secret block named 'no-such-block'")


def test_secret_env_block_of_another_type(env):
    from prefect_launch.blocks.queue_links import QueueLinks

    name = f"notsecret-{env['u']}"
    QueueLinks(queue=env["queue"]).save(name, overwrite=True)
    _refused(env, "--secret-env", f"JOB_SECRET={name}",
             expect=f"block '{name}' (for JOB_SECRET) is a Launch Queue Links block, not a Secret")


def test_secret_env_invalid_name(env):
    _refused(env, "--secret-env", f"1BAD={env['block']}", expect="invalid environment variable name '1BAD'")


def test_secret_env_reserved_name(env):
    _refused(env, "--secret-env", f"CUDA_VISIBLE_DEVICES={env['block']}",
             expect="--secret-env cannot set 'CUDA_VISIBLE_DEVICES'")


def test_secret_env_without_equals(env):
    _refused(env, "--secret-env", "JOB_SECRET", expect="bad --secret-env 'JOB_SECRET': expected NAME=secret-block-name")


def test_secret_env_bad_block_name(env):
    _refused(env, "--secret-env", "JOB_SECRET=Bad_Name", expect="bad Secret block name 'Bad_Name'")


def test_secret_env_twice(env):
    _refused(env, "--secret-env", f"JOB_SECRET={env['block']}", "--secret-env", f"JOB_SECRET={env['block']}",
             expect="'JOB_SECRET' is given twice in --secret-env")


def test_secret_env_and_plain_env_for_one_name(env):
    _refused(env, "--env", "JOB_SECRET=plain", "--secret-env", f"JOB_SECRET={env['block']}",
             expect="'JOB_SECRET' is given with both --env and --secret-env")


def test_secret_env_from_python_api_stores_the_reference_only(env):
    from prefect import get_client

    from prefect_launch.deployments.submit import SubmitRequest, submit
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    with get_client(sync_client=True) as client:
        with pytest.raises(LaunchValidationError, match="no Secret block named 'nope'"):
            submit(client, SubmitRequest(job=env["job"], params={"record_dir": str(env["records"])},
                                         secret_env={"JOB_SECRET": "nope"}))
        out = submit(client, SubmitRequest(job=env["job"], params={"record_dir": str(env["records"])},
                                           secret_env={"JOB_SECRET": env["block"]}))
    (run,) = wait_final(out.run_ids, timeout=120)
    assert run.state.is_completed()
    assert run.job_variables == {"secret_env": {"JOB_SECRET": env["block"]}}
    assert json.loads((env["records"] / f"{out.run_ids[0]}.json").read_text()) == {"value": env["value"]}
    assert env["value"] not in read_runs(out.run_ids)[0].model_dump_json()
