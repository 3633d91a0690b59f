"""A container run's job environment, as the agent prepares it before the run's container starts.

The docker back end calls `prepare_job_image` from ``run`` once the run is placed (its capacity held, as for
process queues: see run_env.py for why) and before its container is created. With no ``environment`` job
variable it returns None and nothing changes. Otherwise it resolves the declaration (files relative to the
deployment's ``path``; a submission already sent its pins inline and its Dockerfile as an absolute path), finds
or builds the image ``launch-env/<job>:<hash>`` (`image.ensure_image`, in a thread) and points the run's
configuration at it. While it builds, the run's ``launch.waiting`` label says "building image <hash>, <n> s";
Docker's output goes to the run's logs; one ``build`` record (``env-cache-hit`` / ``env-cache-miss`` /
``env-build-failed``) goes into the scheduling history; a failed build ends the run Failed with Docker's words.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import anyio
import anyio.to_thread

from prefect_launch.workers.environments.builder import default_cache_dir
from prefect_launch.workers.environments.image import (BuiltImage, ImageBuildError, ensure_image, find_image,
                                                       image_identity, image_tag)
from prefect_launch.workers.environments.image_cache import ImageCache
from prefect_launch.workers.environments.run_env import building_label
from prefect_launch.workers.environments.spec import inline, parse_environment

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


@dataclass
class JobImage:
    built: Optional[BuiltImage] = None
    error: Optional[str] = None
    reference: Optional[str] = None  # what the run's container (or pod) names: the tag, or a pushed digest


async def _deployment(worker: Any, flow_run: "FlowRun") -> Any:
    if not flow_run.deployment_id:
        return None
    try:
        return await worker.client.read_deployment(flow_run.deployment_id)
    except Exception:
        return None


async def prepare_job_image(worker: Any, flow_run: "FlowRun", declared: Any, base: Optional[str],
                            docker_client: Callable[[], Any], lock_dir: Optional[Path] = None,
                            after_build: Optional[Callable[[Any, BuiltImage], str]] = None) -> Optional[JobImage]:
    """Build or find the run's image (``FROM base`` unless the environment names its own); None without an
    environment. The caller points the run at ``reference``.

    ``declared``: the configuration's ``environment``; else the run's job variables', else its deployment's
    (a pool whose template has no slot for it). ``docker_client`` is called only when there is one.
    ``after_build`` (kubernetes: push to the queue's registry)
    turns the built image into the reference the run names, in the same thread and under the same waiting label."""
    declared = declared or (getattr(flow_run, "job_variables", None) or {}).get("environment")
    dep = await _deployment(worker, flow_run) if flow_run.deployment_id else None
    declared = declared or (getattr(dep, "job_variables", None) or {}).get("environment")
    if not declared:
        return None
    import prefect

    job = JobImage()
    logger = worker.get_flow_run_logger(flow_run)
    t0 = time.monotonic()
    env_hash = ""
    tag = "?"
    try:
        spec = parse_environment(declared, "of the run")
        client = await anyio.to_thread.run_sync(docker_client)
        spec = inline(spec, [getattr(dep, "path", None), os.getcwd()])
        ident = await anyio.to_thread.run_sync(image_identity, spec, client, base, prefect.__version__)
        env_hash = ident.hash
        tag = image_tag(getattr(dep, "name", None) or flow_run.name, env_hash)
    except Exception as exc:  # a file the agent cannot see, a Dockerfile that is no Dockerfile
        job.error = f"environment build failed: {exc}"
        await _fail(worker, flow_run, job.error, time.monotonic() - t0, env_hash=env_hash)
        return job
    short = env_hash[:8]
    hit = await anyio.to_thread.run_sync(find_image, client, tag, env_hash)
    if not hit:
        logger.info(f"building image {tag} ({len(ident.pins)} requirement(s)) with docker")
    stop_label = anyio.Event()

    def work() -> tuple[BuiltImage, str]:
        built = ensure_image(client, spec, ident, tag, lock_dir or default_cache_dir(), log=logger.info)
        if built.built:  # LAUNCH_ENV_CACHE_MAX: the least recently used images of no live run go (not this one)
            for gone in ImageCache(client, lock_dir).enforce_limit(keep={built.hash}):
                logger.info(f"image {gone} removed (LAUNCH_ENV_CACHE_MAX, least recently used)")
        return built, (after_build(client, built) if after_build is not None else built.tag)

    async with anyio.create_task_group() as tg:
        if not hit:
            tg.start_soon(building_label, worker, flow_run, f"image {short}", t0, stop_label)
        try:
            job.built, job.reference = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except ImageBuildError as exc:  # caught here: out of the task group it would be an ExceptionGroup
            job.error = str(exc)
        except Exception as exc:  # the daemon gone, a registry refusing
            job.error = f"environment build failed: image {tag}: {type(exc).__name__}: {exc}"
        finally:
            stop_label.set()
    if job.error:
        await _fail(worker, flow_run, job.error, time.monotonic() - t0, env_hash=env_hash)
        return job
    built = job.built
    assert built is not None
    seconds = time.monotonic() - t0
    how = f"built in {built.seconds:.1f} s (cache miss)" if built.built else "cache hit"
    _note(worker, flow_run.id, "build", "SUCCESS", error_code="env-cache-miss" if built.built else "env-cache-hit",
                 from_state="PENDING", to_state="PENDING",
                 message=f"image {built.tag} ({built.id[7:19]}): {how}; agent {worker.name} held the run's "
                         f"capacity for {seconds:.3f} s before its start")
    logger.info(f"job environment image {job.reference} ({how})")
    return job


def _note(worker: Any, *args: Any, **kw: Any) -> None:
    """A scheduling-history record, where the worker keeps one (the kubernetes worker keeps none)."""
    note = getattr(worker, "_note", None)
    if note is not None:
        note(*args, **kw)


async def _fail(worker: Any, flow_run: "FlowRun", message: str, seconds: float, env_hash: str = "") -> None:
    from prefect.states import Failed

    _note(worker, flow_run.id, "build", "FAILURE", error_code="env-build-failed", from_state="PENDING",
          to_state="FAILED", message=f"image {env_hash or '?'} after {seconds:.1f} s: {message}")
    worker.get_flow_run_logger(flow_run).error(message)
    try:
        await worker.client.set_flow_run_state(flow_run.id, Failed(message=message[-2000:]), force=True)
    except Exception as exc:
        worker._logger.warning("could not mark run %s Failed after its image build: %s", flow_run.id, exc)
