"""`prefect-launch session commit NAME --image-name IMG`: a running docker session's container as an image.

Backend.AI's "commit session to image": the container's file system as it is now becomes the image
``launch/<owner>/<img>`` (tagged with the commit time and ``latest``), labelled as the owner's, which
a new session uses with ``session start --image launch/<owner>/<img>:latest`` on a docker queue.

- The image name is checked first (4-32 letters, digits, ``-``, ``_``), before anything is read.
- Mounted folders are left out: they are volumes (bind mounts), which a container commit never
  includes; the result lists the paths that were mounted.
- The run's environment is not baked in: every variable the agent or Prefect set on the container
  (API address, run id, secret env values, ...) is blanked in the image, whose own variables stay.
- The container is paused while it is committed (a consistent snapshot) and keeps running.

The docker daemon is the one at ``DOCKER_HOST`` (or the default socket): the session's agent's host.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Optional

from pydantic import BaseModel

from prefect_launch.workers.scheduling.resources import LaunchValidationError
from prefect_launch.workers.agent.tags import AGENT_LABEL, QUEUE_LABEL, RUN_ID_LABEL, tag_value

IMAGE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{4,32}$")
REPOSITORY_PREFIX = "launch"
OWNER_LABEL = "io.prefect-launch.owner"
SESSION_LABEL = "io.prefect-launch.session"
SESSION_ID_LABEL = "io.prefect-launch.session-id"
IMAGE_NAME_LABEL = "io.prefect-launch.image-name"
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")  # docker's rule for a repository path part


class Committed(BaseModel):
    image: str  # repository:tag, as `session start --image` takes it
    repository: str
    tag: str
    image_id: str
    owner: str
    session: str
    session_id: str
    excluded_mounts: list[str]  # paths in the container that were volumes (not in the image)


def check_image_name(name: str) -> Optional[str]:
    """The problem with an image name, or None (the seed's rule: 4-32 letters, digits, '-', '_')."""
    if not IMAGE_NAME_RE.match(name or ""):
        return (f"image name {name!r}: use 4-32 characters of letters, digits, '-' and '_' "
                "(e.g. my-env_2)")
    if not _COMPONENT.match(name.lower()):
        return (f"image name {name!r}: Docker needs it to start and end with a letter or digit, without "
                "'-_' or three '_' in a row")
    return None


def owner_component(owner: str) -> str:
    """The owner as a repository path part (lowercase; other characters as '-')."""
    part = re.sub(r"[^a-z0-9]+", "-", (owner or "").lower()).strip("-")
    return part or "user"


def repository_for(owner: str, image_name: str) -> str:
    return f"{REPOSITORY_PREFIX}/{owner_component(owner)}/{image_name.lower()}"


def _blanked_env(container_env: list[str], image_env: list[str]) -> list[str]:
    """The image's own variables, and every other variable of the container set empty (Docker merges the
    container's environment into a commit for every name the given config does not set)."""
    own = {e.split("=", 1)[0] for e in image_env}
    return list(image_env) + [f"{name}=" for name in dict.fromkeys(e.split("=", 1)[0] for e in container_env)
                              if name not in own]


def commit_container(container: Any, owner: str, image_name: str, session: str, session_id: str,
                     now: Optional[datetime] = None) -> Committed:
    """Commit ``container`` (docker-py) as the owner's image; see the module's rules."""
    problem = check_image_name(image_name)
    if problem:
        raise LaunchValidationError(problem)
    now = now or datetime.now(timezone.utc)
    repo = repository_for(owner, image_name)
    tag = now.strftime("%Y%m%d-%H%M%S")
    attrs = container.attrs or {}
    try:
        image_env = list((container.image.attrs.get("Config") or {}).get("Env") or [])
    except Exception:
        image_env = []
    conf = {
        "Env": _blanked_env(list((attrs.get("Config") or {}).get("Env") or []), image_env),
        "Labels": {OWNER_LABEL: owner, SESSION_LABEL: session, SESSION_ID_LABEL: session_id,
                   IMAGE_NAME_LABEL: image_name, RUN_ID_LABEL: "", AGENT_LABEL: "", QUEUE_LABEL: ""},
    }
    image = container.commit(repository=repo, tag=tag, message=f"session {session} of {owner}", author=owner,
                             conf=conf, pause=True)
    image.tag(repo, "latest")
    mounts = [m.get("Destination") for m in attrs.get("Mounts") or [] if m.get("Destination")]
    return Committed(image=f"{repo}:latest", repository=repo, tag=tag, image_id=image.id, owner=owner,
                     session=session, session_id=session_id, excluded_mounts=sorted(mounts))


def commit_session(client: Any, docker_client: Any, session: str, image_name: str, owner: str) -> Committed:
    """Find the owner's running session ``session`` (name or id) and commit its container."""
    from prefect_launch.deployments.session_view import find_session
    from prefect_launch.workers.scheduling.queue_spec import queue_spec_of

    problem = check_image_name(image_name)  # before anything is read
    if problem:
        raise LaunchValidationError(problem)
    try:
        fr = find_session(client, session, owner)
    except LookupError as exc:
        raise LaunchValidationError(str(exc)) from None
    if not fr.state or fr.state.type.value != "RUNNING":
        raise LaunchValidationError(f"session {fr.name} is {fr.state_name}; only a running session can be committed")
    spec = None
    try:
        spec = queue_spec_of(client.read_work_pool(fr.work_pool_name))
    except Exception:
        pass
    if spec is None or spec.target != "docker":
        raise LaunchValidationError(f"session {fr.name} runs on queue {fr.work_pool_name!r}, which runs sessions as "
                                    "processes; only sessions of docker queues can be committed")
    live = [c for c in docker_client.containers.list(filters={"label": f"{RUN_ID_LABEL}={fr.id}"})
            if c.status == "running"]
    if not live:
        raise LaunchValidationError(f"session {fr.name}: no running container of it on this Docker host; run the "
                                    "commit where its agent runs (DOCKER_HOST)")
    return commit_container(live[0], tag_value(fr.tags, "owner") or owner, image_name, fr.name, str(fr.id))


class OwnerImage(BaseModel):
    """One image an owner committed from a session (what `session start --image` takes)."""

    image: str  # repository:latest where tagged so, else the newest repository:tag
    repository: str
    tags: list[str]  # every tag of this image, newest first
    image_id: str
    created: Optional[datetime] = None
    size_bytes: Optional[int] = None
    session: str = ""
    session_id: str = ""


def _docker_time(value: Any) -> Optional[datetime]:
    """Docker's ``2026-12-01T00:40:12.123456789Z`` (nanoseconds, UTC) as a datetime; None if unreadable."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z?$", str(value or ""))
    if not m:
        return None
    return datetime.fromisoformat(m.group(1) + "." + (m.group(2) or "0")[:6].ljust(6, "0")).replace(tzinfo=timezone.utc)


def owner_images(images: list[Any], owner: str) -> list[OwnerImage]:
    """The committed images (docker-py ``Image``s) labelled as ``owner``'s, newest first. Pure over the
    images' attributes: the caller lists them (``docker.images.list(filters={"label": ...})``)."""
    out = []
    for img in images:
        labels = getattr(img, "labels", None) or {}
        if labels.get(OWNER_LABEL) != owner:
            continue
        tags = sorted((t for t in (getattr(img, "tags", None) or []) if t.startswith(f"{REPOSITORY_PREFIX}/")),
                      key=lambda t: (t.endswith(":latest"), t.rsplit(":", 1)[-1]), reverse=True)
        if not tags:
            continue
        attrs = getattr(img, "attrs", None) or {}
        created = _docker_time(attrs.get("Created"))
        out.append(OwnerImage(image=tags[0], repository=tags[0].rsplit(":", 1)[0], tags=tags, image_id=img.id,
                              created=created, size_bytes=attrs.get("Size"), session=labels.get(SESSION_LABEL, ""),
                              session_id=labels.get(SESSION_ID_LABEL, "")))
    return sorted(out, key=lambda i: (i.created is not None, i.created or datetime.min.replace(tzinfo=timezone.utc)),
                  reverse=True)


def list_owner_images(docker_client: Any, owner: str) -> list[OwnerImage]:
    """`owner_images` of what the Docker host holds with the owner's label."""
    return owner_images(docker_client.images.list(filters={"label": f"{OWNER_LABEL}={owner}"}), owner)
