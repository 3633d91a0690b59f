"""A fresh SQLite home starts from a copy of a migrated database (local_server.seed_sqlite_database).

The session's Prefect server (conftest) starts from such a copy, so every end-to-end test also
shows that a server runs on it; here: the copy is at Prefect's newest migration, an existing
database is never replaced, and the switch turns it off.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from prefect_launch.local_server import seed_sqlite_database

pytestmark = pytest.mark.server  # Prefect's migrations (`prefect server database upgrade`, ~10 s) build the template


def _revision(db: Path) -> set[str]:
    with closing(sqlite3.connect(db)) as con:
        return {r[0] for r in con.execute("select version_num from alembic_version")}


def test_a_fresh_home_gets_a_database_at_prefects_newest_migration(tmp_path: Path):
    import prefect.server.database
    from alembic.script import ScriptDirectory

    home = tmp_path / "home"
    home.mkdir()
    assert seed_sqlite_database(home) is True
    migrations = Path(prefect.server.database.__file__).parent / "_migrations"
    heads = set(ScriptDirectory(str(migrations), version_locations=[str(migrations / "versions" / "sqlite")]).get_heads())
    assert heads and _revision(home / "prefect.db") == heads
    with closing(sqlite3.connect(home / "prefect.db")) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        assert {"flow_run", "work_pool", "deployment"} <= tables
        assert con.execute("select count(*) from flow_run").fetchone()[0] == 0  # a copy of an empty database


def test_an_existing_database_is_never_replaced_and_the_switch_turns_it_off(tmp_path: Path, monkeypatch):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "prefect.db").write_bytes(b"someone's runs")
    assert seed_sqlite_database(kept) is False
    assert (kept / "prefect.db").read_bytes() == b"someone's runs"

    monkeypatch.setenv("LAUNCH_SERVER_DB_TEMPLATE", "0")
    off = tmp_path / "off"
    off.mkdir()
    assert seed_sqlite_database(off) is False
    assert not (off / "prefect.db").exists()


def test_a_template_build_killed_midway_is_rebuilt_whole(tmp_path: Path, monkeypatch):
    """Kill the process that builds the template while it migrates: the next start builds it again
    instead of copying a half-migrated database into a home."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    import prefect_launch.local_server as ls

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a template of this test's own
    tpl = ls._template_dir()
    first = tmp_path / "first"
    first.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from prefect_launch."
                             "local_server import seed_sqlite_database; seed_sqlite_database(Path(sys.argv[1]))",
                             str(first)], env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tpl / "build" / "prefect.db").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (tpl / "build" / "prefect.db").exists(), "the build never started"
    os.killpg(proc.pid, signal.SIGKILL)  # midway through the migration
    proc.wait()
    assert not (tpl / "prefect.db").exists() and not (first / "prefect.db").exists()  # nothing half-made in use

    home = tmp_path / "home"
    home.mkdir()
    assert seed_sqlite_database(home) is True
    assert not (tpl / "build").exists()
    assert _revision(home / "prefect.db") == _revision(tpl / "prefect.db") and _revision(home / "prefect.db")
