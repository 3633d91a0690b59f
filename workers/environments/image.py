"""Container queues' job environments: one image per content hash, built with docker-py on the agent's daemon.

A docker (or kubernetes) run whose job declares ``environment`` gets an image ``launch-env/<job>:<hash>``:

- **What it is**: ``FROM`` the job's ``base_image`` (else the queue's / run's image), or the job's own
  ``dockerfile`` (its folder, or ``context``, is the build context, its ``.dockerignore`` applied; a Dockerfile
  that starts ``ARG BASE_IMAGE=<default>`` / ``FROM ${BASE_IMAGE}`` is built on the queue's image, passed as that
  build argument, so an image job's Dockerfile only adds its code), with the
  job's pins installed by the image's own ``python -m pip`` and a last ``LABEL io.prefect-launch.env-hash=<hash>``.
  Wheel folders named in ``find_links`` are copied into the build context, so an offline host builds with
  ``--no-index`` (the tests and the benchmark do: no registry or index is reachable from them).
- **Identity** (`ImageIdentity.hash`): the pins, wheel folders and index, the base image's *id* as this daemon
  has it (a re-pulled ``python:3.11`` is another environment), the Dockerfile's bytes and every file of its
  context that Docker would send (its ``.dockerignore`` applied: an ignored file never rebuilds), the Prefect
  version the agent runs and `spec.FORMAT`.
- **Built once**: a flock per hash (``image-<hash>.lock`` in the environments' folder, shared by the host's
  agents) makes concurrent runs of one hash wait for one build; the others find the tag. An image with the hash
  label but another job's tag is reused (tagged again, not rebuilt).
- **Nothing half-made**: the build runs untagged (docker-py's low-level ``api.build``, its output streamed line
  by line to the run's logs) and is tagged only once it succeeded; the label is the last instruction, so a
  failed build leaves no image that carries it. A failed build raises `ImageBuildError` with Docker's own last
  lines; the next run of the hash builds again.
- **Last use**: each use touches ``image-<hash>.used`` in that folder (`mark_used`); `image_cache.ImageCache` reads
  it for ``env ls --images`` and removes the least recently used images of no live container over
  ``LAUNCH_ENV_CACHE_MAX``.
- **Kubernetes**: `push` tags the image ``<registry>/launch-env/<job>:<hash>``, pushes it and returns the
  reference by digest (``...@sha256:...``), which the job manifest names.

docker-py is used directly rather than prefect's ``build_image`` helper: that one opens its own client from the
environment, while the agent builds on the client it runs containers with, and streams each line to the run's
logger as it comes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import re
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from prefect_launch.workers.environments.spec import FORMAT, HASH_CHARS, EnvironmentSpec, check_dockerfile

HASH_LABEL = "io.prefect-launch.env-hash"
REPOSITORY = "launch-env"
LAST_LINES = 12
CTX_DIR = ".launch-env"  # our part of the build context (wheels, requirements, the Dockerfile)
BASE_ARG = "BASE_IMAGE"  # a job's Dockerfile may build FROM ${BASE_IMAGE}: the queue's image


class ImageBuildError(RuntimeError):
    """``str()``: "environment build failed: image <tag>: <Docker's last lines>"."""

    def __init__(self, tag: str, tail: str):
        self.tag = tag
        self.tail = tail
        super().__init__(f"environment build failed: image {tag}: {tail}")


@dataclass(frozen=True)
class ImageIdentity:
    pins: tuple[str, ...]
    find_links: tuple[str, ...]
    index_url: Optional[str]
    offline: bool
    base: Optional[str]  # the base image as named (None: a Dockerfile's FROM)
    base_ids: tuple[str, ...]  # the ids of the FROM images this daemon has (else their names)
    dockerfile_sha: Optional[str]
    context_sha: Optional[str]
    prefect: str
    build_args: tuple[tuple[str, str], ...] = ()  # (BASE_IMAGE, the queue's image) for a FROM ${BASE_IMAGE}

    def as_dict(self) -> dict[str, Any]:
        out = {"format": FORMAT, "kind": "image", "pins": list(self.pins), "find_links": list(self.find_links),
               "index_url": self.index_url, "offline": self.offline, "base": self.base,
               "base_ids": list(self.base_ids), "dockerfile_sha": self.dockerfile_sha,
               "context_sha": self.context_sha, "prefect": self.prefect}
        if self.build_args:  # only then: the hashes of Dockerfiles without the argument stay as they were
            out["build_args"] = [list(a) for a in self.build_args]
        return out

    @property
    def hash(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:HASH_CHARS]


@dataclass
class BuiltImage:
    tag: str
    id: str
    hash: str
    built: bool  # built now (a cache miss)
    seconds: float


def job_slug(name: Optional[str]) -> str:
    """A repository path component Docker accepts: lowercase letters, digits, ``._-``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", (name or "").lower()).strip("._-")
    return slug[:100] or "job"


def image_tag(job: Optional[str], env_hash: str) -> str:
    return f"{REPOSITORY}/{job_slug(job)}:{env_hash}"


def _image_id(client: Any, ref: str) -> Optional[str]:
    import docker.errors

    try:
        return client.images.get(ref).id
    except docker.errors.DockerException:  # not here, or not a plain reference (``FROM $BASE``)
        return None


def context_files(root: Path) -> list[str]:
    """The context's files (relative paths) that Docker would send: its ``.dockerignore`` applied by docker-py's
    own ``exclude_paths``; the ``.dockerignore`` itself is left out (applied here already)."""
    from docker.utils.build import exclude_paths

    ignore = root / ".dockerignore"
    patterns = [line.strip() for line in ignore.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")] if ignore.is_file() else []
    return sorted(rel for rel in exclude_paths(str(root), patterns)
                  if rel != ".dockerignore" and ((root / rel).is_symlink() or not (root / rel).is_dir()))


def _tree_sha(folder: Path) -> str:
    digest = hashlib.sha256()
    for rel in context_files(folder):
        path = folder / rel
        if path.is_symlink():
            digest.update(rel.encode() + b"\0->" + str(path.readlink()).encode() + b"\0")
        else:
            digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def base_arg(text: str, refs: Sequence[str], default_base: Optional[str]) -> tuple[list[str], Optional[str]]:
    """``refs`` with ``$BASE_IMAGE`` / ``${BASE_IMAGE}`` resolved, and the value to pass as that build argument:
    ``default_base`` (the queue's image), else the Dockerfile's own ``ARG BASE_IMAGE=<default>``; None when the
    Dockerfile does not use it."""
    forms = {f"${BASE_ARG}", f"${{{BASE_ARG}}}"}
    if not any(r in forms for r in refs):
        return list(refs), None
    declared = re.search(rf"(?im)^\s*ARG\s+{BASE_ARG}\s*=\s*(\S+)", text)
    value = default_base or (declared.group(1).strip("\"'") if declared else None)
    if not value:
        raise ValueError(f"the Dockerfile builds FROM ${{{BASE_ARG}}}, but the queue has no image and the "
                         f"Dockerfile gives no ARG {BASE_ARG}=<default>")
    return [value if r in forms else r for r in refs], value


def image_identity(spec: EnvironmentSpec, client: Any, default_base: Optional[str],
                   prefect_version: str) -> ImageIdentity:
    """The identity of an inlined spec (`spec.inline` first); the base image's id is read from ``client``."""
    if not isinstance(spec.requirements, list):
        raise ValueError("image_identity() needs inline pins: call inline(spec, bases) first")
    dockerfile_sha = context_sha = None
    build_args: tuple[tuple[str, str], ...] = ()
    if spec.dockerfile:
        path = Path(spec.dockerfile)
        text = path.read_text(errors="replace")
        stages = {m.lower() for m in re.findall(r"(?im)^\s*FROM\s+.*?\s+AS\s+(\S+)", text)}
        refs, base_value = base_arg(text, check_dockerfile(path), default_base)
        if base_value is not None:
            build_args = ((BASE_ARG, base_value),)
        refs = [r for r in refs if r.lower() not in stages and r != "scratch"]
        base = None
        base_ids = tuple(_image_id(client, r) or r for r in refs)
        dockerfile_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        context_sha = _tree_sha(Path(spec.context or path.parent))
    else:
        base = spec.base_image or default_base
        if not base:
            raise ValueError("the environment names no base_image or dockerfile and the queue has no image")
        base_ids = (_image_id(client, base) or base,)
    return ImageIdentity(pins=tuple(spec.requirements), find_links=tuple(spec.links()), index_url=spec.index_url,
                         offline=spec.is_offline(), base=base, base_ids=base_ids, dockerfile_sha=dockerfile_sha,
                         context_sha=context_sha, prefect=prefect_version, build_args=build_args)


def dockerfile_text(spec: EnvironmentSpec, ident: ImageIdentity, local_links: Sequence[str]) -> str:
    """The Dockerfile that is built: the job's (or ``FROM <base>``), then the pins installed, then the label."""
    head = Path(spec.dockerfile).read_text() if spec.dockerfile else f"FROM {ident.base}\n"
    lines = [head.rstrip("\n"), "", "# prefect-launch: the job environment's requirements (environments/image.py)"]
    if ident.pins:
        lines.append(f"COPY {CTX_DIR}/requirements.txt /tmp/launch-env/requirements.txt")
        if local_links:
            lines.append(f"COPY {CTX_DIR}/wheels /tmp/launch-env/wheels")
        opts = ["--no-cache-dir", "--disable-pip-version-check", "--no-input"]
        opts += [f"--find-links /tmp/launch-env/wheels/{i}" for i in range(len(local_links))]
        opts += [f"--find-links {link}" for link in ident.find_links if link not in local_links]
        if ident.index_url:
            opts.append(f"--index-url {ident.index_url}")
        elif ident.offline:
            opts.append("--no-index")
        lines.append('RUN PY="$(command -v python || command -v python3)" && "$PY" -m pip install '
                     f'{" ".join(opts)} -r /tmp/launch-env/requirements.txt && rm -rf /tmp/launch-env')
    lines.append(f'LABEL {HASH_LABEL}="{ident.hash}"')
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _lock(lock_dir: Path, env_hash: str) -> Iterator[None]:
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"image-{env_hash}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # concurrent runs of one hash (any agent of the host) wait for one build
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def mark_used(lock_dir: Path, env_hash: str) -> None:
    """The hash's image was used now (``env ls --images`` and the LRU read it); a write that fails is skipped."""
    with contextlib.suppress(OSError):
        lock_dir.mkdir(parents=True, exist_ok=True)
        (lock_dir / f"image-{env_hash}.used").touch()


def find_image(client: Any, tag: str, env_hash: str) -> Optional[str]:
    """The id of the hash's image: by its tag, else by its label (another job's tag; tagged ``tag`` now)."""
    found = _image_id(client, tag)
    if found:
        return found
    for img in client.images.list(filters={"label": f"{HASH_LABEL}={env_hash}"}):
        repo, _, name = tag.rpartition(":")
        img.tag(repo, name)
        return img.id
    return None


def ensure_image(client: Any, spec: EnvironmentSpec, ident: ImageIdentity, tag: str, lock_dir: Path,
                 log: Optional[Callable[[str], None]] = None) -> BuiltImage:
    """The hash's image, built now when missing (blocking: call it from a thread)."""
    t0 = time.monotonic()
    mark_used(lock_dir, ident.hash)
    found = find_image(client, tag, ident.hash)
    if found:
        return BuiltImage(tag, found, ident.hash, False, time.monotonic() - t0)
    with _lock(lock_dir, ident.hash):
        found = find_image(client, tag, ident.hash)  # another run built it while this one waited
        if found:
            return BuiltImage(tag, found, ident.hash, False, time.monotonic() - t0)
        image_id = build(client, spec, ident, tag, log or (lambda line: None))
        repo, _, name = tag.rpartition(":")
        client.api.tag(image_id, repo, name)  # complete: only now does the tag exist
    seconds = time.monotonic() - t0
    (log or (lambda line: None))(f"image {tag} built in {seconds:.1f} s")
    return BuiltImage(tag, image_id, ident.hash, True, seconds)


def build(client: Any, spec: EnvironmentSpec, ident: ImageIdentity, tag: str, log: Callable[[str], None]) -> str:
    """Build the image untagged; its id. Raises `ImageBuildError` with Docker's last lines."""
    tail: deque[str] = deque(maxlen=LAST_LINES)
    with tempfile.TemporaryDirectory(prefix=f"launch-image-{ident.hash}-") as tmp:
        ctx = Path(tmp) / "ctx"
        ctx.mkdir()
        if spec.dockerfile:  # what Docker would send of the job's context (its .dockerignore applied)
            root = Path(spec.context or Path(spec.dockerfile).parent)
            for rel in context_files(root):
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, ctx / rel, follow_symlinks=False)
        ours = ctx / CTX_DIR
        ours.mkdir(exist_ok=True)
        local = [link for link in ident.find_links if "://" not in link or link.startswith("file://")]
        for i, link in enumerate(local):
            src = Path(link[len("file://"):] if link.startswith("file://") else link)
            if not src.is_dir():
                raise ImageBuildError(tag, f"find_links folder {str(src)!r} does not exist on agent host")
            shutil.copytree(src, ours / "wheels" / str(i))
        (ours / "requirements.txt").write_text("".join(p + "\n" for p in ident.pins))
        (ours / "Dockerfile").write_text(dockerfile_text(spec, ident, local))
        image_id = None
        error = None
        try:
            stream = client.api.build(path=str(ctx), dockerfile=f"{CTX_DIR}/Dockerfile", rm=True, forcerm=True,
                                      decode=True, network_mode="host", pull=False,
                                      buildargs=dict(ident.build_args) or None)
            for chunk in stream:
                if "stream" in chunk:
                    for line in str(chunk["stream"]).splitlines():
                        if line.strip():
                            tail.append(line.rstrip())
                            log(line.rstrip())
                if "error" in chunk:
                    error = str(chunk.get("error") or "").strip()
                    tail.append(error)
                    log(error)
                aux = chunk.get("aux") or {}
                if isinstance(aux, dict) and aux.get("ID"):
                    image_id = aux["ID"]
        except Exception as exc:  # the daemon refused the build itself (bad context, daemon gone)
            raise ImageBuildError(tag, f"{type(exc).__name__}: {exc}") from None
        if error or not image_id:
            raise ImageBuildError(tag, "\n".join(tail) or "docker build gave no image")
        return image_id


def push(client: Any, image_id: str, registry: str, tag: str, log: Optional[Callable[[str], None]] = None) -> str:
    """Push the image to ``registry`` as ``<registry>/<tag>``; the pushed reference by digest."""
    repo, _, name = f"{registry.rstrip('/')}/{tag}".rpartition(":")
    client.api.tag(image_id, repo, name)
    digest = None
    tail: deque[str] = deque(maxlen=LAST_LINES)
    for chunk in client.api.push(repo, tag=name, stream=True, decode=True):
        if chunk.get("error"):
            raise ImageBuildError(f"{repo}:{name}", f"push to {registry} failed: {chunk['error']}")
        aux = chunk.get("aux") or {}
        if isinstance(aux, dict) and aux.get("Digest"):
            digest = aux["Digest"]
        status = chunk.get("status")
        if status and log and not chunk.get("progressDetail"):
            tail.append(str(status))
            log(f"push: {chunk.get('id', '')} {status}".replace("  ", " "))
    if not digest:
        raise ImageBuildError(f"{repo}:{name}", f"push to {registry} gave no digest: {' / '.join(tail)}")
    return f"{repo}@{digest}"
