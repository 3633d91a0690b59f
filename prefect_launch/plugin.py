"""What Prefect imports to find prefect-launch's types (the ``prefect.collections`` entry point).

Importing this module registers the `launch-process` and `launch-docker` worker types and the block
types, so `prefect worker start --type launch-process` finds them. It is not imported by
``import prefect_launch``: a run's engine, a cluster member or a CLI call that needs none of it
does not pay for the worker stack (docker-py, SQLAlchemy, the agent) at every start.
"""

from prefect_launch.workers.backends.process import LaunchProcessWorker  # noqa: F401  (registers launch-process)
from prefect_launch.workers.backends.docker import LaunchDockerWorker  # noqa: F401  (registers launch-docker)
from prefect_launch.blocks.metrics_store import RunMetricsStore  # noqa: F401  (registers the block types)
from prefect_launch.blocks.queue_links import QueueLinks  # noqa: F401

__all__ = ["LaunchDockerWorker", "LaunchProcessWorker", "QueueLinks", "RunMetricsStore"]
