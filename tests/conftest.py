"""Shared fixtures: a real Prefect server (SQLite) started once per test session.

The server runs as a subprocess on a free loopback port under a throw-away
PREFECT_HOME; PREFECT_API_URL is exported so that the CLI, workers and flows the
tests start as subprocesses talk to it too.
"""

from __future__ import annotations

import uuid

import pytest

from prefect_launch.local_server import local_prefect_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """A `prefect server start` on 127.0.0.1 for the whole session; yields its API URL."""
    with local_prefect_server(tmp_path_factory.mktemp("prefect-home")) as api_url:
        yield api_url


@pytest.fixture
def unique_name() -> str:
    """A short unique suffix so tests sharing one server never collide."""
    return uuid.uuid4().hex[:8]
