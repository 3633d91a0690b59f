"""The queue monitor's run index: one SQL row per Prefect flow run, in the metrics store.

Why: Prefect can filter runs by owner and preset only through run tags, and on SQLite
a tag filter reads every run of the range; at 100k runs each aggregate request costs
~0.3 s of server time and a filter change needs several. The index keeps, per run, the
columns the monitor filters, groups and buckets by, so a filter change is a pass over
an in-memory frame instead of a round of server scans.

It is a copy that :mod:`prefect_launch.dashboard.index_sync` keeps in step with the
Prefect server (Prefect stays the source of truth): rows are built from the server's
own flow-run records, so every timestamp is the run's own. Times are epoch
microseconds, the precision Prefect stores.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Iterable, Optional, Sequence

import pandas as pd
import sqlalchemy as sa
from pydantic import BaseModel

from prefect_launch.blocks import metrics_schema as S
from prefect_launch.blocks.metrics_store import RunMetricsStore
from prefect_launch.workers.agent.tags import tag_value

# Schema v4 of the run index (occupancy): the time a run entered its queue for its latest
# scheduling, its first Pending after it, and the agent's placement label. They are part of
# the store's schema (``metrics_schema``, migration 4), which every store applies on first use.
OCCUPANCY_COLUMNS = tuple(S.run_index.c[n] for n in S.V4_COLUMNS[S.run_index.name])
T = S.run_index
COLUMNS = [c.name for c in T.columns]
# what every view filters, groups and buckets by (read for the whole range); the rest of
# the columns are read by id for the runs a view lists
CORE = ["id", "deployment_id", "queue", "owner", "preset", "state_type", "state_us", "expected_start_us", "start_us",
        "end_us", "run_time_s", "synced_ms", "queued_us", "pending_us", "placement", "cpu", "gpu"]
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
# Prefect's other state types: a run in one of them can still change. Asked for by name (IN, which the
# state_type index serves) rather than as NOT IN TERMINAL, which scans every row: ~1 s of each step of
# the monitor's clock at 1M runs
OPEN = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")
MESSAGE_CHARS = 2000  # a state message longer than this is cut (tracebacks): the index is for listing


def to_us(v: Any) -> Optional[int]:
    """ISO string / datetime -> UTC epoch microseconds (naive = UTC)."""
    if v is None or v == "":
        return None
    if isinstance(v, str):
        v = datetime.fromisoformat(v.replace("Z", "+00:00"))
    if v.tzinfo is None:
        v = v.replace(tzinfo=timezone.utc)
    delta = v - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def now_ms() -> int:
    return int(time.time() * 1000)


def _num(v: Any) -> Optional[float]:
    try:
        return float(v) if v is not None and v != "" else None
    except (TypeError, ValueError):
        return None


def migrate_4(conn: sa.engine.Connection) -> None:
    """The occupancy columns on ``launch_run_index`` (missing ones only); kept for callers of the
    time before schema v4 was registered in ``metrics_schema`` (where its migration now lives)."""
    S.add_missing_columns(conn, T, S.V4_COLUMNS[T.name])


def _state_time(state: dict) -> Optional[int]:
    """When a Scheduled state put the run in its queue: its timestamp, or its scheduled
    time when that is later (a run scheduled for later waits from then)."""
    ts = to_us(state.get("timestamp"))
    sched = to_us((state.get("state_details") or {}).get("scheduled_time"))
    return max(t for t in (ts, sched) if t is not None) if ts is not None or sched is not None else None


class IndexRow(BaseModel):
    """What the monitor needs of one flow run (see the ``launch_run_index`` table)."""

    id: str
    name: Optional[str] = None
    deployment_id: Optional[str] = None
    queue: Optional[str] = None
    priority: Optional[str] = None
    owner: Optional[str] = None
    preset: Optional[str] = None
    state_type: str = "SCHEDULED"
    state_name: Optional[str] = None
    state_us: Optional[int] = None
    expected_start_us: Optional[int] = None
    start_us: Optional[int] = None
    end_us: Optional[int] = None
    run_time_s: float = 0.0
    message: Optional[str] = None
    waiting: Optional[str] = None
    cpu: Optional[float] = None
    memory: Optional[str] = None
    gpu: Optional[float] = None
    launched: bool = False
    queued_us: Optional[int] = None
    pending_us: Optional[int] = None
    placement: Optional[str] = None
    launched_by: Optional[str] = None  # v10: the admin or agent who launched it for its owner (the gateway's tag)

    @classmethod
    def from_flow_run(cls, r: dict) -> "IndexRow":
        """From the JSON of ``POST /flow_runs/filter`` (the server's own record)."""
        tags = r.get("tags") or []
        jv = r.get("job_variables") or {}
        state = r.get("state") or {}
        msg = state.get("message") or None
        stype = r.get("state_type") or state.get("type") or "SCHEDULED"
        started = r.get("start_time") is not None
        # what the current state tells of the queue phases (the sync adds what events tell)
        queued_us = _state_time(state) if stype == "SCHEDULED" and not started else None
        pending_us = to_us(state.get("timestamp")) if stype == "PENDING" and not started else None
        return cls(
            id=str(r["id"]), name=r.get("name"), deployment_id=r.get("deployment_id"), queue=r.get("work_pool_name"),
            priority=r.get("work_queue_name"), owner=tag_value(tags, "owner"),
            preset=tag_value(tags, "preset") or (str(jv["preset"]) if jv.get("preset") else None),
            state_type=r.get("state_type") or state.get("type") or "SCHEDULED", state_name=r.get("state_name") or state.get("name"),
            state_us=to_us(state.get("timestamp") or r.get("state_timestamp")), expected_start_us=to_us(r.get("expected_start_time")),
            start_us=to_us(r.get("start_time")), end_us=to_us(r.get("end_time")), run_time_s=float(r.get("total_run_time") or 0.0),
            message=msg[:MESSAGE_CHARS] if msg else None, waiting=(r.get("labels") or {}).get("launch.waiting") or None,
            cpu=_num(jv.get("cpu")), memory=str(jv["memory"]) if jv.get("memory") is not None else None, gpu=_num(jv.get("gpu")),
            launched="launch" in tags, queued_us=queued_us, pending_us=pending_us,
            placement=(r.get("labels") or {}).get("launch.placement") or None,
            launched_by=tag_value(tags, "launched_by"),
        )

    def merged(self, held: Optional["IndexRow"], scheduled_us: Sequence[int] = (), pending_us: Sequence[int] = ()) -> "IndexRow":
        """This fresh row with the queue phases that the row ``held`` before and the state
        entries seen in Prefect's events (``scheduled_us``: entries into a Scheduled-type
        state, ``pending_us``: into a Pending-type one) add.

        queued_us = the latest scheduling before the run first left its queue (a flow
        retry after it started happens inside the process that holds its slot and does not
        re-queue it); pending_us = the first Pending at or after that.
        """
        start = self.start_us
        held_q = held.queued_us if held is not None else None
        # a scheduling's own time is known from the record (while it is the current state)
        # and, as its timestamp, from its event; the first one's scheduled time is the
        # run's expected start (a run submitted for later waits from then)
        sched = [t for t in (*scheduled_us, held_q, self.queued_us, self.expected_start_us)
                 if t is not None and (start is None or t <= start)]
        q = max(sched) if sched else None
        base = q if q is not None else self.expected_start_us
        pend = [t for t in [*pending_us, self.pending_us, held.pending_us if held is not None else None]
                if t is not None and (base is None or t >= base) and (start is None or t <= start)]
        return self.model_copy(update=dict(queued_us=q, pending_us=min(pend) if pend else None,
                                           placement=self.placement or (held.placement if held is not None else None)))


class IndexMeta(BaseModel):
    """How far the index covers one Prefect server, and where its sync left off."""

    api_url: str  # the URL it was last built or synced through
    server_id: Optional[str] = None  # the server's identity (dashboard.api.Api.server_id); None: written before v8
    covered_since_ms: Optional[int] = None
    events_cursor_ms: Optional[int] = None
    last_sync_ms: Optional[int] = None


class RunIndex:
    """Reads and writes the run index in a :class:`RunMetricsStore`'s database."""

    def __init__(self, store: RunMetricsStore) -> None:
        self.store = store  # the store's engine brings its schema (v4 included) up to date on first use

    def key(self) -> str:
        return self.store.resolved_url()

    # ------------------------------------------------------------------ meta

    def meta(self, server_id: str, api_url: Optional[str] = None) -> Optional[IndexMeta]:
        """The index's meta for the server ``server_id``, or None (not built for it). A row written
        before the store knew server identities (v8) is this server's when it names ``api_url``: it is
        adopted (the index is not built again)."""
        m = S.index_meta.c
        mine = m.server_id == server_id
        if api_url:
            mine = sa.or_(mine, sa.and_(m.api_url == api_url, m.server_id.is_(None)))
        with self.store._read() as conn:  # one read each view; a write only the once a row is adopted
            row = conn.execute(sa.select(S.index_meta).where(mine)).mappings().first()
        if row is not None and row["server_id"] is None:
            with self.store._write() as conn:
                conn.execute(sa.update(S.index_meta).where(m.api_url == row["api_url"], m.server_id.is_(None))
                             .values(server_id=server_id))
            row = dict(row, server_id=server_id)
        return IndexMeta(**row) if row else None

    def set_meta(self, meta: IndexMeta) -> None:
        m = S.index_meta.c
        with self.store._write() as conn:
            cond = m.api_url == meta.api_url
            if meta.server_id:
                cond = sa.or_(cond, m.server_id == meta.server_id)
            conn.execute(S.index_meta.delete().where(cond))
            conn.execute(S.index_meta.insert().values(**meta.model_dump()))

    def reset(self, server_id: str, api_url: str) -> None:
        """Forget every row and cursor: the index now follows the server ``server_id``, read through
        ``api_url`` (one server per store)."""
        with self.store._write() as conn:
            conn.execute(T.delete())
            conn.execute(S.index_meta.delete())
            conn.execute(S.index_meta.insert().values(api_url=api_url, server_id=server_id))

    # ------------------------------------------------------------------ rows

    def upsert(self, rows: Sequence[IndexRow], synced_ms: Optional[int] = None) -> int:
        """Insert or replace rows by flow-run id; returns how many were written."""
        if not rows:
            return 0
        synced_ms = synced_ms or now_ms()
        values = [dict(r.model_dump(), synced_ms=synced_ms) for r in {r.id: r for r in rows}.values()]
        with self.store._write() as conn:
            dialect = conn.dialect.name
            if dialect == "sqlite":
                from sqlalchemy.dialects.sqlite import insert
            elif dialect == "postgresql":
                from sqlalchemy.dialects.postgresql import insert
            else:  # pragma: no cover - the store supports SQLite and PostgreSQL
                raise RuntimeError(f"run index: unsupported database {dialect}")
            for i in range(0, len(values), 2000):
                stmt = insert(T)
                stmt = stmt.on_conflict_do_update(index_elements=[T.c.id],
                                                  set_={c: stmt.excluded[c] for c in COLUMNS if c != "id"})
                conn.execute(stmt, values[i : i + 2000])
        return len(values)

    def open_ids_by_type(self) -> dict[str, list[str]]:
        """Runs not in a terminal state (their state can still change), by the state type the index
        holds for them."""
        out: dict[str, list[str]] = {}
        with self.store._read() as conn:
            for rid, stype in conn.execute(sa.select(T.c.id, T.c.state_type).where(T.c.state_type.in_(OPEN))):
                out.setdefault(stype, []).append(rid)
        return out

    def count(self) -> int:
        with self.store._read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(T)).scalar() or 0)

    def frame(self, since_us: Optional[int] = None, synced_after_ms: Optional[int] = None,
              ids: Optional[Iterable[str]] = None, columns: Sequence[str] = COLUMNS) -> pd.DataFrame:
        """Rows as a frame: runs expected from ``since_us`` on, and/or rows written after
        ``synced_after_ms`` (an incremental read), and/or the runs ``ids``.

        Read through the driver's cursor: 100k rows as SQLAlchemy ``Row`` objects cost
        pandas several times more to take apart than plain tuples.
        """
        q = sa.select(*[T.c[c] for c in columns])
        if since_us is not None:
            q = q.where(T.c.expected_start_us >= since_us)
        if synced_after_ms is not None:
            q = q.where(T.c.synced_ms > synced_after_ms)
        queries = [q]
        if ids is not None:  # in chunks: databases cap the number of bound parameters
            ids = list(ids)
            queries = [q.where(T.c.id.in_(ids[i : i + 900])) for i in range(0, len(ids), 900)]
        rows: list = []
        with self.store._read() as conn:
            cur = conn.connection.dbapi_connection.cursor()
            try:
                for one in queries:
                    c = one.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
                    params = c.params if conn.dialect.paramstyle not in ("qmark", "numeric", "format") else None
                    if params is None:
                        cur.execute(str(c), tuple(c.params[k] for k in c.positiontup))
                    else:
                        cur.execute(str(c), params)
                    rows.extend(cur.fetchall())
            finally:
                cur.close()
        return pd.DataFrame.from_records(rows, columns=list(columns))

    def delete(self, ids: Sequence[str]) -> int:
        with self.store._write() as conn:
            return sum(conn.execute(T.delete().where(T.c.id.in_(list(ids[i : i + 900])))).rowcount or 0
                       for i in range(0, len(ids), 900))

    def purge(self, before_us: int) -> int:
        """Delete finished runs expected before ``before_us`` (open runs are kept)."""
        with self.store._write() as conn:
            return conn.execute(T.delete().where(T.c.expected_start_us < before_us, T.c.state_type.in_(TERMINAL))).rowcount or 0
