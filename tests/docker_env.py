"""A Docker daemon and a local base image for the docker back end's tests and benchmark.

No registry is reachable from the test machines, so the base image is built here:

1. ``debootstrap`` a minimal Debian (python3, venv, procps, git: Prefect's ``git_clone`` pull step runs
   inside the container, as in Prefect's own images) once, kept as a tarball in the cache;
2. ``docker import`` it as ``prefect-launch-debian:<suite>-<packages key>``;
3. build ``prefect-launch-base:<key>`` FROM it with Prefect, prefect-docker and this
   project's wheel installed from wheels downloaded on the host (``pip download``;
   the image itself never reaches PyPI). ``<key>`` hashes the wheel's inputs and the pinned
   requirements, so a changed project rebuilds and an unchanged one is reused.

`docker_daemon()` uses a daemon that answers (``DOCKER_HOST`` or the default
socket); otherwise it starts ``dockerd --bridge=none --iptables=false`` on its own
socket under /tmp with its data root in the cache (images survive between test
sessions), shares it between the pytest workers and stops it afterwards, even when
the process that started it was killed. Containers use host networking.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LAUNCH_DOCKER_CACHE", Path.home() / ".cache" / "prefect-launch" / "docker"))
SUITE = "bookworm"
MIRROR = os.environ.get("LAUNCH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# git: a git job's clone (Prefect's git_clone pull step) runs in the container, as with Prefect's own images
DEBIAN_PACKAGES = ("python3", "python3-venv", "procps", "git")
DEBIAN_KEY = hashlib.sha256(",".join(DEBIAN_PACKAGES).encode()).hexdigest()[:8]
IMAGE_PYTHON = "3.11.2"  # Debian bookworm's python3
# needed under the image's older python3 (markers on python_full_version), which pip evaluates against the host's
MARKER_EXTRAS = ("async-timeout>=4.0.3",)
OWN_SOCKET_DIR = Path(tempfile.gettempdir()) / "prefect-launch-dockerd"


def _client(base_url: Optional[str] = None):
    import docker

    return docker.DockerClient(base_url=base_url, timeout=120) if base_url else docker.from_env(timeout=120)


def _answers(base_url: Optional[str]) -> bool:
    try:
        c = _client(base_url)
        c.ping()
        c.close()
        return True
    except Exception:
        return False


def why_no_docker() -> Optional[str]:
    """None when a daemon can be used or started here; else what is missing."""
    if _answers(os.environ.get("DOCKER_HOST")):
        return None
    if not shutil.which("dockerd"):
        return "dockerd is not installed (apt-get install docker.io; make system-deps does it as root)"
    if os.geteuid() != 0:
        return "dockerd must be started as root and no Docker daemon answers"
    return None


@contextlib.contextmanager
def _locked(name: str, folder: Path = OWN_SOCKET_DIR) -> Iterator[None]:
    """Held by one process at a time across the pytest workers (and benchmarks): starting the private
    dockerd and building the images each check for the thing and make it, which two at once would
    both do. A flock: the kernel releases it when its holder dies, even by kill -9."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def docker_daemon(folder: Optional[Path] = None, data_root: Optional[Path] = None) -> Iterator[str]:
    """Yield a DOCKER_HOST URL that answers: ``DOCKER_HOST`` or the default socket when a daemon answers
    there, else our private dockerd (:class:`PrivateDockerd`, under ``folder``) shared by every process
    of ours that needs it. ``folder``/``data_root`` default to the one the suite shares; a test gives its
    own to get a daemon no other worker uses."""
    if folder is None:
        env_host = os.environ.get("DOCKER_HOST")
        if _answers(env_host):
            yield env_host or "unix:///var/run/docker.sock"
            return
    with PrivateDockerd(folder or OWN_SOCKET_DIR, data_root or CACHE / "data-root").used() as url:
        yield url


_HELD: set[Path] = set()  # the private daemons this process uses now


class PrivateDockerd:
    """``dockerd`` on a socket under ``folder``, its data root kept between sessions.

    The first process that needs it starts it and owns it (its pid in ``folder/owner``); later ones
    share it (a mark each under ``folder/users``); the owner stops it once no sharer is left. An owner
    killed with -9 cannot stop it, and the daemon (in its own session) would run on with nobody to stop
    it: so the next process that finds it answering with its owner dead adopts it, and a sharer that
    leaves last after its owner died stops it. Every decision is taken under one file lock."""

    def __init__(self, folder: Path, data_root: Path) -> None:
        self.folder = folder
        self.data_root = data_root
        self.url = f"unix://{folder}/docker.sock"
        self.users = folder / "users"
        self.owner_file = folder / "owner"
        self.pidfile = folder / "dockerd.pid"

    @contextlib.contextmanager
    def used(self) -> Iterator[str]:
        """Start, adopt or share the daemon for the block; stop it on the way out when this process is the
        last one out and owns it (or its owner is dead)."""
        if self.folder in _HELD:  # this process already holds it (nested use): the outer block stops it
            yield self.url
            return
        _HELD.add(self.folder)
        try:
            with self._held() as url:
                yield url
        finally:
            _HELD.discard(self.folder)

    @contextlib.contextmanager
    def _held(self) -> Iterator[str]:
        proc: Optional[subprocess.Popen] = None
        with _locked("dockerd", self.folder):  # decided and marked under the lock: the stop takes the same lock
            if not _answers(self.url):
                proc = self._start()
            if proc is not None or not _alive(self._owner()):  # started here, or its owner was killed: ours now
                self.owner_file.write_text(str(os.getpid()))
            mark = self.users / str(os.getpid())
            self.users.mkdir(parents=True, exist_ok=True)
            mark.touch()
        try:
            yield self.url
        finally:
            mark.unlink(missing_ok=True)
            owner = self._owner()
            if owner == os.getpid() or not _alive(owner):
                self._wait_for_other_users()  # another pytest worker may still be running its docker tests
                with _locked("dockerd", self.folder):  # no process starts sharing it while it stops
                    self._wait_for_other_users()  # (one that began sharing just before)
                    if self._owner() in (os.getpid(), owner):  # not adopted meanwhile by a newcomer
                        self._stop(proc)
                        self.owner_file.unlink(missing_ok=True)

    def _owner(self) -> Optional[int]:
        try:
            return int(self.owner_file.read_text())
        except (OSError, ValueError):
            return None

    def _start(self) -> subprocess.Popen:
        """``dockerd`` on this socket; returned once it answers."""
        self.data_root.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "dockerd.log", "ab") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                ["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false", f"--host={self.url}",
                 f"--data-root={self.data_root}", f"--exec-root={self.folder}/exec", f"--pidfile={self.pidfile}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while not _answers(self.url):
            problem = (f"dockerd exited with {proc.returncode}; see {self.folder}/dockerd.log" if proc.poll() is not None
                       else f"dockerd did not answer on {self.url} within 60 s" if time.time() > deadline else None)
            if problem:
                proc.kill()
                proc.wait()
                raise RuntimeError(problem)
            time.sleep(0.3)
        return proc

    def _stop(self, proc: Optional[subprocess.Popen]) -> None:
        """SIGTERM the daemon (``proc``, or the dockerd its pidfile names when adopted), SIGKILL after 30 s."""
        import psutil

        target: subprocess.Popen | psutil.Process
        if proc is not None:
            target = proc
        else:
            try:
                target = psutil.Process(int(self.pidfile.read_text()))
                if target.name() != "dockerd":  # the pid was reused: the daemon is already gone
                    return
            except (OSError, ValueError, psutil.Error):
                return
        target.terminate()
        try:
            target.wait(timeout=30)
        except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
            target.kill()
            target.wait()

    def _wait_for_other_users(self, timeout: float = 3600) -> None:
        """Until no live process that shares the daemon is left (marks of dead ones are removed)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            live = []
            for mark in self.users.glob("*") if self.users.exists() else []:
                if _alive(int(mark.name) if mark.name.isdigit() else None):
                    live.append(mark)
                else:
                    mark.unlink(missing_ok=True)
            if not live:
                return
            time.sleep(1)


def _alive(pid: Optional[int]) -> bool:
    """Whether ``pid`` is a running process (a zombie is not: nobody may reap an orphan in a container)."""
    import psutil

    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _run(cmd: list[str], **kw) -> None:
    subprocess.run(cmd, check=True, **kw)


def debian_image(client) -> str:
    """``prefect-launch-debian:<suite>-<key>``: debootstrap once per package set (cached tarball), then
    ``docker import``."""
    import docker.errors

    tag = f"prefect-launch-debian:{SUITE}-{DEBIAN_KEY}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    tarball = CACHE / f"rootfs-{SUITE}-{DEBIAN_KEY}.tar"
    if not tarball.exists():
        if not shutil.which("debootstrap"):
            raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
        with tempfile.TemporaryDirectory(prefix="launch-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
                  SUITE, str(rootfs), MIRROR], stdout=subprocess.DEVNULL)
            _run(["rm", "-rf", str(rootfs / "var/cache/apt/archives"), str(rootfs / "var/lib/apt/lists")])
            CACHE.mkdir(parents=True, exist_ok=True)
            _run(["tar", "-C", str(rootfs), "-cf", str(tarball) + ".part", "."])
            os.replace(str(tarball) + ".part", tarball)
    repository, _, name = tag.partition(":")
    client.api.import_image_from_file(str(tarball), repository=repository, tag=name)
    return tag


def _requirements() -> list[str]:
    """What the image needs besides our wheel, pinned to the host's versions."""
    from importlib.metadata import version

    return [f"prefect=={version('prefect')}", f"prefect-docker=={version('prefect-docker')}",
            f"psutil=={version('psutil')}", f"pyyaml=={version('pyyaml')}", f"nvidia-ml-py=={version('nvidia-ml-py')}"]


def _project_wheel(out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
         stdout=subprocess.DEVNULL)
    return next(out.glob("prefect_launch-*.whl"))


SOURCE_DIRS = ("prefect_launch", "blocks", "deployments", "workers", "dashboard")


def _source_key() -> bytes:
    """What the project's wheel is built from: pyproject.toml and the packages' files (no build needed)."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".yaml", ".json", ".toml"):
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.digest()


def _dependency_wheels(reqs: list[str]) -> Path:
    """The dependencies' wheels for the image's Python, downloaded on the host once per requirement set."""
    key = hashlib.sha256("\n".join([IMAGE_PYTHON, *reqs, *MARKER_EXTRAS]).encode()).hexdigest()[:12]
    folder = CACHE / f"wheels-{key}"
    if not (folder / ".complete").exists():
        folder.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "-q", "-d", str(folder), "--only-binary=:all:",
              "--python-version", IMAGE_PYTHON, "--platform", "manylinux2014_x86_64", "--platform",
              "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--implementation", "cp",
              *reqs, *MARKER_EXTRAS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (folder / ".complete").touch()
    return folder


def base_image(client) -> str:
    """``prefect-launch-base:<key>``: Prefect and this project on the local Debian, built once per key.

    ``<key>`` hashes the wheel's inputs (pyproject.toml and the packages' source), the pinned
    requirements and the Debian image, so an unchanged project reuses the image in about a second.
    """
    with _locked("image"):  # another worker building the same image: wait for it, then reuse it
        return _base_image(client)


def _base_image(client) -> str:
    import docker.errors

    debian = debian_image(client)
    reqs = _requirements()
    key = hashlib.sha256(_source_key() + "\n".join(reqs + [debian]).encode()).hexdigest()[:12]
    tag = f"prefect-launch-base:{key}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory(prefix="launch-image-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(_dependency_wheels(reqs), ctx / "wheels", ignore=shutil.ignore_patterns(".complete"))
        own = ctx / "own"
        own.mkdir()
        ours = _project_wheel(own)
        # two layers: the dependencies' layer is reused from dockerd's build cache while they are unchanged
        (ctx / "Dockerfile").write_text(
            f"FROM {debian}\n"
            "COPY wheels /wheels\n"
            "RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-index --find-links /wheels "
            f"{' '.join(repr(r) for r in reqs)} && rm -rf /wheels /root/.cache\n"
            "COPY own /own\n"
            f"RUN /opt/venv/bin/pip install -q --no-index --no-deps /own/{ours.name} && rm -rf /own /root/.cache\n"
            "ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1\n"
            "WORKDIR /opt/prefect\n"
        )
        _build(client, ctx, tag)
        client.images.get(tag).tag("prefect-launch-base", "latest")
    _keep_only(client, "prefect-launch-base", tag)  # keep the cache to one project image
    return tag


def _build(client, ctx: Path, tag: str) -> None:
    """Build ``ctx`` (its Dockerfile) as ``tag`` on host networking; a failure carries the build log's end."""
    import docker.errors

    try:
        client.images.build(path=str(ctx), tag=tag, network_mode="host", rm=True, forcerm=True)
    except docker.errors.BuildError as exc:
        log = "".join(str(c.get("stream") or c.get("error") or "") for c in exc.build_log)
        raise RuntimeError(f"building {tag} failed: {exc}\n{log[-4000:]}") from None


def _keep_only(client, repository: str, tag: str) -> None:
    """Remove ``repository``'s other images (older keys)."""
    import docker.errors

    for stale in client.images.list(name=repository):
        if tag not in stale.tags:
            for t in stale.tags:
                try:
                    client.images.remove(t, noprune=False)
                except docker.errors.APIError:
                    pass  # still used by a container, or by a concurrent session's tests


def session_image(client, base: str) -> str:
    """``prefect-launch-session:<key>``: the base image plus JupyterLab (the host's version), for interactive
    sessions on a docker queue; built once per base image."""
    import docker.errors
    from importlib.metadata import version

    reqs = [f"jupyterlab=={version('jupyterlab')}"]
    key = hashlib.sha256((base + "\n".join(reqs)).encode()).hexdigest()[:12]
    tag = f"prefect-launch-session:{key}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory(prefix="launch-session-image-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(_dependency_wheels(reqs), ctx / "wheels", ignore=shutil.ignore_patterns(".complete"))
        (ctx / "Dockerfile").write_text(
            f"FROM {base}\n"
            "COPY wheels /wheels\n"
            f"RUN /opt/venv/bin/pip install -q --no-index --find-links /wheels {' '.join(repr(r) for r in reqs)} "
            "&& rm -rf /wheels /root/.cache\n")
        _build(client, ctx, tag)
    _keep_only(client, "prefect-launch-session", tag)
    return tag


@contextlib.contextmanager
def host_dockerd(in_host, folder: Optional[Path] = None) -> Iterator[str]:
    """A ``dockerd`` of its own inside a network-namespace host (tests/netns_hosts.py; ``in_host`` is the host's
    ``exec``, which wraps an argv to run there): its data root, exec root and socket under ``folder`` (a short
    new /tmp folder by default: containerd's socket path must stay under 108 bytes). Its containers on host
    networking are on that host's network, as on a machine of their own. Yields its DOCKER_HOST URL; stopped on
    the way out (SIGTERM to its group, SIGKILL after 30 s) and its folder removed."""
    import signal

    made = folder is None
    folder = Path(tempfile.mkdtemp(prefix="lnsd")) if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    url = f"unix://{folder}/docker.sock"
    with open(folder / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(
            in_host(["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false", f"--host={url}",
                     f"--data-root={folder}/data", f"--exec-root={folder}/exec", f"--pidfile={folder}/dockerd.pid"]),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while not _answers(url):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"dockerd in the host did not answer on {url}: "
                                   + (folder / "dockerd.log").read_text(errors="replace")[-2000:])
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if made:
            subprocess.run(["rm", "-rf", str(folder)], check=False)


def copy_image(tag: str, source_url: str, target_url: str) -> None:
    """``docker save`` ``tag`` from one daemon into another (``docker load``, streamed): no registry needed."""
    source, target = _client(source_url), _client(target_url)
    try:
        target.images.load(source.images.get(tag).save(named=True))
    finally:
        source.close()
        target.close()
