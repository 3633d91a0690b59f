"""Old path of :mod:`prefect_launch.workers.backends.kubernetes.plugin`, kept one release for ``python -m`` commands and entry points
written before the workers/ package was split by role (installed metadata, running containers)."""

import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("prefect_launch.workers.backends.kubernetes.plugin", run_name="__main__", alter_sys=True)
else:
    import importlib

    sys.modules[__name__] = importlib.import_module("prefect_launch.workers.backends.kubernetes.plugin")
