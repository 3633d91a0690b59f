"""Scheduling history: every decision an agent makes about a launch run, as rows in the metrics store.

Backend.AI's ``session_scheduling_history`` answers "why is it still pending?": one record per
decision with phase (``schedule``, ``check_precondition``, ``build`` (a job environment), ``start``, ``check_timeout``,
``idle_check``, ``terminate``), result (``SUCCESS``, ``NEED_RETRY``, ``SKIPPED``, ``GIVE_UP``,
``EXPIRED``, ``FAILURE``), from/to state, error code, message, sub-steps and ``attempts``.

The merge rule keeps the table small although the agent re-plans every ~2 s: a decision with
the same phase, result and error code as the run's latest record is folded into that record
(``attempts`` goes up, ``updated`` moves on, message/sub-steps/to-state become the newest);
anything else starts a new record. :class:`HistoryWriter` applies the same rule in memory first
and writes batches from a background thread, so planning never waits on SQL and a store outage
only buffers (bounded; overflow is counted as lost), never raises into the agent.

Use::

    record(store, SchedulingRecord(run_id=rid, phase="schedule", result="NEED_RETRY", ...))
    rows = read_history(store, rid, phase="schedule", result="NEED_RETRY")
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from datetime import datetime, timezone
from typing import Any, Literal, Optional, Sequence, Union
from uuid import UUID

import sqlalchemy as sa
from pydantic import BaseModel, Field, field_validator

from prefect_launch.blocks import metrics_schema as S

__all__ = ["PHASES", "RESULTS", "SubStep", "SchedulingRecord", "record", "record_many", "read_history",
           "purge_history", "HistoryWriter", "merge_key"]

log = logging.getLogger("prefect_launch.scheduling_history")

PHASES = ("schedule", "check_precondition", "build", "start", "check_timeout", "idle_check", "terminate")
RESULTS = ("SUCCESS", "NEED_RETRY", "SKIPPED", "GIVE_UP", "EXPIRED", "FAILURE")
Phase = Literal["schedule", "check_precondition", "build", "start", "check_timeout", "idle_check", "terminate"]
Result = Literal["SUCCESS", "NEED_RETRY", "SKIPPED", "GIVE_UP", "EXPIRED", "FAILURE"]
SubStepName = Literal["sequencing", "validation", "capacity_check", "allocation", "signal", "release"]


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _ms(dt: datetime) -> int:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(round(dt.timestamp() * 1000))


def _dt(ms: Optional[int]) -> Optional[datetime]:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


class SubStep(BaseModel):
    """One step of a decision (sequencing, validation, capacity check, allocation) with its own outcome."""

    step: SubStepName
    result: Result
    message: Optional[str] = None
    error_code: Optional[str] = None
    started: Optional[datetime] = None
    ended: Optional[datetime] = None
    # sequencing only: the run's 1-based place in the cycle's plan, so readers need not parse the message
    position: Optional[int] = None


class SchedulingRecord(BaseModel):
    """One (possibly merged) decision about one run; ``id`` is None until stored."""

    id: Optional[int] = None
    run_id: str
    phase: Phase
    result: Result
    from_state: Optional[str] = None
    to_state: Optional[str] = None
    error_code: Optional[str] = None
    message: Optional[str] = None
    attempts: int = Field(1, ge=1)
    created: datetime = Field(default_factory=_now)
    updated: Optional[datetime] = None  # None: same as created
    sub_steps: list[SubStep] = Field(default_factory=list)

    @field_validator("run_id", mode="before")
    @classmethod
    def _run_id(cls, v: Any) -> Any:
        return str(v) if isinstance(v, UUID) else v

    def model_post_init(self, _ctx: Any) -> None:
        if self.updated is None:
            self.updated = self.created

    @property
    def key(self) -> tuple[str, str, Optional[str]]:
        return merge_key(self)


def merge_key(rec: SchedulingRecord) -> tuple[str, str, Optional[str]]:
    """What must repeat for two decisions to be one record: phase, result and error code."""
    return rec.phase, rec.result, rec.error_code


def merged(into: SchedulingRecord, new: SchedulingRecord) -> SchedulingRecord:
    """``into`` with ``new`` folded in (same key): attempts add up, the newest detail wins."""
    return into.model_copy(update={
        "attempts": into.attempts + new.attempts, "updated": max(into.updated, new.updated),
        "message": new.message, "sub_steps": new.sub_steps, "to_state": new.to_state or into.to_state,
        "from_state": into.from_state or new.from_state,
    })


# -------------------------------------------------------------------- rows

def _steps_json(steps: list[SubStep]) -> Optional[str]:
    return json.dumps([s.model_dump(mode="json", exclude_none=True) for s in steps]) if steps else None


def _row_values(rec: SchedulingRecord) -> dict[str, Any]:
    return {"flow_run_id": rec.run_id, "phase": rec.phase, "result": rec.result, "from_state": rec.from_state,
            "to_state": rec.to_state, "error_code": rec.error_code, "message": rec.message,
            "attempts": rec.attempts, "created_ms": _ms(rec.created), "updated_ms": _ms(rec.updated),
            "sub_steps": _steps_json(rec.sub_steps)}


def _from_row(m: Any) -> SchedulingRecord:
    return SchedulingRecord(
        id=m["id"], run_id=m["flow_run_id"], phase=m["phase"], result=m["result"], from_state=m["from_state"],
        to_state=m["to_state"], error_code=m["error_code"], message=m["message"], attempts=m["attempts"],
        created=_dt(m["created_ms"]), updated=_dt(m["updated_ms"]),
        sub_steps=[SubStep.model_validate(s) for s in json.loads(m["sub_steps"])] if m["sub_steps"] else [],
    )


def _apply(conn: Any, recs: Sequence[SchedulingRecord]) -> list[SchedulingRecord]:
    """Write ``recs`` (oldest first) with the merge rule, inside the caller's write transaction."""
    h = S.scheduling_history
    run_ids = list(dict.fromkeys(r.run_id for r in recs))
    latest: dict[str, SchedulingRecord] = {}
    for i in range(0, len(run_ids), 500):
        newest = (sa.select(sa.func.max(h.c.id)).where(h.c.flow_run_id.in_(run_ids[i:i + 500]))
                  .group_by(h.c.flow_run_id))
        for row in conn.execute(sa.select(h).where(h.c.id.in_(newest))):
            latest[row._mapping["flow_run_id"]] = _from_row(row._mapping)
    out = []
    for rec in recs:
        last = latest.get(rec.run_id)
        if last is not None and last.key == rec.key:
            rec = merged(last, rec)
            conn.execute(h.update().where(h.c.id == last.id).values(
                attempts=h.c.attempts + (rec.attempts - last.attempts), updated_ms=_ms(rec.updated),
                message=rec.message, to_state=rec.to_state, from_state=rec.from_state,
                sub_steps=_steps_json(rec.sub_steps)))
        else:
            values = _row_values(rec)
            new_id = conn.execute(h.insert().values(**values)).inserted_primary_key[0]
            rec = rec.model_copy(update={"id": int(new_id)})
        latest[rec.run_id] = rec
        out.append(rec)
    return out


def record_many(store: Any, recs: Sequence[SchedulingRecord]) -> list[SchedulingRecord]:
    """Store decisions (oldest first) in one transaction, merging repeats; returns them as stored."""
    if not recs:
        return []
    with store._write() as conn:
        return _apply(conn, list(recs))


def record(store: Any, rec: Optional[SchedulingRecord] = None, **fields: Any) -> SchedulingRecord:
    """Store one decision (a :class:`SchedulingRecord` or its fields), merging a repeat into the latest."""
    rec = rec if rec is not None else SchedulingRecord(**fields)
    return record_many(store, [rec])[0]


def _as_list(v: Union[str, Sequence[str], None]) -> Optional[list[str]]:
    if v is None:
        return None
    return [v] if isinstance(v, str) else list(v)


def read_history(store: Any, run_id: Union[str, UUID, Sequence[Union[str, UUID]], None],
                 phase: Union[str, Sequence[str], None] = None, result: Union[str, Sequence[str], None] = None,
                 error_code: Union[str, Sequence[str], None] = None, since: Optional[datetime] = None,
                 until: Optional[datetime] = None, sort: str = "created",
                 limit: Optional[int] = None) -> list[SchedulingRecord]:
    """A run's records (or several runs', or all with ``run_id=None``), oldest first by ``sort``.

    Filters take one value or several. ``since``/``until`` keep the records whose span
    ``[created, updated]`` overlaps ``[since, until)``. ``sort``: ``created`` or ``updated``.
    """
    if sort not in ("created", "updated"):
        raise ValueError(f"sort must be 'created' or 'updated', got {sort!r}")
    h = S.scheduling_history.c
    where = []
    if run_id is not None:
        ids = [str(run_id)] if isinstance(run_id, (str, UUID)) else [str(x) for x in run_id]
        where.append(h.flow_run_id.in_(ids))
    for col, val in ((h.phase, phase), (h.result, result), (h.error_code, error_code)):
        vals = _as_list(val)
        if vals is not None:
            where.append(col.in_(vals))
    if since is not None:
        where.append(h.updated_ms >= _ms(since))
    if until is not None:
        where.append(h.created_ms < _ms(until))
    order = (h.created_ms, h.id) if sort == "created" else (h.updated_ms, h.id)
    stmt = sa.select(S.scheduling_history).where(*where).order_by(*order)
    if limit:
        stmt = stmt.limit(limit)
    with store._read() as conn:
        return [_from_row(r._mapping) for r in conn.execute(stmt)]


def purge_history(conn: Any, cutoff_ms: int) -> int:
    """Delete records last updated before ``cutoff_ms`` (the store's retention); returns how many."""
    h = S.scheduling_history
    res = conn.execute(sa.delete(h).where(h.c.updated_ms < cutoff_ms))
    return int(res.rowcount or 0)


# ------------------------------------------------------------------ writer

class HistoryWriter:
    """The agent's side: ``note`` returns at once; a daemon thread stores batches every ``flush_s``.

    Repeats are merged in memory (only with the run's last pending record, as in the store), so
    a run that waits for an hour costs one row and one UPDATE per flush, not one INSERT per plan.
    While the store is unreachable, records wait in a buffer of ``max_buffer`` (oldest dropped
    and counted in ``lost``) and the writer retries with exponential backoff.
    """

    def __init__(self, store: Any, flush_s: float = 1.0, max_buffer: int = 10_000,
                 retry_backoff_s: tuple[float, float] = (1.0, 60.0), logger: Any = None):
        self.store = store
        self.flush_s = flush_s
        self.max_buffer = max_buffer
        self.retry_backoff_s = retry_backoff_s
        self.log = logger or log
        self.lost = 0
        self.stored = 0
        self.failures = 0
        self._pending: deque[SchedulingRecord] = deque()
        self._last: dict[str, SchedulingRecord] = {}  # run -> its last pending record (merge target)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: Optional[threading.Thread] = None

    def note(self, rec: SchedulingRecord) -> None:
        """Queue a decision; never blocks on the store, never raises."""
        if self.store is None:
            return
        try:
            with self._lock:
                last = self._last.get(rec.run_id)
                if last is not None and last.key == rec.key:
                    i = self._index_of(last)
                    if i is not None:
                        self._pending[i] = self._last[rec.run_id] = merged(last, rec)
                        return
                if len(self._pending) >= self.max_buffer:
                    dropped = self._pending.popleft()
                    if self._last.get(dropped.run_id) is dropped:
                        del self._last[dropped.run_id]
                    self.lost += 1
                    if self.lost == 1 or self.lost % 100 == 0:
                        self.log.warning("scheduling history buffer full (store unreachable): %d records lost",
                                         self.lost)
                self._pending.append(rec)
                self._last[rec.run_id] = rec
                self._idle.clear()
            self._ensure_thread()
        except Exception as exc:  # pragma: no cover - history must never break dispatch
            self.log.debug("could not queue a scheduling-history record: %s", exc)

    def _index_of(self, rec: SchedulingRecord) -> Optional[int]:
        for i in range(len(self._pending) - 1, -1, -1):
            if self._pending[i] is rec:
                return i
        return None

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="launch-history-writer", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        retry_at = 0.0
        while not self._closed.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if time.monotonic() < retry_at:
                continue
            retry_at = 0.0 if self.flush_once() else time.monotonic() + self._backoff()

    def _backoff(self) -> float:
        lo, hi = self.retry_backoff_s
        return min(hi, lo * 2 ** min(self.failures - 1, 20))

    def flush_once(self) -> bool:
        """Store what is pending (one transaction); False when the store failed (records kept)."""
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
            self._last.clear()
        if not batch:
            self._idle.set()
            return True
        try:
            record_many(self.store, batch)
        except Exception as exc:
            self.failures += 1
            with self._lock:  # put them back in front, newest pending ones keep their order after
                keep = batch + list(self._pending)
                over = max(0, len(keep) - self.max_buffer)
                self.lost += over
                self._pending = deque(keep[over:])
                self._last = {r.run_id: r for r in self._pending}
            if self.failures == 1 or self.failures % 10 == 0:
                self.log.warning("scheduling history: store write failed (attempt %d, %d records buffered, "
                                 "%d lost): %s", self.failures, len(self._pending), self.lost,
                                 str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            return False
        if self.failures:
            self.log.info("scheduling history: store reachable again after %d failed attempts", self.failures)
        self.failures = 0
        self.stored += len(batch)
        with self._lock:
            if not self._pending:
                self._idle.set()
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Ask for a write now and wait (bounded) until nothing is pending; True when all was stored."""
        if self.store is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            if self._thread is None or not self._thread.is_alive():
                self.flush_once()
            else:
                self._wake.set()
            self._idle.wait(min(0.2, max(0.0, deadline - time.monotonic())))
        with self._lock:
            return not self._pending

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is left (bounded), then stop the thread; what could not be stored is counted lost."""
        self.flush(timeout)
        self._closed.set()
        self._wake.set()
        with self._lock:
            if self._pending:
                self.lost += len(self._pending)
                self.log.warning("scheduling history: %d records not stored at shutdown (store unreachable)",
                                 len(self._pending))
                self._pending.clear()
                self._last.clear()

