"""The run-metrics store: a Prefect block that holds the connection, and the rows in our own tables.

Blocks are a poor place for time series (each save replaces one encrypted JSON
document), so the block only carries the SQLAlchemy URL and retention; runs,
samples and summaries live in SQL tables that the store creates and upgrades
itself (see :mod:`prefect_launch.blocks.metrics_schema`).

Default URL (``url=None``): an SQLite file ``launch-metrics.db`` beside the
Prefect database under ``PREFECT_HOME``. PostgreSQL works with
``postgresql+psycopg://user@host:port/db`` (password may go in ``password``).

Typical use::

    store = RunMetricsStore.load("default")          # or RunMetricsStore()
    store.upsert_run(RunRecord(flow_run_id=..., queue="gpu", gpu=1, ...))
    store.record_samples([MetricSample(flow_run_id=..., ts=..., cpu_pct=98.0)])
    store.write_summary(flow_run_id, summary)
    rows = store.summaries(queue="gpu", since=week_ago)   # list[dict], pandas.DataFrame(rows)
    pts = store.series(flow_run_id, max_points=200)        # list[dict]

All methods are synchronous and thread-safe (engines are cached per URL and
pooled); ``a``-prefixed variants run them in a worker thread for async callers.
Times are timezone-aware UTC ``datetime`` in and out; they are stored as integer
epoch milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence
from urllib.parse import quote_plus
from uuid import UUID

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator
from sqlalchemy.engine import Connection, Engine

from prefect.blocks.core import Block

from prefect_launch.blocks import metrics_schema as S

__all__ = [
    "RunMetricsStore",
    "RunRecord",
    "MetricSample",
    "RunSummary",
    "default_store_url",
    "to_ms",
    "from_ms",
]

# ------------------------------------------------------------------- helpers


def to_ms(dt: datetime | None) -> int | None:
    """UTC epoch milliseconds; naive datetimes are taken as UTC."""
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(round(dt.timestamp() * 1000))


def from_ms(ms: int | None) -> datetime | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _id(v: Any) -> str:
    return str(v) if isinstance(v, UUID) else v


def default_store_url() -> str:
    """``sqlite:///<PREFECT_HOME>/launch-metrics.db`` (the Prefect DB's directory by default)."""
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    return f"sqlite:///{home / 'launch-metrics.db'}"


# -------------------------------------------------------------------- models


class RunRecord(BaseModel):
    """One launched run: identity, grouping keys and allocated resources."""

    model_config = ConfigDict(extra="ignore")

    flow_run_id: str
    flow_run_name: Optional[str] = None
    queue: Optional[str] = None  # launch queue = work pool name
    work_queue: Optional[str] = None  # priority (work queue) name
    job: Optional[str] = None  # deployment name
    deployment_id: Optional[str] = None
    flow: Optional[str] = None
    owner: Optional[str] = None
    project: Optional[str] = None
    preset: Optional[str] = None
    cpu: Optional[float] = None  # allocated CPUs
    memory_bytes: Optional[int] = None  # allocated memory
    gpu: Optional[int] = None  # allocated GPU count (defaults to len(gpu_indices))
    gpu_indices: list[int] = Field(default_factory=list)
    agent: Optional[str] = None  # worker name
    host: Optional[str] = None
    submitted_at: Optional[datetime] = None
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    state: Optional[str] = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("flow_run_id", "deployment_id", mode="before")
    @classmethod
    def _uuid_to_str(cls, v: Any) -> Any:
        return _id(v)


class MetricSample(BaseModel):
    """One tick of one run's process tree. Counters are per interval, not cumulative."""

    model_config = ConfigDict(extra="ignore")

    flow_run_id: str
    ts: datetime
    interval_s: Optional[float] = None
    cpu_pct: Optional[float] = None  # 100 = one core
    cpu_share_pct: Optional[float] = None  # 100 = all allocated CPUs busy
    rss_bytes: Optional[int] = None  # sum of RSS over the tree
    read_bytes: Optional[int] = None  # disk bytes read during the interval
    write_bytes: Optional[int] = None
    net_rx_bytes: Optional[int] = None  # only when the run has its own network namespace
    net_tx_bytes: Optional[int] = None
    gpu_util_pct: Optional[float] = None  # mean over allocated GPUs, 0-100
    gpu_mem_bytes: Optional[int] = None  # sum over allocated GPUs
    num_procs: Optional[int] = None
    gpu_energy_j: Optional[float] = None  # energy of the allocated GPUs over the interval (NVML); None: not measured
    cpu_energy_j: Optional[float] = None  # the run's share of the CPU packages' energy (RAPL); None: not measured

    @field_validator("flow_run_id", mode="before")
    @classmethod
    def _uuid_to_str(cls, v: Any) -> Any:
        return _id(v)


class RunSummary(BaseModel):
    """End-of-run figures, allocated vs used, and the waste verdict."""

    model_config = ConfigDict(extra="ignore")

    flow_run_id: Optional[str] = None
    started_at: Optional[datetime] = None
    ended_at: Optional[datetime] = None
    duration_s: Optional[float] = None
    queue_s: Optional[float] = None
    cpu_seconds: Optional[float] = None
    avg_cpu_pct: Optional[float] = None
    max_cpu_pct: Optional[float] = None
    avg_cpu_share_pct: Optional[float] = None
    avg_rss_bytes: Optional[int] = None
    peak_rss_bytes: Optional[int] = None
    avg_gpu_util_pct: Optional[float] = None
    max_gpu_util_pct: Optional[float] = None
    peak_gpu_mem_bytes: Optional[int] = None
    gpu_mem_total_bytes: Optional[int] = None  # total memory of the allocated GPUs
    allocated_cpus: Optional[float] = None
    allocated_memory_bytes: Optional[int] = None
    allocated_gpus: Optional[int] = None
    read_bytes: Optional[int] = None
    write_bytes: Optional[int] = None
    net_rx_bytes: Optional[int] = None
    net_tx_bytes: Optional[int] = None
    gpu_used_s: Optional[float] = None  # GPU-seconds used: sum of utilisation x interval x allocated GPUs
    gpu_energy_j: Optional[float] = None  # None: not measured (see the record's extra "gpu_energy")
    cpu_energy_j: Optional[float] = None  # None: not measured (see the record's extra "cpu_energy")
    samples: int = 0
    lost_samples: int = 0
    exit_state: Optional[str] = None
    wasteful: bool = False
    waste_reasons: list[str] = Field(default_factory=list)

    @field_validator("flow_run_id", mode="before")
    @classmethod
    def _uuid_to_str(cls, v: Any) -> Any:
        return _id(v)

    @property
    def memory_used_pct(self) -> Optional[float]:
        """Peak RSS as % of allocated memory."""
        if self.peak_rss_bytes is None or not self.allocated_memory_bytes:
            return None
        return 100.0 * self.peak_rss_bytes / self.allocated_memory_bytes


# ------------------------------------------------------------------- engines

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


def _engine_for(url: str) -> Engine:
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


# ------------------------------------------------------------------- columns

_RUN_FIELDS = {
    # model field -> column
    "flow_run_id": "flow_run_id",
    "flow_run_name": "flow_run_name",
    "queue": "queue",
    "work_queue": "work_queue",
    "job": "job",
    "deployment_id": "deployment_id",
    "flow": "flow",
    "owner": "owner",
    "project": "project",
    "preset": "preset",
    "cpu": "alloc_cpus",
    "memory_bytes": "alloc_memory_bytes",
    "gpu": "alloc_gpus",
    "agent": "agent",
    "host": "host",
    "state": "state",
}
_SAMPLE_FIELDS = [
    "cpu_pct",
    "cpu_share_pct",
    "rss_bytes",
    "read_bytes",
    "write_bytes",
    "net_rx_bytes",
    "net_tx_bytes",
    "gpu_util_pct",
    "gpu_mem_bytes",
    "num_procs",
    "gpu_energy_j",
    "cpu_energy_j",
]
_SUMMARY_FIELDS = [
    c.name for c in S.summaries.columns if c.name not in ("run_id", "waste_reasons", "written_ms", "exit_state")
]


def _run_values(rec: RunRecord) -> dict[str, Any]:
    v: dict[str, Any] = {col: getattr(rec, f) for f, col in _RUN_FIELDS.items()}
    if rec.gpu is None and rec.gpu_indices:
        v["alloc_gpus"] = len(rec.gpu_indices)
    v["gpu_indices"] = ",".join(str(i) for i in rec.gpu_indices) if rec.gpu_indices else None
    v["submitted_ms"] = to_ms(rec.submitted_at)
    v["started_ms"] = to_ms(rec.started_at)
    v["ended_ms"] = to_ms(rec.ended_at)
    v["extra"] = json.dumps(rec.extra, default=str) if rec.extra else None
    return v


def _run_row_to_dict(row: Any) -> dict[str, Any]:
    m = row._mapping
    out: dict[str, Any] = {f: m[col] for f, col in _RUN_FIELDS.items()}
    gi = m["gpu_indices"]
    out["gpu_indices"] = [int(x) for x in gi.split(",")] if gi else []
    out["submitted_at"] = from_ms(m["submitted_ms"])
    out["started_at"] = from_ms(m["started_ms"])
    out["ended_at"] = from_ms(m["ended_ms"])
    out["extra"] = json.loads(m["extra"]) if m["extra"] else {}
    return out


def _chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


# --------------------------------------------------------------------- block


class RunMetricsStore(Block):
    """Where prefect-launch keeps per-run metrics: the SQL connection of the store.

    The rows (runs, samples, summaries) live in the store's own tables; this block
    holds only how to reach them and how long to keep them.
    """

    _block_type_name = "Launch Run Metrics Store"
    _block_type_slug = "launch-run-metrics-store"
    _description = (
        "SQL store (SQLite or PostgreSQL) for prefect-launch run metrics: per-run samples, "
        "summaries and queue aggregates. Holds the SQLAlchemy URL and the retention."
    )
    _documentation_url = "https://github.com/prefect-launch/prefect-launch"

    url: Optional[str] = Field(
        default=None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://launch@db:5432/launch. "
        "Empty: SQLite file launch-metrics.db under PREFECT_HOME.",
    )
    password: Optional[SecretStr] = Field(
        default=None, description="Database password, put into the URL at connect time (kept out of `url`)."
    )
    password_secret: Optional[str] = Field(
        default=None, description="Name of a Prefect Secret block holding the database password, read at "
        "connect time (instead of `password`).",
    )
    retention_days: Optional[int] = Field(
        default=90, description="purge() without an argument deletes runs that ended longer ago than this."
    )

    # ------------------------------------------------------------ connection

    _secret_password: Optional[str] = PrivateAttr(None)  # the Secret block's value, read once per instance

    def _password_value(self) -> Optional[str]:
        if self.password is not None:
            return self.password.get_secret_value()
        if not self.password_secret:
            return None
        if self._secret_password is None:
            from prefect.blocks.system import Secret

            try:
                secret = Secret.load(self.password_secret, _sync=True)
            except ValueError:
                raise ValueError(f"the metrics store's password Secret block {self.password_secret!r} does not "
                                 "exist; create it or run `prefect-launch setup --metrics-password-secret NAME`") from None
            self._secret_password = str(secret.get())
        return self._secret_password

    def resolved_url(self) -> str:
        """The URL to connect with, password included: never print or log it (see :meth:`display_url`)."""
        url = self.url or default_store_url()
        password = self._password_value()
        if password is not None:
            u = sa.engine.make_url(url).set(password=password)
            url = u.render_as_string(hide_password=False)
        return url

    def display_url(self) -> str:
        """The URL for people: a password in it shows as ``***``."""
        if not self.url:
            return "(SQLite beside the Prefect database)"
        try:
            return sa.engine.make_url(self.url).render_as_string(hide_password=True)
        except Exception:
            return "(unparseable URL)"

    def redact(self, text: str) -> str:
        """``text`` with this store's password (and URLs holding it) masked: for error messages."""
        try:
            password = self._password_value()
        except Exception:
            password = None
        for secret in filter(None, [password, quote_plus(password) if password else None]):
            text = text.replace(secret, "***")
        return text

    def password_source(self) -> str:
        """Where the password comes from: ``none``, ``block`` (encrypted field) or ``secret:<block name>``."""
        if self.password is not None:
            return "block"
        return f"secret:{self.password_secret}" if self.password_secret else "none"

    @property
    def engine(self) -> Engine:
        """The cached engine for this URL; creates/upgrades the schema on first use."""
        return _engine_for(self.resolved_url())

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(launch_write=True) as conn:
            with conn.begin():
                yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            with conn.begin():
                yield conn

    def schema_version(self) -> int:
        with self._read() as conn:
            return S.current_version(conn)

    # ----------------------------------------------------------------- runs

    def _upsert_run_conn(self, conn: Connection, rec: RunRecord) -> int:
        values = _run_values(rec)
        values["updated_ms"] = to_ms(_utcnow())  # every write moves the stamp (readers of changes only)
        dialect = conn.dialect.name
        if dialect in ("sqlite", "postgresql"):
            if dialect == "sqlite":
                from sqlalchemy.dialects.sqlite import insert
            else:
                from sqlalchemy.dialects.postgresql import insert
            stmt = insert(S.runs).values(created_ms=to_ms(_utcnow()), **values)
            # Merge: a field given as None keeps what is stored.
            upd = {
                col: sa.func.coalesce(stmt.excluded[col], S.runs.c[col])
                for col in values
                if col != "flow_run_id"
            }
            stmt = stmt.on_conflict_do_update(index_elements=[S.runs.c.flow_run_id], set_=upd)
            conn.execute(stmt)
        else:  # generic: select then insert/update
            existing = conn.execute(
                sa.select(S.runs.c.id).where(S.runs.c.flow_run_id == rec.flow_run_id)
            ).scalar()
            if existing is None:
                conn.execute(S.runs.insert().values(created_ms=to_ms(_utcnow()), **values))
            else:
                conn.execute(
                    S.runs.update()
                    .where(S.runs.c.id == existing)
                    .values(**{k: v for k, v in values.items() if v is not None})
                )
        return conn.execute(sa.select(S.runs.c.id).where(S.runs.c.flow_run_id == rec.flow_run_id)).scalar_one()

    def upsert_run(self, record: RunRecord) -> None:
        """Insert the run or merge it into the stored row (fields given as None are kept)."""
        with self._write() as conn:
            self._upsert_run_conn(conn, record)

    def get_run(self, flow_run_id: str | UUID) -> Optional[RunRecord]:
        with self._read() as conn:
            row = conn.execute(sa.select(S.runs).where(S.runs.c.flow_run_id == _id(flow_run_id))).first()
        return RunRecord(**_run_row_to_dict(row)) if row else None

    def _run_keys(self, conn: Connection, ids: Iterable[str], create: bool) -> dict[str, int]:
        ids = list(dict.fromkeys(ids))
        keys: dict[str, int] = {}
        for chunk in _chunks(ids, 500):
            for rid, fid in conn.execute(
                sa.select(S.runs.c.id, S.runs.c.flow_run_id).where(S.runs.c.flow_run_id.in_(chunk))
            ):
                keys[fid] = rid
        if create:
            for fid in ids:
                if fid not in keys:
                    keys[fid] = self._upsert_run_conn(conn, RunRecord(flow_run_id=fid))
        return keys

    # -------------------------------------------------------------- samples

    def record_samples(self, samples: Sequence[MetricSample]) -> int:
        """Write a batch of samples in one transaction; returns the number written.

        Idempotent: a sample with the same (run, ts) as a stored one is ignored, so
        a batch may be retried after an unclear failure. Unknown runs get a stub row.
        """
        if not samples:
            return 0
        with self._write() as conn:
            keys = self._run_keys(conn, (s.flow_run_id for s in samples), create=True)
            rows = []
            for s in samples:
                row = {f: getattr(s, f) for f in _SAMPLE_FIELDS}
                row["run_id"] = keys[s.flow_run_id]
                row["ts_ms"] = to_ms(s.ts)
                row["interval_ms"] = int(round(s.interval_s * 1000)) if s.interval_s is not None else None
                rows.append(row)
            dialect = conn.dialect.name
            if dialect == "sqlite":
                from sqlalchemy.dialects.sqlite import insert
            elif dialect == "postgresql":
                from sqlalchemy.dialects.postgresql import insert
            else:
                insert = None
            for chunk in _chunks(rows, 1000):
                if insert is not None:
                    conn.execute(insert(S.samples).on_conflict_do_nothing(), list(chunk))
                else:
                    conn.execute(S.samples.insert(), list(chunk))
        return len(rows)

    def series(
        self,
        flow_run_id: str | UUID | Sequence[str | UUID],
        since: datetime | None = None,
        until: datetime | None = None,
        max_points: int | None = None,
    ) -> list[dict[str, Any]]:
        """Samples of one run (or several), oldest first.

        Returns ``list[dict]`` with keys ``flow_run_id, ts`` (UTC datetime), ``interval_s``,
        ``cpu_pct, cpu_share_pct, rss_bytes, read_bytes, write_bytes, net_rx_bytes,
        net_tx_bytes, gpu_util_pct, gpu_mem_bytes, num_procs`` (``pandas.DataFrame(rows)``
        works directly). With ``max_points``, each run's samples are averaged into at most
        about that many time buckets in SQL (``rss_bytes`` and ``gpu_mem_bytes`` take the max
        of the bucket, I/O counters the sum).
        """
        ids = [_id(flow_run_id)] if isinstance(flow_run_id, (str, UUID)) else [_id(x) for x in flow_run_id]
        out: list[dict[str, Any]] = []
        with self._read() as conn:
            keys = self._run_keys(conn, ids, create=False)
            for fid in ids:
                if fid not in keys:
                    continue
                out.extend(self._series_one(conn, fid, keys[fid], since, until, max_points))
        return out

    def _series_one(self, conn, fid, key, since, until, max_points) -> list[dict[str, Any]]:
        c = S.samples.c
        where = [c.run_id == key]
        if since is not None:
            where.append(c.ts_ms >= to_ms(since))
        if until is not None:
            where.append(c.ts_ms < to_ms(until))
        bucket_ms = None
        if max_points:
            lo, hi, n = conn.execute(sa.select(sa.func.min(c.ts_ms), sa.func.max(c.ts_ms), sa.func.count()).where(*where)).one()
            if n and n > max_points:
                bucket_ms = max(1, -(-(hi - lo + 1) // max_points))
        if bucket_ms is None:
            rows = conn.execute(sa.select(S.samples).where(*where).order_by(c.ts_ms)).all()
            result = []
            for r in rows:
                m = r._mapping
                d = {"flow_run_id": fid, "ts": from_ms(m["ts_ms"])}
                d["interval_s"] = m["interval_ms"] / 1000 if m["interval_ms"] is not None else None
                d.update({f: m[f] for f in _SAMPLE_FIELDS})
                result.append(d)
            return result
        bucket = c.ts_ms // bucket_ms
        agg = {
            "cpu_pct": sa.func.avg(c.cpu_pct),
            "cpu_share_pct": sa.func.avg(c.cpu_share_pct),
            "rss_bytes": sa.func.max(c.rss_bytes),
            "read_bytes": sa.func.sum(c.read_bytes),
            "write_bytes": sa.func.sum(c.write_bytes),
            "net_rx_bytes": sa.func.sum(c.net_rx_bytes),
            "net_tx_bytes": sa.func.sum(c.net_tx_bytes),
            "gpu_util_pct": sa.func.avg(c.gpu_util_pct),
            "gpu_mem_bytes": sa.func.max(c.gpu_mem_bytes),
            "num_procs": sa.func.max(c.num_procs),
            "gpu_energy_j": sa.func.sum(c.gpu_energy_j),
            "cpu_energy_j": sa.func.sum(c.cpu_energy_j),
        }
        stmt = (
            sa.select(
                sa.func.min(c.ts_ms).label("ts_ms"),
                sa.func.sum(c.interval_ms).label("interval_ms"),
                *[v.label(k) for k, v in agg.items()],
            )
            .where(*where)
            .group_by(bucket)
            .order_by(sa.func.min(c.ts_ms))
        )
        result = []
        for r in conn.execute(stmt):
            m = r._mapping
            d = {"flow_run_id": fid, "ts": from_ms(int(m["ts_ms"]))}
            d["interval_s"] = float(m["interval_ms"]) / 1000 if m["interval_ms"] is not None else None
            for f in _SAMPLE_FIELDS:
                v = m[f]
                if v is not None:
                    v = float(v) if f.endswith(("_pct", "_j")) else int(v)
                d[f] = v
            result.append(d)
        return result

    # ------------------------------------------------------------ summaries

    def write_summary(self, flow_run_id: str | UUID, summary: RunSummary) -> None:
        """Store (replace) the run's summary; also sets the run's ended_at and state."""
        fid = _id(flow_run_id)
        with self._write() as conn:
            key = self._run_keys(conn, [fid], create=True)[fid]
            values = {f: getattr(summary, f) for f in _SUMMARY_FIELDS}
            values["exit_state"] = summary.exit_state
            values["waste_reasons"] = json.dumps(summary.waste_reasons)
            values["written_ms"] = to_ms(_utcnow())
            conn.execute(sa.delete(S.summaries).where(S.summaries.c.run_id == key))
            conn.execute(S.summaries.insert().values(run_id=key, **values))
            upd: dict[str, Any] = {"updated_ms": values["written_ms"]}  # the run's cost figures change with it
            if summary.ended_at is not None:
                upd["ended_ms"] = to_ms(summary.ended_at)
            if summary.started_at is not None:
                upd["started_ms"] = sa.func.coalesce(S.runs.c.started_ms, to_ms(summary.started_at))
            if summary.exit_state is not None:
                upd["state"] = summary.exit_state
            for col, val in (
                ("alloc_cpus", summary.allocated_cpus),
                ("alloc_memory_bytes", summary.allocated_memory_bytes),
                ("alloc_gpus", summary.allocated_gpus),
            ):
                if val is not None:
                    upd[col] = sa.func.coalesce(S.runs.c[col], val)
            conn.execute(S.runs.update().where(S.runs.c.id == key).values(**upd))

    def _window(self, since: datetime | None, until: datetime | None) -> list[Any]:
        r = S.runs.c
        start = S.RUN_START  # what ix_launch_runs_newest indexes
        where = []
        if until is not None:
            where.append(start < to_ms(until))
        if since is not None:
            where.append(sa.or_(r.ended_ms.is_(None), r.ended_ms >= to_ms(since)))
        return where

    def summaries(
        self,
        flow_run_ids: Sequence[str | UUID] | None = None,
        queue: str | Sequence[str] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Runs with their summaries, newest start first.

        Filters: ``flow_run_ids``; ``queue`` (one name or several); ``since``/``until``
        select runs whose life overlaps ``[since, until)`` (start = started_at, else
        submitted_at; a run with no end counts as still running).

        Returns ``list[dict]``, one per run, with every :class:`RunRecord` field
        (``flow_run_id, flow_run_name, queue, work_queue, job, deployment_id, flow, owner,
        project, preset, cpu, memory_bytes, gpu, gpu_indices, agent, host, submitted_at,
        started_at, ended_at, state, extra``), then every :class:`RunSummary` field
        (``duration_s, queue_s, cpu_seconds, avg_cpu_pct, max_cpu_pct, avg_cpu_share_pct,
        avg_rss_bytes, peak_rss_bytes, avg_gpu_util_pct, max_gpu_util_pct,
        peak_gpu_mem_bytes, gpu_mem_total_bytes, read_bytes, write_bytes, net_rx_bytes,
        net_tx_bytes, samples, lost_samples, exit_state, wasteful, waste_reasons``) which
        are None (``waste_reasons`` ``[]``) until the summary is written, and
        ``has_summary`` (bool). ``queue_s`` is filled from the run times when no summary
        exists yet.
        """
        r, s = S.runs.c, S.summaries.c
        stmt = sa.select(S.runs, *[s[f] for f in _SUMMARY_FIELDS], s.exit_state, s.waste_reasons, s.run_id.label("summary_key"))
        stmt = stmt.select_from(S.runs.outerjoin(S.summaries, s.run_id == r.id))
        where = self._window(since, until)
        if queue is not None:
            where.append(r.queue.in_([queue] if isinstance(queue, str) else list(queue)))
        out: list[dict[str, Any]] = []
        with self._read() as conn:
            id_chunks: list[Optional[Sequence[str]]] = [None]
            if flow_run_ids is not None:
                id_chunks = list(_chunks([_id(x) for x in flow_run_ids], 500))
            for chunk in id_chunks:
                w = list(where)
                if chunk is not None:
                    w.append(r.flow_run_id.in_(chunk))
                q = stmt.where(*w).order_by(S.RUN_START.desc())  # newest first through ix_launch_runs_newest
                if limit:
                    q = q.limit(limit)
                for row in conn.execute(q):
                    m = row._mapping
                    d = _run_row_to_dict(row)
                    for f in _SUMMARY_FIELDS:
                        d[f] = m[f]
                    d["wasteful"] = bool(m["wasteful"]) if m["wasteful"] is not None else None
                    d["exit_state"] = m["exit_state"]
                    d["waste_reasons"] = json.loads(m["waste_reasons"]) if m["waste_reasons"] else []
                    d["has_summary"] = m["summary_key"] is not None
                    if d["queue_s"] is None and m["started_ms"] is not None and m["submitted_ms"] is not None:
                        d["queue_s"] = (m["started_ms"] - m["submitted_ms"]) / 1000
                    out.append(d)
        if flow_run_ids is not None and len(id_chunks) > 1:
            out.sort(key=lambda d: d["started_at"] or d["submitted_at"] or datetime.min.replace(tzinfo=timezone.utc), reverse=True)
        return out

    def get_summary(self, flow_run_id: str | UUID) -> Optional[RunSummary]:
        rows = self.summaries(flow_run_ids=[flow_run_id])
        if not rows or not rows[0]["has_summary"]:
            return None
        d = dict(rows[0])
        d["allocated_cpus"], d["allocated_memory_bytes"], d["allocated_gpus"] = d["cpu"], d["memory_bytes"], d["gpu"]
        return RunSummary(**d)

    def queue_aggregates(
        self, queue: str | None, since: datetime | None = None, until: datetime | None = None
    ) -> dict[str, Any]:
        """Totals for one queue (None = all queues) over runs overlapping ``[since, until)``.

        Computed in SQL. Returns a dict: ``queue, since, until, runs, finished`` (runs with a
        summary), ``running`` (no end yet), ``wasteful``, ``by_state`` ({state: count}),
        ``run_seconds`` (sum of durations of finished runs), ``queue_seconds``,
        ``avg_queue_s``, ``max_queue_s``, ``cpu_seconds`` (used), ``cpu_alloc_seconds``
        (allocated CPUs x duration), ``cpu_used_pct`` (used / allocated), ``gpu_alloc_seconds``,
        ``gpu_busy_seconds`` (allocated GPUs x duration x avg util), ``gpu_used_pct``,
        ``avg_gpu_util_pct`` (mean over finished GPU runs), ``peak_rss_bytes``,
        ``peak_gpu_mem_bytes``.
        """
        r, s = S.runs.c, S.summaries.c
        where = self._window(since, until)
        if queue is not None:
            where.append(r.queue == queue)
        j = S.runs.outerjoin(S.summaries, s.run_id == r.id)
        gpus = sa.func.coalesce(r.alloc_gpus, 0)
        qs = sa.case(
            (s.queue_s.is_not(None), s.queue_s),
            ((r.started_ms.is_not(None)) & (r.submitted_ms.is_not(None)), (r.started_ms - r.submitted_ms) / 1000.0),
            else_=None,
        )
        stmt = (
            sa.select(
                sa.func.count(r.id).label("runs"),
                sa.func.count(s.run_id).label("finished"),
                sa.func.sum(sa.case((r.ended_ms.is_(None), 1), else_=0)).label("running"),
                sa.func.sum(sa.case((s.wasteful == sa.true(), 1), else_=0)).label("wasteful"),
                sa.func.sum(s.duration_s).label("run_seconds"),
                sa.func.sum(qs).label("queue_seconds"),
                sa.func.avg(qs).label("avg_queue_s"),
                sa.func.max(qs).label("max_queue_s"),
                sa.func.sum(s.cpu_seconds).label("cpu_seconds"),
                sa.func.sum(r.alloc_cpus * s.duration_s).label("cpu_alloc_seconds"),
                sa.func.sum(gpus * s.duration_s).label("gpu_alloc_seconds"),
                sa.func.sum(gpus * s.duration_s * s.avg_gpu_util_pct / 100.0).label("gpu_busy_seconds"),
                sa.func.avg(sa.case((gpus > 0, s.avg_gpu_util_pct), else_=None)).label("avg_gpu_util_pct"),
                sa.func.max(s.peak_rss_bytes).label("peak_rss_bytes"),
                sa.func.max(s.peak_gpu_mem_bytes).label("peak_gpu_mem_bytes"),
            )
            .select_from(j)
            .where(*where)
        )
        state = sa.func.coalesce(s.exit_state, r.state)
        by_state_q = sa.select(state, sa.func.count()).select_from(j).where(*where).group_by(state)
        with self._read() as conn:
            m = dict(conn.execute(stmt).one()._mapping)
            by_state = {k or "UNKNOWN": int(v) for k, v in conn.execute(by_state_q)}
        out: dict[str, Any] = {"queue": queue, "since": since, "until": until}
        for k, v in m.items():
            if k in ("runs", "finished", "running", "wasteful"):
                out[k] = int(v or 0)
            elif k.startswith("peak_"):
                out[k] = int(v) if v is not None else None
            else:
                out[k] = float(v) if v is not None else None
        out["by_state"] = by_state
        ca, ga = out["cpu_alloc_seconds"], out["gpu_alloc_seconds"]
        out["cpu_used_pct"] = 100.0 * out["cpu_seconds"] / ca if ca and out["cpu_seconds"] is not None else None
        out["gpu_used_pct"] = 100.0 * out["gpu_busy_seconds"] / ga if ga and out["gpu_busy_seconds"] is not None else None
        return out

    # ------------------------------------------------------------ retention

    def purge(self, older_than_days: float | None = None) -> int:
        """Delete runs (with samples and summary) that ended more than N days ago.

        Runs that never ended are judged by their latest known time. Scheduling-history
        records last updated before the same cutoff go too (a run that never started has
        history but no run row). Defaults to ``retention_days``; returns the number of runs
        deleted (0 when both are None).
        """
        days = older_than_days if older_than_days is not None else self.retention_days
        if days is None:
            return 0
        cutoff = to_ms(_utcnow() - timedelta(days=days))
        r = S.runs.c
        last = sa.func.coalesce(r.ended_ms, r.started_ms, r.submitted_ms, r.created_ms)
        total = 0
        while True:
            with self._write() as conn:
                keys = [k for (k,) in conn.execute(sa.select(r.id).where(last < cutoff).limit(500))]
                if not keys:
                    break
                conn.execute(sa.delete(S.samples).where(S.samples.c.run_id.in_(keys)))
                conn.execute(sa.delete(S.summaries).where(S.summaries.c.run_id.in_(keys)))
                conn.execute(sa.delete(S.runs).where(r.id.in_(keys)))
                total += len(keys)
        from prefect_launch.blocks.scheduling_history import purge_history

        with self._write() as conn:
            purge_history(conn, cutoff)
        return total

    # ---------------------------------------------------------------- async

    async def aupsert_run(self, record: RunRecord) -> None:
        await asyncio.to_thread(self.upsert_run, record)

    async def arecord_samples(self, samples: Sequence[MetricSample]) -> int:
        return await asyncio.to_thread(self.record_samples, samples)

    async def awrite_summary(self, flow_run_id: str | UUID, summary: RunSummary) -> None:
        await asyncio.to_thread(self.write_summary, flow_run_id, summary)

    async def asummaries(self, **kw: Any) -> list[dict[str, Any]]:
        return await asyncio.to_thread(lambda: self.summaries(**kw))

    async def aseries(self, flow_run_id: Any, **kw: Any) -> list[dict[str, Any]]:
        return await asyncio.to_thread(lambda: self.series(flow_run_id, **kw))



# ------------------------------------------------------------------- set-up


def split_password(url: str) -> tuple[str, Optional[str]]:
    """``url`` without its password, and the password (None when it has none).

    Raises ValueError without repeating the URL (it may hold a password).
    """
    try:
        u = sa.engine.make_url(url)
    except Exception:
        raise ValueError("malformed metrics store URL: expected e.g. postgresql+psycopg://user@host:5432/db "
                         "or sqlite:///path/launch-metrics.db") from None
    if u.password is None:
        return url, None
    return u._replace(password=None).render_as_string(hide_password=False), str(u.password)


def configure_store(name: str, url: Optional[str] = None,
                    password_secret: Optional[str] = None) -> tuple["RunMetricsStore", str]:
    """Create or update the store block ``name``; returns it and ``created``/``updated``/``kept``.

    A password inside ``url`` is moved to the block's encrypted ``password`` field (the saved
    ``url`` never holds it); ``password_secret`` names a Secret block read at connect time
    instead. Given a ``url``, the password settings are this call's; given only
    ``password_secret``, the stored URL is kept. A stored URL that still holds a password is
    rewritten the same way. Raises ValueError (without any password) on bad input.
    """
    from prefect.blocks.system import Secret

    clean, password = split_password(url) if url else (None, None)
    if password is not None and password_secret:
        raise ValueError("give the store's password either inside --metrics-url or as --metrics-password-secret, "
                         "not both")
    if password_secret:
        try:
            Secret.load(password_secret, _sync=True)
        except ValueError:
            raise ValueError(f"no Secret block named {password_secret!r} for the metrics store's password; create it "
                             f"first, e.g. Secret(value='...').save({password_secret!r})") from None
    try:
        current: Optional[RunMetricsStore] = RunMetricsStore.load(name, _sync=True)
    except ValueError:
        current = None
    if current is None:
        store = RunMetricsStore(url=clean, password=password, password_secret=password_secret)
        store.save(name)
        return store, "created"
    want = {"url": current.url, "password": current.password, "password_secret": current.password_secret}
    if url:
        want = {"url": clean, "password": SecretStr(password) if password is not None else None,
                "password_secret": password_secret}
    elif password_secret:
        want.update(password=None, password_secret=password_secret)
    if want["url"]:
        stored_clean, stored_password = split_password(want["url"])
        if stored_password is not None:  # an old block with the password inside its URL
            want["url"] = stored_clean
            if want["password"] is None and not want["password_secret"]:
                want["password"] = SecretStr(stored_password)

    def plain(v: dict) -> tuple:
        pw = v["password"]
        return v["url"], pw.get_secret_value() if pw is not None else None, v["password_secret"]

    if plain(want) == plain({"url": current.url, "password": current.password,
                             "password_secret": current.password_secret}):
        return current, "kept"
    store = RunMetricsStore(retention_days=current.retention_days, **want)
    store.save(name, overwrite=True)
    return store, "updated"


__all__ += ["configure_store", "split_password"]
