"""Start and stop a local Prefect server on loopback: for tests, benchmarks and scripts.

One place for what every test fixture and benchmark needs: a free port, a
private PREFECT_HOME (SQLite, or PostgreSQL with ``db_url``), a health wait, and a
clean stop; and a private PostgreSQL server (initdb/pg_ctl on a loopback port) for
the Prefect server and the metrics store; and the system Chromium that the
browser tests and page benchmarks drive through Playwright.

From a shell (scripts/demo.sh)::

    python -m prefect_launch.local_server postgres start DIR [--port N] [--db NAME ...]   # prints the port
    python -m prefect_launch.local_server postgres stop DIR
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator, Optional

import httpx

# Debian's chromium (make system-deps): Playwright's own browser download is not reachable here
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHROMIUM_MISSING = f"{CHROMIUM} missing: install Debian's chromium (make system-deps)"

# Prefect's own CLI (``prefect ...``) started through this package, so that the process imports
# jsonschema without the iri grammar (see prefect_launch/__init__.py): about 2 s of CPU less per start
PREFECT_CLI = [sys.executable, "-c", "import prefect_launch; from prefect.cli import app; app()"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_env(home: Path, api_url: str, ui: bool = False, db_url: Optional[str] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    for k in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"):
        env.pop(k, None)
    if db_url:  # e.g. postgresql+asyncpg://launch@127.0.0.1:5433/prefect
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = db_url
    if not ui:
        env.update(PREFECT_UI_ENABLED="false", PREFECT_SERVER_UI_ENABLED="false")
    return env


def wait_healthy(api_url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 120,
                 log: Optional[Path] = None, health_path: str = "/health", what: str = "prefect server") -> None:
    """Wait until ``api_url + health_path`` answers 200 (any local server: Prefect, Streamlit)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{api_url}{health_path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} at {api_url} did not become healthy in {timeout:.0f} s; see {log}")


def _template_dir() -> Path:
    from importlib.metadata import version

    return Path(tempfile.gettempdir()) / f"prefect-launch-db-{version('prefect')}-{os.getuid()}"


def seed_sqlite_database(home: Path) -> bool:
    """Give a new SQLite home a copy of an already migrated database; True when one was copied.

    Migrating an empty database is most of a fresh server's start (about 10 of 17 s here), and the
    test suite and the benchmarks start many fresh servers. The template is migrated once
    per Prefect version (under a file lock, so concurrent test workers build it once), then copied;
    the server still checks its migrations on start, so a stale copy is upgraded, never trusted.
    ``LAUNCH_SERVER_DB_TEMPLATE=0`` turns this off.
    """
    if os.environ.get("LAUNCH_SERVER_DB_TEMPLATE") == "0" or (home / "prefect.db").exists():
        return False
    tpl = _template_dir()
    tpl.mkdir(parents=True, exist_ok=True)
    db = tpl / "prefect.db"
    with open(tpl / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not db.exists():
            build = tpl / "build"
            shutil.rmtree(build, ignore_errors=True)
            build.mkdir()
            env = server_env(build, "http://127.0.0.1:1/api")
            try:
                done = subprocess.run([*PREFECT_CLI, "server", "database", "upgrade", "-y"], env=env,
                                      capture_output=True, text=True, timeout=300)
            except subprocess.TimeoutExpired:
                return False
            if done.returncode != 0 or not (build / "prefect.db").exists():
                return False  # either way the server migrates its own database, as it always does
            import sqlite3

            with contextlib.closing(sqlite3.connect(build / "prefect.db")) as con:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # all of it in the one file copied
            os.replace(build / "prefect.db", db)
            shutil.rmtree(build, ignore_errors=True)
        shutil.copyfile(db, home / "prefect.db.part")
        os.replace(home / "prefect.db.part", home / "prefect.db")  # never a half-copied database
    return True


def stop_server(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM, up to ``grace_s`` for the server to finish its writes, then SIGKILL; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_prefect_server(home: Path, port: int, log: IO, ui: bool = False, db_url: Optional[str] = None,
                         auth_string: Optional[str] = None, host: str = "127.0.0.1") -> subprocess.Popen:
    """``prefect server start`` on ``host``:``port`` (loopback by default) in its own session (so a test can
    kill its group), on a copy of the migrated template database unless ``db_url`` names another; not
    waited for."""
    if not db_url:
        seed_sqlite_database(home)
    api_url = f"http://{host}:{port}/api"
    return subprocess.Popen(
        [*PREFECT_CLI, "server", "start", "--host", host, "--port", str(port)],
        env={**server_env(home, api_url, ui, db_url),
             **({"PREFECT_SERVER_API_AUTH_STRING": auth_string} if auth_string else {})},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


@contextlib.contextmanager
def local_prefect_server(home: Optional[Path] = None, port: Optional[int] = None, ui: bool = False,
                         export: bool = True, db_url: Optional[str] = None,
                         auth_string: Optional[str] = None, host: str = "127.0.0.1") -> Iterator[str]:
    """Run ``prefect server start`` on 127.0.0.1 (or ``host``: e.g. a test bridge's address, which agents in
    network namespaces reach); yields the API URL.

    ``db_url`` (``postgresql+asyncpg://...``) puts the server's database on PostgreSQL instead of
    SQLite under ``home``. With ``export`` the URL and home go into ``os.environ`` (so subprocesses
    use this server) and Prefect's in-process settings are refreshed to match.
    ``auth_string`` (``user:password``) makes the server require it (PREFECT_SERVER_API_AUTH_STRING);
    clients then need PREFECT_API_AUTH_STRING (exported too with ``export``).
    """
    home = Path(home or tempfile.mkdtemp(prefix="prefect-launch-"))
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    api_url = f"http://{host}:{port}/api"
    log_path = home / "server.log"
    log = open(log_path, "a")
    proc = start_prefect_server(home, port, log, ui=ui, db_url=db_url, auth_string=auth_string, host=host)
    try:
        wait_healthy(api_url, proc, log=log_path, timeout=180 if db_url else 120)
        if export:
            os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=api_url,
                              PREFECT_SERVER_ANALYTICS_ENABLED="false")
            if auth_string:
                os.environ["PREFECT_API_AUTH_STRING"] = auth_string
            import prefect.context

            prefect.context.refresh_global_settings_context()
        yield api_url
    finally:
        stop_server(proc)
        log.close()


@contextlib.contextmanager
def background_process(args: list[str], log_path: Path, env: Optional[dict] = None,
                       cwd: Optional[Path] = None) -> Iterator[subprocess.Popen]:
    """Run ``args`` in its own session, logging to ``log_path``; Ctrl-C it (then kill) on exit."""
    import signal

    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                            cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\n[background_process] still running 20 s after SIGINT: killed ({' '.join(map(str, args))[:200]})\n")
        log.close()


# ----------------------------------------------------------------------------- PostgreSQL
PG_USER = "launch"  # the superuser initdb creates; loopback only, trust auth


def find_pg_bin(name: str) -> Optional[str]:
    """``initdb`` / ``pg_ctl``: on PATH, else the newest /usr/lib/postgresql/*/bin (Debian layout)."""
    import glob
    import shutil

    p = shutil.which(name)
    if p:
        return p
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda c: int(c.split("/")[4]) if c.split("/")[4].isdigit() else 0)
    return cands[-1] if cands else None


def _pg_run_as() -> Optional[str]:
    """PostgreSQL refuses to run as root: as root, run it as ``postgres`` (or ``nobody``)."""
    import pwd

    if os.geteuid() != 0:
        return None
    for cand in ("postgres", "nobody"):
        try:
            pwd.getpwnam(cand)
            return cand
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")


def _as_user(user: Optional[str], argv: list[str]) -> subprocess.CompletedProcess:
    import shutil

    if user:
        argv = ["runuser", "-u", user, "--", *argv] if shutil.which("runuser") else \
            ["su", user, "-s", "/bin/sh", "-c", " ".join(argv)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc


def pg_url(port: int, db: str, driver: str = "psycopg", host: str = "127.0.0.1") -> str:
    """SQLAlchemy URL of database ``db``: ``psycopg`` for the metrics store, ``asyncpg`` for the Prefect server."""
    return f"postgresql+{driver}://{PG_USER}@{host}:{port}/{db}"


def start_postgres(base: Path, port: Optional[int] = None, fast: bool = True, hosts: str = "127.0.0.1",
                   trust_nets: tuple[str, ...] = ()) -> int:
    """Start a private PostgreSQL with its data under ``base`` (initdb on first use) on 127.0.0.1 (or on
    ``hosts``, comma-separated addresses: e.g. also a test bridge's, for agents in network namespaces,
    whose subnet ``trust_nets`` lets in without a password, as the loopback is).

    Returns the port. ``fast`` turns fsync off (tests, benchmarks, the demo: never for data you keep).
    """
    initdb, pg_ctl = find_pg_bin("initdb"), find_pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found; run scripts/system-deps.sh")
    base = Path(base).resolve()
    user = _pg_run_as()
    data, sock = base / "data", base / "sock"
    sock.mkdir(parents=True, exist_ok=True)
    if user:
        import pwd

        pw = pwd.getpwnam(user)
        for p in (base, sock):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(base, 0o700)
        # the server's user must be able to reach its directory
        for parent in base.parents:
            if parent == Path("/"):
                break
            if not os.stat(parent).st_mode & 0o001:
                raise RuntimeError(f"{parent} is not searchable by user {user!r}; put the PostgreSQL data elsewhere")
    if not (data / "PG_VERSION").exists():
        _as_user(user, [initdb, "-D", str(data), "-U", PG_USER, "--auth=trust", "-E", "UTF8", "--no-sync"])
    if trust_nets:
        hba = data / "pg_hba.conf"
        text = hba.read_text()
        extra = "".join(f"host all all {net} trust\n" for net in trust_nets if f"host all all {net} trust" not in text)
        if extra:
            with open(hba, "a") as f:
                f.write(extra)
    port = port or free_port()
    opts = f"-p {port} -k {sock} -h {hosts} -c max_connections=300"
    if fast:
        opts += " -F -c fsync=off -c full_page_writes=off -c synchronous_commit=off"
    _as_user(user, [pg_ctl, "-D", str(data), "-l", str(base / "pg.log"), "-o", opts, "-w", "-t", "60", "start"])
    (base / "port").write_text(str(port))
    return port


def stop_postgres(base: Path, mode: str = "fast") -> None:
    pg_ctl = find_pg_bin("pg_ctl")
    data = Path(base).resolve() / "data"
    if pg_ctl and (data / "postmaster.pid").exists():
        _as_user(_pg_run_as(), [pg_ctl, "-D", str(data), "-m", mode, "-w", "stop"])


def create_database(port: int, name: str, host: str = "127.0.0.1") -> None:
    """Create database ``name`` unless it exists."""
    import psycopg

    deadline = time.time() + 30
    while True:
        try:
            with psycopg.connect(host=host, port=port, user=PG_USER, dbname="postgres", autocommit=True) as conn:
                if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                    conn.execute(f'CREATE DATABASE "{name}"')
            return
        except psycopg.OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.3)


@contextlib.contextmanager
def local_postgres(base: Optional[Path] = None, keep: bool = False, hosts: str = "127.0.0.1",
                   trust_nets: tuple[str, ...] = ()) -> Iterator[int]:
    """A private PostgreSQL for the duration of the block; yields its port (see :func:`pg_url`)."""
    import shutil

    base = Path(base or tempfile.mkdtemp(prefix="launch-pg-"))
    port = start_postgres(base, hosts=hosts, trust_nets=trust_nets)
    try:
        yield port
    finally:
        with contextlib.suppress(Exception):
            stop_postgres(base, mode="immediate")
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m prefect_launch.local_server")
    sub = ap.add_subparsers(dest="what", required=True)
    pg = sub.add_parser("postgres", help="a private PostgreSQL on 127.0.0.1")
    pg.add_argument("action", choices=["start", "stop"])
    pg.add_argument("dir", help="data folder (created on first start)")
    pg.add_argument("--port", type=int, default=None)
    pg.add_argument("--db", action="append", default=[], help="database to create if missing; repeatable")
    args = ap.parse_args(argv)
    try:
        if args.action == "start":
            port = start_postgres(Path(args.dir), args.port)
            for db in args.db:
                create_database(port, db)
            print(port)
        else:
            stop_postgres(Path(args.dir))
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
