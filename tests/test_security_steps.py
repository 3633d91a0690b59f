"""prefect.yaml's deploy steps: no shell, option-like git values refused, snapshots named by what they copy.

The steps are our Python functions (prefect_launch.deployments.steps); they are tested
directly and through Prefect's own `prefect deploy` of the project's prefect.yaml on a
real server (``deploy_jobs``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launch_helpers import ROOT, cli
from prefect_launch.deployments.jobs import JobDeployError, deploy_jobs
from prefect_launch.deployments.steps import (
    DeployStepError,
    pin_git_commit,
    push_code_snapshot,
    snapshot_files,
    snapshot_version,
)

GIT_ENV = dict(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")


@pytest.fixture
def repo(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "repo"
    path.mkdir()
    env = dict(os.environ, **GIT_ENV)

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q", "-b", "main")
    (path / "f.txt").write_text("one")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    git("tag", "v1")
    return {"path": str(path), "sha": git("rev-parse", "HEAD")}


# --------------------------------------------------------------------------- git pin, directly
def test_pin_resolves_branch_tag_and_commit(repo):
    for ref in ("main", "v1", repo["sha"], "HEAD"):
        out = pin_git_commit(repo["path"], ref)
        assert out == {"repository": repo["path"], "commit_sha": repo["sha"], "ref": ref}


@pytest.mark.parametrize("field", ["repository", "ref"])
@pytest.mark.parametrize("value", ["--upload-pack=touch {marker}", "-c", " --output={marker}"])
def test_option_like_git_values_are_refused(repo, tmp_path, field, value):
    marker = tmp_path / "ran"
    args = {"repository": repo["path"], "ref": "main", field: value.format(marker=marker)}
    with pytest.raises(DeployStepError) as exc:
        pin_git_commit(**args)
    assert f"git {field}" in str(exc.value) and "starts with '-'" in str(exc.value)
    assert not marker.exists()


@pytest.mark.parametrize("field", ["repository", "ref"])
def test_command_substitution_in_git_values_does_not_run(repo, tmp_path, field):
    marker = tmp_path / "ran"
    for value in (f"$(touch {marker})", f"`touch {marker}`", f"x; touch {marker}", f'"; touch {marker}; echo "'):
        args = {"repository": repo["path"], "ref": "main", field: value}
        with pytest.raises(DeployStepError, match="cannot resolve git ref"):
            pin_git_commit(**args)
        assert not marker.exists(), value


def test_template_and_control_characters_are_refused(repo):
    with pytest.raises(DeployStepError, match="Prefect template"):
        pin_git_commit(repo["path"], "{{ prefect.blocks.secret.x }}")
    with pytest.raises(DeployStepError, match="control characters"):
        pin_git_commit(repo["path"] + "\n--upload-pack=x", "main")


# --------------------------------------------------------------------------- code snapshot, directly
def test_snapshot_name_hashes_exactly_the_copied_files(tmp_path):
    src = tmp_path / "flows"
    (src / "pkg").mkdir(parents=True)
    (src / "job.py").write_text("print(1)\n")
    (src / "config.yaml").write_text("lr: 0.5\n")
    (src / "pkg" / "data.csv").write_text("a,b\n1,2\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "job.cpython-311.pyc").write_bytes(b"\0junk")
    storage = tmp_path / "storage"

    first = push_code_snapshot(str(src), str(storage))
    copied = Path(first["path"]) / "flows"
    copied_files = sorted(p.relative_to(copied).as_posix() for p in copied.rglob("*") if p.is_file())
    assert copied_files == ["config.yaml", "job.py", "pkg/data.csv"]
    assert [p.as_posix() for p in snapshot_files(src)] == copied_files
    # the name is the hash of what is in the snapshot, recomputed from the snapshot itself
    assert snapshot_version(copied) == first["version"] == Path(first["path"]).name

    # a non-Python change gives a new snapshot holding the new content; the old one is untouched
    (src / "pkg" / "data.csv").write_text("a,b\n1,3\n")
    second = push_code_snapshot(str(src), str(storage))
    assert second["version"] != first["version"]
    assert (Path(second["path"]) / "flows" / "pkg" / "data.csv").read_text() == "a,b\n1,3\n"
    assert (copied / "pkg" / "data.csv").read_text() == "a,b\n1,2\n"

    # a new non-Python file too; caches are not part of the snapshot and do not change its name
    (src / "notes.md").write_text("x")
    third = push_code_snapshot(str(src), str(storage))
    assert third["version"] not in (first["version"], second["version"])
    (src / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"\0more")
    assert push_code_snapshot(str(src), str(storage)) == third
    # the executable bit is copied, so it is part of the name
    os.chmod(src / "notes.md", 0o755)
    assert push_code_snapshot(str(src), str(storage))["version"] != third["version"]


def test_snapshot_of_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(DeployStepError, match="is not a folder"):
        push_code_snapshot(str(tmp_path / "nope"), str(tmp_path / "storage"))


# --------------------------------------------------------------------------- through `prefect deploy`
@pytest.fixture(scope="module")
def project(prefect_server, tmp_path_factory) -> dict:
    """A copy of the project's prefect.yaml and flows/ (so files can change) and a queue for it."""
    import uuid

    uid = uuid.uuid4().hex[:6]
    root = tmp_path_factory.mktemp("project")
    shutil.copy(ROOT / "prefect.yaml", root / "prefect.yaml")
    shutil.copytree(ROOT / "flows", root / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    queue = f"sec-{uid}"
    qfile = root / "queues.yaml"
    qfile.write_text(yaml.safe_dump({"queues": [{"name": queue, "presets": {"small": {"cpu": 0.5, "memory": "512Mi"}},
                                                 "default_preset": "small"}]}))
    cli("queue", "apply", str(qfile))
    return {"root": root, "queue": queue}


def _deployment(job: str):
    import prefect.context
    from prefect import get_client

    prefect.context.refresh_global_settings_context()
    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(job)


def test_deploy_with_injected_git_repo_runs_nothing(project, repo, tmp_path):
    marker = tmp_path / "pwned"
    for value in (f"$(touch {marker})", f"{repo['path']}$(touch {marker})", f"--upload-pack=touch {marker}"):
        with pytest.raises(JobDeployError) as exc:
            deploy_jobs(project["root"] / "prefect.yaml", names=["versioned-git"], pool=project["queue"],
                        env={"LAUNCH_GIT_REPO": value, "LAUNCH_GIT_REF": "main"})
        assert not marker.exists(), f"deploying with LAUNCH_GIT_REPO={value!r} ran a command"
        msg = str(exc.value)
        if value.startswith("-"):
            assert "starts with '-' and would be read by git as an option" in msg
            assert "a deploy step refused its input" in msg
        else:
            assert "cannot resolve git ref 'main'" in msg


def test_deploy_with_option_like_git_ref_is_refused(project, repo, tmp_path):
    with pytest.raises(JobDeployError) as exc:
        deploy_jobs(project["root"] / "prefect.yaml", names=["versioned-git"], pool=project["queue"],
                    env={"LAUNCH_GIT_REPO": repo["path"], "LAUNCH_GIT_REF": "--output=/tmp/x"})
    assert "git ref '--output=/tmp/x' starts with '-'" in str(exc.value)


def test_deploy_pins_git_job_through_python_step(project, repo):
    deployed = deploy_jobs(project["root"] / "prefect.yaml", names=["versioned-git"], pool=project["queue"],
                           env={"LAUNCH_GIT_REPO": repo["path"], "LAUNCH_GIT_REF": "v1"})
    assert deployed == ["versioned/versioned-git"]
    dep = _deployment("versioned/versioned-git")
    (step,) = dep.pull_steps
    assert step["prefect.deployments.steps.git_clone"]["repository"] == repo["path"]
    assert step["prefect.deployments.steps.git_clone"]["commit_sha"] == repo["sha"] == dep.version


def test_non_python_change_gives_a_new_code_snapshot(project, tmp_path):
    storage = tmp_path / "storage"
    env = {"LAUNCH_CODE_STORAGE": str(storage)}
    prefect_file = project["root"] / "prefect.yaml"
    deploy_jobs(prefect_file, names=["versioned-code"], env=env, pool=project["queue"])
    first = _deployment("versioned/versioned-code")
    (project["root"] / "flows" / "settings.json").write_text('{"threshold": 0.5}')
    deploy_jobs(prefect_file, names=["versioned-code"], env=env, pool=project["queue"])
    second = _deployment("versioned/versioned-code")
    assert first.version != second.version
    snap = storage / "code" / second.version / "flows"
    assert (snap / "settings.json").read_text() == '{"threshold": 0.5}'
    assert not (storage / "code" / first.version / "flows" / "settings.json").exists()
    (step,) = second.pull_steps
    assert step["prefect.deployments.steps.pull_from_remote_storage"]["path"] == str(storage / "code" / second.version)
    assert snapshot_version(snap) == second.version
