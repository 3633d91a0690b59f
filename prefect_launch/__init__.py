"""prefect-launch: resource-aware launch queues, run metrics and a queue monitor on Prefect 3.

Importing the package registers the `launch-process` worker type with Prefect
(through the `prefect.collections` entry point), so `prefect worker start --type
launch-process` finds it.
"""

__version__ = "0.1.0"
