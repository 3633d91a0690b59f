"""The three kinds of launch job, registered from prefect.yaml and run end to end.

Each job is registered from the project's own prefect.yaml with Prefect's
`prefect deploy` (through ``deploy_jobs``), on queues made unique for this
module from deployments/queues.yaml (``--pool``), then submitted through the
`prefect-launch` CLI to a real agent. What ran is read back from the runs'
persisted results, i.e. from the code that actually executed:

- code-based: the code is a snapshot pushed to LAUNCH_CODE_STORAGE at deploy
  time and pulled into the run's temporary working directory;
- git-based: the repository is cloned at the commit the branch/tag/commit
  named by LAUNCH_GIT_REF pointed to at deploy time;
- image-based: registered with its image; submission validates presets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launch_helpers import ROOT, agent, cli, cli_json, wait_final
from prefect_launch.deployments.jobs import JobDeployError, declared_jobs, deploy_jobs

pytestmark = pytest.mark.usefixtures("prefect_server")

PREFECT_FILE = ROOT / "prefect.yaml"
VERSION_LINE = 'VERSION = "tree"'


def _declared() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load(PREFECT_FILE.read_text())["deployments"]}


def _deployment(job: str):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(job)


def _result(run) -> dict:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    return state.result()


def _submit(job: str, queue: str, *args: str) -> str:
    out = cli_json("submit", job, "--queue", queue, *args)
    assert len(out["run_ids"]) == 1
    return out["run_ids"][0]


def _run_to_completion(job: str, queue: str, *args: str):
    run_id = _submit(job, queue, *args)
    (run,) = wait_final([run_id], timeout=150)
    assert run.state.is_completed(), f"{job} run {run_id} ended {run.state.name}: {run.state.message}"
    return run


def _under(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


# ------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def in_process_client(prefect_server):
    """Prefect freezes its settings on import (here: at collection, before the server fixture set
    PREFECT_API_URL); refresh them so this process's clients talk to the test server."""
    import prefect.context
    from prefect import get_client

    prefect.context.refresh_global_settings_context()
    with get_client(sync_client=True) as client:
        assert str(client.api_url).rstrip("/") == prefect_server.rstrip("/")


@pytest.fixture(scope="module")
def uid() -> str:
    import uuid

    return uuid.uuid4().hex[:6]


@pytest.fixture(scope="module")
def queues(prefect_server, tmp_path_factory, uid) -> dict[str, str]:
    """The example queues under names unique to this module: example name -> queue."""
    data = yaml.safe_load((ROOT / "deployments" / "queues.yaml").read_text())
    names = {}
    for q in data["queues"]:
        names[q["name"]] = q["name"] = f"{q['name']}-jk{uid}"
    path = tmp_path_factory.mktemp("queues") / "queues.yaml"
    path.write_text(yaml.safe_dump(data))
    cli("queue", "apply", str(path))
    return names


@pytest.fixture(scope="module")
def launch_agent(queues, tmp_path_factory, uid):
    """One agent serving the two process queues; stopped (process group) even on failure."""
    with agent([queues["gpu-box"], queues["cpu-pool"]], f"jobs-{uid}", "cpu=2,memory=4Gi,gpu=2",
               tmp_path_factory.mktemp("agent")) as proc:
        yield proc


@pytest.fixture(scope="module")
def git_repo(tmp_path_factory, uid) -> dict[str, str]:
    """A real local repository: flows/versioned.py and examples/ at tag v1, versioned.py changed by a second
    commit on main."""
    repo = tmp_path_factory.mktemp("gitrepo") / "jobs-repo"
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    source = (ROOT / "flows" / "versioned.py").read_text()
    assert VERSION_LINE in source
    (repo / "flows").mkdir(parents=True)
    git("init", "-q", "-b", "main")
    pinned, head = f"pinned-{uid}", f"head-{uid}"
    (repo / "flows" / "versioned.py").write_text(source.replace(VERSION_LINE, f'VERSION = "{pinned}"'))
    shutil.copytree(ROOT / "examples", repo / "examples",  # report-git-env's flow and requirements
                    ignore=shutil.ignore_patterns("__pycache__"))
    git("add", "flows", "examples")
    git("commit", "-q", "-m", "v1")
    git("tag", "v1")
    first = git("rev-parse", "HEAD")
    (repo / "flows" / "versioned.py").write_text(source.replace(VERSION_LINE, f'VERSION = "{head}"'))
    git("commit", "-q", "-am", "v2")
    return {"path": str(repo), "first": first, "head_sha": git("rev-parse", "HEAD"),
            "pinned": pinned, "head": head}


# ------------------------------------------------------------------------ code-based
def test_code_based_job_runs_from_the_pulled_snapshot(queues, launch_agent, tmp_path, uid):
    storage = tmp_path / "storage"
    deployed = deploy_jobs(PREFECT_FILE, names=["versioned-code"], env={"LAUNCH_CODE_STORAGE": str(storage)},
                           pool=queues["cpu-pool"])
    assert deployed == ["versioned/versioned-code"]

    dep = _deployment("versioned/versioned-code")
    snapshot = storage / "code" / dep.version
    assert (snapshot / "flows" / "versioned.py").read_text() == (ROOT / "flows" / "versioned.py").read_text()
    (step,) = dep.pull_steps
    assert step["prefect.deployments.steps.pull_from_remote_storage"]["path"] == str(snapshot)

    # The snapshot, not the developer's tree, is what runs: change only the snapshot.
    stored = snapshot / "flows" / "versioned.py"
    stored.write_text(stored.read_text().replace(VERSION_LINE, f'VERSION = "snapshot-{uid}"'))
    assert VERSION_LINE in (ROOT / "flows" / "versioned.py").read_text()

    run = _run_to_completion("versioned/versioned-code", queues["cpu-pool"], "--param", f"note={uid}")
    result = _result(run)
    assert result["version"] == f"snapshot-{uid}"
    assert result["note"] == uid
    # pulled into the run's own working directory: neither the tree nor the storage itself
    assert _under(result["file"], Path(result["cwd"]))
    assert not _under(result["file"], ROOT)
    assert not _under(result["file"], storage)


def test_code_based_example_jobs_train_and_evaluate(queues, launch_agent, tmp_path):
    storage = tmp_path / "storage"
    env = {"LAUNCH_CODE_STORAGE": str(storage)}
    assert deploy_jobs(PREFECT_FILE, names=["train-code"], env=env, pool=queues["gpu-box"]) == ["train/train-code"]
    assert deploy_jobs(PREFECT_FILE, names=["evaluate-code"], env=env, pool=queues["cpu-pool"]) == [
        "evaluate/evaluate-code"]
    declared = _declared()
    for job, name in (("train/train-code", "train-code"), ("evaluate/evaluate-code", "evaluate-code")):
        dep = _deployment(job)
        assert dep.job_variables == declared[name]["work_pool"]["job_variables"]
        assert dep.parameters == declared[name]["parameters"]
        assert (storage / "code" / dep.version / "flows").is_dir()

    train = _run_to_completion("train/train-code", queues["gpu-box"], "--param", "epochs=30")
    evaluate = _run_to_completion("evaluate/evaluate-code", queues["cpu-pool"], "--param", "n_samples=800")
    # the deployment's preset (job_variables) applied to the runs
    assert train.labels["launch.preset"] == declared["train-code"]["work_pool"]["job_variables"]["preset"]
    assert evaluate.labels["launch.preset"] == declared["evaluate-code"]["work_pool"]["job_variables"]["preset"]
    t, e = _result(train), _result(evaluate)
    assert t["final_loss"] < t["first_loss"]
    assert 0.5 < e["accuracy"] <= 1.0


def test_code_based_example_job_with_its_own_environment(queues, launch_agent, tmp_path):
    """report-env imports tabulate, which the agent's Python lacks: the agent builds its environment from
    examples/requirements-report.txt (here from a local wheel folder standing in for the package index)."""
    import importlib.util
    import json

    from env_wheels import write_wheel

    assert importlib.util.find_spec("tabulate") is None, "the agent must lack the example's package"
    wheels = tmp_path / "wheels"
    write_wheel(wheels, "tabulate", "0.9.0", body="def tabulate(rows, headers=()):\n    return repr((list(rows), headers))\n")
    env = {"LAUNCH_CODE_STORAGE": str(tmp_path / "storage")}
    assert deploy_jobs(PREFECT_FILE, names=["report-env"], env=env, pool=queues["cpu-pool"]) == ["report/report-env"]
    assert _deployment("report/report-env").job_variables["environment"] == _declared()["report-env"]["work_pool"][
        "job_variables"]["environment"]
    environment = json.dumps({"requirements": str(ROOT / "examples" / "requirements-report.txt"),
                              "find_links": str(wheels)})
    run = _run_to_completion("report/report-env", queues["cpu-pool"], "--environment", environment)
    assert run.job_variables["environment"] == {"requirements": ["tabulate==0.9.0"], "find_links": str(wheels)}


# ------------------------------------------------------------------------ git-based
@pytest.mark.parametrize("ref_kind", ["tag", "commit", "branch"])
def test_git_based_job_runs_the_pinned_commit(queues, launch_agent, git_repo, ref_kind):
    ref = {"tag": "v1", "commit": git_repo["first"], "branch": "main"}[ref_kind]
    want_sha = git_repo["head_sha"] if ref_kind == "branch" else git_repo["first"]
    want_version = git_repo["head"] if ref_kind == "branch" else git_repo["pinned"]

    deployed = deploy_jobs(PREFECT_FILE, names=["versioned-git"], pool=queues["cpu-pool"],
                           env={"LAUNCH_GIT_REPO": git_repo["path"], "LAUNCH_GIT_REF": ref})
    assert deployed == ["versioned/versioned-git"]
    dep = _deployment("versioned/versioned-git")
    (step,) = dep.pull_steps
    clone = step["prefect.deployments.steps.git_clone"]
    assert clone["repository"] == git_repo["path"]
    assert clone["commit_sha"] == want_sha
    assert dep.version == want_sha

    run = _run_to_completion("versioned/versioned-git", queues["cpu-pool"], "--param", f"note={ref_kind}")
    result = _result(run)
    assert result["version"] == want_version
    assert result["note"] == ref_kind
    assert _under(result["file"], Path(result["cwd"]))
    assert not _under(result["file"], ROOT) and not _under(result["file"], Path(git_repo["path"]))


def test_git_based_example_job_with_its_own_environment(queues, launch_agent, git_repo, tmp_path):
    """report-git-env: examples/report_env.py from the clone at v1 imports tabulate, which the agent's Python lacks;
    the pins come from the repository's examples/requirements-report.txt (a local wheel folder for the index)."""
    import json

    from env_wheels import write_wheel

    wheels = tmp_path / "wheels"
    write_wheel(wheels, "tabulate", "0.9.0", body="def tabulate(rows, headers=()):\n    return __file__\n")
    deployed = deploy_jobs(PREFECT_FILE, names=["report-git-env"], pool=queues["cpu-pool"],
                           env={"LAUNCH_GIT_REPO": git_repo["path"], "LAUNCH_GIT_REF": "v1"})
    assert deployed == ["report/report-git-env"]
    dep = _deployment("report/report-git-env")
    assert dep.pull_steps[0]["prefect.deployments.steps.git_clone"]["commit_sha"] == git_repo["first"]
    assert dep.job_variables["environment"] == _declared()["report-git-env"]["work_pool"]["job_variables"][
        "environment"]
    requirements = Path(git_repo["path"]) / "examples" / "requirements-report.txt"
    environment = json.dumps({"requirements": str(requirements), "find_links": str(wheels)})
    run = _run_to_completion("report/report-git-env", queues["cpu-pool"], "--environment", environment)
    assert run.job_variables["environment"] == {"requirements": ["tabulate==0.9.0"], "find_links": str(wheels)}
    # the flow's table is the fake tabulate's own file: imported from the run's built environment, which is
    # neither the agent's Python (.venv) nor the project tree
    module = Path(_result(run))
    assert module.name == "__init__.py" and module.parent.name == "tabulate" and "site-packages" in module.parts
    assert not _under(str(module), ROOT) and not _under(str(module), Path(git_repo["path"]))
    (build,) = [r for r in cli_json("history", str(run.id)) if r["phase"] == "build"]
    assert build["result"] == "SUCCESS" and build["error_code"] == "env-cache-miss"  # a new wheel folder: a new hash


def test_git_ref_that_does_not_exist_fails_the_deploy(queues, git_repo):
    with pytest.raises(JobDeployError) as exc:
        deploy_jobs(PREFECT_FILE, names=["versioned-git"], pool=queues["cpu-pool"],
                    env={"LAUNCH_GIT_REPO": git_repo["path"], "LAUNCH_GIT_REF": "no-such-tag"})
    assert "cannot resolve git ref 'no-such-tag'" in str(exc.value)
    assert "LAUNCH_GIT_REF" in str(exc.value)


# ------------------------------------------------------------------------ image-based
def test_image_based_job_registers_and_submission_validates_presets(queues):
    queue = queues["docker-gpu"]
    assert deploy_jobs(PREFECT_FILE, names=["train-image"], pool=queue) == ["train/train-image"]
    declared = _declared()["train-image"]["work_pool"]["job_variables"]

    rows = {r["job"]: r for r in cli_json("jobs", "ls")}
    assert rows["train/train-image"]["kind"] == "image"
    assert rows["train/train-image"]["queue"] == queue
    dep = _deployment("train/train-image")
    assert dep.job_variables["image"] == declared["image"]
    assert dep.job_variables["preset"] == declared["preset"]

    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    def runs_of_job() -> int:
        with get_client(sync_client=True) as client:
            return client.count_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    before = runs_of_job()
    bad = cli("submit", "train/train-image", "--queue", queue, "--preset", "no-such-preset", check=False)
    assert bad.returncode != 0
    assert "unknown preset 'no-such-preset'" in bad.stderr
    assert runs_of_job() == before

    ok = cli_json("submit", "train/train-image", "--queue", queue, "--param", "epochs=5")
    assert ok["preset"] == declared["preset"]
    assert runs_of_job() == before + 1
    with get_client(sync_client=True) as client:  # nothing will run it before the container issue
        for rid in ok["run_ids"]:
            client.delete_flow_run(rid)


# ------------------------------------------------------------------------ deploy_jobs itself
def test_deploy_jobs_reports_unknown_jobs_and_missing_queues(uid):
    with pytest.raises(JobDeployError, match="unknown job"):
        deploy_jobs(PREFECT_FILE, names=["no-such-job"])
    with pytest.raises(JobDeployError) as exc:
        deploy_jobs(PREFECT_FILE, names=["train-image"], pool=f"missing-{uid}")
    assert "prefect-launch queue apply" in str(exc.value)


def test_deploy_all_registers_every_declared_job_with_its_kind(tmp_path, git_repo):
    """What the demo runs: the example queues, then every job of prefect.yaml at once (--all)."""
    cli("queue", "apply", str(ROOT / "deployments" / "queues.yaml"))
    deployed = deploy_jobs(PREFECT_FILE, env={"LAUNCH_CODE_STORAGE": str(tmp_path / "storage"),
                                              "LAUNCH_GIT_REPO": git_repo["path"], "LAUNCH_GIT_REF": "v1"})
    declared = _declared()
    assert sorted(d.split("/", 1)[1] for d in deployed) == sorted(declared_jobs(PREFECT_FILE)) == sorted(declared)
    rows = {r["job"]: r for r in cli_json("jobs", "ls")}
    for job in deployed:
        spec = declared[job.split("/", 1)[1]]
        pull = yaml.safe_dump(spec["pull"])
        variables = spec["work_pool"]["job_variables"]
        baked = "image" in variables or "dockerfile" in (variables.get("environment") or {})  # code in the image
        want = "image" if baked else "git" if "git_clone" in pull else "code"
        assert rows[job]["kind"] == want, job
        assert rows[job]["queue"] == spec["work_pool"]["name"]
