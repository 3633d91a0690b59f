"""Every tag and label prefect-launch writes on a Prefect run or a container, in one place.

Tags (written by `submit`): ``launch``, ``owner:<user>``, ``preset:<name>``.
Flow-run labels (written by the agent): ``launch.waiting`` (why a run waits),
``launch.placement`` (where it runs, for people), ``launch.alloc`` (the same for
machines: enough to rebuild the ledger after a restart), ``launch.idle`` (the live state
of the run's idle checks, JSON), ``launch.cluster.plan`` / ``launch.cluster.ack.<agent>`` (a multi-node
cluster run's plan and each member agent's answer). Container labels: the
run id, so a restarted agent finds its live containers. The CLI, the agent, the
metrics store and the monitor import these names so the convention cannot drift.
"""

from __future__ import annotations

from typing import Iterable, Optional

LAUNCH_TAG = "launch"
OWNER = "owner"
PRESET = "preset"

WAIT_LABEL = "launch.waiting"
PLACED_LABEL = "launch.placement"
ALLOC_LABEL = "launch.alloc"
IDLE_LABEL = "launch.idle"
CLUSTER_PLAN_LABEL = "launch.cluster.plan"  # multi-node cluster run: the leader's plan (JSON), read by the other members' agents
CLUSTER_ACK_LABEL = "launch.cluster.ack."  # + agent name: "ok" once it booked and started its members, or "no: why"
CLUSTER_BEAT_LABEL = "launch.cluster.beat."  # + agent name: a count each follower raises while it follows the run
WORKER_LABEL = "prefect.worker.name"  # Prefect's own label: the worker that claimed the run

RUN_ID_LABEL = "io.prefect-launch.run-id"  # on containers and pods: the flow run they execute
AGENT_LABEL = "io.prefect-launch.agent"
QUEUE_LABEL = "io.prefect-launch.queue"


def tag(key: str, value: str) -> str:
    return f"{key}:{value}"


def launch_tags(owner: str, preset: str) -> list[str]:
    return [LAUNCH_TAG, tag(OWNER, owner), tag(PRESET, preset)]


def tag_value(tags: Optional[Iterable[str]], key: str) -> Optional[str]:
    """The value of the first ``key:value`` tag, or None."""
    prefix = key + ":"
    return next((t[len(prefix):] for t in tags or () if t.startswith(prefix)), None)
