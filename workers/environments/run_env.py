"""A process run's job environment, as the agent prepares it before the run's engine starts.

The process back end calls `prepare_job_environment` from ``run`` once the run is placed (its capacity held)
and before its process starts. With no ``environment`` job variable it returns None and nothing changes.
Otherwise it resolves the declaration (a requirements file is read relative to the deployment's ``path``; a
submission already sent its pins inline), builds or finds the environment (`builder.EnvCache.ensure`, in a
thread: the agent's loop keeps placing other runs), and points the run at it: the engine command becomes
``<env>/bin/python -m prefect.engine`` (a command the job set itself is kept, with the environment's ``bin``
first on ``PATH``), ``VIRTUAL_ENV`` is set.

- **Warm or cold start**: a warm engine is the agent's own Python with Prefect (and its dependencies) already
  imported. It runs the job when the environment only *adds* packages the agent does not have (`can_start_warm`:
  none of them can be imported already), with the environment's site-packages put first on ``sys.path``
  (``LAUNCH_ENV_SITE``, read by `warm_engine`) and on ``PYTHONPATH`` (for the job's own ``sys.executable``
  children). An environment that shadows an agent package (another version of something the agent has) starts
  cold, in its own interpreter, and pays the engine's imports (~1-2 s).
- **Capacity is held during the build**, and the build's time is counted and shown: the run was placed and
  claimed (Pending) before ``run`` is called, its GPUs and cores bound; handing them back for the build and
  placing it again would need a second claim path and could starve the run behind others, while a uv build is
  seconds and happens once per hash. While it builds, the run's ``launch.waiting`` label says
  "building environment <hash>, <n> s" (the CLI's run list shows it for a Pending run).
- **Records**: one ``build`` record in the scheduling history per run with an environment: SUCCESS with
  error code ``env-cache-hit`` or ``env-cache-miss`` (and the build's time), or FAILURE ``env-build-failed``.
  The build's output goes to the run's Prefect logs line by line.
- **A failed build** (or a file that cannot be read) ends the run Failed "environment build failed: <the
  installer's last lines>"; nothing is left that looks complete, and the next run of that hash builds again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import anyio
import anyio.to_thread

from prefect_launch.workers.environments.builder import (Built, EnvCache, EnvironmentBuildError, shadows_agent,
                                                         site_packages)
from prefect_launch.workers.environments.spec import identity, inline, parse_environment

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

LABEL_EVERY_S = 5.0  # how often the waiting label's seconds move on during a build


async def building_label(worker: Any, flow_run: "FlowRun", what: str, t0: float, stop: anyio.Event) -> None:
    """Until ``stop``: the run's waiting label says what is being built and for how long ("building image
    3f2a..., 12 s on agent a"), moved on every LABEL_EVERY_S; a label write that fails is only skipped."""
    from prefect_launch.workers.agent.tags import WAIT_LABEL

    while not stop.is_set():
        text = f"building {what}, {time.monotonic() - t0:.0f} s on agent {worker.name}"
        try:
            await worker.client.update_flow_run_labels(flow_run.id, {WAIT_LABEL: text})
        except Exception:
            pass
        with anyio.move_on_after(LABEL_EVERY_S):
            await stop.wait()


@dataclass
class JobEnvironment:
    """The outcome for one run: the environment it uses, or why it could not be had."""

    cache: EnvCache
    run_id: str
    built: Optional[Built] = None
    error: Optional[str] = None
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """The run is over: it no longer holds the environment (prune and the size limit may take it)."""
        if self.built is not None and not self._released:
            self._released = True
            self.cache.release(self.built.hash, self.run_id)


async def _deployment_path(worker: Any, flow_run: "FlowRun") -> Optional[str]:
    if not flow_run.deployment_id:
        return None
    try:
        dep = await worker.client.read_deployment(flow_run.deployment_id)
    except Exception:
        return None
    return getattr(dep, "path", None)


def point_at(configuration: Any, built: Built, warm: bool) -> None:
    """The run's engine starts in the environment: a warm engine with its site-packages first (``warm``), else
    the environment's own python (a cold start; see the module's docstring)."""
    from prefect.utilities.processutils import command_to_string

    bin_dir = str(built.path / "bin")
    env = configuration.env
    env["PATH"] = bin_dir + os.pathsep + (env.get("PATH") or os.environ.get("PATH", ""))
    env["VIRTUAL_ENV"] = str(built.path)
    env.pop("PYTHONHOME", None)
    if warm:  # the warm engine puts it first on sys.path; PYTHONPATH: for the job's own `sys.executable` children
        site_dir = str(site_packages(built.path))
        env["LAUNCH_ENV_SITE"] = site_dir
        env["PYTHONPATH"] = site_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    elif not configuration._command_configured:
        configuration.command = command_to_string([str(built.python), "-m", "prefect.engine"])
        configuration._command_configured = True


def can_start_warm(worker: Any, configuration: Any, cache: EnvCache, built: Built) -> bool:
    """A warm engine (the agent's Python, Prefect already imported) may run the job when the environment only
    adds packages the agent does not have: none of them can have been imported by it, so putting the
    environment's site-packages first gives the job exactly its pins. An environment that shadows an agent
    package (another version of pydantic, numpy, ...) starts cold, in its own interpreter."""
    if getattr(worker, "warm_pool", None) is None or configuration._command_configured:
        return False
    names = cache.meta(built.hash).get("top_level")
    return names is not None and not shadows_agent(names)


async def prepare_job_environment(worker: Any, flow_run: "FlowRun", configuration: Any,
                                  cache: Optional[EnvCache] = None) -> Optional[JobEnvironment]:
    """Build or find the run's environment and point ``configuration`` at it; None without an environment."""
    # the run's own job variables too: a queue applied before job environments has no ``environment`` in its
    # template, and `submit` always sends the declaration (the deployment's, inlined) with the run
    declared = getattr(configuration, "environment", None) or (getattr(flow_run, "job_variables", None) or {}).get(
        "environment")
    if not declared:
        return None
    import prefect

    run_id = str(flow_run.id)
    job = JobEnvironment(cache=cache or EnvCache(), run_id=run_id)
    logger = worker.get_flow_run_logger(flow_run)
    t0 = time.monotonic()
    try:
        spec = parse_environment(declared, "of the run")
        if not isinstance(spec.requirements, list):  # a file: read relative to the deployment's path
            spec = inline(spec, [await _deployment_path(worker, flow_run), os.getcwd()])
        spec = inline(spec, [])  # inline pins (what submit sends): normalised, no server round trip
        ident = identity(spec, prefect.__version__)
    except Exception as exc:  # a file the agent cannot see, a python it does not run
        job.error = f"environment build failed: {exc}"
        await _fail(worker, flow_run, job.error, time.monotonic() - t0)
        return job
    short = ident.hash[:8]
    hit = job.cache.is_complete(ident.hash)
    if not hit:
        logger.info(f"building environment {ident.hash} ({len(ident.pins)} requirement(s)) with uv")
    stop_label = anyio.Event()

    async with anyio.create_task_group() as tg:
        if not hit:
            tg.start_soon(building_label, worker, flow_run, f"environment {short}", t0, stop_label)
        try:
            job.built = await anyio.to_thread.run_sync(
                lambda: job.cache.ensure(ident, log=logger.info, run_id=run_id), abandon_on_cancel=True)
        except EnvironmentBuildError as exc:  # caught here: out of the task group it would be an ExceptionGroup
            job.error = str(exc)
        finally:
            stop_label.set()
    if job.error:
        await _fail(worker, flow_run, job.error, time.monotonic() - t0, env_hash=ident.hash)
        return job
    seconds = time.monotonic() - t0
    built = job.built
    how = f"built in {built.seconds:.1f} s (cache miss)" if built.built else "cache hit"
    worker._note(flow_run.id, "build", "SUCCESS", error_code="env-cache-miss" if built.built else "env-cache-hit",
                 from_state="PENDING", to_state="PENDING",
                 message=f"environment {built.hash}: {how}; agent {worker.name} held the run's capacity "
                         f"for {seconds:.3f} s before its start")
    warm = can_start_warm(worker, configuration, job.cache, built)
    logger.info(f"job environment {built.hash} ({how}) at {built.path}; {'warm' if warm else 'cold'} start")
    point_at(configuration, built, warm)
    return job


async def _fail(worker: Any, flow_run: "FlowRun", message: str, seconds: float, env_hash: str = "") -> None:
    from prefect.states import Failed

    worker._note(flow_run.id, "build", "FAILURE", error_code="env-build-failed", from_state="PENDING",
                 to_state="FAILED", message=f"environment {env_hash or '?'} after {seconds:.1f} s: {message}")
    worker.get_flow_run_logger(flow_run).error(message)
    try:
        await worker.client.set_flow_run_state(flow_run.id, Failed(message=message[-2000:]), force=True)
    except Exception as exc:
        worker._logger.warning("could not mark run %s Failed after its environment build: %s", flow_run.id, exc)
