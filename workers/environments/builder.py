"""Build and cache job environments: one virtual environment per content hash, built with uv.

Layout, under ``LAUNCH_ENV_DIR`` (default: ``_envs`` in the agents' state directory, ``LAUNCH_STATE_DIR`` or
``$PREFECT_HOME/launch/agents``; every agent of the host shares it)::

    <hash>/                  a complete environment (never written again once renamed here)
    <hash>/launch-env.json   what the hash was computed over, build time, size
    <hash>/.last-used        touched at each use (LRU order)
    <hash>/.users/<run id>   one per live run using it, holding the agent's pid (a dead pid does not count)
    <hash>.lock              flock: one build per hash at a time; the others wait and find it built
    .build-<hash>-<random>/  a build in progress or left by a crash: never used, removed by the next build/prune

A build is ``uv venv --relocatable --python <the agent's interpreter>`` then ``uv pip install`` of the pins
(``--offline``/``--no-index`` with ``find_links`` for hosts without the internet), both into the build folder,
then one ``rename`` to ``<hash>``: a half-built folder never looks complete. A failed build raises
`EnvironmentBuildError` with the installer's last lines and removes its folder; the next run builds again.

**How the job sees Prefect** (the choice, and its trade-off): the environment does not install Prefect.
It gets the agent's site-packages through a ``.pth`` file that sorts last (``zzz-launch-agent.pth``), so
``python -m prefect.engine`` imports exactly the Prefect the agent runs (the version is in the hash) at no
install cost, and the job's own pins come first on ``sys.path``: a job pinning ``tinypkg==1.0`` sees 1.0 even
when the agent (or another job) has 2.0. Two jobs never see each other's packages (each has its own folder).
The price: a package the job does not pin but the agent has is visible to the job (the agent's Prefect
dependencies: pydantic, httpx, ...), and a job pin that conflicts with Prefect's own dependencies (say an old
pydantic) wins and may break the engine; pin those to what the agent runs. The lines are plain paths, so the
agent's own ``.pth`` hooks do not run: this project's editable install is not importable from a job (the engine
needs nothing of it: `python -m prefect.engine` loads the flow through Prefect's pull steps alone). The
environment needs the agent's Python minor version (checked: `spec.check_python`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from prefect_launch.settings import env_text
from prefect_launch.workers.environments.spec import CachedEnv, Identity, lru_victims

META = "launch-env.json"
LAST_LINES = 12  # of the installer's output, in the error of a failed build


class EnvironmentBuildError(RuntimeError):
    """A build failed; ``str()`` is "environment build failed: <the installer's last lines>"."""

    def __init__(self, env_hash: str, tail: str):
        self.env_hash = env_hash
        self.tail = tail
        super().__init__(f"environment build failed: {tail}")


@dataclass
class Built:
    """The environment a run uses: its python, whether it was built now (cache miss), and how long it took."""

    hash: str
    path: Path
    built: bool
    seconds: float

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def default_cache_dir() -> Path:
    """``LAUNCH_ENV_DIR``, else ``_envs`` beside the agents' journals (``LAUNCH_STATE_DIR`` or PREFECT_HOME's)."""
    given = env_text("LAUNCH_ENV_DIR", "")
    if given:
        return Path(given)
    base = env_text("LAUNCH_STATE_DIR", "")
    if not base:
        home = os.environ.get("PREFECT_HOME") or str(Path.home() / ".prefect")
        base = str(Path(home) / "launch" / "agents")
    return Path(base) / "_envs"


def cache_max_bytes() -> Optional[int]:
    """``LAUNCH_ENV_CACHE_MAX`` (a size: 5Gi, 500Mi, bytes); unset: no limit."""
    raw = env_text("LAUNCH_ENV_CACHE_MAX", "")
    if not raw:
        return None
    from prefect_launch.workers.scheduling.resources import parse_size

    return parse_size(raw, "LAUNCH_ENV_CACHE_MAX")


def uv_bin() -> str:
    import uv

    return uv.find_uv_bin()


def agent_site_paths() -> list[str]:
    paths = list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and os.path.isdir(user):
        paths.append(user)
    return [p for p in dict.fromkeys(paths) if os.path.isdir(p)]


class EnvCache:
    """The host's environment cache (one folder, shared by its agents)."""

    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    # ------------------------------------------------------------------ reading
    def path(self, env_hash: str) -> Path:
        return self.root / env_hash

    def is_complete(self, env_hash: str) -> bool:
        return (self.path(env_hash) / META).is_file() and (self.path(env_hash) / "bin" / "python").exists()

    def entries(self) -> list[dict]:
        """Every complete environment: hash, size, last use, live runs, what it was built from."""
        out = []
        if not self.root.is_dir():
            return out
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") or not p.is_dir() or not self.is_complete(p.name):
                continue
            try:
                meta = json.loads((p / META).read_text())
            except (OSError, ValueError):
                meta = {}
            out.append({"hash": p.name, "path": str(p), "size": meta.get("size") or dir_size(p),
                        "last_used": self.last_used(p.name), "users": self.users(p.name),
                        "built_at": meta.get("built_at"), "build_seconds": meta.get("build_seconds"),
                        "pins": (meta.get("identity") or {}).get("pins", []),
                        "python": (meta.get("identity") or {}).get("python"),
                        "prefect": (meta.get("identity") or {}).get("prefect")})
        return out

    def meta(self, env_hash: str) -> dict:
        try:
            return json.loads((self.path(env_hash) / META).read_text())
        except (OSError, ValueError):
            return {}

    def last_used(self, env_hash: str) -> float:
        for name in (".last-used", META):
            with contextlib.suppress(OSError):
                return (self.path(env_hash) / name).stat().st_mtime
        return 0.0

    def users(self, env_hash: str) -> list[str]:
        """The runs using it now (their agent process alive)."""
        d = self.path(env_hash) / ".users"
        out = []
        if d.is_dir():
            for f in d.iterdir():
                try:
                    pid = int(f.read_text().strip() or 0)
                except (OSError, ValueError):
                    continue
                if pid and pid_alive(pid):
                    out.append(f.name)
        return sorted(out)

    # ------------------------------------------------------------------ using
    @contextlib.contextmanager
    def use(self, env_hash: str, run_id: str) -> Iterator[None]:
        """Mark ``run_id`` as a live user of the environment (prune and LRU never remove it meanwhile)."""
        self.acquire(env_hash, run_id)
        try:
            yield
        finally:
            self.release(env_hash, run_id)

    def acquire(self, env_hash: str, run_id: str) -> None:
        d = self.path(env_hash) / ".users"
        d.mkdir(exist_ok=True)
        (d / run_id).write_text(str(os.getpid()))
        (self.path(env_hash) / ".last-used").touch()

    def release(self, env_hash: str, run_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.path(env_hash) / ".users" / run_id).unlink()

    # ------------------------------------------------------------------ building
    @contextlib.contextmanager
    def _lock(self, env_hash: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{env_hash}.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # concurrent runs of one hash wait here for one build
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def ensure(self, ident: Identity, log: Optional[Callable[[str], None]] = None,
               run_id: Optional[str] = None) -> Built:
        """The environment of ``ident``, built now when missing (blocking: call it from a thread).

        ``log`` gets every line of the build's output; ``run_id`` is marked a user before the lock is let go,
        so a prune between the build and the run's start cannot take it."""
        env_hash = ident.hash
        t0 = time.monotonic()
        if self.is_complete(env_hash):  # the common case: no lock, no build
            if run_id:
                self.acquire(env_hash, run_id)
            return Built(env_hash, self.path(env_hash), False, time.monotonic() - t0)
        with self._lock(env_hash):
            if self.is_complete(env_hash):  # another run built it while this one waited
                if run_id:
                    self.acquire(env_hash, run_id)
                return Built(env_hash, self.path(env_hash), False, time.monotonic() - t0)
            self._build(ident, log or (lambda line: None))
            if run_id:
                self.acquire(env_hash, run_id)
        self.enforce_limit()
        return Built(env_hash, self.path(env_hash), True, time.monotonic() - t0)

    def _build(self, ident: Identity, log: Callable[[str], None]) -> None:
        env_hash = ident.hash
        for stale in self.root.glob(f".build-{env_hash}-*"):  # a crashed build's leftovers (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".build-{env_hash}-", dir=self.root))
        t0 = time.monotonic()
        try:
            venv = work / "venv"
            uv = uv_bin()
            env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_", "PIP_"))}
            env["UV_CACHE_DIR"] = str(self.root / ".uv-cache")
            self._run([uv, "venv", "--relocatable", "--no-project", "--python", sys.executable, str(venv)],
                      env, log, env_hash)
            if ident.pins:
                req = work / "requirements.txt"
                req.write_text("\n".join(ident.pins) + "\n")
                cmd = [uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--no-progress",
                       "-r", str(req)]
                for link in ident.find_links:
                    cmd += ["--find-links", link]
                if ident.index_url:
                    cmd += ["--index-url", ident.index_url]
                if ident.offline:
                    cmd += ["--offline"] + ([] if ident.index_url else ["--no-index"])
                self._run(cmd, env, log, env_hash)
            site_dir = site_packages(venv)
            (site_dir / "zzz-launch-agent.pth").write_text("".join(p + "\n" for p in agent_site_paths()))
            seconds = time.monotonic() - t0
            (venv / META).write_text(json.dumps({"identity": ident.as_dict(), "hash": env_hash,
                                                 "built_at": time.time(), "build_seconds": round(seconds, 3),
                                                 "size": dir_size(venv), "top_level": top_level_names(site_dir)},
                                                indent=1))
            os.rename(venv, self.path(env_hash))  # complete: one rename, never a half-built <hash>
            log(f"environment {env_hash} built in {seconds:.1f} s")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _run(cmd: list[str], env: dict, log: Callable[[str], None], env_hash: str) -> None:
        tail: deque[str] = deque(maxlen=LAST_LINES)  # this command's own last lines (not the venv's banner)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                log(line)
        if proc.wait() != 0:
            raise EnvironmentBuildError(env_hash, "\n".join(tail) or f"{cmd[1]} exited {proc.returncode}")

    # ------------------------------------------------------------------ removing
    def remove(self, env_hash: str, force: bool = False) -> bool:
        """Remove one environment (not while a live run uses it, unless ``force``); False when absent."""
        path = self.path(env_hash)
        if not path.is_dir():
            return False
        with self._lock(env_hash):
            if self.users(env_hash) and not force:
                raise RuntimeError(f"environment {env_hash} is used by run(s) {', '.join(self.users(env_hash))}")
            doomed = self.root / f".rm-{env_hash}-{os.getpid()}"
            os.rename(path, doomed)  # gone from the cache at once; the delete may take a while
            shutil.rmtree(doomed, ignore_errors=True)
        return True

    def enforce_limit(self, max_bytes: Optional[int] = None) -> list[str]:
        """LRU removal down to ``max_bytes`` (default ``LAUNCH_ENV_CACHE_MAX``); environments in use stay."""
        limit = max_bytes if max_bytes is not None else cache_max_bytes()
        if limit is None:
            return []
        envs = [CachedEnv(e["hash"], int(e["size"]), float(e["last_used"]), bool(e["users"])) for e in self.entries()]
        removed = []
        for victim in lru_victims(envs, limit):
            with contextlib.suppress(RuntimeError, OSError):
                if self.remove(victim.hash):
                    removed.append(victim.hash)
        return removed

    def prune(self, max_bytes: Optional[int] = None, all_unused: bool = False) -> list[str]:
        """Leftover build folders, then LRU down to the limit (``all_unused``: every environment no run uses)."""
        if self.root.is_dir():
            for stale in list(self.root.glob(".build-*")) + list(self.root.glob(".rm-*")):
                h = stale.name.split("-")[1]
                try:
                    with open(self.root / f"{h}.lock", "a+") as fh:
                        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a build in progress holds it
                        shutil.rmtree(stale, ignore_errors=True)
                except BlockingIOError:
                    continue
        if all_unused:
            return self.enforce_limit(0)
        return self.enforce_limit(max_bytes)


def site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python*/site-packages"))


def top_level_names(site_dir: Path) -> list[str]:
    """The importable top-level names an environment adds (packages, modules, extension modules)."""
    names = set()
    for p in site_dir.iterdir():
        if p.name.endswith((".dist-info", ".egg-info", ".pth")) or p.name in ("__pycache__",) \
                or p.name.startswith(("_virtualenv", "zzz-launch")):
            continue
        if p.is_dir() or p.suffix in (".py", ".so", ".pyd"):
            names.add(p.name.split(".", 1)[0])
    return sorted(names)


def shadows_agent(names: list[str]) -> list[str]:
    """Those of ``names`` the agent's Python could already have imported (its site-packages, stdlib, loaded)."""
    paths = agent_site_paths()
    out = []
    for name in names:
        if name in sys.modules or name in sys.stdlib_module_names or any(
                os.path.exists(os.path.join(p, name)) or os.path.exists(os.path.join(p, name + ".py"))
                or any(f.startswith(name + ".") and f.endswith(".so") for f in _listing(p)) for p in paths):
            out.append(name)
    return out


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
