"""The integrations an agent reports to Prefect: the same list as Prefect's worker reports, without
importing every installed collection at each agent start (prefect-kubernetes: ~1.3 s of CPU)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from prefect.workers.base import BaseWorker

from prefect_launch.workers.agent.metadata import installed_integrations

PROBE = """
import asyncio, json, sys
from prefect_launch.workers.backends.process import LaunchProcessWorker
before = "prefect_kubernetes" in sys.modules
meta = asyncio.run(LaunchProcessWorker(work_pool_name="probe")._worker_metadata())
print(json.dumps({"before": before, "after": "prefect_kubernetes" in sys.modules,
                  "integrations": sorted([i.name, i.version] for i in meta.integrations)}))
"""


def _pairs(meta) -> list[list[str]]:
    """Name and version of each integration, once (Prefect's list repeats a distribution found twice on
    sys.path, as under a test that put the checkout on it)."""
    return sorted(map(list, {(i.name, i.version) for i in meta.integrations}))


def test_the_agent_reports_what_prefects_worker_reports():
    ours = installed_integrations()
    prefects = asyncio.run(BaseWorker._worker_metadata(None))  # Prefect's: imports every collection to list them
    assert ours is not None and prefects is not None
    assert _pairs(ours) == _pairs(prefects)
    names = {i.name for i in ours.integrations}
    assert {"prefect-launch", "prefect-docker", "prefect-kubernetes"} <= names  # the dev install has all three


def test_an_agent_lists_prefect_kubernetes_without_importing_it():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] is False and got["after"] is False, got
    assert "prefect-kubernetes" in {name for name, _ in got["integrations"]}
    assert got["integrations"] == _pairs(installed_integrations())
    assert len(got["integrations"]) == len({name for name, _ in got["integrations"]})  # each once
