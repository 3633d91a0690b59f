"""Fixtures for tests across several hosts (network namespaces, tests/netns_hosts.py), issue 41 §1.

Import them into a test module: ``from fixtures_hosts import netns_hosts, prefect_server_hosts  # noqa: F401``.

- ``netns_hosts`` (module): ``HOSTS`` hosts (a module-level ``HOSTS = n``, default 2) on a fresh bridge;
  skips with the reason where namespaces cannot be made (not root, no iproute2, ``ip netns`` refused).
- ``prefect_server_hosts`` (module): a Prefect server listening on the bridge address (``hosts.gateway``)
  instead of the loopback, so agents inside the hosts reach it; PREFECT_API_URL and PREFECT_HOME are
  exported while the module runs and restored afterwards (the session's loopback server serves the other
  modules). With ``HOSTS_DB = "postgresql"`` in the module: its database and the metrics store are on a
  private PostgreSQL of the module's that listens on the loopback and the bridge address (the hosts'
  subnet trusted as the loopback is), the store block pointing at the bridge address; else SQLite (the
  metrics store the default file under PREFECT_HOME, which the hosts share only because they share this
  machine's file system). Yields ``{"api_url", "hosts", "metrics_url", "restart_server", "restart_postgres"}``:
  ``restart_server()`` stops the Prefect server and starts it again on the same address, port and database
  (waits until it is healthy); ``restart_postgres()`` restarts PostgreSQL (``pg_ctl stop -m fast``: every
  connection cut; same port and data), None on SQLite.
- ``host_agent(host, ...)``: ``prefect-launch agent`` inside a host (a context manager, as
  ``launch_helpers.agent``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

import netns_hosts as N
from launch_helpers import CLI, restored_env, wait_agent_online
from prefect_launch.local_server import (background_process, create_database, find_pg_bin, free_port, local_postgres,
                                         pg_url, start_postgres, start_prefect_server, stop_postgres, stop_server,
                                         wait_healthy)

_EXPORTED = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED", "LAUNCH_METRICS_BLOCK")


@pytest.fixture(scope="module")
def netns_hosts(request) -> Iterator[N.Hosts]:
    why = N.unavailable()
    if why:
        pytest.skip(why)
    with N.namespace_hosts(getattr(request.module, "HOSTS", 2)) as hosts:
        yield hosts


@contextlib.contextmanager
def _restartable_server(home: Path, host: str, db_url: Optional[str]) -> Iterator[tuple[str, callable]]:
    """``prefect server start`` on ``host`` (exported as local_server.local_prefect_server does); yields the API URL
    and a ``restart()`` that stops it and starts it again on the same port."""
    import prefect.context

    port = free_port(host)
    api = f"http://{host}:{port}/api"
    log_path = home / "server.log"
    cur: dict = {}

    def start() -> None:
        log = open(log_path, "a")
        cur.update(proc=start_prefect_server(home, port, log, db_url=db_url, host=host), log=log)
        wait_healthy(api, cur["proc"], log=log_path, timeout=180 if db_url else 120)

    def stop() -> None:
        proc, log = cur.pop("proc", None), cur.pop("log", None)
        if proc is not None:
            stop_server(proc)
        if log is not None:
            log.close()

    def restart() -> None:
        stop()
        start()

    try:
        start()
        os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false")
        prefect.context.refresh_global_settings_context()
        yield api, restart
    finally:
        stop()


@pytest.fixture(scope="module")
def prefect_server_hosts(netns_hosts, tmp_path_factory, request) -> Iterator[dict]:
    import tempfile

    home = tmp_path_factory.mktemp("prefect-home-hosts")
    gw = netns_hosts.gateway
    with restored_env(*_EXPORTED):
        os.environ.pop("LAUNCH_METRICS_BLOCK", None)
        with contextlib.ExitStack() as stack:
            db_url = metrics_url = restart_postgres = None
            if getattr(request.module, "HOSTS_DB", "sqlite") == "postgresql":
                if not find_pg_bin("initdb") or not find_pg_bin("pg_ctl"):
                    pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed; run scripts/system-deps.sh")
                pg_base = Path(tempfile.mkdtemp(prefix="launch-pg-"))  # reachable by PostgreSQL's own user
                pg_opts = {"hosts": f"127.0.0.1,{gw}", "trust_nets": (netns_hosts.subnet,)}
                port = stack.enter_context(local_postgres(base=pg_base, **pg_opts))
                for db in ("prefect", "metrics"):
                    create_database(port, db)
                db_url = pg_url(port, "prefect", driver="asyncpg")
                metrics_url = pg_url(port, "metrics", host=gw)  # agents inside the hosts reach it there

                def _restart_postgres() -> None:
                    stop_postgres(pg_base, mode="fast")
                    start_postgres(pg_base, port=port, **pg_opts)

                restart_postgres = _restart_postgres

            api, restart_server = stack.enter_context(_restartable_server(home, gw, db_url))
            if metrics_url:
                subprocess.run([sys.executable, "-m", "prefect_launch.cli", "setup", "--metrics-url", metrics_url],
                               check=True, capture_output=True, env=os.environ.copy(), timeout=120)
            yield {"api_url": api, "hosts": netns_hosts, "metrics_url": metrics_url,
                   "restart_server": restart_server, "restart_postgres": restart_postgres}


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
