"""Bad input not covered elsewhere: what the user gets from the CLI, the Python API and prefect.yaml.

Every case asserts the message and a non-zero exit (CLI) or the exception (Python);
submissions also assert that nothing was enqueued. docs/bad-input.md lists these rows
together with the cases tested in other modules.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from launch_helpers import ROOT, apply_queue, cli, deploy_probe

pytestmark = pytest.mark.usefixtures("prefect_server")


@pytest.fixture(scope="module")
def site(prefect_server, tmp_path_factory):
    import prefect.context

    prefect.context.refresh_global_settings_context()
    u = uuid.uuid4().hex[:6]
    tmp = tmp_path_factory.mktemp("bad-input")
    queue = apply_queue(tmp, {"name": f"bad-{u}", "presets": {"s": {"cpu": 1, "memory": "1Gi"}},
                              "default_preset": "s", "bounds": {"gpu": {"max": 2}}})
    job = deploy_probe(queue, f"bad-{u}")
    # a second job of the same name under another flow: "bad-<u>" alone is ambiguous
    code = ("from prefect import flow\n"
            f"flow.from_source(source={str(ROOT / 'flows')!r}, entrypoint='versioned.py:versioned').deploy("
            f"name='bad-{u}', work_pool_name={queue!r}, build=False, push=False, print_next_steps=False)\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    return {"queue": queue, "job": job, "name": f"bad-{u}", "tmp": tmp, "u": u}


def _runs(site) -> int:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        return client.count_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[site["name"]])))


def _refused(*args: str, expect: str) -> str:
    proc = cli(*args, check=False)
    assert proc.returncode != 0, proc.stdout
    text = " ".join((proc.stderr + proc.stdout).split())
    assert expect in text, text
    assert "Traceback" not in text
    return text


# ------------------------------------------------------------------------------ CLI: submit
SUBMIT_CASES = {
    "param_without_equals": (["--param", "seconds"], "bad --param 'seconds': expected key=value"),
    "param_empty_name": (["--param", "=3"], "bad --param '=3': empty name"),
    "env_without_equals": (["--env", "NOEQUALS"], "bad --env 'NOEQUALS': expected NAME=value"),
    "count_zero": (["--count", "0"], "Invalid value for '--count'"),
    "count_too_many": (["--count", "1001"], "Invalid value for '--count'"),
    "cpu_not_a_number": (["--cpu", "abc"], "Invalid value for '--cpu'"),
    "cpu_zero": (["--cpu", "0"], "cpu must be positive in the submission"),
    "gpu_negative": (["--gpu", "-1"], "-1 is less than the minimum of 0"),
    "gpu_above_bounds": (["--gpu", "3"], "gpu=3 is above the queue maximum 2"),
    "missing_required_parameter": (["--no-record-dir"], "'record_dir' is a required property"),
}


@pytest.mark.parametrize("case", sorted(SUBMIT_CASES))
def test_submit_refuses(site, case):
    args, expect = SUBMIT_CASES[case]
    params = [] if args == ["--no-record-dir"] else ["--param", f"record_dir={site['tmp']}"]
    args = [] if args == ["--no-record-dir"] else args
    before = _runs(site)
    text = _refused("submit", site["job"], "--queue", site["queue"], *args, *params, expect=expect)
    assert _runs(site) == before, f"a refused submission enqueued a run: {text}"


def test_submit_ambiguous_job_name(site):
    _refused("submit", site["name"], expect=f"job name '{site['name']}' is ambiguous; use FLOW/DEPLOYMENT")


# ------------------------------------------------------------------------------ CLI: agents, runs, queues
def test_agent_without_queue():
    _refused("agent", expect="give at least one --queue")


def test_agent_unknown_queue(site):
    _refused("agent", "--queue", f"nope-{site['u']}", "--capacity", "cpu=1,memory=1Gi",
             expect=f"unknown queue 'nope-{site['u']}'; create it with `prefect-launch queue apply FILE`")


def test_agent_unknown_capacity_key(site):
    _refused("agent", "--queue", site["queue"], "--capacity", "tpu=1", expect="unknown capacity key 'tpu'")


def test_runs_show_short_id():
    _refused("runs", "show", "abc", expect="give the full id or at least 8 characters of it")


def test_runs_show_run_without_metrics():
    rid = str(uuid.uuid4())
    _refused("runs", "show", rid, expect=f"no metrics recorded for run {rid}")


def test_runs_ls_unknown_state():
    _refused("runs", "ls", "--state", "BOGUS", expect="unknown state in ['BOGUS']; use one of SCHEDULED")


def test_queue_ls_unknown_queue(site):
    _refused("queue", "ls", f"nope-{site['u']}", expect=f"unknown queue(s): nope-{site['u']}")


QUEUE_FILES = {
    "missing_file": (None, "does not exist"),
    "not_yaml": ("queues: [\n", "is not valid YAML"),
    "empty_file": ("", "queues: Field required"),
    "unknown_target": ("queues:\n  - name: x\n    target: mainframe\n    presets: {a: {cpu: 1, memory: 1Gi}}\n"
                       "    default_preset: a\n", "Input should be 'process', 'docker' or 'kubernetes'"),
    "malformed_preset_memory": ("queues:\n  - name: x\n    presets: {a: {cpu: 1, memory: lots}}\n    default_preset: a\n",
                                "malformed size 'lots'"),
    "preset_out_of_bounds": ("queues:\n  - name: x\n    presets: {big: {cpu: 64, memory: 1Gi}}\n    default_preset: big\n"
                             "    bounds: {cpu: {max: 8}}\n", "preset 'big' is out of bounds: cpu=64 is above the queue maximum 8"),
}


@pytest.mark.parametrize("case", sorted(QUEUE_FILES))
def test_queue_file_refused(tmp_path, case):
    content, expect = QUEUE_FILES[case]
    path = tmp_path / "queues.yaml"
    if content is not None:
        path.write_text(content)
    _refused("queue", "apply", str(path), expect=expect)


def test_cli_without_a_server_url(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "prefect_launch.cli", "queue", "ls"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2 and "PREFECT_API_URL is not set" in proc.stderr


# ------------------------------------------------------------------------------ Python API
def test_python_api_refuses_the_same_way(site):
    from prefect import get_client
    from pydantic import ValidationError

    from prefect_launch.deployments.submit import SubmitRequest, submit
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    with pytest.raises(ValidationError, match="count"):
        SubmitRequest(job=site["job"], count=0)
    before = _runs(site)
    cases = [
        (dict(job=f"probe/nope-{site['u']}"), "unknown job"),
        (dict(job=site["job"], env={"1BAD": "x"}), "invalid environment variable name '1BAD'"),
        (dict(job=site["job"], preset="huge"), "unknown preset 'huge'"),
        (dict(job=site["job"], params={"record_dir": str(site["tmp"]), "seconds": "soon"}), "bad parameter value"),
        (dict(job=site["job"], queue=f"nope-{site['u']}"), "unknown queue"),
        (dict(job=site["job"], secret_env={"JOB_X": "missing-block"}), "no Secret block named 'missing-block'"),
    ]
    with get_client(sync_client=True) as client:
        for kwargs, expect in cases:
            with pytest.raises(LaunchValidationError, match=expect.replace("(", r"\(")):
                submit(client, SubmitRequest(**kwargs))
    assert _runs(site) == before


# ------------------------------------------------------------------------------ prefect.yaml values
def test_unwritable_code_storage_fails_the_deploy(site, tmp_path):
    from prefect_launch.deployments.jobs import JobDeployError, deploy_jobs

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "prefect.yaml", project / "prefect.yaml")
    shutil.copytree(ROOT / "flows", project / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    blocker = tmp_path / "storage-is-a-file"
    blocker.write_text("x")
    with pytest.raises(JobDeployError) as exc:
        deploy_jobs(project / "prefect.yaml", names=["versioned-code"], pool=site["queue"],
                    env={"LAUNCH_CODE_STORAGE": str(blocker)})
    assert "check that LAUNCH_CODE_STORAGE is writable" in str(exc.value)


def test_prefect_yaml_without_deployments(tmp_path):
    from prefect_launch.deployments.jobs import JobDeployError, deploy_jobs

    bad = tmp_path / "prefect.yaml"
    bad.write_text(yaml.safe_dump({"name": "x"}))
    with pytest.raises(JobDeployError, match="declares no deployments"):
        deploy_jobs(bad)
    with pytest.raises(JobDeployError, match="not found"):
        deploy_jobs(tmp_path / "missing.yaml")
    bad.write_text("deployments: [\n")
    with pytest.raises(JobDeployError, match="is not valid YAML"):
        deploy_jobs(bad)
