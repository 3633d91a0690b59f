"""prefect-launch: resource-aware launch queues, run metrics and a queue monitor on Prefect 3.

Importing the package registers the `launch-process` worker type with Prefect
(through the `prefect.collections` entry point), so `prefect worker start --type
launch-process` finds it.
"""

__version__ = "0.1.0"

from prefect_launch.workers.worker import LaunchProcessWorker  # noqa: E402  (registers the worker type)

__all__ = ["LaunchProcessWorker", "__version__"]
