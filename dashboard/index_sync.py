"""Keeps the run index (:mod:`prefect_launch.blocks.run_index`) in step with a Prefect server.

Rows are always the server's own flow-run records (``POST /flow_runs/filter``); the
sync only decides *which* runs to read again:

* a **build** reads every run expected after ``now - LAUNCH_INDEX_DAYS`` once (keyset
  pages of 200, the API's cap, in parallel time slices) and records that coverage;
* a **sync** (before each view, at most every ``MIN_SYNC_S``) reads
  - runs whose state changed: the ids of Prefect's ``prefect.flow-run.*`` events since
    the last sync (``POST /events/filter``; read ``EVENTS_OVERLAP_S`` back again,
    because the server persists events in batches),
  - runs the index holds as not finished (their state can change at any moment; this
    keeps "now" exact even before the events are persisted, and catches what no event
    tells: labels, deletions). The service *checks* them at most every ``OPEN_REREAD_S``
    (a step of the page's clock: no figure promises less): it asks the server only for
    those whose state type is no longer the one the index holds, and how many still exist
    (reading them all when one is gone); it reads them all at most every
    ``OPEN_FULL_REREAD_S`` (what a check cannot see: a label, a state renamed within its
    type). At 100k runs with 630 running, a check costs the server 0.06 s of CPU against
    0.5 s for the full read. Between those it relies on the events,
  - runs expected from the last sync minus ``NEW_RUN_SLACK_S`` to as far ahead of now
    (new submissions, seen at once rather than when their events are persisted).
  After a longer gap than ``EVENTS_MAX_GAP_S`` it re-reads every run expected since
  the gap began instead of paging through the events.

:class:`IndexService` is the process-wide entry point the view assembly (:mod:`.view`) uses:
it builds in the background, syncs, and holds the prepared rows (:mod:`.index_view`) in
memory between views.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import pandas as pd
from pydantic import BaseModel

from prefect_launch.blocks.run_index import CORE, IndexMeta, IndexRow, RunIndex, now_ms, to_us
from prefect_launch.dashboard import index_view as IV
from prefect_launch.dashboard.api import PAGE, fan_out, fetch_runs_by_id
from prefect_launch.dashboard.spec import PAGE_STEP_S, iso, us

log = logging.getLogger("prefect_launch.dashboard.index")
UTC = dt.timezone.utc
EVENTS_OVERLAP_S = 30.0
EVENTS_MAX_GAP_S = 3600.0
EVENTS_MAX_PAGES = 40  # 50 events a page; past this, re-reading the runs themselves is cheaper
NEW_RUN_SLACK_S = 300.0
MIN_SYNC_S = 2.0
OPEN_REREAD_S = float(PAGE_STEP_S)
OPEN_FULL_REREAD_S = 6 * float(PAGE_STEP_S)
ID_RECHECK_S = float(PAGE_STEP_S)  # no index under the held server id: read the id again at most this often
COUNT_IDS = 1000  # ids a count request names
READ_OVERLAP_MS = 5000
BUILD_SLICES = 4
_IO = ThreadPoolExecutor(max_workers=BUILD_SLICES + 2, thread_name_prefix="index-io")


def index_days() -> float:
    return float(os.environ.get("LAUNCH_INDEX_DAYS", "30"))


class SyncResult(BaseModel):
    """What one sync or build read and wrote."""

    runs_read: int = 0
    rows_written: int = 0
    events: int = 0
    mode: str = "events"  # events | catch-up | build
    took_s: float = 0.0
    deleted: list[str] = []  # runs gone from the server, dropped from the index


# ------------------------------------------------------------------ API reads


def read_runs_expected(api: Any, since: dt.datetime, until: Optional[dt.datetime] = None) -> Iterator[list[dict]]:
    """Every run expected in [since, until] (until None: no upper bound), newest first,
    in pages; keyset paging on expected start, with an offset walk through a timestamp
    that more than a page of runs share."""
    seen: set[str] = set()
    before = iso(until) if until else None

    def page(after: str, before_: Optional[str], offset: int = 0) -> tuple[list[dict], list[dict]]:
        """(the page, its runs not seen before)."""
        t: dict = {"after_": after}
        if before_:
            t["before_"] = before_
        got = api.post("/flow_runs/filter", {"flow_runs": {"expected_start_time": t}, "sort": "EXPECTED_START_TIME_DESC",
                                             "limit": PAGE, "offset": offset})
        new = [r for r in got if r["id"] not in seen]
        seen.update(r["id"] for r in got)
        return got, new

    after = iso(since)
    while True:
        got, new = page(after, before)
        if new:
            yield new
        if len(got) < PAGE:
            return
        last = got[-1]["expected_start_time"]
        if not new:  # a page of runs all at `last`: walk that instant by offset, then go below it
            off = 0
            while True:
                tie, fresh = page(last, last, off)
                if fresh:
                    yield fresh
                if len(tie) < PAGE:
                    break
                off += PAGE
            last = iso(dt.datetime.fromisoformat(last.replace("Z", "+00:00")) - dt.timedelta(microseconds=1))
        before = last


class StateEntries(BaseModel):
    """Per flow run, when it entered Scheduled- and Pending-type states (from events)."""

    scheduled: dict[str, list[int]] = {}
    pending: dict[str, list[int]] = {}

    def add(self, event: dict) -> None:
        res = event.get("resource") or {}
        rid = res.get("prefect.resource.id", "")[len("prefect.flow-run."):]
        kind = {"SCHEDULED": self.scheduled, "PENDING": self.pending}.get(res.get("prefect.state-type") or "")
        at = to_us(res.get("prefect.state-timestamp") or event.get("occurred"))
        if kind is not None and rid and at is not None:
            kind.setdefault(rid, []).append(at)


def changed_run_ids(api: Any, since: dt.datetime, until: dt.datetime,
                    entries: Optional[StateEntries] = None) -> Optional[tuple[set[str], int]]:
    """(flow-run ids, events read) of ``prefect.flow-run.*`` events that occurred in
    [since, until]; None when there are more than ``EVENTS_MAX_PAGES`` pages of them.
    ``entries`` collects the runs' Scheduled / Pending entry times on the way."""
    body = {"filter": {"occurred": {"since": iso(since), "until": iso(until)}, "event": {"prefix": ["prefect.flow-run."]},
                       "order": "ASC"}, "limit": 50}
    res = api.post("/events/filter", body)
    ids: set[str] = set()
    n, pages = 0, 0
    while True:
        for e in res.get("events") or []:
            rid = (e.get("resource") or {}).get("prefect.resource.id", "")
            if rid.startswith("prefect.flow-run."):
                ids.add(rid[len("prefect.flow-run."):])
                if entries is not None:
                    entries.add(e)
            n += 1
        nxt = res.get("next_page")
        pages += 1
        if not nxt:
            return ids, n
        if pages >= EVENTS_MAX_PAGES:
            return None
        r = api.http.get(nxt)
        r.raise_for_status()
        res = r.json()


# ----------------------------------------------------------------- build / sync


def build(index: RunIndex, api: Any, days: Optional[float] = None, progress: Optional[Callable[[int], None]] = None) -> SyncResult:
    """Read every run expected in the last ``days`` (and later) into a fresh index."""
    t0 = time.perf_counter()
    start = dt.datetime.now(UTC)
    since = start - dt.timedelta(days=days if days is not None else index_days())
    index.reset(api.server_id(), api.api_url)
    # time slices read in parallel: the last one open-ended (runs scheduled in the future)
    edges = [since + (start - since) * k / BUILD_SLICES for k in range(BUILD_SLICES + 1)]
    slices = [(edges[k], edges[k + 1] - dt.timedelta(microseconds=1) if k < BUILD_SLICES - 1 else None) for k in range(BUILD_SLICES)]
    lock = threading.Lock()
    totals = {"read": 0, "written": 0}

    def one(sl: tuple) -> None:
        buf: list[IndexRow] = []
        for page in read_runs_expected(api, sl[0], sl[1]):
            buf.extend(IndexRow.from_flow_run(r).merged(None) for r in page)
            with lock:
                totals["read"] += len(page)
                if progress:
                    progress(totals["read"])
            if len(buf) >= 5000:
                w = index.upsert(buf)
                buf = []
                with lock:
                    totals["written"] += w
        w = index.upsert(buf)
        with lock:
            totals["written"] += w

    for f in [_IO.submit(one, sl) for sl in slices]:
        f.result()
    # changes made while the build read are picked up by the sync that follows (events since start)
    cursor = int(start.timestamp() * 1000)
    index.set_meta(IndexMeta(api_url=api.api_url, server_id=api.server_id(), covered_since_ms=int(since.timestamp() * 1000), events_cursor_ms=cursor,
                             last_sync_ms=cursor))
    res = sync(index, api)
    return SyncResult(runs_read=totals["read"] + res.runs_read, rows_written=totals["written"] + res.rows_written, events=res.events,
                      mode="build", took_s=time.perf_counter() - t0)


def changed_open_runs(api: Any, by_type: dict[str, list[str]]) -> tuple[list[dict], bool]:
    """Of the open runs (ids by the state type the index holds), the server's records of those
    whose state type is now another, and whether every one of them still exists."""
    moved = [r for t, ids in by_type.items() for r in fetch_runs_by_id(api, ids, {"state": {"type": {"not_any_": [t]}}})]
    every = [i for ids in by_type.values() for i in ids]
    counts = [every[i:i + COUNT_IDS] for i in range(0, len(every), COUNT_IDS)]
    found = fan_out(lambda c: int(api.post("/flow_runs/count", {"flow_runs": {"id": {"any_": c}}})), counts)
    return moved, sum(found) == len(every)


def sync(index: RunIndex, api: Any, now: Optional[dt.datetime] = None, open_runs: bool | str = True) -> SyncResult:
    """Bring a built index up to date (see the module docstring for what is read). ``open_runs``:
    True reads the runs not yet finished again; ``"check"`` reads only those whose state type
    changed (all of them when one was deleted); False reads them only where an event names them
    (all of them when the events cannot be read)."""
    t0 = time.perf_counter()
    now = now or dt.datetime.now(UTC)
    meta = index.meta(api.server_id(), api.api_url)
    if meta is None or meta.covered_since_ms is None:
        raise RuntimeError("the run index is not built for this server: run `prefect-launch monitor index`")
    cursor = dt.datetime.fromtimestamp((meta.events_cursor_ms or meta.last_sync_ms or 0) / 1000, UTC)
    last = dt.datetime.fromtimestamp((meta.last_sync_ms or 0) / 1000, UTC)
    gap = (now - cursor).total_seconds()
    f_open = _IO.submit(index.open_ids_by_type) if open_runs else None  # read beside the events
    events = None
    entries = StateEntries()
    if gap <= EVENTS_MAX_GAP_S:
        events = changed_run_ids(api, cursor - dt.timedelta(seconds=EVENTS_OVERLAP_S), now + dt.timedelta(seconds=60), entries)
    mode = "events" if events is not None else "catch-up"
    if events is None and open_runs is not True:  # no events to rely on: the open runs are read after all
        f_open, open_runs = f_open or _IO.submit(index.open_ids_by_type), True
    checked, open_ids = _open_runs(api, f_open.result(), open_runs) if f_open is not None else ([], set())
    slack = dt.timedelta(seconds=NEW_RUN_SLACK_S)
    # new runs due about now (events reveal runs scheduled further ahead, e.g. by deployment
    # schedules, without reading all of those on every sync); after a gap, everything since
    new_since, new_until = (last - slack, now + slack) if events is not None else (cursor - slack, None)
    fresh = [r for page in read_runs_expected(api, new_since, new_until) for r in page]
    have = {r["id"] for r in fresh}
    fresh += [r for r in checked if r["id"] not in have]
    have |= {r["id"] for r in checked}
    ids = (set(events[0]) if events else set()) | open_ids
    fresh += fetch_runs_by_id(api, sorted(ids - have))
    written = index.upsert(changed_rows(index, [IndexRow.from_flow_run(r) for r in fresh], entries))
    gone = open_ids - {r["id"] for r in fresh}  # deleted on the server: not shown as waiting or running forever
    if gone:
        index.delete(sorted(gone))
    stamp = int(now.timestamp() * 1000)
    update = dict(events_cursor_ms=stamp, last_sync_ms=stamp)
    keep_ms = int(index_days() * 86400_000)
    if stamp - meta.covered_since_ms > keep_ms + 86400_000:  # retention: once a day, drop finished runs past the window
        index.purge(before_us=(stamp - keep_ms) * 1000)
        update["covered_since_ms"] = stamp - keep_ms
    index.set_meta(meta.model_copy(update=dict(update, api_url=api.api_url)))  # the URL it was synced through
    return SyncResult(runs_read=len(fresh), rows_written=written, events=events[1] if events else 0, mode=mode,
                      took_s=time.perf_counter() - t0, deleted=sorted(gone))


def _open_runs(api: Any, by_type: dict[str, list[str]], mode: bool | str) -> tuple[list[dict], set[str]]:
    """(open runs already read as the server holds them, open runs to read by id): with ``mode``
    "check", only those whose state type changed are read (:func:`changed_open_runs`), unless one
    was deleted: then every open run is read again, so that the missing ones are known."""
    if mode == "check":
        checked, complete = changed_open_runs(api, by_type)
        if complete:
            return checked, set()
    return [], {i for ids in by_type.values() for i in ids}


def changed_rows(index: RunIndex, rows: list[IndexRow], entries: Optional[StateEntries] = None) -> list[IndexRow]:
    """The rows, completed with the queue phases the index held and the events showed
    (:meth:`IndexRow.merged`), that differ from what the index holds (re-read open runs
    mostly have not changed; rewriting them would make every reader re-read them)."""
    if not rows:
        return []
    entries = entries or StateEntries()
    held = index.frame(ids=[r.id for r in rows])
    stored: dict[str, dict] = {}
    fields = list(IndexRow.model_fields)
    if not held.empty:
        stored = {rec["id"]: rec for rec in held[fields].astype(object).where(held[fields].notna(), None).to_dict("records")}
    out = []
    for r in rows:
        old = IndexRow(**stored[r.id]) if r.id in stored else None
        new = r.merged(old, entries.scheduled.get(r.id, ()), entries.pending.get(r.id, ()))
        if old is None or old != new:
            out.append(new)
    return out


# ------------------------------------------------------------------- service


class IndexService:
    """One run index as the monitor's process uses it: built in the background, synced
    before views, its prepared frame held in memory and refreshed incrementally."""

    def __init__(self, index: RunIndex, api: Any) -> None:
        self.index, self.api = index, api
        self._lock = threading.Lock()
        self._build: Optional[threading.Thread] = None
        self.build_progress = 0
        self.build_error: Optional[str] = None
        self._prepared: Optional[pd.DataFrame] = None
        self._deps: Optional[dict] = None
        self._loaded_since_us: Optional[int] = None
        self._read_at_ms = 0
        self._synced_at = 0.0
        self._open_read_at = float("-inf")  # the open runs last checked (or read)
        self._open_full_at = float("-inf")  # ... and last read in full
        self._id_read_at = float("-inf")  # the server id last read again for want of an index under it
        self.last_sync: Optional[SyncResult] = None

    # -------------------------------------------------------------- coverage

    def meta(self) -> Optional[IndexMeta]:
        """Read each time (one indexed row): another process may be rebuilding the index. With no index
        under the server id this process holds, the id is read again first: had its Variable been deleted
        while this monitor ran, a monitor started since made a new one and built the index under it, and
        the two would otherwise reset each other's index on every visit until this one restarted. Read again
        at most once per ``ID_RECHECK_S``: on a store never built every check finds no index, and the id
        has not changed for that."""
        held = self.api.server_id()
        meta = self.index.meta(held, self.api.api_url)
        if meta is None and time.monotonic() - self._id_read_at >= ID_RECHECK_S:
            self._id_read_at = time.monotonic()
            if self.api.server_id(fresh=True) != held:
                meta = self.index.meta(self.api.server_id(), self.api.api_url)
        return meta

    def covers(self, since: dt.datetime) -> bool:
        m = self.meta()
        return bool(m and m.covered_since_ms is not None and m.covered_since_ms <= since.timestamp() * 1000)

    def building(self) -> bool:
        return self._build is not None and self._build.is_alive()

    def start_build(self, days: Optional[float] = None) -> None:
        """Build in a background thread (once at a time); views use the API meanwhile."""
        with self._lock:
            if self.building():
                return

            def run() -> None:
                try:
                    build(self.index, self.api, days, progress=lambda n: setattr(self, "build_progress", n))
                    self._prepared = None
                except Exception as e:  # the page keeps working from the API; it shows why
                    log.exception("run index build failed")
                    self.build_error = f"{type(e).__name__}: {e}"

            self.build_error = None
            self._build = threading.Thread(target=run, name="run-index-build", daemon=True)
            self._build.start()

    # ------------------------------------------------------------------ read

    def sync_if_due(self, now: Optional[dt.datetime] = None) -> None:
        """Sync with the server unless that was done in the last ``MIN_SYNC_S`` (a view starts this
        while it reads the queues and jobs it needs before :meth:`frame`)."""
        with self._lock:
            self._sync_if_due(now)

    def _sync_if_due(self, now: Optional[dt.datetime]) -> None:
        t = time.monotonic()
        if t - self._synced_at < MIN_SYNC_S:
            return
        full = t - self._open_full_at >= OPEN_FULL_REREAD_S
        check = t - self._open_read_at >= OPEN_REREAD_S
        self.last_sync = sync(self.index, self.api, now, open_runs=True if full else "check" if check else False)
        self._synced_at = t
        if full or check:
            self._open_read_at = t
        if full:
            self._open_full_at = t
        if self.last_sync.deleted and self._prepared is not None:  # no row read later says so
            self._prepared = self._prepared[~self._prepared["id"].isin(self.last_sync.deleted)]

    def frame(self, since: dt.datetime, deployments: dict[str, dict], now: Optional[dt.datetime] = None) -> tuple[pd.DataFrame, bool]:
        """(prepared rows expected since ``since`` at least, read incrementally?) after a sync."""
        with self._lock:
            self._sync_if_due(now)
            want_us = us(since)
            incremental = self._prepared is not None and self._loaded_since_us is not None and self._loaded_since_us <= want_us
            read_at = now_ms()
            if incremental:
                # rows written since the last read (a writer's row can commit a little after its stamp)
                delta = self.index.frame(synced_after_ms=self._read_at_ms - READ_OVERLAP_MS, columns=CORE)
                delta = delta[delta["expected_start_us"].fillna(0) >= self._loaded_since_us]
                if not delta.empty:
                    self._prepared = IV.splice(self._prepared, IV.prepare(delta, deployments))
                if self._deps != deployments:  # a job renamed or added: only its names change
                    self._prepared["job"] = IV.job_names(self._prepared["deployment_id"], deployments)
            else:
                self._prepared = IV.prepare(self.index.frame(since_us=want_us, columns=CORE), deployments)
                self._loaded_since_us = want_us
            self._read_at_ms = read_at
            self._deps = dict(deployments)
            return self._prepared, incremental

    def details(self, ids: list[str]) -> pd.DataFrame:
        """Every column of these runs (names, messages, resources: what lists show)."""
        ids = list(dict.fromkeys(ids))  # a run can be both listed and an error
        return self.index.frame(ids=ids) if ids else pd.DataFrame(columns=IV.RECORD_COLUMNS)

    def status(self) -> dict:
        m = self.meta()
        return dict(built=bool(m and m.covered_since_ms), building=self.building(), build_progress=self.build_progress,
                    build_error=self.build_error,
                    covered_since=dt.datetime.fromtimestamp(m.covered_since_ms / 1000, UTC).isoformat() if m and m.covered_since_ms else None,
                    last_sync=dt.datetime.fromtimestamp(m.last_sync_ms / 1000, UTC).isoformat() if m and m.last_sync_ms else None,
                    rows=len(self._prepared) if self._prepared is not None else None)


_SERVICES: dict[tuple, IndexService] = {}
_SERVICES_LOCK = threading.Lock()


def service_for(store: Any, api: Any) -> IndexService:
    """The process-wide service for (metrics store, Prefect server)."""
    key = (store.resolved_url(), api.api_url)
    with _SERVICES_LOCK:
        if key not in _SERVICES:
            _SERVICES[key] = IndexService(RunIndex(store), api)
        return _SERVICES[key]


def forget_services() -> None:
    """Drop the in-memory frames (the index tables stay): the next view reads them again."""
    with _SERVICES_LOCK:
        for k in [k for k, s in _SERVICES.items() if not s.building()]:  # a running build keeps its service
            del _SERVICES[k]
