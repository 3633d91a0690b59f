"""Shared fixtures: a real Prefect server (SQLite) started once per test session.

The server runs as a subprocess on a free loopback port under a throw-away
PREFECT_HOME; PREFECT_API_URL is exported so that the CLI, workers and flows the
tests start as subprocesses talk to it too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited early with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("prefect server did not become healthy in time")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """Start `prefect server start` on 127.0.0.1 and return its API URL."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_UI_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(api_url, proc)
        # Everything started later in this session (CLI, workers, flows) uses this server.
        os.environ["PREFECT_HOME"] = str(home)
        os.environ["PREFECT_API_URL"] = api_url
        os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        # Prefect fixes its settings at import; modules collected earlier may have imported it.
        import prefect.context

        prefect.context.refresh_global_settings_context()
        yield api_url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def unique_name() -> str:
    """A short unique suffix so tests sharing one server never collide."""
    return uuid.uuid4().hex[:8]
