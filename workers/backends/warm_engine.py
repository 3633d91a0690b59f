"""A pre-imported Prefect engine process waiting for its flow run.

The agent keeps one of these ready. It pays Prefect's import cost (about a
second, more on a busy box) before any run exists; when a run is placed the
agent writes one JSON line to its stdin - the run's environment and working
directory - and it becomes ``python -m prefect.engine`` for that run. Nothing
is forked: it is a real child of the agent, in its own session, so pinning,
memory limits, output streaming and cancellation work as for a cold start.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Optional


PRELOAD = ("prefect.engine", "prefect.flow_engine", "prefect.flows", "prefect.deployments.steps",
           "prefect._internal.control_listener", "prefect.client.orchestration",
           # what every run's engine still imported after the order (traced: sys.modules at the order vs at
           # exit): ~0.06 s of CPU per run, up to ~0.5 s of its start on a loaded box
           "anyio._backends._asyncio", "anyio.streams.memory", "anyio.streams.stapled", "anyio.streams.tls",
           "encodings.idna", "stringprep", "pydantic.v1", "rich._emoji_codes")
# What an interactive session serves (flows/session.py forks its server from this interpreter when
# it is imported). Where installed; skipped as soon as a run is waiting; only when the pool asks for them
# (LAUNCH_WARM_APPS=1: it does after the agent placed an interactive session, see warm_start.WarmPool).
PRELOAD_APPS = ("jupyter_server.serverapp", "jupyter_server_terminals", "jupyterlab.labapp")


def main() -> None:
    import importlib
    import select

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for name in PRELOAD_APPS if os.environ.get("LAUNCH_WARM_APPS", "1") != "0" else ():
        if select.select([sys.stdin], [], [], 0)[0]:  # the order is here: a job does not wait for the apps
            break
        try:
            importlib.import_module(name)
        except ImportError:
            break
    order_path = os.environ.get("LAUNCH_WARM_ORDER")
    if order_path:  # a warm container (workers/backends/warm_containers.py): the order arrives as a file
        order = _wait_for_order(order_path, os.environ.get("LAUNCH_WARM_ORDER_DONE"))
    else:
        line = sys.stdin.readline()
        if not line:  # the agent went away before using us
            return
        order = json.loads(line)
    if order.get("log_path"):
        # Write to a file the agent tails, not to a pipe held by the agent: if the agent dies
        # (SIGKILL, OOM) the run goes on and is re-adopted, instead of dying of a broken pipe.
        fd = os.open(order["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if order.get("replace_env", True):
        os.environ.clear()
    os.environ.update({k: v for k, v in order["env"].items() if v is not None})
    if os.environ.get("LAUNCH_ENV_SITE"):  # the run's job environment, first (workers/environments/run_env.py)
        import importlib

        sys.path.insert(0, os.environ["LAUNCH_ENV_SITE"])
        importlib.invalidate_caches()
    if order.get("cwd"):
        os.chdir(order["cwd"])
    # Settings were read at import time from the agent's environment; re-read them from the run's.
    from prefect.context import SettingsContext
    from prefect.settings import Settings

    ctx = SettingsContext.get()
    SettingsContext(profile=ctx.profile if ctx else None, settings=Settings()).__enter__()
    from prefect_launch.api_retry import install

    install()  # a 503 from a busy SQLite server costs the run milliseconds, not Prefect's 2 s back-off
    if order_path:  # a warm container: the engine must not get the agent's SIGTERM (see container_engine)
        from prefect_launch.workers.backends.container_engine import shield_from_sigterm

        shield_from_sigterm()
    from prefect_launch.compat.prefect import engine_heartbeats_unjoined

    # the run's capacity goes back when this process exits: not a second after its final state, waiting for
    # Prefect's heartbeat thread to finish a 1-s sleep (compat: Prefect's own join_on_exit=False)
    engine_heartbeats_unjoined()
    import warnings

    # runpy's notice that prefect.engine is already imported: that is the point of a warm engine
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    sys.argv = ["prefect.engine"]
    from prefect_launch.settings import env_text

    if env_text("LAUNCH_ENGINE_FAST_EXIT", "1").lower() in ("0", "false", "no"):
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # the engine's own exit(0/1); any other exception: Python's exit, as before
        code = exit_code(exc)
    finish_fast(code)


def exit_code(exc: SystemExit) -> int:
    """The status the interpreter would exit with for ``exc`` (printing a message code, as it does)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def finish_fast(code: int) -> None:
    """End the engine as the interpreter would, less its finalization, which frees every object of an
    interpreter that imported Prefect: measured 3-5 s between the last exit handler and the process's end on a
    loaded box (load ~18 on 2 cores), all of it with the run done and its capacity still held.

    In the interpreter's order: the non-daemon threads are waited for (and what they registered to run
    first, e.g. thread pools' shutdown), the exit handlers run (Prefect's log and event workers flush there),
    open files are flushed (finalization would have done it for files the job never closed), then the process
    ends with ``code``. ``LAUNCH_ENGINE_FAST_EXIT=0``: the interpreter's own exit.
    """
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_handlers is None:  # not CPython: its own exit
        sys.exit(code)
    shutdown()
    run_exit_handlers()
    flush_open_files()
    os._exit(code)


def flush_open_files() -> None:
    """Flush every open writable file object (text layers first), as their finalization would."""
    import gc
    import io

    text, binary = [], []
    binary_types = {io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair}
    # the classes open() returns, by exact type: 0.05 s of CPU for an engine's ~235k objects; isinstance against
    # io's ABCs cost 0.14 s of CPU, seconds on a loaded box
    for obj in gc.get_objects():
        kind = type(obj)
        if kind is io.TextIOWrapper:
            text.append(obj)
        elif kind in binary_types:
            binary.append(obj)
    for stream in [sys.stdout, sys.stderr, *text, *binary]:
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            pass


def _wait_for_order(path: str, done_path: Optional[str] = None, poll_s: float = 0.02) -> dict:
    """Say we are ready (with our uid/gid, so the agent writes a file we can read and remove), then wait.

    The agent writes the order with Docker's archive API, then a done marker in the same archive
    (``done_path``, workers/warm_containers.ORDER_DONE_PATH): the order is read once the marker exists, when
    Docker is done with the order file. The order is then removed at once (it holds the run's environment);
    the empty marker stays, as Docker may still be setting its owner. Without ``done_path`` (an agent of an
    older version) the order is read as soon as it parses.
    """
    import time

    print(f"launch-warm-ready uid={os.getuid()} gid={os.getgid()}", flush=True)
    while True:
        if done_path and not os.path.exists(done_path):
            time.sleep(poll_s)
            continue
        try:
            with open(path) as fh:
                order = json.loads(fh.read())
        except (OSError, ValueError):
            time.sleep(poll_s)
            continue
        try:
            os.remove(path)
        except OSError:
            pass
        return order


if __name__ == "__main__":
    main()
