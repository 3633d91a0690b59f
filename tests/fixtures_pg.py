"""A private PostgreSQL server for the tests: initdb in a temp dir, started on a free loopback port.

Import the fixtures into a test module: ``from fixtures_pg import pg_server, pg_url  # noqa: F401``.
``pg_url`` yields a SQLAlchemy URL (``postgresql+psycopg://...``) to a fresh database.
``prefect_server_pg`` (with ``pg_server``) runs a Prefect server whose database is on that
PostgreSQL, with the metrics store in another database of the same server, for one test module.
Skips only when no ``initdb`` exists at all. When running as root, PostgreSQL runs as the
``postgres`` user (or ``nobody``), since it refuses to run as root
(see :mod:`prefect_launch.local_server`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from launch_helpers import restored_env
from prefect_launch.local_server import (PG_USER, create_database, find_pg_bin, local_postgres,
                                         local_prefect_server, pg_url as make_pg_url)


@pytest.fixture(scope="session")
def pg_server():
    if not find_pg_bin("initdb") or not find_pg_bin("pg_ctl"):
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed; run scripts/system-deps.sh")
    with local_postgres() as port:
        yield {"host": "127.0.0.1", "port": port, "user": PG_USER}


@pytest.fixture
def pg_url(pg_server) -> str:
    """URL of a fresh, empty database on the session's PostgreSQL server."""
    name = "t_" + uuid.uuid4().hex[:10]
    create_database(pg_server["port"], name)
    return make_pg_url(pg_server["port"], name)


_EXPORTED = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED", "LAUNCH_METRICS_BLOCK")


@pytest.fixture(scope="module")
def prefect_server_pg(pg_server, tmp_path_factory):
    """A Prefect server on PostgreSQL (fresh database) for this module; the metrics store block
    ``default`` points at a second database on the same PostgreSQL. PREFECT_API_URL is exported while
    the module runs and restored afterwards, so the session's SQLite server serves the other modules."""
    port = pg_server["port"]
    suffix = uuid.uuid4().hex[:8]
    create_database(port, f"prefect_{suffix}")
    create_database(port, f"metrics_{suffix}")
    with restored_env(*_EXPORTED), local_prefect_server(
            tmp_path_factory.mktemp("prefect-home-pg"),
            db_url=make_pg_url(port, f"prefect_{suffix}", driver="asyncpg")) as api_url:
        os.environ.pop("LAUNCH_METRICS_BLOCK", None)
        metrics_url = make_pg_url(port, f"metrics_{suffix}")
        subprocess.run([sys.executable, "-m", "prefect_launch.cli", "setup", "--metrics-url", metrics_url],
                       check=True, capture_output=True, env=os.environ.copy(), timeout=120)
        yield {"api_url": api_url, "metrics_url": metrics_url, "pg_port": port}
