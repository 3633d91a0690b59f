"""The run-metrics store's SQLAlchemy engines: one per URL for the process, its schema brought up to date on first use.

SQLite engines run in WAL mode and let SQLAlchemy, not pysqlite, begin transactions, so DDL is
transactional and a writer (a connection with the ``launch_write`` execution option) takes the
lock up front (``BEGIN IMMEDIATE``). Other back ends (PostgreSQL) get a pre-pinged pool. The
schema and its migrations are :mod:`prefect_launch.blocks.metrics_schema`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from prefect_launch.blocks import metrics_schema as S

__all__ = ["engine_for", "dispose_engines"]

_ENGINES: dict[str, Engine] = {}
_READY: set[str] = set()
_LOCK = threading.Lock()


def _make_engine(url: str) -> Engine:
    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _rec):  # pragma: no cover - trivial
            # Let SQLAlchemy (not pysqlite) decide where transactions begin, so that
            # DDL is transactional and writers can take the lock up front.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _on_begin(conn):
            if conn.get_execution_options().get("launch_write"):
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.exec_driver_sql("BEGIN")

        return engine
    kw: dict[str, Any] = {"pool_pre_ping": True, "pool_size": 5, "max_overflow": 10}
    if u.get_backend_name() == "postgresql":
        kw["connect_args"] = {"connect_timeout": 5}
    return sa.create_engine(url, **kw)


def engine_for(url: str) -> Engine:
    """The cached engine for ``url``; creates/upgrades the schema on its first use in this process."""
    with _LOCK:
        engine = _ENGINES.get(url)
        if engine is None:
            engine = _ENGINES[url] = _make_engine(url)
    if url not in _READY:
        with engine.connect().execution_options(launch_write=True) as conn:
            with conn.begin():
                S.ensure_schema(conn)
        _READY.add(url)
    return engine


def dispose_engines() -> None:
    """Close every cached engine (tests, shutdown)."""
    with _LOCK:
        for e in _ENGINES.values():
            e.dispose()
        _ENGINES.clear()
        _READY.clear()
