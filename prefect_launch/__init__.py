"""prefect-launch: resource-aware launch queues, run metrics and a queue monitor on Prefect 3.

Prefect finds the `launch-process` and `launch-docker` worker types through the
``prefect.collections`` entry point (`prefect_launch.plugin`). Importing this package is
light on purpose: every run's engine imports it, and pays for nothing it does not use; the
worker and block classes are imported on first use (``prefect_launch.LaunchProcessWorker``).
"""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


def _jsonschema_without_iri_grammar() -> None:
    """Import jsonschema without ``rfc3987_syntax``, which it only uses to check the ``iri`` string format.

    JupyterLab (the sessions extra) pulls that package in, and importing it compiles a Lark grammar: about
    1.2 s of CPU in every process that imports Prefect (each agent, run engine, cluster member and CLI call,
    measured). Neither Prefect's schemas nor ours use that format. The package stays importable for any
    other code; only jsonschema's format checker in this process goes without ``iri`` checks.
    ``LAUNCH_JSONSCHEMA_IRI=1`` keeps them.
    """
    if "jsonschema" in sys.modules or os.environ.get("LAUNCH_JSONSCHEMA_IRI") == "1":
        return
    blocked = "rfc3987_syntax" not in sys.modules
    if blocked:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  # makes `import rfc3987_syntax` fail
    try:
        import jsonschema._format  # noqa: F401
    except ImportError:
        pass
    finally:
        if blocked and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]


_jsonschema_without_iri_grammar()

_LAZY = {
    "LaunchProcessWorker": "prefect_launch.workers.backends.process",
    "LaunchDockerWorker": "prefect_launch.workers.backends.docker",
    "RunMetricsStore": "prefect_launch.blocks.metrics_store",
    "QueueLinks": "prefect_launch.blocks.queue_links",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prefect_launch' has no attribute {name!r}")


__all__ = ["LaunchDockerWorker", "LaunchProcessWorker", "QueueLinks", "RunMetricsStore", "__version__"]
