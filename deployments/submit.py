"""Submitting jobs: validate everything first, then create the run(s) or none.

The Python API (`submit`) and the CLI share this module, so both reject bad
input with the same message before anything reaches the queue.
"""

from __future__ import annotations

import getpass
import os
from datetime import datetime
import json
import re
from typing import Any, Optional, Union

from pydantic import BaseModel, Field

from prefect_launch.deployments.submit_retry import create_runs
from prefect_launch.workers.cluster.spec import check_fits_one_agent
from prefect_launch.workers.scheduling.queue_spec import queue_spec_of
from prefect_launch.workers.agent.queued_state import queued
from prefect_launch.workers.agent.registry import read_agents_sync
from prefect_launch.workers.scheduling.resolve import ResolvedRequest, resolve_request
from prefect_launch.workers.scheduling.resources import LaunchValidationError
from prefect_launch.workers.agent.tags import launch_tags
from prefect_launch.workers.agent.secrets import check_secret_blocks, parse_secret_env
from prefect_launch.workers.environments.spec import environment_for_submit

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SubmitRequest(BaseModel):
    job: str
    queue: Optional[str] = None
    preset: Optional[str] = None
    cpu: Optional[float] = None
    memory: Optional[str] = None
    gpu: Optional[int] = None
    shm_size: Optional[str] = None
    priority: Optional[str] = None
    params: dict[str, Any] = Field(default_factory=dict)
    env: Union[dict[str, str], list[str]] = Field(default_factory=dict)
    # NAME=secret-block-name: only the block name is stored; the agent reads the value at start
    secret_env: Union[dict[str, str], list[str]] = Field(default_factory=dict)
    name: Optional[str] = None
    count: int = Field(1, ge=1, le=1000)
    agent: Optional[str] = None
    owner: Optional[str] = None
    idempotency_key: Optional[str] = Field(
        None, description="Names this submission: repeating it with the same key returns the same runs")
    timeout: Optional[str] = None  # e.g. "90s", "2h": the agent ends the run Failed after this long
    preemptible: Optional[bool] = None  # None: the queue's default for the priority level
    scheduled_time: Optional[datetime] = None  # never starts before (a batch session's --starts-at)
    extra_tags: list[str] = Field(default_factory=list)  # e.g. a session's type
    extra_labels: dict[str, str] = Field(default_factory=dict)
    extra_job_variables: dict[str, Any] = Field(default_factory=dict)  # e.g. a docker session's image and volumes
    dry_run: bool = False  # validate and resolve everything, create nothing
    cluster_size: Optional[int] = None  # a cluster run of this many members (main1, sub1, ...), placed all or none
    cluster_mode: Optional[str] = None  # single-node | multi-node
    # a job environment ({requirements: FILE or [pins], ...}; a bare file name too): overrides the deployment's
    environment: Optional[Any] = None


class Submitted(BaseModel):
    run_ids: list[str]
    names: list[str]
    job: str
    queue: str
    priority: str
    preset: str
    resources: str
    timeout_s: Optional[float] = None
    dry_run: bool = False
    cluster_size: int = 1
    cluster_mode: str = "single-node"


def parse_params(items: list[str]) -> dict[str, str]:
    """``k=v`` pairs, values kept as typed; `validate_params` decodes them against the job's schema."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise LaunchValidationError(f"bad --param {item!r}: expected key=value")
        k, v = item.split("=", 1)
        if not k:
            raise LaunchValidationError(f"bad --param {item!r}: empty name")
        out[k] = v
    return out


def parse_env(items: Union[list[str], dict[str, str]]) -> dict[str, str]:
    """Validate env names; a name given twice is an error, not a silent override."""
    pairs: list[tuple[str, str]] = list(items.items()) if isinstance(items, dict) else []
    if isinstance(items, list):
        for item in items:
            if "=" not in item:
                raise LaunchValidationError(f"bad --env {item!r}: expected NAME=value")
            pairs.append(tuple(item.split("=", 1)))  # type: ignore[arg-type]
    out: dict[str, str] = {}
    for k, v in pairs:
        if not ENV_NAME_RE.match(k):
            raise LaunchValidationError(
                f"invalid environment variable name {k!r}: use letters, digits and '_' and do not start with a digit"
            )
        if k in out:
            raise LaunchValidationError(f"environment variable {k!r} is given twice; keep one")
        out[k] = str(v)
    return out


def _is_text(prop: dict[str, Any]) -> bool:
    types = [prop.get("type")] + [alt.get("type") for alt in prop.get("anyOf", [])]
    return "string" in types and not any(t in types for t in ("integer", "number", "boolean", "array", "object"))


def _coerce_to_schema(params: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Text from the command line is JSON (``3``, ``true``, ``[1,2]``) unless the parameter is a string:
    ``--param tag=123`` or ``--param note=750e50`` for a string parameter stays that exact text."""
    props = schema.get("properties", {})
    out = dict(params)
    for k, v in params.items():
        prop = props.get(k, {})
        if isinstance(v, str):
            if not _is_text(prop):
                try:
                    out[k] = json.loads(v)
                except json.JSONDecodeError:
                    pass
        elif prop.get("type") == "string":
            out[k] = json.dumps(v) if isinstance(v, (list, dict)) else str(v).lower() if isinstance(v, bool) else str(v)
    return out


def validate_params(params: dict[str, Any], schema: Optional[dict[str, Any]], job: str) -> dict[str, Any]:
    from prefect.utilities.schema_tools.validation import validate

    if not schema or not schema.get("properties"):
        if params:
            raise LaunchValidationError(f"job {job!r} takes no parameters, got {sorted(params)}")
        return params
    unknown = sorted(set(params) - set(schema["properties"]))
    if unknown:
        raise LaunchValidationError(
            f"unknown parameter(s) {unknown} for job {job!r}; it takes: {', '.join(sorted(schema['properties']))}"
        )
    params = _coerce_to_schema(params, schema)
    errors = validate(params, schema, raise_on_error=False, ignore_required=True)
    if errors:
        msgs = "; ".join(
            f"{'.'.join(str(p) for p in e.path) or 'parameters'}: {e.message}" for e in errors
        )
        raise LaunchValidationError(f"bad parameter value for job {job!r}: {msgs}")
    return params


def find_deployment(client: Any, job: str) -> Any:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.exceptions import ObjectNotFound

    if "/" in job:
        try:
            return client.read_deployment_by_name(job)
        except ObjectNotFound:
            raise LaunchValidationError(f"unknown job {job!r}; list jobs with `prefect-launch jobs ls`") from None
    found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[job])))
    if not found:
        raise LaunchValidationError(f"unknown job {job!r}; list jobs with `prefect-launch jobs ls`")
    if len(found) > 1:
        raise LaunchValidationError(
            f"job name {job!r} is ambiguous; use FLOW/DEPLOYMENT, e.g. one of "
            + ", ".join(sorted(f"{client.read_flow(d.flow_id).name}/{d.name}" for d in found))
        )
    return found[0]


def check_capacity(client: Any, queue: str, resolved: ResolvedRequest) -> None:
    """Refuse what no agent of the queue could ever hold; pins must name a known agent."""
    agents = [a for a in read_agents_sync(client) if queue in a.queues]
    if resolved.agent:
        pinned = [a for a in agents if a.name == resolved.agent]
        if not pinned:
            known = ", ".join(a.name for a in agents) or "none yet"
            raise LaunchValidationError(
                f"unknown agent {resolved.agent!r} for queue {queue!r}; agents serving it: {known}"
            )
        agents = pinned
    online = [a for a in agents if a.online()] or agents
    if online and not any(not resolved.resources.shortfall(a.capacity) for a in online):
        best = max(online, key=lambda a: (a.capacity.gpu, a.capacity.cpu, a.capacity.memory))
        need = "; ".join(f"{n}={need} (agent {best.name} has {have} in total)"
                         for n, need, have in resolved.resources.shortfall(best.capacity))
        raise LaunchValidationError(
            f"beyond any agent's total capacity on queue {queue!r}: needs {need}; choose a smaller preset"
        )
    too_big = check_fits_one_agent(resolved.cluster, resolved.resources, {a.name: a.capacity for a in online})
    if too_big:
        raise LaunchValidationError(f"beyond any agent's total capacity on queue {queue!r}: {too_big}")


def submit(client: Any, req: SubmitRequest) -> Submitted:
    """Validate ``req`` completely, then create ``req.count`` runs (all or none)."""
    from prefect.exceptions import ObjectNotFound

    if req.queue:
        try:
            client.read_work_pool(req.queue)
        except ObjectNotFound:
            raise LaunchValidationError(f"unknown queue {req.queue!r}; list queues with `prefect-launch queue ls`") from None
    deployment = find_deployment(client, req.job)
    queue = deployment.work_pool_name
    if req.queue and req.queue != queue:
        raise LaunchValidationError(
            f"job {req.job!r} is deployed to queue {queue!r}, not {req.queue!r}; "
            f"deploy it to {req.queue!r} (prefect.yaml work_pool) or submit with --queue {queue}"
        )
    pool = client.read_work_pool(queue)
    spec = queue_spec_of(pool)
    if spec is None:
        raise LaunchValidationError(
            f"queue {queue!r} has no launch presets; apply it with `prefect-launch queue apply FILE`"
        )
    priority = req.priority or spec.default_priority
    if priority not in spec.priorities:
        raise LaunchValidationError(f"unknown priority {priority!r}; queue {queue!r} has {', '.join(spec.priorities)}")
    run_vars = {k: v for k, v in {"preset": req.preset, "cpu": req.cpu, "memory": req.memory, "gpu": req.gpu,
                                  "shm_size": req.shm_size, "agent": req.agent,
                                  "timeout": str(req.timeout) if req.timeout is not None else None,
                                  "preemptible": req.preemptible, "cluster_size": req.cluster_size,
                                  "cluster_mode": req.cluster_mode}.items()
                if v is not None}
    resolved = resolve_request(spec, deployment.job_variables or {}, run_vars, priority=priority)
    env = parse_env(req.env)
    secret_env = parse_secret_env(req.secret_env, env)
    check_secret_blocks(client, secret_env)
    params = validate_params(req.params, deployment.parameter_openapi_schema, req.job)
    check_capacity(client, queue, resolved)
    environment = environment_for_submit(spec.target, deployment.job_variables, req.environment,
                                         [os.getcwd(), getattr(deployment, "path", None)])

    job_variables = dict(run_vars)
    if environment is not None:  # its file read here: inline pins travel with the run
        job_variables["environment"] = environment
    if env:  # per-run env overlays the deployment's env, key by key
        job_variables["env"] = {**((deployment.job_variables or {}).get("env") or {}), **env}
    if secret_env:  # block names only, never values; overlays the deployment's references
        job_variables["secret_env"] = {**((deployment.job_variables or {}).get("secret_env") or {}), **secret_env}
    job_variables.update(req.extra_job_variables)
    owner = req.owner or getpass.getuser()
    tags = launch_tags(owner, resolved.preset) + list(req.extra_tags)
    names = [req.name if req.count == 1 else (f"{req.name}-{i + 1}" if req.name else None) for i in range(req.count)]
    if req.dry_run:
        return Submitted(run_ids=[], names=[n or "" for n in names], job=req.job, queue=queue, priority=priority,
                         preset=resolved.preset, resources=resolved.resources.describe(),
                         timeout_s=resolved.timeout_s, dry_run=True, **_cluster_fields(resolved))

    def run_kwargs(i: int) -> dict[str, Any]:
        kw = dict(parameters=params, job_variables=job_variables, work_queue_name=priority, tags=tags, name=names[i],
                  labels={"launch.resources": (f"{resolved.cluster.size} x " if resolved.cluster.is_cluster else "")
                          + resolved.resources.describe(), "launch.preset": resolved.preset,
                          **({"launch.cluster": resolved.cluster.describe()} if resolved.cluster.is_cluster else {}),
                          **req.extra_labels})
        kw["state"] = queued(req.scheduled_time)  # named Queued: Prefect's late-runs service leaves it alone
        return kw

    # idempotency keys make retries on a busy server safe; all or none (see submit_retry)
    created = create_runs(client, deployment.id, req.count, run_kwargs, key=req.idempotency_key)
    return Submitted(
        run_ids=[str(fr.id) for fr in created], names=[fr.name for fr in created], job=req.job, queue=queue,
        priority=priority, preset=resolved.preset, resources=resolved.resources.describe(),
        timeout_s=resolved.timeout_s, **_cluster_fields(resolved),
    )


def _cluster_fields(resolved: ResolvedRequest) -> dict[str, Any]:
    return {"cluster_size": resolved.cluster.size, "cluster_mode": resolved.cluster.mode}
