"""Upstream names that are not public API, one module per upstream, each name listed once.

prefect-launch extends Prefect's workers the way prefect-docker and prefect-kubernetes do, and some of
what it needs has no public equivalent. Every such name is imported or declared here:

- `compat.prefect`: BaseWorker attributes and hooks, the process worker's run internals;
- `compat.prefect_docker`: DockerWorker hooks the docker back end overrides or calls;
- `compat.prefect_kubernetes`: KubernetesWorker hooks and the label/name slug helpers;
- `compat.streamlit`: the two functions of Streamlit's server the monitor wraps;
- `compat.psutil`: the one-scan parent map the sampler uses.

docker-py is used through its public API only (no module here). Each module has ``missing()``:
the names the installed upstream no longer has, which `tests/test_compat.py` turns into one failure
per upstream that says which name went and where prefect-launch uses it.
"""

from __future__ import annotations

import inspect
from typing import Iterable


def missing_members(owner: type, names: Iterable[str]) -> list[str]:
    """The names neither defined on ``owner`` (or a base) nor assigned as ``self.<name>`` in its classes."""
    sources = []
    for cls in owner.__mro__:
        try:
            sources.append(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
    text = "\n".join(sources)
    return [n for n in names if not hasattr(owner, n) and f"self.{n}" not in text]
