"""Shared fixtures: a real Prefect server (SQLite) started once per test session.

The server runs as a subprocess on a free loopback port under a throw-away
PREFECT_HOME; PREFECT_API_URL is exported so that the CLI, workers and flows the
tests start as subprocesses talk to it too.
"""

from __future__ import annotations

import functools
import uuid

import pytest

from prefect_launch.local_server import local_prefect_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> str:
    """A `prefect server start` on 127.0.0.1 for the whole session; yields its API URL."""
    with local_prefect_server(tmp_path_factory.mktemp("prefect-home")) as api_url:
        yield api_url


@pytest.fixture(scope="session", autouse=True)
def component_manifests_scanned_once():
    """Streamlit's AppTest scans every installed package's metadata for component manifests on each run
    (~1.4 s here, for each of the suite's ~60 page runs; a served monitor scans once, at start). The
    installed packages do not change during a test session, so the scan's answer is kept for it."""
    try:
        from streamlit.components.v2 import manifest_scanner as scanner
    except ImportError:  # a Streamlit without v2 components: nothing to keep
        yield
        return
    scan = scanner.scan_component_manifests
    scanner.scan_component_manifests = functools.lru_cache(maxsize=1)(scan)
    try:
        yield
    finally:
        scanner.scan_component_manifests = scan


@pytest.fixture
def unique_name() -> str:
    """A short unique suffix so tests sharing one server never collide."""
    return uuid.uuid4().hex[:8]


def pytest_collection_modifyitems(config, items) -> None:
    """Files heaviest first (tests/file_order.py), so that under ``--dist loadfile
    --no-loadscope-reorder`` the long docker, browser and end-to-end files start early and the
    short ones fill the end; the tests within a file keep their order."""
    from file_order import heaviest_first, load_costs

    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {f: i for i, f in enumerate(heaviest_first(files, load_costs()))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
