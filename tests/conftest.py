"""Shared fixtures: a real Prefect server (SQLite) started once per test session.

The server runs as a subprocess on a free loopback port under a throw-away
PREFECT_HOME; PREFECT_API_URL is exported so that the CLI, workers and flows the
tests start as subprocesses talk to it too.
"""

from __future__ import annotations

import functools
import re
import subprocess
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


# ------------------------------------------------------------------ pure tests and the `server` marker
# `make test-fast` runs `pytest -m "not server"`: the tests that need no Prefect server, agent, Docker
# daemon, browser, PostgreSQL or served Streamlit app (tests/README.md). What is `server` is decided here,
# mechanically: a test whose fixture closure holds one of these shared fixtures is marked at collection.
# A module fixture that starts a service by itself (its own server, dockerd, streamlit, chromium) is
# marked in its module (`pytestmark = pytest.mark.server` or on the test). A test left unmarked that still
# launches one of these services fails (`_refuse_services`), so a test-fast run stays fast and honest.
SERVICE_FIXTURES = frozenset({
    "prefect_server",  # here: `prefect server start` (SQLite) for the session
    "pg_server", "pg_url", "prefect_server_pg",  # tests/fixtures_pg.py: a private PostgreSQL (+ a server on it)
    "docker_host",  # tests/test_docker_backend.py: the suite's dockerd (under docker_client and image too)
    "prefect_server_hosts",  # tests/fixtures_hosts.py: a server on the bridge of network-namespace hosts
})

SERVICE_COMMAND = re.compile(
    r"\bserver\s+(start|database)\b|prefect\.server\.api\.server:create_app"  # a Prefect server (also ephemeral), its migrations
    r"|prefect_launch\.cli\s+agent\b|\bworker\s+start\b"  # an agent or a Prefect worker
    r"|\bdockerd\b|\bcontainerd\b"  # a Docker daemon
    r"|chrom(e|ium)|headless_shell|playwright"  # a browser (or Playwright's driver)
    r"|\binitdb\b|\bpg_ctl\b|/postgres\b"  # PostgreSQL
    r"|streamlit\s+run\b|prefect_launch\.dashboard\.serve\b|jupyter-?lab\b")  # a served Streamlit app, JupyterLab


def mark_server_tests(items) -> None:
    """Mark ``server`` every test that uses a service fixture (its whole fixture closure counts)."""
    for item in items:
        if SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


_REFUSED = pytest.StashKey[list]()


def _refuse_services(item):
    """While a test not marked ``server`` sets up, runs and tears down, starting a service process raises
    (in this process: a service that a child process starts is not seen, so such a test is marked by hand).
    The refusal is also kept, and fails the test even where its code caught the error."""
    real = subprocess.Popen._execute_child
    refused = item.stash.setdefault(_REFUSED, [])

    def guarded(self, args, *rest, **kw):
        line = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if SERVICE_COMMAND.search(line):
            refused.append(f"{item.nodeid} is not marked `server` but starts a service: {line[:200]!r}; "
                           "mark it @pytest.mark.server (tests/README.md)")
            raise RuntimeError(refused[-1])
        return real(self, args, *rest, **kw)

    return real, guarded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    refused = item.stash.get(_REFUSED, None)
    if refused and report.passed and report.when == "call":
        report.outcome, report.longrepr = "failed", "\n".join(refused)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("server") is not None:
        return (yield)
    real, guarded = _refuse_services(item)
    subprocess.Popen._execute_child = guarded
    try:
        return (yield)
    finally:
        subprocess.Popen._execute_child = real


@pytest.hookimpl(tryfirst=True)  # the `server` marks go on before `-m` deselects by them
def pytest_collection_modifyitems(config, items) -> None:
    """Marks the ``server`` tests (above); then files heaviest first (tests/file_order.py), so that under
    ``--dist loadfile --no-loadscope-reorder`` the long docker, browser and end-to-end files start early
    and the short ones fill the end; the tests within a file keep their order."""
    from file_order import heaviest_first, load_costs

    mark_server_tests(items)

    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    rank = {f: i for i, f in enumerate(heaviest_first(files, load_costs()))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
