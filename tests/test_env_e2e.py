"""Job environments end to end (issue 39 sections 2 and 4): a real server, one agent, jobs whose flow imports a
package only their environment has, built with uv from a local wheel folder (no network).

Assertions come from the jobs' own records (the package version each saw, its interpreter) and from the
scheduling history (``build`` records: cache miss, then hit), never from what the agent says about itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from env_wheels import slow_index, wheel_folder, write_wheel
from launch_helpers import ROOT, LabelWatch, agent, apply_queue, cli, cli_json, records, wait_final

pytestmark = pytest.mark.usefixtures("prefect_server")


def _deploy(queue: str, name: str, job_variables: dict) -> str:
    import prefect.context
    from prefect import flow

    prefect.context.refresh_global_settings_context()
    flow.from_source(source=str(ROOT / "tests" / "jobs"), entrypoint="env_job.py:env_job").deploy(
        name=name, work_pool_name=queue, work_queue_name="medium", build=False, push=False,
        print_next_steps=False, job_variables=job_variables)
    return f"env-job/{name}"


def _history(run_id: str, phase: str, timeout: float = 30) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        rows = [r for r in cli_json("history", run_id) if r["phase"] == phase]
        if rows or time.time() > deadline:
            return rows
        time.sleep(0.5)


def test_code_jobs_get_their_own_cached_environments(tmp_path: Path, unique_name: str, monkeypatch):
    wheels = wheel_folder(tmp_path / "wheels")
    write_wheel(wheels, "iniconfig", "0.0.1")  # shadows a package the agent has (pytest's): that run starts cold
    monkeypatch.setenv("LAUNCH_ENV_DIR", str(tmp_path / "envs"))
    (tmp_path / "requirements.txt").write_text("launchtiny==1.0\nlaunchalpha\n")
    q = apply_queue(tmp_path, {"name": f"env-{unique_name}", "presets": {"small": {"cpu": 0.5, "memory": "512Mi"}},
                               "default_preset": "small"})
    job = _deploy(q, f"env-{unique_name}", {"environment": {"requirements": str(tmp_path / "requirements.txt"),
                                                            "find_links": str(wheels)}})
    rec = tmp_path / "records"

    def submit(tag: str, *extra: str, seconds: float = 0.5) -> str:
        return cli_json("submit", job, "--queue", q, "--param", f"record_dir={rec}", "--param", f"tag={tag}",
                        "--param", f"seconds={seconds}", *extra)["run_ids"][0]

    # bad input is refused before anything is enqueued
    bad = cli("submit", job, "--queue", q, "--dry-run", "--environment", str(tmp_path / "missing.txt"), check=False)
    assert bad.returncode != 0 and "missing.txt" in bad.stdout + bad.stderr and "does not exist" in bad.stdout + bad.stderr
    bad = cli("submit", job, "--queue", q, "--environment", '{"requirements": ["-r other.txt"]}', check=False)
    assert bad.returncode != 0 and "list its pins inline" in bad.stdout + bad.stderr
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(job)
        assert client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))) == []

    pin2 = json.dumps({"requirements": ["launchtiny==2.0", "iniconfig==0.0.1"], "find_links": str(wheels)})
    nope = json.dumps({"requirements": ["launchnope==9"], "find_links": str(wheels)})
    write_wheel(tmp_path / "index", "launchtiny", "3.0")
    # a build that takes a while (its index answers 3 s late): the run's waiting reason says it is building
    with slow_index(tmp_path / "index", delay=3.0) as index_url, LabelWatch() as labels, \
            agent([q], f"env-{unique_name}", "cpu=2,memory=4Gi", tmp_path):
        first = submit("one", "--param", "meet=two", seconds=1)  # each waits for the other's start
        other = submit("two", "--environment", pin2, "--param", "meet=one", seconds=1)
        broken = submit("bad", "--environment", nope)
        slow = submit("slow", "--environment", json.dumps({"requirements": ["launchtiny==3.0"],
                                                            "index_url": index_url}))
        labels.run_ids.append(slow)
        runs = {str(r.id): r for r in wait_final([first, other, broken, slow], timeout=120)}
        again = submit("again")
        runs.update({str(r.id): r for r in wait_final([again], timeout=60)})
        listed = cli_json("env", "ls")["environments"]  # the agent's cache, read by the CLI on this host

    assert all(runs[r].state.is_completed() for r in (first, other, again, slow)), {
        k: (v.state_name, v.state.message) for k, v in runs.items()}
    got = records(rec)
    # each run saw its own pin, from its own environment (two jobs side by side, one agent)
    assert (got[first]["launchtiny"], got[other]["launchtiny"], got[again]["launchtiny"]) == ("1.0", "2.0", "1.0")
    envs = str(tmp_path / "envs")
    assert all(got[r]["launchtiny_file"].startswith(envs) for r in (first, other, again))
    assert got[first]["launchtiny_file"] == got[again]["launchtiny_file"] != got[other]["launchtiny_file"]
    # only new packages: a warm engine (the agent's interpreter) with the environment first on sys.path;
    # one that shadows an agent package: a cold start in the environment's own interpreter
    assert not got[first]["prefix"].startswith(envs) and got[other]["prefix"].startswith(envs)
    overlap = got[first]["start"] < got[other]["end"] and got[other]["start"] < got[first]["end"]
    assert overlap, "the two environments' runs ran side by side"
    # built once: a miss for the first run of a hash, a hit for the next one
    assert [r["error_code"] for r in _history(first, "build")] == ["env-cache-miss"]
    assert [r["error_code"] for r in _history(again, "build")] == ["env-cache-hit"]
    # a package that does not resolve: Failed with the installer's words, nothing left that looks complete
    failed = runs[broken]
    assert failed.state.is_failed() and failed.state.message.startswith("environment build failed:")
    assert "launchnope" in failed.state.message
    assert [r["result"] for r in _history(broken, "build")] == ["FAILURE"]
    complete = {p.name for p in (tmp_path / "envs").iterdir() if (p / "launch-env.json").is_file()}
    assert len(complete) == 3 and not list((tmp_path / "envs").glob(".build-*"))
    assert {e["hash"] for e in listed} == complete
    # while it was built, the slow run's waiting reason said so: "building environment <hash>, <n> s on agent a"
    assert got[slow]["launchtiny"] == "3.0"
    (slow_hash,) = [e["hash"] for e in listed if e["pins"] == ["launchtiny==3.0"]]
    assert any(t.startswith(f"building environment {slow_hash[:8]}, ") and t.endswith(f"s on agent env-{unique_name}")
               for t in labels.seen.get(slow, [])), labels.seen
