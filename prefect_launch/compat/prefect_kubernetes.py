"""prefect-kubernetes's private names that the kubernetes back end relies on.

The worker (`workers/backends/kubernetes/worker.py`) calls KubernetesWorker's Job creation and API client
and overrides its job configuration's eviction handling; names and labels are slugged exactly as prefect-kubernetes slugs
them, so a Job made by either worker reads the same.
"""

from __future__ import annotations

from prefect_kubernetes.utilities import _slugify_label_value as slugify_label_value
from prefect_kubernetes.utilities import _slugify_name as slugify_name
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

from prefect_launch.compat import missing_members

KUBERNETES_WORKER_HOOKS = ("_create_job", "_get_configured_kubernetes_client")
# the job configuration's SIGTERM-reschedule set-up, which launch queues turn off (they record the eviction)
JOB_CONFIGURATION_HOOKS = ("_configure_eviction_handling",)


def missing() -> list[str]:
    return ([f"KubernetesWorker.{n}" for n in missing_members(KubernetesWorker, KUBERNETES_WORKER_HOOKS)]
            + [f"KubernetesWorkerJobConfiguration.{n}"
               for n in missing_members(KubernetesWorkerJobConfiguration, JOB_CONFIGURATION_HOOKS)])


__all__ = ["slugify_label_value", "slugify_name", "missing"]
