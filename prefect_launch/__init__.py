"""prefect-launch: resource-aware launch queues, run metrics and a queue monitor on Prefect 3.

Importing the package registers the `launch-process` and `launch-docker` worker
types with Prefect (through the `prefect.collections` entry point), so `prefect
worker start --type launch-process` (or `launch-docker`) finds them.
"""

__version__ = "0.1.0"

from prefect_launch.workers.worker import LaunchProcessWorker  # noqa: E402  (registers the worker type)
from prefect_launch.workers.docker_worker import LaunchDockerWorker  # noqa: E402  (registers launch-docker)
from prefect_launch.blocks.metrics_store import RunMetricsStore  # noqa: E402  (registers the block types)
from prefect_launch.blocks.queue_links import QueueLinks  # noqa: E402

__all__ = ["LaunchDockerWorker", "LaunchProcessWorker", "QueueLinks", "RunMetricsStore", "__version__"]
