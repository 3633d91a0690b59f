"""A private PostgreSQL server for the tests: initdb in a temp dir, started on a free loopback port.

Import the fixture into a test module: ``from tests.fixtures_pg import pg_url  # noqa: F401``
(or ``from fixtures_pg import pg_url``). It yields a SQLAlchemy URL
(``postgresql+psycopg://...``) to a fresh database. Skips only when no ``initdb``
exists at all. When running as root, the server runs as the ``postgres`` user (or
``nobody``), since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest


def _find_bin(name: str) -> str | None:
    p = shutil.which(name)
    if p:
        return p
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return cands[-1] if cands else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as(user: str | None, argv: list[str], **kw) -> subprocess.CompletedProcess:
    if user:
        if shutil.which("runuser"):
            argv = ["runuser", "-u", user, "--", *argv]
        else:
            argv = ["su", user, "-s", "/bin/sh", "-c", " ".join(argv)]
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


@pytest.fixture(scope="session")
def pg_server():
    initdb, pg_ctl = _find_bin("initdb"), _find_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed; run scripts/system-deps.sh")
    user = None
    if os.geteuid() == 0:
        for cand in ("postgres", "nobody"):
            try:
                pwd.getpwnam(cand)
                user = cand
                break
            except KeyError:
                continue
        if user is None:
            pytest.fail("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")
    base = tempfile.mkdtemp(prefix="launch-pg-")
    data = os.path.join(base, "data")
    sock = os.path.join(base, "sock")
    os.makedirs(sock)
    if user:
        pw = pwd.getpwnam(user)
        for p in (base, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(base, 0o700)
    _run_as(user, [initdb, "-D", data, "-U", "launch", "--auth=trust", "-E", "UTF8", "--no-sync"])
    port = _free_port()
    opts = f"-p {port} -k {sock} -h 127.0.0.1 -F -c fsync=off -c full_page_writes=off"
    log = os.path.join(base, "pg.log")
    _run_as(user, [pg_ctl, "-D", data, "-l", log, "-o", opts, "-w", "-t", "60", "start"])
    try:
        yield {"host": "127.0.0.1", "port": port, "user": "launch"}
    finally:
        try:
            _run_as(user, [pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"])
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server) -> str:
    """URL of a fresh, empty database on the session's PostgreSQL server."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:10]
    deadline = time.time() + 30
    while True:
        try:
            with psycopg.connect(
                host=pg_server["host"], port=pg_server["port"], user=pg_server["user"], dbname="postgres",
                autocommit=True,
            ) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            break
        except psycopg.OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)
    return f"postgresql+psycopg://{pg_server['user']}@{pg_server['host']}:{pg_server['port']}/{name}"
