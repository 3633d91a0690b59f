"""Registering launch jobs: the deployments declared in prefect.yaml.

Jobs are registered with Prefect's own ``prefect --no-prompt deploy`` so that
prefect.yaml stays the single, plain-Prefect description of every job (its
build, push and pull steps run exactly as Prefect runs them). ``deploy_jobs``
runs that command, checks that every job it asked for was registered, and
says what to do when something fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import yaml

_CREATED = re.compile(r"Deployment '([^'\n]+)' successfully created")


class JobDeployError(RuntimeError):
    """``prefect deploy`` failed or did not register every job it was asked for."""


def declared_jobs(prefect_file: str | os.PathLike = "prefect.yaml") -> list[str]:
    """Deployment names declared in ``prefect_file``, in file order."""
    path = Path(prefect_file)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise JobDeployError(f"{path} not found; run from the project root or pass prefect_file=") from None
    except yaml.YAMLError as exc:
        raise JobDeployError(f"{path} is not valid YAML: {exc}") from None
    deployments = data.get("deployments") if isinstance(data, dict) else None
    if not isinstance(deployments, list):
        raise JobDeployError(f"{path} declares no deployments (expected a top-level 'deployments:' list)")
    return [d["name"] for d in deployments if isinstance(d, dict) and d.get("name")]


_NO_SERVER = "start a Prefect server and export PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)"


def _hint(output: str) -> str:
    output = " ".join(output.split())  # Prefect's console wraps lines at the terminal's width
    if "Starting temporary server" in output:
        return f"no Prefect server is configured ({_NO_SERVER})"
    if "does not exist" in output.lower() and "work pool" in output.lower():
        return ("create the queues first: `prefect-launch queue apply deployments/queues.yaml` "
                "(or deploy to an existing queue)")
    if "cannot resolve git ref" in output or "not a git repository" in output:
        return ("the git-based job could not be pinned: set LAUNCH_GIT_REPO to a git repository and "
                "LAUNCH_GIT_REF to an existing branch, tag or commit")
    if "DeployStepError" in output:
        step_error = re.findall(r"DeployStepError: ([^\n]+)", output)
        return f"a deploy step refused its input: {step_error[-1] if step_error else 'see the output'}"
    if "pin_git_commit" in output or "push_code_snapshot" in output or "run_shell_script" in output:
        return ("a build/push step failed: check that LAUNCH_CODE_STORAGE is writable and that "
                "LAUNCH_GIT_REPO / LAUNCH_GIT_REF name an existing repository and ref")
    if "PREFECT_API_URL" in output or "ConnectError" in output or "Connection refused" in output:
        return _NO_SERVER
    return "read the output above; run the same command by hand from the project root to reproduce"


def deploy_jobs(
    prefect_file: str | os.PathLike = "prefect.yaml",
    names: Optional[list[str]] = None,
    env: Optional[dict[str, str]] = None,
    *,
    pool: Optional[str] = None,
    cwd: Optional[str | os.PathLike] = None,
    timeout: float = 600,
) -> list[str]:
    """Register the jobs of ``prefect_file`` with ``prefect --no-prompt deploy``; return "flow/job" names.

    names: deployment names to register (default: all, ``--all``).
    env: extra environment for the command, e.g. ``{"LAUNCH_CODE_STORAGE": "/shared/code"}``
        (read by the build/push steps at deploy time).
    pool: register the named jobs on this queue instead of the one in the file (``--pool``;
        Prefect applies it only to single-job deploys, so each job is deployed on its own).
    cwd: directory the entrypoints and steps are relative to (default: the file's folder).
    Raises JobDeployError with what to do when the command fails or a job is missing.
    """
    path = Path(prefect_file).resolve()
    declared = declared_jobs(path)
    wanted = list(names) if names else declared
    unknown = [n for n in wanted if n.split("/", 1)[-1] not in declared]
    if unknown:
        raise JobDeployError(f"unknown job(s) {unknown} in {path}; it declares: {', '.join(declared)}")
    if pool and not names:
        raise JobDeployError("pool= needs names=: say which jobs to register on that queue")
    run_env = dict(os.environ)
    run_env.update({k: str(v) for k, v in (env or {}).items()})
    run_env.setdefault("COLUMNS", "500")  # keep Prefect's messages on one line
    run_env["NO_COLOR"] = "1"
    base = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(path)]
    if pool:
        batches = [[*base, "--name", n, "--pool", pool] for n in wanted]
    elif names:
        batches = [base + [arg for n in wanted for arg in ("--name", n)]]
    else:
        batches = [base + ["--all"]]
    deployed: list[str] = []
    for cmd in batches:
        try:
            proc = subprocess.run(cmd, cwd=str(cwd or path.parent), env=run_env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise JobDeployError(f"`{' '.join(cmd[1:])}` did not finish in {timeout:g}s; is the Prefect server up?") from None
        output = (proc.stdout or "") + (proc.stderr or "")
        created = _CREATED.findall(" ".join(output.split()))
        if "Starting temporary server" in output:
            # registered on a throw-away server that is gone again: nothing a worker could ever see
            raise JobDeployError(f"`prefect deploy` found no Prefect server and used a temporary one; {_NO_SERVER}")
        if proc.returncode != 0:
            raise JobDeployError(
                f"`prefect deploy` exited with {proc.returncode} (registered so far: {deployed + created or 'none'}); "
                f"{_hint(output)}.\n--- output ---\n{output[-4000:]}"
            )
        deployed.extend(created)
    missing = [n for n in wanted if not any(d.split("/", 1)[-1] == n.split("/", 1)[-1] for d in deployed)]
    if missing:
        raise JobDeployError(
            f"`prefect deploy` succeeded but did not register {missing} (registered: {deployed or 'none'}); "
            "check the deployments' names and entrypoints in the prefect file"
        )
    return deployed


__all__ = ["JobDeployError", "declared_jobs", "deploy_jobs"]
