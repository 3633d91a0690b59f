"""Registers the `launch-kubernetes` worker type with Prefect where prefect-kubernetes is installed.

It is the ``prefect_launch_kubernetes`` entry point of the ``prefect.collections`` group
(pyproject.toml), which Prefect imports before it looks a worker type up (``prefect worker
start --type launch-kubernetes``, ``prefect work-pool create --type launch-kubernetes``). Without
the ``kubernetes`` extra it registers nothing and says nothing; `launch-process` and
`launch-docker` are registered by the ``prefect_launch`` entry point.
"""

from __future__ import annotations

try:
    import prefect_kubernetes  # noqa: F401
except ImportError:  # extra 'kubernetes' not installed
    LaunchKubernetesWorker = None
else:
    from prefect_launch.workers.backends.kubernetes.worker import LaunchKubernetesWorker  # noqa: F401  (registers the type)
