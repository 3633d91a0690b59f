"""Launcher of a cluster run's member on Kubernetes: ``python -m prefect_launch.workers.cluster.kubernetes_member -- ARGS``.

Every pod of an indexed Job has the same template, but main1 runs the Prefect engine (``ARGS``, e.g.
``prefect flow-run execute``) and sub<i> runs the flow's function without reporting states
(`cluster_member`, as on the process back end). This picks by ``JOB_COMPLETION_INDEX`` (the Job
controller's index), sets the member's own name (``LAUNCH_CLUSTER_MEMBER``), and replaces itself with
that program (``exec``: no shell, the exit status and signals are the program's own).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from prefect_launch.workers.cluster.kubernetes import member_of_index

MEMBER_MODULE = "prefect_launch.workers.cluster.member"


def member_program(index: int, args: list[str], flow_run_id: str) -> list[str]:
    """What member ``index`` runs: ``args`` (the engine) for main1, `cluster_member` for the others."""
    if index == 0:
        return list(args)
    return [sys.executable, "-m", MEMBER_MODULE, flow_run_id]


def main(argv: list[str], environ: Optional[dict[str, str]] = None) -> list[str]:
    """Set up the env and return the program to exec (split from the exec for tests)."""
    env = os.environ if environ is None else environ
    args = argv[1:] if argv[:1] == ["--"] else argv
    raw = env.get("JOB_COMPLETION_INDEX", "")
    if not raw.isdigit():
        raise SystemExit(f"kubernetes_member: JOB_COMPLETION_INDEX is {raw!r}, not an index: run it in an "
                         "indexed Job's pod")
    index = int(raw)
    if index == 0 and not args:
        raise SystemExit("kubernetes_member: main1 needs the engine's command after '--'")
    if index > 0 and not env.get("PREFECT__FLOW_RUN_ID"):
        raise SystemExit("kubernetes_member: a sub member needs PREFECT__FLOW_RUN_ID (the worker sets it)")
    env["LAUNCH_CLUSTER_MEMBER"] = member_of_index(index)
    return member_program(index, args, env.get("PREFECT__FLOW_RUN_ID", ""))


if __name__ == "__main__":
    program = main(sys.argv[1:])
    sys.stdout.flush()
    os.execvp(program[0], program)
