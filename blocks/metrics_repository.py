"""The run-metrics store's reads and writes: runs, samples and summaries in its SQL tables.

:class:`MetricsRepository` is what the :class:`~prefect_launch.blocks.metrics_store.RunMetricsStore`
block does with its connection; the block mixes it in and gives it ``resolved_url()`` and
``retention_days``. The tables are :mod:`prefect_launch.blocks.metrics_schema` (created and
upgraded on an engine's first use, :mod:`prefect_launch.blocks.metrics_engines`), the records
:mod:`prefect_launch.blocks.metrics_records`.

Typical use::

    store = RunMetricsStore.load("default")          # or RunMetricsStore()
    store.upsert_run(RunRecord(flow_run_id=..., queue="gpu", gpu=1, ...))
    store.record_samples([MetricSample(flow_run_id=..., ts=..., cpu_pct=98.0)])
    store.write_summary(flow_run_id, summary)
    rows = store.summaries(queue="gpu", since=week_ago)   # list[dict], pandas.DataFrame(rows)
    pts = store.series(flow_run_id, max_points=200)        # list[dict]

All methods are synchronous and thread-safe (engines are cached per URL and pooled).
Times are timezone-aware UTC ``datetime`` in and out; they are stored as integer epoch
milliseconds.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Iterator, Optional, Sequence
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.metrics_engines import engine_for
from prefect_launch.blocks.metrics_records import MetricSample, RunRecord, RunSummary, id_str

__all__ = ["MetricsRepository", "to_ms", "from_ms"]

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


# ---------------------------------------------------------------- repository


class MetricsRepository:
    """The store's SQL reads and writes; mixed into the block, which gives ``resolved_url()`` and ``retention_days``."""

    def resolved_url(self) -> str:  # pragma: no cover - the block's
        raise NotImplementedError

    # ------------------------------------------------------------ connection

    @property
    def engine(self) -> Engine:
        """The cached engine for this URL; creates/upgrades the schema on first use."""
        return engine_for(self.resolved_url())

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
            row = conn.execute(sa.select(S.runs).where(S.runs.c.flow_run_id == id_str(flow_run_id))).first()
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
        ids = [id_str(flow_run_id)] if isinstance(flow_run_id, (str, UUID)) else [id_str(x) for x in flow_run_id]
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
        fid = id_str(flow_run_id)
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
                id_chunks = list(_chunks([id_str(x) for x in flow_run_ids], 500))
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

    # ------------------------------------------------------------ retention

    def purge(self, older_than_days: float | None = None) -> int:
        """Delete runs (with samples and summary) that ended more than N days ago.

        Runs that never ended are judged by their latest known time. Scheduling-history
        records last updated before the same cutoff go too (a run that never started has
        history but no run row). Defaults to ``retention_days``; returns the number of runs
        deleted (0 when both are None).
        """
        days = older_than_days if older_than_days is not None else self.retention_days  # the block's field
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
