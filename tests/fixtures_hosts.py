"""Fixtures for tests across several hosts (network namespaces, tests/netns_hosts.py), issue 41 §1.

Import them into a test module: ``from fixtures_hosts import netns_hosts, prefect_server_hosts  # noqa: F401``.

- ``netns_hosts`` (module): ``HOSTS`` hosts (a module-level ``HOSTS = n``, default 2) on a fresh bridge;
  skips with the reason where namespaces cannot be made (not root, no iproute2, ``ip netns`` refused).
- ``prefect_server_hosts`` (module): a Prefect server (SQLite) listening on the bridge address
  (``hosts.gateway``) instead of the loopback, so agents inside the hosts reach it; PREFECT_API_URL and
  PREFECT_HOME are exported while the module runs and restored afterwards (the session's loopback server
  serves the other modules). The metrics store is the default SQLite file under that PREFECT_HOME: the
  hosts share this machine's file system. Yields ``{"api_url", "hosts"}``.
- ``host_agent(host, ...)``: ``prefect-launch agent`` inside a host (a context manager, as
  ``launch_helpers.agent``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator, Optional

import pytest

import netns_hosts as N
from launch_helpers import CLI, wait_agent_online
from prefect_launch.local_server import background_process, local_prefect_server

_EXPORTED = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED", "LAUNCH_METRICS_BLOCK")


@pytest.fixture(scope="module")
def netns_hosts(request) -> Iterator[N.Hosts]:
    why = N.unavailable()
    if why:
        pytest.skip(why)
    with N.namespace_hosts(getattr(request.module, "HOSTS", 2)) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def prefect_server_hosts(netns_hosts, tmp_path_factory) -> Iterator[dict]:
    import prefect.context

    saved = {k: os.environ.get(k) for k in _EXPORTED}
    try:
        os.environ.pop("LAUNCH_METRICS_BLOCK", None)
        with local_prefect_server(tmp_path_factory.mktemp("prefect-home-hosts"), host=netns_hosts.gateway) as api:
            yield {"api_url": api, "hosts": netns_hosts}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        prefect.context.refresh_global_settings_context()


@contextlib.contextmanager
def host_agent(host: N.Host, queues: list[str], name: str, capacity: str, log_dir: Path,
               extra: tuple[str, ...] = (), wait_online: bool = True, log_name: Optional[str] = None,
               on_exit: str = "cancel") -> Iterator[subprocess.Popen]:
    """An agent running inside ``host``; leaving the block stops it (SIGINT to its group, then SIGKILL)."""
    args = N.host_agent_args(host, CLI, queues, name, capacity, extra, on_exit)
    with background_process(args, log_dir / (log_name or f"agent-{name}.log")) as proc:
        if wait_online:
            wait_agent_online(name, queues, timeout=120)
        yield proc
