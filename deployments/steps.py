"""Deploy steps of prefect-launch, named in prefect.yaml like Prefect's own steps.

Prefect runs any importable function named as a step key in prefect.yaml, with the
step's other keys as keyword arguments, and makes the returned dict available to
later steps and to the deployment as ``{{ <step id>.<key> }}``::

    push:
      - prefect_launch.deployments.steps.push_code_snapshot:
          id: push-code
          source: flows
    pull:
      - prefect.deployments.steps.pull_from_remote_storage:
          path: "{{ push-code.path }}"

Why steps and not ``run_shell_script``: a value pasted into a shell script
(``repo="{{ git-repo.stdout }}"``) is code, so a repository named ``$(...)`` ran at
deploy time. Here every value is a Python argument and git gets an argument list
(no shell anywhere); values that git would read as options (a leading ``-``) are
refused before git sees them.

- :func:`push_code_snapshot` copies a source folder to a content-addressed snapshot
  whose name is the hash of exactly the files it copies (any file, not only ``*.py``).
- :func:`pin_git_commit` resolves the repository and branch/tag/commit to a commit SHA.

Both read their defaults from the environment (``LAUNCH_CODE_STORAGE``,
``LAUNCH_GIT_REPO``, ``LAUNCH_GIT_REF``) when an argument is not given, so
prefect.yaml stays free of values.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

SKIP_DIRS = frozenset({"__pycache__"})
SKIP_SUFFIXES = (".pyc", ".pyo")
VERSION_CHARS = 12
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# Transports git may use for a launch job's repository: no ext::/fd:: (which run commands).
GIT_PROTOCOLS = "file:git:http:https:ssh"
GIT_TIMEOUT_S = 60


class DeployStepError(ValueError):
    """A deploy step was given a value it refuses; the message says which and what to do."""


# ----------------------------------------------------------------------------- code snapshot
def snapshot_files(source: str | os.PathLike) -> list[Path]:
    """The files a snapshot of ``source`` holds, relative and sorted: every regular file
    (a symlink counts as the file it points to) except ``__pycache__`` and compiled Python.
    Symlinked folders are not followed (nor copied)."""
    root = Path(source)
    if not root.is_dir():
        raise DeployStepError(f"code source {str(source)!r} is not a folder (run `prefect deploy` from the project root)")
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(SKIP_SUFFIXES):
                continue
            path = Path(dirpath, name)
            if not path.is_file():  # dangling link, socket, fifo: nothing to copy
                continue
            out.append(path.relative_to(root))
    return sorted(out, key=lambda p: p.as_posix())


def snapshot_version(source: str | os.PathLike, files: Optional[list[Path]] = None) -> str:
    """12 hex characters of a SHA-256 over each copied file's relative path, executable bit and
    content: any change to what is copied (any file type) gives a new version."""
    root = Path(source)
    digest = hashlib.sha256()
    for rel in files if files is not None else snapshot_files(root):
        path = root / rel
        content = hashlib.sha256(path.read_bytes()).hexdigest()
        executable = "x" if os.stat(path).st_mode & stat.S_IXUSR else "-"
        digest.update(f"{rel.as_posix()}\0{executable}\0{content}\n".encode())
    return digest.hexdigest()[:VERSION_CHARS]


def push_code_snapshot(source: str = "flows", storage: Optional[str] = None) -> dict[str, str]:
    """Copy ``source`` to ``<storage>/code/<version>/<source name>``; return its version and folder.

    storage: default ``LAUNCH_CODE_STORAGE``, else ``.launch/storage`` (relative to the cwd).
    Returns ``{"version": <12 hex>, "path": <snapshot folder>}``. The copy is made in a
    temporary folder and renamed into place, so a snapshot is never seen half written;
    an existing snapshot of the same version is reused.
    """
    src = Path(source)
    files = snapshot_files(src)
    version = snapshot_version(src, files)
    root = Path(storage or os.environ.get("LAUNCH_CODE_STORAGE") or ".launch/storage").expanduser().resolve()
    code = root / "code"
    dest = code / version
    target = dest / src.resolve().name
    if not target.is_dir():
        code.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".push.", dir=code))
        try:
            tmp.chmod(0o755)
            for rel in files:
                out = tmp / src.resolve().name / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / rel, out)  # follows a file symlink: the content is what was hashed
            try:
                tmp.rename(dest)
            except OSError:  # pushed meanwhile by another deploy: same content, keep that one
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"version": version, "path": str(dest)}


# ----------------------------------------------------------------------------- git pin
def _check_value(what: str, value: str, env_name: str) -> str:
    value = value.strip()
    if not value:
        raise DeployStepError(f"git {what} is empty; set {env_name}")
    if value.startswith("-"):
        raise DeployStepError(
            f"git {what} {value!r} starts with '-' and would be read by git as an option; "
            f"set {env_name} to a repository path or URL and a branch, tag or commit"
        )
    if any(ord(c) < 32 or c == "\x7f" for c in value):
        raise DeployStepError(f"git {what} {value!r} contains control characters; set {env_name} to a plain value")
    if "{{" in value or "}}" in value:
        raise DeployStepError(f"git {what} {value!r} contains '{{{{' or '}}}}' (a Prefect template); use a plain value")
    return value


def _git(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ALLOW_PROTOCOL=GIT_PROTOCOLS)
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, env=env, timeout=GIT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise DeployStepError("git is not installed (needed to pin the git-based job)") from None
    except subprocess.TimeoutExpired:
        raise DeployStepError(f"`git {args[0]}` did not answer in {GIT_TIMEOUT_S}s; is the repository reachable?") from None


def pin_git_commit(repository: Optional[str] = None, ref: Optional[str] = None) -> dict[str, str]:
    """Resolve ``ref`` in ``repository`` to the commit SHA the job is pinned to.

    repository: a local path or a URL; default ``LAUNCH_GIT_REPO``, else the git repository
        around the current directory. A local path is made absolute.
    ref: branch, tag or commit; default ``LAUNCH_GIT_REF``, else ``HEAD``.
    Returns ``{"repository": ..., "commit_sha": <40 hex>, "ref": ...}``. Raises
    DeployStepError ("cannot resolve git ref ...") when the ref does not exist.
    """
    repo = repository if repository is not None else os.environ.get("LAUNCH_GIT_REPO")
    if repo is None or not repo.strip():
        top = _git("rev-parse", "--show-toplevel")
        if top.returncode != 0:
            raise DeployStepError("not a git repository: set LAUNCH_GIT_REPO to the job's repository")
        repo = top.stdout.strip()
    repo = _check_value("repository", repo, "LAUNCH_GIT_REPO")
    ref = _check_value("ref", ref if ref is not None else os.environ.get("LAUNCH_GIT_REF") or "HEAD", "LAUNCH_GIT_REF")

    sha = ""
    if Path(repo).is_dir():
        repo = str(Path(repo).resolve())
        out = _git("-C", repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
        sha = out.stdout.strip() if out.returncode == 0 else ""
    elif SHA_RE.match(ref):
        sha = ref
    else:
        out = _git("ls-remote", repo, ref, f"refs/tags/{ref}^{{}}")
        lines = [ln.split("\t", 1)[0] for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else []
        sha = lines[-1] if lines else ""
    if not SHA_RE.match(sha):
        raise DeployStepError(
            f"cannot resolve git ref {ref!r} in {repo!r}: set LAUNCH_GIT_REPO to a git repository and "
            "LAUNCH_GIT_REF to an existing branch, tag or commit"
        )
    return {"repository": repo, "commit_sha": sha, "ref": ref}


__all__ = ["DeployStepError", "pin_git_commit", "push_code_snapshot", "snapshot_files", "snapshot_version"]
