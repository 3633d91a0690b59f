"""prefect-launch: resource-aware launch queues, run metrics and a queue monitor on Prefect 3.

Importing the package registers the `launch-process` worker type with Prefect
(through the `prefect.collections` entry point), so `prefect worker start --type
launch-process` finds it.
"""

__version__ = "0.1.0"

from prefect_launch.workers.worker import LaunchProcessWorker  # noqa: E402  (registers the worker type)
from prefect_launch.blocks.metrics_store import RunMetricsStore  # noqa: E402  (registers the block types)
from prefect_launch.blocks.queue_links import QueueLinks  # noqa: E402

__all__ = ["LaunchProcessWorker", "QueueLinks", "RunMetricsStore", "__version__"]
