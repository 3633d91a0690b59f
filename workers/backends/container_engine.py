"""The command a launch-docker container runs: Prefect's engine, without the CLI in front.

Prefect's default container command, ``prefect flow-run execute``, imports the whole
CLI before the engine, and the engine inside a container never had our quick retries
of SQLite's "database is locked" 503, so one such answer cost the run Prefect's 2-s
back-off. Measured on the docker dispatch benchmark: about 3.5 s from container start
to the deployment's pull steps. This module is what the agent writes as the command
when the job did not set one: it installs the quick retries and runs
``python -m prefect.engine`` for ``PREFECT__FLOW_RUN_ID`` (set by Prefect for every
run), exactly the engine ``flow-run execute`` would run.

It must also work in an image without prefect-launch installed, so the command is a
short ``python -c`` launcher (`COMMAND`) that falls back to Prefect's own engine.
"""

from __future__ import annotations

import runpy
import sys

# Runs in the job's image: tries this module, else Prefect's engine as it is.
COMMAND = (
    "python", "-c",
    "try:\n"
    "    from prefect_launch.workers.backends.container_engine import main\n"
    "except ImportError:\n"
    "    import runpy, sys; sys.argv = [\"prefect.engine\"]; runpy.run_module(\"prefect.engine\", run_name=\"__main__\")\n"
    "else:\n"
    "    main()\n",
)


def shield_from_sigterm() -> None:
    """Run the rest of this program in a child; this process waits for it and ignores SIGTERM and SIGINT.

    Prefect's engine answers a SIGTERM by forcing the run to "Crashed ... termination signal", over the
    final state the agent records before it stops a run (timeout, cancel, session terminate). So in a
    container the engine never gets the signal: a stop is the agent's grace period, then a kill of the
    whole container, and the agent's state stands. The parent also reaps orphans until the child ends
    (it is PID 1's only child under Docker's init) and exits with the child's status.
    """
    import os
    import signal

    pid = os.fork()
    if pid == 0:
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if done == pid:
            code = os.waitstatus_to_exitcode(status)  # negative: killed by that signal
            os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    import prefect_launch  # noqa: F401  # jsonschema without the IRI grammar (prefect_launch/__init__.py)
    from prefect_launch.api_retry import install

    install()
    shield_from_sigterm()
    sys.argv = ["prefect.engine"]
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
