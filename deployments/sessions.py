"""Compute sessions (Backend.AI's batch and interactive sessions) as flow runs of flows/session.py.

`start_session` validates a whole request first and reports every problem at once,
then submits through `deployments.submit` - the same path as jobs - so presets, bounds,
capacity checks, placement, pinning, metrics and timeouts apply unchanged. The rules
are the seed's: names 4-64 characters of letters, digits, ``_ . -`` starting and ending
alphanumeric and unique among the owner's live sessions; startup command required for
batch; starts-at and timeout refused for interactive; ports 1024-65535 without
duplicates; valid, unique environment names.
"""

from __future__ import annotations

import getpass
import random
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from prefect_launch.local_server import free_port
from prefect_launch.deployments.submit import SubmitRequest, Submitted, parse_env, submit
from prefect_launch.times import duration_seconds, parse_when
from prefect_launch.workers.scheduling.resources import LaunchValidationError
from prefect_launch.workers.agent.tags import tag

SESSION_FLOW = "launch-session"
SESSION_TAG = "launch-session"
NAME_RE = re.compile(r"^(?=.{4,64}$)[A-Za-z0-9][A-Za-z0-9_.-]*[A-Za-z0-9]$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IMAGE_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")


def _flows_dir() -> Path:
    """The installed ``prefect_launch.flows`` package's folder (package data, found through importlib.resources:
    site-packages in a wheel install, ``flows/`` in an editable one); deployments and docker sessions refer to
    its files by this path, so it must be a real folder (not inside a zip)."""
    from importlib.resources import files

    return Path(str(files("prefect_launch.flows")))


FLOWS_DIR = _flows_dir()
LIVE = ("SCHEDULED", "PENDING", "RUNNING", "CANCELLING", "PAUSED")
_ADJ = ("amber", "brisk", "calm", "deft", "eager", "fresh", "gentle", "keen", "lucid", "mellow", "nimble",
        "quiet", "rapid", "steady", "swift", "vivid")
_NOUN = ("falcon", "otter", "lynx", "heron", "maple", "cedar", "comet", "delta", "ember", "fjord", "harbor",
         "meadow", "nebula", "quartz", "ridge", "tundra")


class SessionValidationError(LaunchValidationError):
    """Every problem of a session request, one per line."""

    def __init__(self, problems: list[str]):
        super().__init__("invalid session request:\n  - " + "\n  - ".join(problems))
        self.problems = problems


EXPOSE_BIND = "0.0.0.0"  # an exposed session's apps: every address of its host (its agent's published one too)


class SessionRequest(BaseModel):
    """What `prefect-launch session start` and the Python API take."""

    type: Literal["batch", "interactive"] = "interactive"
    queue: str
    name: Optional[str] = None
    preset: Optional[str] = None
    cpu: Optional[float] = None
    memory: Optional[str] = None
    gpu: Optional[int] = None
    shm_size: Optional[str] = None
    image: Optional[str] = None
    env: Union[dict[str, str], list[str]] = Field(default_factory=list)
    mounts: list[str] = Field(default_factory=list)
    ports: list[int] = Field(default_factory=list)
    count: int = 1
    owner: Optional[str] = None
    startup_command: Optional[str] = None
    starts_at: Optional[str] = None
    timeout: Optional[str] = None
    omp_threads: Optional[int] = None
    priority: Optional[str] = None
    agent: Optional[str] = None
    preemptible: bool = False  # may fill idle hardware and be preempted (then waits again for room)
    cluster_size: Optional[int] = None  # members main1, sub1, ... each with the preset, placed all or none
    cluster_mode: Optional[str] = None  # single-node | multi-node
    expose: bool = False  # interactive: apps listen on every address of the agent's host (token still required)


class SessionStarted(BaseModel):
    run_ids: list[str]
    names: list[str]
    type: str
    queue: str
    preset: str
    resources: str
    ports: list[int]
    starts_at: Optional[datetime] = None
    timeout_s: Optional[float] = None
    preemptible: bool = False
    cluster_size: int = 1
    cluster_mode: str = "single-node"
    warnings: list[str] = Field(default_factory=list)
    dry_run: bool = False


def session_deployment(queue: str) -> str:
    return f"{SESSION_FLOW}/session-{queue}"


def readable_name(rng: Optional[random.Random] = None) -> str:
    rng = rng or random.Random()
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}-{rng.randrange(16**4):04x}"


def check(req: SessionRequest, now: Optional[datetime] = None) -> tuple[list[str], list[str]]:
    """All problems and warnings of ``req`` (pure: no server)."""
    now = now or datetime.now(timezone.utc)
    problems: list[str] = []
    warnings: list[str] = []
    if req.name is not None and not NAME_RE.match(req.name):
        problems.append(f"name {req.name!r}: use 4-64 letters, digits, '_', '.' or '-', starting and ending "
                        "with a letter or digit")
    if req.count < 1 or req.count > 100:
        problems.append(f"count must be 1..100, got {req.count}")
    if req.type == "batch":
        if not (req.startup_command or "").strip():
            problems.append("a batch session needs --startup-command (the command it runs once placed)")
    else:
        for flag, value in (("--startup-command", req.startup_command), ("--starts-at", req.starts_at),
                            ("--timeout", req.timeout)):
            if value:
                problems.append(f"{flag} is for batch sessions; an interactive session lives until it is "
                                "terminated or reclaimed")
    if req.starts_at:
        try:
            parse_when(req.starts_at, now, what="starts-at", ahead=True)
        except LaunchValidationError as exc:
            problems.append(str(exc))
    if req.timeout:
        try:
            duration_seconds(req.timeout, "timeout")
        except LaunchValidationError as exc:
            problems.append(str(exc))
    seen_ports: set[int] = set()
    for p in req.ports:
        if not 1024 <= p <= 65535:
            problems.append(f"port {p} is outside 1024-65535")
        if p in seen_ports:
            problems.append(f"port {p} is given twice")
        seen_ports.add(p)
    if req.type == "interactive" and req.count > 1 and req.ports:
        problems.append("--port with --count > 1 would give several sessions the same port; omit --port "
                        "and each session gets free ports")
    env_items = list(req.env.items()) if isinstance(req.env, dict) else []
    if isinstance(req.env, list):
        for item in req.env:
            if "=" not in item:
                problems.append(f"env {item!r}: expected NAME=value")
                continue
            env_items.append(tuple(item.split("=", 1)))
    names = [k for k, _ in env_items]
    for k in names:
        if not ENV_RE.match(k):
            problems.append(f"env name {k!r}: use letters, digits and '_', not starting with a digit")
    for k in sorted({k for k in names if names.count(k) > 1}):
        problems.append(f"env name {k!r} is given twice")
    dsts = []
    for m in req.mounts:
        if ":" not in m or not m.split(":", 1)[0] or not m.split(":", 1)[1]:
            problems.append(f"mount {m!r}: expected HOST_FOLDER:PATH_IN_SESSION")
            continue
        src, dst = m.split(":", 1)
        if not Path(src).is_absolute():
            problems.append(f"mount {m!r}: the host folder must be an absolute path")
        if ".." in Path(dst).parts:
            problems.append(f"mount {m!r}: the path in the session must not contain '..'")
        if Path(src).exists() and not Path(src).is_dir():
            problems.append(f"mount {m!r}: {src} is a file, not a folder")
        dsts.append(dst.strip("/"))
    for d in sorted({d for d in dsts if dsts.count(d) > 1}):
        problems.append(f"two mounts share the path {d!r} in the session")
    if req.omp_threads is not None and req.omp_threads < 1:
        problems.append(f"omp-threads must be at least 1, got {req.omp_threads}")
    if not req.mounts:
        warnings.append("no --mount: nothing the session writes is kept after it ends (its scratch folder is deleted)")
    return problems, warnings


def live_sessions(client: Any, owner: Optional[str] = None) -> list[Any]:
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                FlowRunFilterTags)
    from prefect.client.schemas.objects import StateType

    tags = [SESSION_TAG] + ([tag("owner", owner)] if owner else [])
    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        tags=FlowRunFilterTags(all_=tags),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(s) for s in LIVE]))), limit=200)


def start_session(client: Any, req: SessionRequest, dry_run: bool = False, record_recent: bool = True,
                  now: Optional[datetime] = None) -> SessionStarted:
    """Validate everything (all errors at once), then submit ``req.count`` session runs or none."""
    now = now or datetime.now(timezone.utc)
    problems, warnings = check(req, now)
    owner = req.owner or getpass.getuser()
    base = req.name or readable_name()
    names = [base] if req.count == 1 else [f"{base}-{i + 1}" for i in range(req.count)]
    if not problems:
        taken = {r.name for r in live_sessions(client, owner)}
        for n in names:
            if n in taken:
                problems.append(f"name {n!r} is taken by another live session of {owner}; pick another --name "
                                "or terminate that one")
    spec = _queue_spec(client, req.queue)  # None: unknown queue, which the submit check below reports
    docker = spec is not None and spec.target == "docker"
    if req.image and not docker:
        problems.append(f"--image {req.image!r} needs a docker queue; queue {req.queue!r} runs sessions as "
                        "processes in the agent's environment")
    if req.image and not IMAGE_REF_RE.match(req.image):
        problems.append(f"--image {req.image!r} is not an image reference (e.g. launch/me/my-env:latest)")
    if docker and not (req.image or spec.image):
        problems.append(f"--image is needed: docker queue {req.queue!r} declares no default image")
    ports = list(req.ports) or ([free_port()] if req.type == "interactive" and req.count == 1 else [])
    env = parse_env(req.env) if not problems else {}
    if req.omp_threads:
        env["LAUNCH_OMP_THREADS"] = str(req.omp_threads)
    starts_at = (parse_when(req.starts_at, now, what="starts-at", ahead=True)
                 if req.starts_at and not problems else None)
    sub = SubmitRequest(
        job=session_deployment(req.queue), queue=req.queue, preset=req.preset, cpu=req.cpu, memory=req.memory,
        gpu=req.gpu, shm_size=req.shm_size, priority=req.priority, env=env, name=base, count=req.count,
        agent=req.agent, owner=owner, timeout=req.timeout if req.type == "batch" else None,
        preemptible=req.preemptible, cluster_size=req.cluster_size, cluster_mode=req.cluster_mode,
        params={"session_type": req.type, "startup_command": req.startup_command or "", "ports": ports,
                "mounts": container_mounts(req.mounts) if docker else list(req.mounts),
                **({"bind_host": EXPOSE_BIND} if req.expose and req.type == "interactive" else {})},
        extra_job_variables=docker_job_variables(req) if docker else {},
        scheduled_time=starts_at, extra_tags=[SESSION_TAG, tag("session-type", req.type)],
        extra_labels={"launch.session.ports": ",".join(map(str, ports))}, dry_run=True,
    )
    try:  # the job path's checks: queue, presets, bounds, capacity, priority - reported with the rest
        planned = submit(client, sub)
    except LaunchValidationError as exc:
        msg = str(exc)
        if "no job" in msg.lower() or "not found" in msg.lower() or "unknown job" in msg.lower():
            msg = (f"queue {req.queue!r} has no session deployment; run `prefect-launch queue apply FILE` "
                   f"again to deploy it ({msg})")
        problems.append(msg)
        planned = None
    if problems:
        raise SessionValidationError(problems)
    result = SessionStarted(run_ids=[], names=names, type=req.type, queue=req.queue, preset=planned.preset,
                            resources=planned.resources, ports=ports, starts_at=starts_at,
                            timeout_s=planned.timeout_s, preemptible=req.preemptible,
                            cluster_size=planned.cluster_size, cluster_mode=planned.cluster_mode,
                            warnings=warnings, dry_run=dry_run)
    if dry_run:
        return result
    done: Submitted = submit(client, sub.model_copy(update={"dry_run": False}))
    if record_recent:
        from prefect_launch.deployments.session_recent import remember

        try:
            remember(client, owner, req)
        except Exception:
            pass  # history is a convenience; never fail a launch for it
    return result.model_copy(update={"run_ids": done.run_ids, "names": done.names})


def _queue_spec(client: Any, queue: str) -> Any:
    from prefect_launch.workers.scheduling.queue_spec import queue_spec_of

    try:
        return queue_spec_of(client.read_work_pool(queue))
    except Exception:
        return None


def _in_container(dst: str) -> str:
    """Where a mount's PATH is in a docker session's container: absolute (``data`` -> ``/data``)."""
    return "/" + dst.strip("/")


def flows_volume() -> str:
    """The session flow's folder, read-only at the same path in a docker session's container."""
    return f"{FLOWS_DIR}:{FLOWS_DIR}:ro"


def container_mounts(mounts: list[str]) -> list[str]:
    """The session flow's ``mounts`` parameter in a container: the bind-mounted path, linked into the scratch folder."""
    return [f"{_in_container(m.split(':', 1)[1])}:{m.split(':', 1)[1]}" for m in mounts]


def docker_job_variables(req: SessionRequest) -> dict[str, Any]:
    """A docker session's job variables: its image (never pulled when present locally: committed session
    images exist only on their host) and volumes: the session flow's folder and each mount as a bind
    mount of the host folder (volumes are not part of the container's file system, so `session commit`
    leaves them out)."""
    out: dict[str, Any] = {"volumes": [flows_volume()] + [f"{m.split(':', 1)[0]}:{_in_container(m.split(':', 1)[1])}"
                                                          for m in req.mounts],
                           "image_pull_policy": "IfNotPresent"}
    if req.image:
        out["image"] = req.image
    return out


def deploy_session_flow(queue: str, work_queue: str, target: str = "process", image: Optional[str] = None) -> str:
    """Deploy the built-in session flow on ``queue`` (idempotent); returns its job reference.

    Docker queues: the flow's folder is mounted read-only into the container (the image needs Prefect,
    not this project); the queue's image is the default environment, ``session start --image`` another."""
    from prefect import flow

    job_variables: dict[str, Any] = {}
    if target == "docker":
        job_variables = {"volumes": [flows_volume()], "image_pull_policy": "IfNotPresent"}
    # to_deployment + apply is what Flow.deploy does for a pre-built image (build=False, push=False), without
    # its console output: `queue apply --json` prints one JSON document and nothing else
    deployment = flow.from_source(source=str(session_flow_file().parent), entrypoint="session.py:session").to_deployment(
        name=f"session-{queue}", work_pool_name=queue, work_queue_name=work_queue, job_variables=job_variables)
    deployment.apply(work_pool_name=queue, image=image if target == "docker" else None)
    return session_deployment(queue)


def session_flow_file() -> Path:
    """flows/session.py as installed; a clear error (not a FileNotFoundError deep in Prefect) when the
    installation lacks it."""
    path = FLOWS_DIR / "session.py"
    if not path.is_file():
        raise LaunchValidationError(f"the built-in session flow is missing from this installation: {path} does not "
                                    "exist (reinstall prefect-launch; its wheel ships prefect_launch/flows/)")
    return path
