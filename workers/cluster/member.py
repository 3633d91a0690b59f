"""A sub member of a cluster run: ``python -m prefect_launch.workers.cluster.member FLOW_RUN_ID``.

The agent starts one per sub member (sub1, sub2, ...) beside the run's Prefect engine (main1). It
loads the deployment's flow the way the engine does (pull steps included, in a working directory
of its own) and calls the flow's function with the run's parameters, without reporting any
flow-run state: the run's state is main1's, and the agent fails the run when a member fails.
Exit status 0 when the function returns, 1 when it raises.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any
from uuid import UUID


async def _load(run_id: UUID) -> tuple[Any, dict[str, Any]]:
    from prefect import get_client
    from prefect.flows import load_flow_from_flow_run

    async with get_client() as client:
        flow_run = await client.read_flow_run(run_id)
    flow = await load_flow_from_flow_run(flow_run)  # the client is injected
    params = dict(flow_run.parameters or {})
    try:  # the engine's coercion of JSON values to the function's annotations
        params = flow.validate_parameters(params)
    except Exception:
        pass
    return flow, params


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m prefect_launch.workers.cluster.member FLOW_RUN_ID", file=sys.stderr)
        return 2
    member = os.environ.get("LAUNCH_CLUSTER_MEMBER", "sub?")
    from prefect_launch.api_retry import install

    install()
    workdir = tempfile.mkdtemp(prefix=f"launch-{member}-")
    os.chdir(workdir)
    try:
        flow, params = asyncio.run(_load(UUID(argv[0])))
        result = flow.fn(**params)
        if inspect.isawaitable(result):
            asyncio.run(result)
        return 0
    except BaseException as exc:  # report and exit non-zero: the agent fails the run and names this member
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0
        traceback.print_exc()
        print(f"cluster member {member} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    finally:
        os.chdir("/")
        shutil.rmtree(workdir, ignore_errors=True)


def record_exit(code: int) -> None:
    """Leave the exit status where the agent finds it (``LAUNCH_MEMBER_EXIT_FILE``): an agent that restarted
    is no longer this process's parent and cannot read its exit code any other way. A member killed by a
    signal leaves no file, which the agent reads as that."""
    path = os.environ.get("LAUNCH_MEMBER_EXIT_FILE")
    if not path:
        return
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            fh.write(str(code))
        os.replace(tmp, path)
    except OSError:
        pass


if __name__ == "__main__":
    _code = main(sys.argv[1:])
    record_exit(_code)
    sys.exit(_code)
