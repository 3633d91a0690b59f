"""SQL schema of the run-metrics store, and its versioned migrations.

The store owns its schema: a one-row ``launch_schema_version`` table holds the
version, and :func:`ensure_schema` applies every migration above it, in order,
inside one write transaction (serialised across processes: ``BEGIN IMMEDIATE``
on SQLite, an advisory lock on PostgreSQL). A fresh database is built by the
same chain of migrations an old one is upgraded by, so the upgrade path is the
path every test exercises.

Tables (current version):

``launch_runs``
    one row per flow run; ``id`` is a compact integer key used by the sample
    rows, ``flow_run_id`` the Prefect id (text, unique). Queue, job, flow,
    owner, preset and allocated resources sit beside it so that readers can
    group without asking Prefect.
``launch_samples``
    one row per run per tick, primary key ``(run_id, ts_ms)``; on SQLite a
    ``WITHOUT ROWID`` table so the key is stored once (about 100 bytes a row).
``launch_summaries``
    one row per finished run (written by the sampler at the end).
``launch_run_index``
    (v3) the queue monitor's run index: one row per Prefect flow run with the
    columns its panels filter, group and bucket by (queue, job, owner, preset,
    state, expected start / start / end), kept in step with the Prefect server by
    ``dashboard.index_sync``. It is a copy: Prefect stays the source of truth.
``launch_index_meta``
    (v3) one row for the Prefect server the index follows (by its identity since v8):
    how far back the index covers, and the sync cursors.

Version 4 adds what the monitor's occupancy and cost panels need: on the run index,
the time a run entered its queue for its latest scheduling (``queued_us``), its first
Pending after it (``pending_us``) and the agent's placement label; on samples, the
energy of the interval (``gpu_energy_j`` from NVML, ``cpu_energy_j`` from RAPL, NULL
where it cannot be measured); on summaries, the utilisation-weighted GPU-seconds
(``gpu_used_s``) and the run's energy. Databases whose run index already got its v4
columns from ``run_index.migrate_4`` (applied by the index itself before v4 was
registered here) are upgraded by adding only the columns they lack.

Version 5 adds ``launch_scheduling_history``: one row per decision an agent made about a run
(phase, result, from/to state, error code, message, attempts, created/updated, sub-steps as
JSON); repeats merge into the run's latest row (see ``blocks.scheduling_history``). Keyed by
the Prefect run id, not ``launch_runs.id``: a run that never started has history but no run row.

Version 6 indexes ``launch_runs`` by a run's start as readers order it (started, else submitted,
else created; alone and after the queue): the monitor reads the newest runs of its range on every
view, and without the index that sorted every row of the range (0.33 s at 100k runs, 0.05 s with it).

Version 7 stamps each ``launch_runs`` row with the writer's clock at its last change
(``updated_ms``: an upsert, or its summary written), indexed: the monitor's cost reader reads only
the rows changed since its last read instead of every run of the range at each step of its clock.
Rows written before v7 carry NULL (a reader's first read is a whole one).

Version 8 keys ``launch_index_meta`` by the Prefect server's identity (``server_id``: a UUID kept in
a Prefect Variable, see ``dashboard.api.Api.server_id``) rather than its URL alone: monitors reaching
one server by another spelling (localhost, a proxy, another port) share its index instead of each
resetting it. A meta row from before v8 (NULL ``server_id``) is adopted by the first monitor whose
URL it names.

Version 9 adds who may use the box (issue 40, ``blocks.identity_repository``): ``launch_users`` (name, role
admin/user/agent, disabled), ``launch_projects``, ``launch_project_members``, ``launch_api_keys`` (only a
public key id, a per-key salt and the scrypt hash of the secret; revoked and last-used times) and
``launch_queue_access`` (which users and projects a queue is open to; a queue without rows is open to all).

Version 10 adds run keys (issue 40, per-run keys): ``launch_api_keys.run_id`` (the flow run a key is bound to;
NULL for a user's own keys) and ``expires_ms`` (a run key's end of life), and ``launch_run_index.launched_by`` (who
launched a run for its owner, shown in the monitor's run tables).
"""

from __future__ import annotations

import logging
from typing import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

log = logging.getLogger("prefect_launch.metrics_store")

SCHEMA_VERSION = 10

metadata = sa.MetaData()

schema_version = sa.Table(
    "launch_schema_version",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
)

runs = sa.Table(
    "launch_runs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("flow_run_id", sa.String(64), nullable=False, unique=True),
    sa.Column("flow_run_name", sa.String(255)),
    sa.Column("queue", sa.String(255)),
    sa.Column("work_queue", sa.String(255)),
    sa.Column("job", sa.String(255)),
    sa.Column("deployment_id", sa.String(64)),
    sa.Column("flow", sa.String(255)),
    sa.Column("owner", sa.String(255)),
    sa.Column("project", sa.String(255)),
    sa.Column("preset", sa.String(255)),
    sa.Column("alloc_cpus", sa.Float),
    sa.Column("alloc_memory_bytes", sa.BigInteger),
    sa.Column("alloc_gpus", sa.Integer),
    sa.Column("gpu_indices", sa.String(255)),
    sa.Column("agent", sa.String(255)),
    sa.Column("host", sa.String(255)),
    sa.Column("submitted_ms", sa.BigInteger),
    sa.Column("started_ms", sa.BigInteger),
    sa.Column("ended_ms", sa.BigInteger),
    sa.Column("state", sa.String(64)),
    sa.Column("created_ms", sa.BigInteger),
    # v2
    sa.Column("extra", sa.Text),
    # v7: the writer's clock at the row's last change (upsert or summary), for readers that read changes only
    sa.Column("updated_ms", sa.BigInteger),
)
sa.Index("ix_launch_runs_queue_started", runs.c.queue, runs.c.started_ms)
ix_runs_started = sa.Index("ix_launch_runs_started", runs.c.started_ms)
# v6: a run's start as readers order "newest first" by (started, else submitted, else created); the
# monitor reads the newest runs of a range on every view, which without these sorted every row
RUN_START = sa.func.coalesce(runs.c.started_ms, runs.c.submitted_ms, runs.c.created_ms)
ix_runs_newest = sa.Index("ix_launch_runs_newest", RUN_START)
ix_runs_queue_newest = sa.Index("ix_launch_runs_queue_newest", runs.c.queue, RUN_START)
ix_runs_updated = sa.Index("ix_launch_runs_updated", runs.c.updated_ms)  # v7

samples = sa.Table(
    "launch_samples",
    metadata,
    sa.Column("run_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("ts_ms", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("interval_ms", sa.Integer),
    sa.Column("cpu_pct", sa.Float),
    sa.Column("cpu_share_pct", sa.Float),
    sa.Column("rss_bytes", sa.BigInteger),
    sa.Column("read_bytes", sa.BigInteger),
    sa.Column("write_bytes", sa.BigInteger),
    sa.Column("gpu_util_pct", sa.Float),
    sa.Column("gpu_mem_bytes", sa.BigInteger),
    # v2
    sa.Column("net_rx_bytes", sa.BigInteger),
    sa.Column("net_tx_bytes", sa.BigInteger),
    sa.Column("num_procs", sa.Integer),
    # v4: energy over the interval (J); NULL where it cannot be measured
    sa.Column("gpu_energy_j", sa.Float),  # allocated GPUs, NVML energy counter (else power x interval)
    sa.Column("cpu_energy_j", sa.Float),  # RAPL package energy x the run's share of the host's busy CPU time
    sqlite_with_rowid=False,
)

summaries = sa.Table(
    "launch_summaries",
    metadata,
    sa.Column("run_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("duration_s", sa.Float),
    sa.Column("queue_s", sa.Float),
    sa.Column("cpu_seconds", sa.Float),
    sa.Column("avg_cpu_pct", sa.Float),
    sa.Column("max_cpu_pct", sa.Float),
    sa.Column("avg_cpu_share_pct", sa.Float),
    sa.Column("avg_rss_bytes", sa.BigInteger),
    sa.Column("peak_rss_bytes", sa.BigInteger),
    sa.Column("avg_gpu_util_pct", sa.Float),
    sa.Column("max_gpu_util_pct", sa.Float),
    sa.Column("peak_gpu_mem_bytes", sa.BigInteger),
    sa.Column("gpu_mem_total_bytes", sa.BigInteger),
    sa.Column("read_bytes", sa.BigInteger),
    sa.Column("write_bytes", sa.BigInteger),
    sa.Column("net_rx_bytes", sa.BigInteger),
    sa.Column("net_tx_bytes", sa.BigInteger),
    sa.Column("samples", sa.Integer),
    sa.Column("lost_samples", sa.Integer),
    sa.Column("exit_state", sa.String(64)),
    sa.Column("wasteful", sa.Boolean),
    sa.Column("waste_reasons", sa.Text),
    sa.Column("written_ms", sa.BigInteger),
    # v4
    sa.Column("gpu_used_s", sa.Float),  # GPU-seconds used: sum of utilisation x interval x GPUs
    sa.Column("gpu_energy_j", sa.Float),
    sa.Column("cpu_energy_j", sa.Float),
)

run_index = sa.Table(
    "launch_run_index",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),  # Prefect flow run id
    sa.Column("name", sa.String(255)),
    sa.Column("deployment_id", sa.String(64)),
    sa.Column("queue", sa.String(255)),  # work pool
    sa.Column("priority", sa.String(255)),  # work queue
    sa.Column("owner", sa.String(255)),
    sa.Column("preset", sa.String(255)),
    sa.Column("state_type", sa.String(32)),
    sa.Column("state_name", sa.String(255)),
    sa.Column("state_us", sa.BigInteger),  # timestamp of the current state (epoch microseconds)
    sa.Column("expected_start_us", sa.BigInteger),
    sa.Column("start_us", sa.BigInteger),
    sa.Column("end_us", sa.BigInteger),
    sa.Column("run_time_s", sa.Float),  # Prefect's total_run_time (time spent RUNNING)
    sa.Column("message", sa.Text),
    sa.Column("waiting", sa.Text),
    sa.Column("cpu", sa.Float),
    sa.Column("memory", sa.String(64)),
    sa.Column("gpu", sa.Float),
    sa.Column("launched", sa.Boolean),
    sa.Column("synced_ms", sa.BigInteger, nullable=False),  # when this row was last written
    # v4 (occupancy)
    sa.Column("queued_us", sa.BigInteger),  # entered the queue (latest scheduling before it first left it)
    sa.Column("pending_us", sa.BigInteger),  # first Pending after queued_us (the agent's claim)
    sa.Column("placement", sa.Text),  # label launch.placement: "agent A: cpu=..,gpu=..; gpus 0,1; cores 2,3"
    sa.Column("launched_by", sa.String(255)),  # v10: tag launched_by (an admin launching for the owner)
)
sa.Index("ix_launch_run_index_expected", run_index.c.expected_start_us)
sa.Index("ix_launch_run_index_synced", run_index.c.synced_ms)
sa.Index("ix_launch_run_index_state", run_index.c.state_type)

index_meta = sa.Table(
    "launch_index_meta",
    metadata,
    sa.Column("api_url", sa.String(512), primary_key=True),  # the URL the index was last built or synced through
    sa.Column("covered_since_ms", sa.BigInteger),  # every run expected after this is in the index
    sa.Column("events_cursor_ms", sa.BigInteger),  # Prefect events read up to here
    sa.Column("last_sync_ms", sa.BigInteger),
    sa.Column("server_id", sa.String(64)),  # v8: the server's identity (its URLs may differ between monitors)
)

scheduling_history = sa.Table(
    "launch_scheduling_history",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("flow_run_id", sa.String(64), nullable=False),  # Prefect flow run id
    sa.Column("phase", sa.String(32), nullable=False),
    sa.Column("result", sa.String(16), nullable=False),
    sa.Column("from_state", sa.String(32)),
    sa.Column("to_state", sa.String(32)),
    sa.Column("error_code", sa.String(64)),
    sa.Column("message", sa.Text),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("created_ms", sa.BigInteger, nullable=False),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
    sa.Column("sub_steps", sa.Text),  # JSON list of {step, result, message, error_code, started, ended}
)
sa.Index("ix_launch_sched_history_run", scheduling_history.c.flow_run_id, scheduling_history.c.id)
sa.Index("ix_launch_sched_history_updated", scheduling_history.c.updated_ms)

# v9: identity (blocks.identity_repository). Names are unique; keys are stored as scrypt hashes only.
users = sa.Table(
    "launch_users",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(255), nullable=False, unique=True),
    sa.Column("role", sa.String(16), nullable=False),  # admin, user, agent
    sa.Column("disabled", sa.Boolean, nullable=False, default=False),
    sa.Column("created_ms", sa.BigInteger, nullable=False),
)

projects = sa.Table(
    "launch_projects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(255), nullable=False, unique=True),
    sa.Column("created_ms", sa.BigInteger, nullable=False),
)

project_members = sa.Table(
    "launch_project_members",
    metadata,
    sa.Column("project_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("user_id", sa.Integer, primary_key=True, autoincrement=False),
)

api_keys = sa.Table(
    "launch_api_keys",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key_id", sa.String(32), nullable=False, unique=True),  # the key's public part, to find its row
    sa.Column("user_id", sa.Integer, nullable=False),
    sa.Column("salt", sa.String(64), nullable=False),  # hex
    sa.Column("hash", sa.String(128), nullable=False),  # hex scrypt(secret, salt)
    sa.Column("created_ms", sa.BigInteger, nullable=False),
    sa.Column("revoked_ms", sa.BigInteger),
    sa.Column("last_used_ms", sa.BigInteger),
    sa.Column("run_id", sa.String(64)),  # v10: a run key's flow run (NULL: a user's own key)
    sa.Column("expires_ms", sa.BigInteger),  # v10: a run key's end of life
)
sa.Index("ix_launch_api_keys_user", api_keys.c.user_id)
ix_api_keys_run = sa.Index("ix_launch_api_keys_run", api_keys.c.run_id)

queue_access = sa.Table(
    "launch_queue_access",
    metadata,
    sa.Column("queue", sa.String(255), primary_key=True),
    sa.Column("kind", sa.String(16), primary_key=True),  # user, project
    sa.Column("name", sa.String(255), primary_key=True),
)

IDENTITY_TABLES = (users, projects, project_members, api_keys, queue_access)

# ---------------------------------------------------------------- migrations
# Each migration moves the schema from version k-1 to k. Never edit a released
# migration; append a new one and bump SCHEMA_VERSION.


def _v1_tables() -> list[sa.Table]:
    """The version-1 schema: runs and samples, without the v2 columns."""
    md = sa.MetaData()
    skip = {"launch_runs": {"extra", "updated_ms"},
            "launch_samples": {"net_rx_bytes", "net_tx_bytes", "num_procs", *V4_COLUMNS["launch_samples"]}}
    out = []
    for table in (runs, samples):
        cols = [c._copy() for c in table.columns if c.name not in skip[table.name]]
        kw = {"sqlite_with_rowid": False} if table is samples else {}
        out.append(sa.Table(table.name, md, *cols, **kw))
    sa.Index("ix_launch_runs_queue_started", out[0].c.queue, out[0].c.started_ms)
    return out


def _migrate_1(conn: Connection) -> None:
    for table in _v1_tables():
        table.create(conn, checkfirst=True)


def _add_column(conn: Connection, table: sa.Table, name: str) -> None:
    col = table.c[name]
    ddl = sa.schema.CreateColumn(col).compile(dialect=conn.dialect)
    conn.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {ddl}")


V4_COLUMNS = {
    "launch_samples": ("gpu_energy_j", "cpu_energy_j"),
    "launch_summaries": ("gpu_used_s", "gpu_energy_j", "cpu_energy_j"),
    "launch_run_index": ("queued_us", "pending_us", "placement"),
}


def _without(table: sa.Table, skip: tuple[str, ...]) -> sa.Table:
    """``table`` as an earlier version created it: the same, less the columns ``skip``."""
    md = sa.MetaData()
    kw = {"sqlite_with_rowid": False} if table is samples else {}
    out = sa.Table(table.name, md, *[c._copy() for c in table.columns if c.name not in skip], **kw)
    for ix in table.indexes:
        if all(c.name not in skip for c in ix.columns):
            sa.Index(ix.name, *[out.c[c.name] for c in ix.columns])
    return out


def _migrate_2(conn: Connection) -> None:
    _add_column(conn, runs, "extra")
    for name in ("net_rx_bytes", "net_tx_bytes", "num_procs"):
        _add_column(conn, samples, name)
    _without(summaries, V4_COLUMNS[summaries.name]).create(conn, checkfirst=True)
    ix_runs_started.create(conn, checkfirst=True)


def _migrate_3(conn: Connection) -> None:
    _without(run_index, V4_COLUMNS[run_index.name] + ("launched_by",)).create(conn, checkfirst=True)
    _without(index_meta, ("server_id",)).create(conn, checkfirst=True)


def add_missing_columns(conn: Connection, table: sa.Table, names: tuple[str, ...]) -> list[str]:
    """Add those of ``names`` that ``table`` lacks in the database; returns the ones added."""
    have = {c["name"] for c in sa.inspect(conn).get_columns(table.name)}
    added = [n for n in names if n not in have]
    for name in added:
        _add_column(conn, table, name)
    return added


def _migrate_4(conn: Connection) -> None:
    for table in (samples, summaries, run_index):
        add_missing_columns(conn, table, V4_COLUMNS[table.name])


def _migrate_5(conn: Connection) -> None:
    scheduling_history.create(conn, checkfirst=True)


def _migrate_6(conn: Connection) -> None:
    for ix in (ix_runs_newest, ix_runs_queue_newest):  # IF NOT EXISTS: SQLite does not reflect expression indexes
        conn.execute(sa.schema.CreateIndex(ix, if_not_exists=True))


def _migrate_7(conn: Connection) -> None:
    add_missing_columns(conn, runs, ("updated_ms",))
    conn.execute(sa.schema.CreateIndex(ix_runs_updated, if_not_exists=True))  # no reflection (v6's expression indexes)


def _migrate_8(conn: Connection) -> None:
    add_missing_columns(conn, index_meta, ("server_id",))


def _migrate_9(conn: Connection) -> None:
    for table in IDENTITY_TABLES:
        _without(table, ("run_id", "expires_ms")).create(conn, checkfirst=True)


def _migrate_10(conn: Connection) -> None:
    add_missing_columns(conn, api_keys, ("run_id", "expires_ms"))
    add_missing_columns(conn, run_index, ("launched_by",))
    conn.execute(sa.schema.CreateIndex(ix_api_keys_run, if_not_exists=True))


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _migrate_1, 2: _migrate_2, 3: _migrate_3, 4: _migrate_4, 5: _migrate_5, 6: _migrate_6, 7: _migrate_7,
    8: _migrate_8, 9: _migrate_9, 10: _migrate_10,
}
assert max(MIGRATIONS) == SCHEMA_VERSION


def current_version(conn: Connection) -> int:
    if not sa.inspect(conn).has_table(schema_version.name):
        return 0
    v = conn.execute(sa.select(schema_version.c.version).where(schema_version.c.id == 1)).scalar()
    return int(v or 0)


def ensure_schema(conn: Connection, target: int = SCHEMA_VERSION) -> int:
    """Bring the schema to ``target`` inside the caller's (write) transaction.

    Returns the version found before migrating.
    """
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7446512093)")
    schema_version.create(conn, checkfirst=True)
    found = current_version(conn)
    if found > SCHEMA_VERSION:
        log.warning(
            "metrics store schema is version %s, newer than this code's %s; continuing", found, SCHEMA_VERSION
        )
        return found
    for v in range(found + 1, target + 1):
        log.info("metrics store: migrating schema to version %s", v)
        MIGRATIONS[v](conn)
    if target > found:
        if found == 0:
            conn.execute(schema_version.insert().values(id=1, version=target))
        else:
            conn.execute(schema_version.update().where(schema_version.c.id == 1).values(version=target))
    return found
