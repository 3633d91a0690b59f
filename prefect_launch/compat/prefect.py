"""Prefect's private names that prefect-launch relies on (Prefect 3.9), each listed once.

Public first: the agent uses ``work_pool``, ``client``, ``sync_with_backend``, ``kill_infrastructure``
and hands the runs it accepts to ``_submit_scheduled_flow_runs`` as prefect-kubernetes does. What
follows has no public equivalent. `missing()` says which of them this Prefect no longer has.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Optional

from prefect.runner._flow_run_executor import FlowRunExecutorContext  # the engine process's life (warm start)
from prefect.runner._process_manager import ProcessHandle, create_isolated_termination_scope  # warm start
from prefect.runner._starter_engine import EngineCommandStarter  # the warm starter's base
from prefect.workers.base import BaseWorker
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

from prefect_launch.compat import missing_members

# BaseWorker state the agent reads (where): the run task group its loops and stops start in (core, backends,
# cluster), its logger, the pool (None before the first sync: the property raises) and queues, the client
# before it is opened, the runs being submitted, the scopes teardown cancels, the cancel observer, prefetch.
WORKER_ATTRIBUTES = (
    "_runs_task_group", "_logger", "_work_pool", "_work_pool_name", "_work_queues", "_client",
    "_submitting_flow_run_ids", "_scheduled_task_scopes", "_cancelling_observer", "_prefetch_seconds",
)
# BaseWorker hooks the agent overrides or calls (agent/core.py, backends/kubernetes/worker.py): the due-run
# read, the hand-over of accepted runs, one run's submit, its Pending/Crashed proposals, the limiter slot,
# the worker labels written on a run, the worker's metadata.
WORKER_HOOKS = (
    "_get_scheduled_flow_runs", "_submit_scheduled_flow_runs", "_submit_run", "_submit_run_and_capture_errors",
    "_propose_pending_state", "_propose_crashed_state", "_release_limit_slot",
    "_give_worker_labels_to_flow_run", "_worker_metadata",
)
# ProcessJobConfiguration: whether the job set its own command (such runs start cold; backends/*).
JOB_CONFIGURATION_ATTRIBUTES = ("_command_configured",)

# `backends/process.py::_run_warm` is ProcessWorker.run's command branch with the engine process taken from
# the warm pool (same executor, same `resolve_flow` hooks, same result). This is the run it was last read
# against; when Prefect changes it, re-read both and update the fingerprint (tests/test_compat.py says so).
PROCESS_RUN_FINGERPRINT = "d9f454e18b"  # Prefect 3.9.1
PROCESS_RUN_KEYWORDS = ("resolve_flow=load_flow_from_flow_run", "propose_submitting=False",
                        "identifier=str(execution.handle.pid)")


def process_run_fingerprint() -> str:
    """The first 10 hex digits of sha256 over ProcessWorker.run's source, blank lines and indentation dropped."""
    lines = [line.strip() for line in inspect.getsource(ProcessWorker.run).splitlines() if line.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


# The sync flow engine's heartbeat context (``prefect.flow_engine._send_heartbeats(engine, join_on_exit=True)``):
# its daemon thread sleeps in 1-s steps and the context joins it at the run's end, so a run's process outlives
# its Completed state by up to a second (measured: ~1 s per run end with whole-second runs) before its capacity
# can go back. Prefect's async engine passes ``join_on_exit=False``; warm engines do the same for sync flows.
ENGINE_HEARTBEATS = "_send_heartbeats"
ENGINE_HEARTBEATS_JOIN = "join_on_exit"


def engine_heartbeats_unjoined() -> bool:
    """In an engine process, before its run: Prefect's sync flow engine leaves its heartbeat thread to end on its
    own (``join_on_exit=False``, as its async engine does) instead of waiting up to a second for it. The thread is
    a daemon, stops at its next 1-s step and emits nothing once the run's state is final. False where this
    Prefect has no such parameter (nothing changed)."""
    import functools

    from prefect import flow_engine

    original = getattr(flow_engine, ENGINE_HEARTBEATS, None)
    if original is None:
        return False
    if getattr(original, "launch_unjoined", False):
        return True
    if ENGINE_HEARTBEATS_JOIN not in inspect.signature(original).parameters:
        return False

    @functools.wraps(original)
    def unjoined(engine, join_on_exit: bool = True):
        return original(engine, **{ENGINE_HEARTBEATS_JOIN: False})

    unjoined.launch_unjoined = True  # type: ignore[attr-defined]
    setattr(flow_engine, ENGINE_HEARTBEATS, unjoined)
    return True


# In an engine process: the port of its runner's control channel, read from the environment by Prefect's control
# listener (which removes the variable); one port for all runs of a worker means one shared executor context.
CONTROL_LISTENER_PORT = "_configured_port"


def engine_control_port() -> Optional[int]:
    """The control-channel port this engine process was given (None: none, or this Prefect keeps it elsewhere)."""
    import sys

    listener = sys.modules.get("prefect._internal.control_listener")
    port = getattr(listener, CONTROL_LISTENER_PORT, None) if listener is not None else None
    return port if isinstance(port, int) else None


def missing() -> list[str]:
    """The private names above that this Prefect no longer has (empty: all there)."""
    from prefect import flow_engine

    gone = [f"BaseWorker.{n}" for n in missing_members(BaseWorker, WORKER_ATTRIBUTES + WORKER_HOOKS)]
    heartbeats = getattr(flow_engine, ENGINE_HEARTBEATS, None)
    if heartbeats is None or ENGINE_HEARTBEATS_JOIN not in inspect.signature(
            getattr(heartbeats, "__wrapped__", heartbeats)).parameters:
        gone.append(f"prefect.flow_engine.{ENGINE_HEARTBEATS}({ENGINE_HEARTBEATS_JOIN}=...)")
    from prefect._internal import control_listener

    if not hasattr(control_listener, CONTROL_LISTENER_PORT):
        gone.append(f"prefect._internal.control_listener.{CONTROL_LISTENER_PORT}")
    gone += [f"ProcessJobConfiguration.{n}" for n in missing_members(ProcessJobConfiguration,
                                                                      JOB_CONFIGURATION_ATTRIBUTES)]
    source = inspect.getsource(ProcessWorker.run)
    gone += [f"ProcessWorker.run's `{k}`" for k in PROCESS_RUN_KEYWORDS if k not in source]
    return gone


__all__ = ["FlowRunExecutorContext", "ProcessHandle", "create_isolated_termination_scope", "EngineCommandStarter",
           "engine_control_port", "engine_heartbeats_unjoined", "missing", "process_run_fingerprint"]
