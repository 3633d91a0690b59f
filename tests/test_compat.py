"""Every upstream private name prefect-launch relies on is still there (prefect_launch/compat/).

An upgrade of Prefect, prefect-docker, prefect-kubernetes or Streamlit that removes or renames one fails
here, naming it, instead of somewhere in a run.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from prefect_launch.compat import prefect as compat_prefect
from prefect_launch.compat import prefect_docker, prefect_kubernetes, psutil as compat_psutil, streamlit

ROOT = pathlib.Path(__file__).resolve().parents[1]
UPSTREAMS = ("prefect", "prefect_docker", "prefect_kubernetes", "streamlit", "docker", "psutil")


@pytest.mark.parametrize("module", [compat_prefect, prefect_docker, prefect_kubernetes, streamlit, compat_psutil],
                         ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_every_private_name_is_still_upstream(module):
    gone = module.missing()
    assert not gone, (f"{module.__name__}: this upgrade removed or renamed {gone}; find their uses "
                      f"(grep -rn the name in workers/ dashboard/) and replace or re-list them there")


def test_the_warm_start_was_read_against_this_prefects_process_run():
    assert compat_prefect.process_run_fingerprint() == compat_prefect.PROCESS_RUN_FINGERPRINT, (
        "prefect.workers.process.ProcessWorker.run changed: re-read workers/backends/process.py::_run_warm "
        "(its command branch with a warm engine) against it, then update PROCESS_RUN_FINGERPRINT in "
        "prefect_launch/compat/prefect.py")


def private_imports(path: pathlib.Path) -> list[str]:
    """``from <upstream>... import _x`` or ``from <upstream>._mod import x`` in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in UPSTREAMS:
                continue
            if any(p.startswith("_") for p in parts) or any(a.name.startswith("_") for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import "
                             + ", ".join(a.name for a in node.names))
    return found


def test_private_upstream_modules_are_imported_only_in_compat():
    code = [p for d in ("workers", "dashboard", "deployments", "flows", "blocks", "prefect_launch")
            for p in (ROOT / d).rglob("*.py") if "compat" not in p.parts]
    stray = [hit for p in code for hit in private_imports(p)]
    assert not stray, "import these through prefect_launch/compat/ (one module per upstream):\n" + "\n".join(stray)
