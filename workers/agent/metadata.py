"""The integrations a worker reports to the Prefect server, read without importing them.

Prefect's ``BaseWorker._worker_metadata`` lists the installed distributions that declare a
``prefect.collections`` entry point, and to find their names it imports every one of those
collections (``load_prefect_collections``). Where prefect-kubernetes is installed that import alone
is about 1.3 s of CPU (its Kubernetes client models), paid at every agent start by an agent that may
serve only process or Docker queues. The entry points' names are in the distributions' metadata, so
the same list is read from there; a collection that would fail to import is listed as Prefect lists
it (by its entry point's name), since Prefect keeps failed loads under their names too.
"""

from __future__ import annotations

from importlib.metadata import distributions, entry_points
from typing import Optional

from prefect.client.schemas.objects import Integration, WorkerMetadata

GROUP = "prefect.collections"


def collection_names() -> set[str]:
    """Names of the ``prefect.collections`` entry points (what ``load_prefect_collections`` keys by)."""
    return {ep.name or ep.value for ep in entry_points(group=GROUP)}


def installed_integrations() -> Optional[WorkerMetadata]:
    """Prefect's worker metadata (distribution name and version of each installed collection), or None.

    A distribution found twice on ``sys.path`` (an egg-info beside the source of an editable install,
    when the working directory is on the path) is listed once, as Python's import finds it first."""
    names = collection_names()
    found: dict[str, Integration] = {}
    for dist in distributions():
        name = dist.metadata.get("Name") if dist.metadata else None
        if name and name.replace("-", "_") in names and name not in found:
            found[name] = Integration(name=name, version=dist.version)
    return WorkerMetadata(integrations=list(found.values())) if found else None
