"""Data layer of the queue monitor: reads Prefect's API (and the metrics store) into pandas.

Two kinds of functions live here:

* readers (``fetch_*``, :func:`load_view`) that ask the Prefect server, always bounded by
  time filters, never paging through every run: per-interval numbers come from the
  server-side aggregation ``POST /flow_runs/history`` (one request per group, in
  parallel); per-run rows (Gantt, details, scatter joins) are the newest
  ``detail_limit`` runs of the range, read 200 at a time in parallel and refreshed
  incrementally (only new runs and runs that were not finished are read again);
* pure functions (pandas in, pandas out) that the page and the tests use.

Conventions (the launch worker produces them): queue = work pool; priority = the
pool's work queue (critical/high/medium/low); job = deployment name; a launched run has
tags ``launch``, ``owner:<user>``, ``preset:<name>`` and job variables ``preset``,
``cpu``, ``memory``, ``gpu``; a waiting run carries the label ``launch.waiting``.
Runs without them show owner/preset ``unknown``.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional, Sequence

import httpx
import pandas as pd

from prefect_launch.workers.agent_registry import ONLINE_WINDOW_S
from prefect_launch.workers.run_tags import LAUNCH_TAG, OWNER, PRESET, WAIT_LABEL, tag, tag_value

UTC = dt.timezone.utc
PAGE = 200  # the API's maximum page size for flow runs
MAX_GROUPS = 12  # series per chart before the rest is folded into "other"
UNKNOWN = "unknown"
OTHER = "other"

GROUPINGS = ("owner", "job", "queue", "preset", "status")
STATUSES = ("queued", "pending", "running", "completed", "failed", "crashed", "cancelled", "paused")
FINISHED = ("completed", "failed", "crashed", "cancelled")
STATUS_OF_TYPE = {
    "SCHEDULED": "queued",
    "PENDING": "pending",
    "RUNNING": "running",
    "COMPLETED": "completed",
    "FAILED": "failed",
    "CRASHED": "crashed",
    "CANCELLED": "cancelled",
    "CANCELLING": "cancelled",
    "PAUSED": "paused",
}
TYPES_OF_STATUS: dict[str, list[str]] = {}
for _t, _s in STATUS_OF_TYPE.items():
    TYPES_OF_STATUS.setdefault(_s, []).append(_t)
TERMINAL_TYPES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
STATUS_COLORS = {
    "queued": "#9e9e9e",
    "pending": "#f4b400",
    "running": "#1e88e5",
    "completed": "#43a047",
    "failed": "#e53935",
    "crashed": "#8e24aa",
    "cancelled": "#6d4c41",
    "paused": "#00acc1",
}
RANGES = {"Last 1 hour": dt.timedelta(hours=1), "Last 24 hours": dt.timedelta(days=1), "Last 7 days": dt.timedelta(days=7)}
NICE_INTERVALS = (60, 120, 300, 600, 900, 1800, 3600, 2 * 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400)

OCCUPANCY_LOOKBACK = dt.timedelta(days=1)  # runs expected this long before a range are read for its occupancy
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dash-io")
# history requests are whole-range scans on the server: more than two at once only make
# them contend there (measured: 7 in parallel cost 1.5x the server CPU of 7 in a row)
_HISTORY_SLOTS = threading.BoundedSemaphore(int(os.environ.get("LAUNCH_DASHBOARD_HISTORY_SLOTS", "2")))


# ------------------------------------------------------------------ view spec


@dataclass(frozen=True)
class ViewSpec:
    """What the sidebar selected; hashable so it can key caches."""

    since: dt.datetime
    until: dt.datetime
    queues: tuple[str, ...] = ()  # work pool names; () = all
    grouping: str = "job"
    owners: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    interval_s: Optional[int] = None
    detail_limit: int = 1000

    @property
    def interval(self) -> int:
        return self.interval_s or interval_for(self.since, self.until)

    def filter_key(self) -> tuple:
        """The spec without its times (what the incremental run cache is keyed by)."""
        return (self.queues, self.owners, self.jobs, self.statuses, self.presets, self.detail_limit)


def interval_for(since: dt.datetime, until: dt.datetime, target: int = 170) -> int:
    """A round bucket size giving about ``target`` (at most 500) buckets."""
    span = max((until - since).total_seconds(), 60.0)
    for s in NICE_INTERVALS:
        if span / s <= target:
            return s
    return int(math.ceil(span / 500))


def time_window(choice: str, now: Optional[dt.datetime] = None, custom: Optional[tuple] = None) -> tuple[dt.datetime, dt.datetime]:
    """(since, until) for a sidebar choice; ``custom`` = (start date, end date) inclusive."""
    now = now or dt.datetime.now(UTC)
    if choice in RANGES:
        return now - RANGES[choice], now
    start, end = custom
    since = dt.datetime.combine(start, dt.time(), tzinfo=UTC)
    until = dt.datetime.combine(end, dt.time(), tzinfo=UTC) + dt.timedelta(days=1)
    return since, min(until, now) if until > now else until


# ------------------------------------------------------------------- API access


class Api:
    """A small synchronous JSON client for the Prefect REST API (thread-safe)."""

    def __init__(self, api_url: Optional[str] = None, timeout: float = 30.0):
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

        self.api_url = (api_url or os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value() or "").rstrip("/")
        if not self.api_url:
            raise RuntimeError("PREFECT_API_URL is not set: point it at your Prefect server's /api")
        headers = {}
        if PREFECT_API_KEY.value():
            headers["Authorization"] = f"Bearer {PREFECT_API_KEY.value()}"
        elif PREFECT_API_AUTH_STRING.value():
            import base64

            headers["Authorization"] = "Basic " + base64.b64encode(PREFECT_API_AUTH_STRING.value().encode()).decode()
        self.http = httpx.Client(base_url=self.api_url + "/", headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=16, max_keepalive_connections=16))

    def post(self, path: str, body: Optional[dict] = None) -> Any:
        r = self.http.post(path.lstrip("/"), json=body or {})
        r.raise_for_status()
        return r.json()

    def get(self, path: str) -> Any:
        r = self.http.get(path.lstrip("/"))
        r.raise_for_status()
        return r.json()

    def ui_url(self) -> str:
        """Base URL of the Prefect UI: PREFECT_UI_URL if set, else this API URL minus ``/api``."""
        ui = os.environ.get("PREFECT_UI_URL")
        if ui:
            return str(ui).rstrip("/")
        base = self.api_url
        return base[: -len("/api")] if base.endswith("/api") else base


_APIS: dict[str, Api] = {}
_APIS_LOCK = threading.Lock()


def get_api(api_url: Optional[str] = None) -> Api:
    key = api_url or os.environ.get("PREFECT_API_URL") or ""
    with _APIS_LOCK:
        if key not in _APIS:
            _APIS[key] = Api(api_url)
        return _APIS[key]


def run_url(ui_base: str, flow_run_id: str) -> str:
    return f"{ui_base.rstrip('/')}/runs/flow-run/{flow_run_id}"


def _iso(t: dt.datetime) -> str:
    return t.astimezone(UTC).isoformat()


# --------------------------------------------------------------- filter bodies


def tag_combos(spec: ViewSpec) -> list[tuple[str, ...]]:
    """Owner x preset filters as tag sets to AND (one request each; the sets are disjoint)."""
    owners = [tag(OWNER, o) for o in spec.owners] or [None]
    presets = [tag(PRESET, p) for p in spec.presets] or [None]
    return [tuple(t for t in (o, p) if t) for o in owners for p in presets]


def filter_body(spec: ViewSpec, tags: Sequence[str] = (), *, time_field: str = "expected_start_time",
                pools: Optional[Sequence[str]] = None, jobs: Optional[Sequence[str]] = None,
                state_types: Optional[Sequence[str]] = None, since: Optional[dt.datetime] = None,
                until: Optional[dt.datetime] = None) -> dict:
    """The flow_runs / deployments / work_pools filter for a spec (plus a group's narrowing)."""
    fr: dict[str, Any] = {}
    s, u = since or spec.since, until or spec.until
    if time_field:
        fr[time_field] = {"after_": _iso(s), "before_": _iso(u)}
    if tags:
        fr["tags"] = {"all_": list(tags)}
    types = list(state_types) if state_types is not None else [t for st in spec.statuses for t in TYPES_OF_STATUS[st]]
    if types:
        fr["state"] = {"type": {"any_": types}}
    body: dict[str, Any] = {"flow_runs": fr}
    pool_names = list(pools) if pools is not None else list(spec.queues)
    if pool_names:
        body["work_pools"] = {"name": {"any_": pool_names}}
    job_names = list(jobs) if jobs is not None else list(spec.jobs)
    if job_names:
        body["deployments"] = {"name": {"any_": job_names}}
    return body


# --------------------------------------------------------------------- readers


def fetch_pools(api: Api) -> list[dict]:
    """Every work pool, paged by offset (a server with more than one page of queues lost some before)."""
    out: list[dict] = []
    while True:
        page = api.post("/work_pools/filter", {"limit": PAGE, "offset": len(out)})
        out.extend(page)
        if len(page) < PAGE:
            return out


def fetch_deployments(api: Api) -> dict[str, dict]:
    """Deployment id -> {name, pool}; pages by offset (deployments are few)."""
    out: dict[str, dict] = {}
    offset = 0
    while True:
        page = api.post("/deployments/filter", {"limit": PAGE, "offset": offset})
        for d in page:
            out[d["id"]] = {"name": d["name"], "pool": d.get("work_pool_name")}
        if len(page) < PAGE:
            return out
        offset += PAGE


def fetch_history(api: Api, spec: ViewSpec, interval_s: int, tags: Sequence[str] = (),
                  deployment_ids: Optional[Sequence[str]] = None, **narrow: Any) -> list[dict]:
    """``POST /flow_runs/history`` for the spec narrowed by ``narrow`` (pools, jobs, state_types);
    ``deployment_ids`` narrows by the indexed run column ([] = runs without a deployment)."""
    body = filter_body(spec, tags, time_field="", **narrow)
    if deployment_ids is not None:
        body["flow_runs"]["deployment_id"] = {"any_": list(deployment_ids)} if deployment_ids else {"is_null_": True}
        body.pop("deployments", None)
    body.update(history_start=_iso(spec.since), history_end=_iso(spec.until), history_interval_seconds=interval_s)
    with _HISTORY_SLOTS:
        return api.post("/flow_runs/history", body)


def history_frame(buckets: list[dict], group: str = "all") -> pd.DataFrame:
    """History JSON -> long frame: bucket, group, state_type, status, count, run_s, queued_s."""
    rows = []
    for b in buckets:
        start = pd.Timestamp(b["interval_start"])
        for s in b.get("states", []):
            rows.append((start, group, s["state_type"], STATUS_OF_TYPE.get(s["state_type"], s["state_type"].lower()),
                         int(s["count_runs"]), float(s["sum_estimated_run_time"]), float(s["sum_estimated_lateness"])))
    df = pd.DataFrame(rows, columns=["bucket", "group", "state_type", "status", "count", "run_s", "queued_s"])
    df["bucket"] = pd.to_datetime(df["bucket"], utc=True)
    return df


def subtract_groups(total: pd.DataFrame, parts: pd.DataFrame, label: str = OTHER) -> pd.DataFrame:
    """Runs in ``total`` that no group in ``parts`` took, as group ``label`` (empty if none)."""
    keys = ["bucket", "state_type", "status"]
    t = total.groupby(keys, as_index=False)[["count", "run_s", "queued_s"]].sum()
    p = parts.groupby(keys, as_index=False)[["count", "run_s", "queued_s"]].sum()
    m = t.merge(p, on=keys, how="left", suffixes=("", "_p")).fillna(0)
    for c in ("count", "run_s", "queued_s"):
        m[c] = m[c] - m[c + "_p"]
    m = m[m["count"] > 0][keys + ["count", "run_s", "queued_s"]]
    m["group"] = label
    return m[["bucket", "group", "state_type", "status", "count", "run_s", "queued_s"]]


def _parse_ts(v: Any) -> Optional[pd.Timestamp]:
    return pd.Timestamp(v) if v else None


def runs_frame(raw: list[dict], deployments: Optional[dict[str, dict]] = None, now: Optional[dt.datetime] = None) -> pd.DataFrame:
    """Flow-run JSON (``/flow_runs/filter``) -> one row per run with the dashboard's columns.

    queued_s = start - expected start (now - expected start while still waiting);
    duration_s = end - start (now - start while running).
    """
    deployments = deployments or {}
    now_ts = pd.Timestamp(now or dt.datetime.now(UTC))
    rows = []
    for r in raw:
        tags = r.get("tags") or []
        owner = tag_value(tags, "owner") or UNKNOWN
        preset = tag_value(tags, "preset")
        jv = r.get("job_variables") or {}
        preset = preset or jv.get("preset") or UNKNOWN
        dep = deployments.get(r.get("deployment_id") or "", {})
        state = r.get("state") or {}
        stype = r.get("state_type") or state.get("type") or "SCHEDULED"
        rows.append(
            dict(
                id=r["id"], name=r.get("name"), job=dep.get("name") or (UNKNOWN if r.get("deployment_id") else "(no deployment)"),
                queue=r.get("work_pool_name") or dep.get("pool") or UNKNOWN, priority=r.get("work_queue_name"),
                owner=owner, preset=str(preset), state_type=stype, state_name=r.get("state_name") or state.get("name"),
                status=STATUS_OF_TYPE.get(stype, stype.lower()), expected_start=_parse_ts(r.get("expected_start_time")),
                start=_parse_ts(r.get("start_time")), end=_parse_ts(r.get("end_time")),
                message=state.get("message") or "", waiting=(r.get("labels") or {}).get(WAIT_LABEL, ""),
                cpu=jv.get("cpu"), memory=jv.get("memory"), gpu=jv.get("gpu"), launched=LAUNCH_TAG in tags,
            )
        )
    cols = ["id", "name", "job", "queue", "priority", "owner", "preset", "state_type", "state_name", "status",
            "expected_start", "start", "end", "message", "waiting", "cpu", "memory", "gpu", "launched"]
    df = pd.DataFrame(rows, columns=cols)
    for c in ("expected_start", "start", "end"):
        df[c] = pd.to_datetime(df[c], utc=True)
    started = df["start"].notna()
    waiting = ~started & ~df["state_type"].isin(list(TERMINAL_TYPES)) & (df["expected_start"] < now_ts)
    df["queued_s"] = 0.0
    df.loc[started, "queued_s"] = (df.loc[started, "start"] - df.loc[started, "expected_start"]).dt.total_seconds().clip(lower=0)
    df.loc[waiting, "queued_s"] = (now_ts - df.loc[waiting, "expected_start"]).dt.total_seconds()
    end = df["end"].where(df["end"].notna(), now_ts)
    df["duration_s"] = (end - df["start"]).dt.total_seconds().where(started)
    return df.sort_values("expected_start", ascending=False, ignore_index=True)


def _count(api: Api, body: dict) -> int:
    return int(api.post("/flow_runs/count", body))


def fetch_runs(api: Api, spec: ViewSpec, since: Optional[dt.datetime] = None, limit: Optional[int] = None,
               until: Optional[dt.datetime] = None) -> list[dict]:
    """Newest ``limit`` runs expected to start in [since, until], read 200 at a time in parallel."""
    limit = limit or spec.detail_limit
    bodies = [dict(filter_body(spec, tags, since=since, until=until), sort="EXPECTED_START_TIME_DESC") for tags in tag_combos(spec)]
    # the first page of each filter set alone: most narrow filters match less than one page
    first = list(_POOL.map(lambda b: api.post("/flow_runs/filter", dict(b, limit=min(PAGE, limit), offset=0)), bodies))
    rest = [dict(b, limit=min(PAGE, limit - off), offset=off)
            for b, p in zip(bodies, first) if len(p) == min(PAGE, limit) for off in range(PAGE, limit, PAGE)]
    pages = first + list(_POOL.map(lambda b: api.post("/flow_runs/filter", b), rest))
    seen: set = set()
    uniq = []
    for p in pages:
        for r in p:
            if r["id"] not in seen:
                seen.add(r["id"])
                uniq.append(r)
    uniq.sort(key=lambda r: r.get("expected_start_time") or "", reverse=True)
    return uniq[:limit]


def fetch_runs_by_id(api: Api, ids: Sequence[str]) -> list[dict]:
    chunks = [list(ids[i : i + PAGE]) for i in range(0, len(ids), PAGE)]
    pages = _POOL.map(lambda c: api.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": c}}, "limit": PAGE}), chunks)
    return [r for p in pages for r in p]


@dataclass
class _CachedRuns:
    since: dt.datetime
    until: dt.datetime
    raw: dict[str, dict]
    watermark: str
    total: int
    spec: Optional[ViewSpec] = None
    complete: bool = False  # raw holds every run of the filter set in [since, until]


def _ts(r: dict, key: str = "expected_start_time") -> Optional[dt.datetime]:
    v = r.get(key)
    return dt.datetime.fromisoformat(v.replace("Z", "+00:00")) if v else None


def narrows(wide: ViewSpec, narrow: ViewSpec) -> bool:
    """Every run ``narrow``'s filters select is also selected by ``wide``'s (times aside)."""
    return all(not w or (n and set(n) <= set(w)) for w, n in (
        (wide.queues, narrow.queues), (wide.owners, narrow.owners), (wide.jobs, narrow.jobs),
        (wide.statuses, narrow.statuses), (wide.presets, narrow.presets)))


def run_matches(r: dict, spec: ViewSpec, deployments: dict[str, dict]) -> bool:
    """The sidebar filters applied to one flow-run JSON, as the server applies them."""
    tags = r.get("tags") or []
    if spec.queues and r.get("work_pool_name") not in spec.queues:
        return False
    if spec.owners and not any(tag(OWNER, o) in tags for o in spec.owners):
        return False
    if spec.presets and not any(tag(PRESET, p) in tags for p in spec.presets):
        return False
    if spec.jobs and (deployments.get(r.get("deployment_id") or "") or {}).get("name") not in spec.jobs:
        return False
    if spec.statuses and r.get("state_type") not in {t for st in spec.statuses for t in TYPES_OF_STATUS[st]}:
        return False
    return True


class RunCache:
    """Per filter set, the newest runs of the range; refreshed incrementally.

    A refresh reads only runs expected after the newest one held (the watermark) and
    re-reads the held runs that had not finished; finished runs do not change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[tuple, _CachedRuns] = {}

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def _superset(self, api: Api, spec: ViewSpec) -> Optional[_CachedRuns]:
        """A held entry whose filters are wider than ``spec``'s and whose range covers it."""
        with self._lock:
            cands = [e for (url, _), e in self._data.items() if url == api.api_url and e.spec is not None
                     and e.since <= spec.since and e.until <= spec.until + dt.timedelta(seconds=1) and e.until > spec.since
                     and narrows(e.spec, spec)]
        # prefer a complete one, then the one reaching furthest back
        return max(cands, key=lambda e: (e.complete, -min((_ts(r).timestamp() for r in e.raw.values() if _ts(r)), default=0)),
                   default=None)

    def _derive(self, api: Api, spec: ViewSpec, wide: _CachedRuns, deployments: Any) -> list[dict]:
        """The newest runs of ``spec`` from a wider filter's newest runs.

        ``wide`` holds every run of its filter expected after its oldest run t0 (its runs
        are the newest of their range), so the matching runs after t0 are exactly the
        narrower filter's runs after t0; only the ones at or before t0 are read.
        """
        limit = spec.detail_limit
        deps = deployments() if spec.jobs else {}
        held = [r for r in wide.raw.values() if _ts(r) is not None]
        t0 = min((_ts(r) for r in held), default=wide.until)
        lo, hi = spec.since, min(spec.until, wide.until)
        matched = [r for r in held if lo <= _ts(r) <= hi and (wide.complete or _ts(r) > t0)
                   and (run_matches(r, spec, deps) or (spec.statuses and r.get("state_type") not in TERMINAL_TYPES))]
        # finished runs do not change; the others are read again (and matched on their new state)
        open_ids = [r["id"] for r in matched if r.get("state_type") not in TERMINAL_TYPES]
        if open_ids:
            fresh = {r["id"]: r for r in fetch_runs_by_id(api, open_ids)}
            matched = [fresh.get(r["id"], r) for r in matched]
        matched = [r for r in matched if run_matches(r, spec, deps)]
        if spec.until > wide.until:  # the page's clock moved on since the wider view: read the gap
            seen = {r["id"] for r in matched}
            matched += [r for r in fetch_runs(api, spec, since=wide.until, limit=limit) if r["id"] not in seen]
        matched.sort(key=lambda r: _ts(r), reverse=True)
        if wide.complete or len(matched) >= limit:
            return matched[:limit], wide.complete and len(matched) <= limit
        rest = fetch_runs(api, spec, limit=limit - len(matched), until=t0)
        seen = {r["id"] for r in matched}
        out = matched + [r for r in rest if r["id"] not in seen]
        out.sort(key=lambda r: _ts(r) or lo, reverse=True)
        return out[:limit], len(rest) < limit - len(matched)

    def get(self, api: Api, spec: ViewSpec, deployments: Any = None) -> tuple[list[dict], bool]:
        """(raw runs, refreshed incrementally?)

        ``deployments``: a callable giving the id -> {name, pool} map (only needed to
        derive a job-filtered view from a wider one that is held).
        """
        key = (api.api_url, spec.filter_key())
        with self._lock:
            entry = self._data.get(key)
        if entry is None or entry.since > spec.since or spec.until < entry.until:
            wide = self._superset(api, spec) if entry is None else None
            if wide is not None:
                raw, complete = self._derive(api, spec, wide, deployments or (lambda: fetch_deployments(api)))
            else:
                raw = fetch_runs(api, spec)
                complete = len(raw) < spec.detail_limit
            wm = max((r.get("expected_start_time") or "" for r in raw), default=_iso(spec.since))
            with self._lock:
                self._data[key] = _CachedRuns(spec.since, spec.until, {r["id"]: r for r in raw}, wm, len(raw), spec, complete)
            return raw, False
        new_since = max(pd.Timestamp(entry.watermark).to_pydatetime() - dt.timedelta(seconds=1), spec.since)
        new = fetch_runs(api, spec, since=new_since)
        open_ids = [i for i, r in entry.raw.items() if (r.get("state_type") not in TERMINAL_TYPES) and i not in {x["id"] for x in new}]
        fresh = fetch_runs_by_id(api, open_ids) if open_ids else []
        merged = dict(entry.raw)
        added = sum(1 for r in new if r["id"] not in merged)
        for r in list(new) + fresh:
            merged[r["id"]] = r
        lo = _iso(spec.since)
        keep = sorted((r for r in merged.values() if (r.get("expected_start_time") or "") >= lo),
                      key=lambda r: r.get("expected_start_time") or "", reverse=True)
        dropped = len(merged) - len(keep)
        keep = keep[: spec.detail_limit]
        total = max(entry.total + added - dropped, len(keep))
        wm = max([entry.watermark] + [r.get("expected_start_time") or "" for r in new])
        with self._lock:
            self._data[key] = _CachedRuns(spec.since, spec.until, {r["id"]: r for r in keep}, wm, total, spec,
                                          entry.complete and len(keep) < spec.detail_limit)
        return keep, True


RUN_CACHE = RunCache()


def fetch_errors(api: Api, spec: ViewSpec, limit: int = PAGE) -> tuple[list[dict], list[dict]]:
    """Failed and crashed runs that ended in the range (newest first) and their ERROR logs."""
    runs: list[dict] = []
    for tags in tag_combos(spec):
        body = filter_body(spec, tags, time_field="end_time", state_types=["FAILED", "CRASHED"])
        body.update(sort="END_TIME_DESC", limit=limit)
        runs.extend(api.post("/flow_runs/filter", body))
    runs.sort(key=lambda r: r.get("end_time") or r.get("state", {}).get("timestamp") or "", reverse=True)
    runs = runs[:limit]
    return runs, _error_logs(api, [r["id"] for r in runs])


def _error_logs(api: Api, run_ids: Sequence[str]) -> list[dict]:
    """The newest ERROR (and worse) logs of these runs."""
    if not run_ids:
        return []
    return api.post("/logs/filter", {"logs": {"flow_run_id": {"any_": list(run_ids)}, "level": {"ge_": 40}},
                                     "sort": "TIMESTAMP_DESC", "limit": PAGE})


def errors_frame(runs: pd.DataFrame, logs: Sequence[dict] = ()) -> pd.DataFrame:
    """time, job, run, owner, queue, state, message (state message, else the last ERROR log), newest first."""
    last_log: dict[str, str] = {}
    for lg in logs:  # newest first: keep the first seen per run
        last_log.setdefault(lg.get("flow_run_id"), (lg.get("message") or "").strip().splitlines()[-1:] and (lg.get("message") or "").strip().splitlines()[-1] or "")
    if runs.empty:
        return pd.DataFrame(columns=["time", "job", "run", "id", "owner", "queue", "state", "message"])
    df = runs[runs["status"].isin(["failed", "crashed"])].copy()
    df["time"] = df["end"].where(df["end"].notna(), df["start"])
    df["message"] = [m or last_log.get(i, "") for m, i in zip(df["message"], df["id"])]
    df["log"] = [last_log.get(i, "") for i in df["id"]]
    df = df.rename(columns={"name": "run", "state_name": "state"})
    return df.sort_values("time", ascending=False, ignore_index=True)[["time", "job", "run", "id", "owner", "queue", "state", "message", "log"]]


def fetch_now_counts(api: Api, spec: ViewSpec, pools: Sequence[str], now: dt.datetime) -> pd.DataFrame:
    """Per pool, runs queued (due and waiting), pending and running right now."""
    jobs = []
    for pool in pools:
        for status, types, extra in (
            ("queued", ["SCHEDULED"], {"expected_start_time": {"before_": _iso(now)}}),
            ("pending", ["PENDING"], {}),
            ("running", ["RUNNING"], {}),
        ):
            for tags in tag_combos(spec):
                body = filter_body(spec, tags, time_field="", pools=[pool], state_types=types)
                body["flow_runs"].update(extra)
                jobs.append((pool, status, body))
    counts = list(_POOL.map(lambda j: _count(api, j[2]), jobs))
    df = pd.DataFrame([(p, s, n) for (p, s, _), n in zip(jobs, counts)], columns=["queue", "status", "count"])
    if df.empty:
        return pd.DataFrame(columns=["queue", "queued", "pending", "running"])
    return df.pivot_table(index="queue", columns="status", values="count", aggfunc="sum", fill_value=0).reindex(
        columns=["queued", "pending", "running"], fill_value=0).reset_index()


def fetch_workers(api: Api, pools: Sequence[str]) -> pd.DataFrame:
    def one(pool: str) -> list[dict]:
        try:
            return [dict(w, pool=pool) for w in api.post(f"/work_pools/{pool}/workers/filter", {"limit": PAGE})]
        except httpx.HTTPError:
            return []

    rows = [w for ws in _POOL.map(one, pools) for w in ws]
    return pd.DataFrame([dict(queue=w["pool"], worker=w["name"], status=w.get("status", "OFFLINE"),
                              last_heartbeat=w.get("last_heartbeat_time")) for w in rows],
                        columns=["queue", "worker", "status", "last_heartbeat"])


def fetch_agents(api: Api) -> list[dict]:
    """Capacity that launch agents publish as Prefect Variables tagged ``launch-agent``."""
    try:
        vars_ = api.post("/variables/filter", {"variables": {"tags": {"all_": ["launch-agent"]}}, "limit": PAGE})
    except httpx.HTTPError:
        return []
    return [v["value"] for v in vars_ if isinstance(v.get("value"), dict)]


def agents_frame(agents: Sequence[dict], now: Optional[dt.datetime] = None, online_window_s: float = ONLINE_WINDOW_S) -> pd.DataFrame:
    """One row per (agent, queue): capacity and free cpu / memory / gpu, online or not."""
    now = now or dt.datetime.now(UTC)
    rows = []
    for a in agents:
        hb = pd.Timestamp(a.get("heartbeat")) if a.get("heartbeat") else None
        online = hb is not None and (pd.Timestamp(now) - hb).total_seconds() <= online_window_s
        cap, free = a.get("capacity") or {}, a.get("free") or {}
        for q in a.get("queues") or [UNKNOWN]:
            rows.append(dict(agent=a.get("name"), queue=q, online=online, runs=len(a.get("runs") or []),
                             cpu=cap.get("cpu"), free_cpu=free.get("cpu"), memory_gib=(cap.get("memory") or 0) / 2**30,
                             free_memory_gib=(free.get("memory") or 0) / 2**30, gpu=cap.get("gpu"), free_gpu=free.get("gpu")))
    return pd.DataFrame(rows, columns=["agent", "queue", "online", "runs", "cpu", "free_cpu", "memory_gib", "free_memory_gib", "gpu", "free_gpu"])


# -------------------------------------------------------------- metrics store


def metrics_store():
    """The run metrics store: ``LAUNCH_METRICS_URL`` (an SQLAlchemy URL) if set, else the block
    named ``LAUNCH_METRICS_BLOCK`` (default "default"), else the store's default URL.

    The block is loaded from the server at most once a minute per process (a load costs a
    client start-up, ~50 ms, on every view otherwise)."""
    key = (os.environ.get("LAUNCH_METRICS_URL"), os.environ.get("LAUNCH_METRICS_BLOCK"), os.environ.get("PREFECT_API_URL"))
    return STORE_CACHE.get(key, _load_metrics_store)


def _load_metrics_store():
    try:
        from prefect_launch.blocks.metrics_store import RunMetricsStore
    except Exception:
        return None
    if os.environ.get("LAUNCH_METRICS_URL"):
        return RunMetricsStore(url=os.environ["LAUNCH_METRICS_URL"])
    name = os.environ.get("LAUNCH_METRICS_BLOCK", "default")
    try:
        return RunMetricsStore.load(name)
    except Exception:
        return RunMetricsStore()


def fetch_metrics(store: Any, spec: ViewSpec, pools: Sequence[str]) -> list[dict]:
    if store is None:
        return []
    try:
        return store.summaries(queue=list(spec.queues) or None, since=spec.since, until=spec.until, limit=max(spec.detail_limit * 2, 2000))
    except Exception:
        return []


class TtlCache:
    """Results that do not depend on every sidebar filter, kept ``ttl_s`` seconds per key.

    The metrics rows depend on the queues and the range only (owner, job, preset and
    status narrow them on the client), so changing one of those filters reuses them.
    """

    def __init__(self, ttl_s: float = 30.0, max_entries: int = 32) -> None:
        import time

        self._clock = time.monotonic
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._lock = threading.Lock()
        self._data: dict[Any, tuple[float, Any]] = {}

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def get(self, key: Any, compute: Any) -> Any:
        now = self._clock()
        with self._lock:
            hit = self._data.get(key)
        if hit is not None and now - hit[0] <= self.ttl_s:
            return hit[1]
        value = compute()
        with self._lock:
            self._data[key] = (now, value)
            if len(self._data) > self.max_entries:
                for k, _ in sorted(self._data.items(), key=lambda kv: kv[1][0])[: len(self._data) - self.max_entries]:
                    self._data.pop(k, None)
        return value


METRICS_CACHE = TtlCache()
STORE_CACHE = TtlCache(ttl_s=60.0, max_entries=8)


def _store_key(store: Any) -> Any:
    try:
        return store.resolved_url()
    except Exception:
        return id(store)


def fetch_metrics_cached(cache: TtlCache, store: Any, spec: ViewSpec) -> list[dict]:
    """:func:`fetch_metrics` through ``cache``, keyed by what the query depends on."""
    if store is None:
        return []
    key = (_store_key(store), spec.queues, spec.since, spec.until, spec.detail_limit)
    return cache.get(key, lambda: fetch_metrics(store, spec, list(spec.queues)))


def metrics_frame(rows: Sequence[dict], spec: Optional[ViewSpec] = None) -> pd.DataFrame:
    """Store summaries -> run, job, queue, owner, preset, flow, duration_s and the four metrics."""
    cols = ["id", "run", "job", "queue", "owner", "preset", "flow", "state", "status", "duration_s", "gpu_util_pct", "cpu_pct",
            "cpu_share_pct", "gpu_mem_gib", "rss_gib", "alloc_gpus", "alloc_cpus", "alloc_memory_gib", "wasteful", "waste_reasons"]
    out = []
    for r in rows:
        if not r.get("has_summary") and r.get("duration_s") is None:
            continue
        state = (r.get("exit_state") or r.get("state") or "").upper()
        out.append(dict(
            id=r["flow_run_id"], run=r.get("flow_run_name") or r["flow_run_id"][:8], job=r.get("job") or UNKNOWN,
            queue=r.get("queue") or UNKNOWN, owner=r.get("owner") or UNKNOWN, preset=r.get("preset") or UNKNOWN,
            flow=r.get("flow") or r.get("project") or UNKNOWN, state=state, status=STATUS_OF_TYPE.get(state, state.lower() or UNKNOWN),
            duration_s=r.get("duration_s"), gpu_util_pct=r.get("avg_gpu_util_pct"), cpu_pct=r.get("avg_cpu_pct"),
            cpu_share_pct=r.get("avg_cpu_share_pct"),
            gpu_mem_gib=(r["peak_gpu_mem_bytes"] / 2**30) if r.get("peak_gpu_mem_bytes") is not None else None,
            rss_gib=(r["peak_rss_bytes"] / 2**30) if r.get("peak_rss_bytes") is not None else None,
            alloc_gpus=r.get("gpu"), alloc_cpus=r.get("cpu"),
            alloc_memory_gib=(r["memory_bytes"] / 2**30) if r.get("memory_bytes") else None,
            wasteful=bool(r.get("wasteful")), waste_reasons="; ".join(r.get("waste_reasons") or []),
        ))
    df = pd.DataFrame(out, columns=cols)
    if spec is not None and not df.empty:
        df = apply_filters(df, spec)
    return df


def apply_filters(df: pd.DataFrame, spec: ViewSpec) -> pd.DataFrame:
    """Client-side version of the sidebar filters (for frames not read through Prefect)."""
    m = pd.Series(True, index=df.index)
    for col, vals in (("queue", spec.queues), ("owner", spec.owners), ("job", spec.jobs), ("preset", spec.presets), ("status", spec.statuses)):
        if vals and col in df:
            m &= df[col].isin(vals)
    return df[m]


def waste_frame(metrics: pd.DataFrame) -> pd.DataFrame:
    w = metrics[metrics["wasteful"]] if not metrics.empty else metrics
    return w.sort_values("duration_s", ascending=False, ignore_index=True)[
        ["run", "id", "job", "owner", "queue", "preset", "duration_s", "gpu_util_pct", "cpu_share_pct", "alloc_gpus", "waste_reasons"]]


# ------------------------------------------------------------- pure transforms


def status_counts(hist: pd.DataFrame) -> pd.DataFrame:
    """Per bucket, runs by status (runs bucketed by expected start, with their current state)."""
    if hist.empty:
        return pd.DataFrame(columns=["bucket", "status", "count"])
    out = hist.groupby(["bucket", "status"], as_index=False)["count"].sum()
    return out[out["count"] > 0].reset_index(drop=True)


def queued_time(hist: pd.DataFrame) -> pd.DataFrame:
    """Per bucket and group, the sum of seconds runs spent queued (expected start -> start)."""
    if hist.empty:
        return pd.DataFrame(columns=["bucket", "group", "queued_s"])
    out = hist.groupby(["bucket", "group"], as_index=False)["queued_s"].sum()
    return out[out["queued_s"] > 0].reset_index(drop=True)


def busy_load(hist: pd.DataFrame, interval_s: int, since: dt.datetime, until: dt.datetime) -> pd.DataFrame:
    """Per bucket (all buckets of the range): runs submitted and run-seconds / bucket seconds (avg busy runs)."""
    idx = pd.date_range(pd.Timestamp(since), pd.Timestamp(until), freq=f"{interval_s}s", inclusive="left")
    if hist.empty:
        agg = pd.DataFrame({"count": 0, "run_s": 0.0}, index=idx)
    else:
        agg = hist.groupby("bucket")[["count", "run_s"]].sum()
        # bucket starts from the server are since + k*interval: align by position
        agg.index = pd.to_datetime(agg.index, utc=True)
        agg = agg.reindex(agg.index.union(idx)).fillna(0)
    agg = agg.sort_index()
    out = pd.DataFrame({"bucket": agg.index, "runs": agg["count"].astype(int).values, "run_s": agg["run_s"].values})
    out["busy"] = out["run_s"] / float(interval_s)
    return out


def idle_periods(load: pd.DataFrame, interval_s: int, min_buckets: int = 1) -> pd.DataFrame:
    """Stretches of consecutive buckets with no run submitted and no run time."""
    rows, start, n = [], None, 0
    for b, idle in zip(load["bucket"], (load["runs"] == 0) & (load["run_s"] <= 0)):
        if idle:
            start = b if start is None else start
            n += 1
        else:
            if start is not None and n >= min_buckets:
                rows.append((start, start + pd.Timedelta(seconds=interval_s * n)))
            start, n = None, 0
    if start is not None and n >= min_buckets:
        rows.append((start, start + pd.Timedelta(seconds=interval_s * n)))
    df = pd.DataFrame(rows, columns=["from", "to"])
    df["hours"] = (df["to"] - df["from"]).dt.total_seconds() / 3600 if not df.empty else []
    return df.sort_values("hours", ascending=False, ignore_index=True) if not df.empty else df


def load_heatmap(hist_hourly: pd.DataFrame) -> pd.DataFrame:
    """Hour of day x weekday (UTC): mean runs submitted per hour and mean busy runs (run-seconds / 3600)."""
    days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
    if hist_hourly.empty:
        return pd.DataFrame(columns=["weekday", "hour", "runs", "busy"])
    h = hist_hourly.assign(bucket=hist_hourly["bucket"].dt.floor("h")).groupby("bucket", as_index=False)[["count", "run_s"]].sum()
    h["weekday"] = h["bucket"].dt.day_of_week.map(dict(enumerate(days)))
    h["hour"] = h["bucket"].dt.hour
    out = h.groupby(["weekday", "hour"], as_index=False).agg(runs=("count", "mean"), run_s=("run_s", "mean"))
    out["busy"] = out["run_s"] / 3600.0  # mean concurrent runs in that hour of that weekday
    return out[["weekday", "hour", "runs", "busy"]]


def gantt_frame(runs: pd.DataFrame, now: Optional[dt.datetime] = None) -> pd.DataFrame:
    """One bar per run that started: start -> end (now while running)."""
    now_ts = pd.Timestamp(now or dt.datetime.now(UTC))
    g = runs[runs["start"].notna()].copy()
    g["bar_end"] = g["end"].where(g["end"].notna(), now_ts)
    return g.reset_index(drop=True)


def group_column(grouping: str) -> str:
    return {"owner": "owner", "job": "job", "queue": "queue", "preset": "preset", "status": "status"}[grouping]


def top_groups(values: Iterable[str], n: int = MAX_GROUPS) -> list[str]:
    s = pd.Series(list(values))
    return [] if s.empty else [g for g in s.value_counts().index.tolist()[:n] if g != UNKNOWN]


def capacity_share(load: pd.DataFrame, capacity: Optional[float]) -> Optional[float]:
    """Used share of a fixed capacity (concurrent runs) over the range, in %."""
    if not capacity or load.empty:
        return None
    return 100.0 * load["busy"].mean() / capacity


# ----------------------------------------------------------------- whole view


@dataclass
class View:
    spec: ViewSpec
    now: dt.datetime
    interval_s: int
    pools: pd.DataFrame
    hist: pd.DataFrame  # long: bucket, group, state_type, status, count, run_s, queued_s
    hist_hourly: pd.DataFrame
    runs: pd.DataFrame  # newest detail_limit runs
    runs_total: int
    errors: pd.DataFrame
    now_counts: pd.DataFrame
    workers: pd.DataFrame
    agents: pd.DataFrame
    metrics: pd.DataFrame
    ui_base: str
    incremental: bool = False
    timings: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    metrics_available: bool = False
    source: str = "api"  # where the run panels came from: api | index
    occupancy: Any = None  # :class:`prefect_launch.dashboard.occupancy.Occupancy`

    @property
    def truncated(self) -> bool:
        return self.runs_total > len(self.runs)


class HistoryCache:
    """``/flow_runs/history`` per filter set, bucket by bucket, with buckets aligned to the interval.

    A bucket is settled once it lies in the past and holds only finished runs (or none):
    its numbers can no longer change, so a refresh asks the server only from the first
    unsettled bucket on (typically the last hours of the range).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[tuple, dict[pd.Timestamp, list[dict]]] = {}
        self._settled: dict[tuple, set] = {}

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._settled.clear()

    def get(self, api: Api, spec: ViewSpec, interval_s: int, tags: Sequence[str] = (), now: Optional[dt.datetime] = None,
            **narrow: Any) -> tuple[list[dict], int]:
        """(bucket JSON list covering the aligned range, buckets asked from the server)."""
        now = now or dt.datetime.now(UTC)
        start, end = aligned_range(spec.since, spec.until, interval_s)
        key = (api.api_url, interval_s, tuple(tags), tuple(sorted((k, tuple(v)) for k, v in narrow.items())),
               spec.queues, spec.jobs, spec.statuses)
        with self._lock:
            have = dict(self._data.get(key, {}))
            settled = set(self._settled.get(key, set()))
        step = pd.Timedelta(seconds=interval_s)
        buckets = list(pd.date_range(pd.Timestamp(start), pd.Timestamp(end), freq=step, inclusive="left"))
        missing = [b for b in buckets if b not in settled]
        asked = 0
        if missing:
            q_start = missing[0].to_pydatetime()
            sub = replace(spec, since=q_start, until=end)
            got = fetch_history(api, sub, interval_s, tags, **narrow)
            asked = len(got)
            for b in got:
                bt = pd.Timestamp(b["interval_start"])
                have[bt] = b.get("states", [])
            returned = {pd.Timestamp(x["interval_start"]) for x in got}
            for b in buckets:
                if b >= pd.Timestamp(q_start) and b not in returned:
                    have[b] = []
            now_ts = pd.Timestamp(now)
            for b in buckets:
                if b + step <= now_ts - pd.Timedelta(seconds=60) and all(x["state_type"] in TERMINAL_TYPES for x in have.get(b, [])):
                    settled.add(b)
            with self._lock:
                self._data[key] = have
                self._settled[key] = settled
        return [{"interval_start": b.isoformat(), "states": have.get(b, [])} for b in buckets], asked


HISTORY_CACHE = HistoryCache()


def clear_caches() -> None:
    """Forget every process-wide cache (runs, history buckets, metrics rows, the run
    index's in-memory frames; the index tables themselves stay)."""
    from prefect_launch.dashboard import index_sync

    RUN_CACHE.clear()
    HISTORY_CACHE.clear()
    METRICS_CACHE.clear()
    STORE_CACHE.clear()
    index_sync.forget_services()


def aligned_range(since: dt.datetime, until: dt.datetime, interval_s: int) -> tuple[dt.datetime, dt.datetime]:
    """[since, until) widened to whole buckets aligned on multiples of the interval (UTC epoch)."""
    s = math.floor(since.timestamp() / interval_s) * interval_s
    e = math.ceil(until.timestamp() / interval_s) * interval_s
    return dt.datetime.fromtimestamp(s, UTC), dt.datetime.fromtimestamp(max(e, s + interval_s), UTC)


def _grouped_history(api: Api, spec: ViewSpec, interval_s: int, pools: list[str], deps: dict[str, dict],
                     runs: pd.DataFrame, cache: HistoryCache, now: dt.datetime) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(total history, history per group). One history request per group, in parallel.

    job: one request per deployment (an indexed filter, cheap) plus runs without a
    deployment; the total is their sum. queue / owner / preset: the total plus one
    request per group; what no group took is shown as "other / unknown".
    status: the total alone, split by state.
    """
    g = spec.grouping
    combos = tag_combos(spec)
    tasks: list[tuple[str, dict]] = []
    partition = False
    if g == "job":
        wanted = set(spec.jobs)
        ids_by_job: dict[str, list[str]] = {}
        for i, d in deps.items():
            # not narrowed by the deployment's own pool: a run can be sent to another pool's
            # queue; the queue filter stays in the request body (work_pools)
            if not wanted or d["name"] in wanted:
                ids_by_job.setdefault(d["name"], []).append(i)
        tasks = [(j, dict(deployment_ids=ids)) for j, ids in sorted(ids_by_job.items())]
        if not wanted:
            tasks.append(("(no deployment)", dict(deployment_ids=[])))
        partition = True
    elif g == "queue":
        tasks = [(p, dict(pools=[p])) for p in (list(spec.queues) or pools)]
    elif g in ("owner", "preset"):
        sel = spec.owners if g == "owner" else spec.presets
        groups = list(sel) or top_groups(runs[g] if not runs.empty else [])
        tasks = [(v, dict(tag=f"{g}:{v}")) for v in groups]

    def one(task: tuple[str, dict, tuple]) -> pd.DataFrame:
        name, narrow, tags = task
        narrow = dict(narrow)
        extra_tag = narrow.pop("tag", None)
        t = tuple(tags)
        if extra_tag:
            dim = extra_tag.split(":")[0] + ":"
            if any(x.startswith(dim) and x != extra_tag for x in tags):
                return history_frame([], name)  # another value of this dimension is filtered: empty
            t = t + ((extra_tag,) if extra_tag not in t else ())
        buckets, _ = cache.get(api, spec, interval_s, t, now=now, **narrow)
        return history_frame(buckets, name)

    group_tasks = [(n, nw, c) for n, nw in tasks for c in combos]
    all_tasks = ([] if partition else [("all", {}, c) for c in combos]) + group_tasks
    frames = list(_POOL.map(one, all_tasks))
    if partition:
        parts = pd.concat(frames, ignore_index=True) if frames else history_frame([], "x")
        total = parts.assign(group="all")
        return total, parts
    total = pd.concat(frames[: len(combos)], ignore_index=True)
    if g == "status" or not tasks:
        per = total.copy()
        per["group"] = per["status"] if g == "status" else "all"
        return total, per
    parts = pd.concat(frames[len(combos):], ignore_index=True)
    rest = subtract_groups(total, parts, f"{OTHER} / {UNKNOWN}")
    return total, pd.concat([parts, rest], ignore_index=True)


def _index_service(api: Api, store: Any, spec: ViewSpec, source: str, use_cache: bool):
    """The run index to serve ``spec`` from, or None for the API path.

    ``source``: "api" never uses the index; "index" builds it first if it does not cover
    the range yet; "auto" uses it when it covers the range and otherwise starts building
    it in the background (this view comes from the API).
    """
    if source == "api" or store is None:
        return None
    from prefect_launch.dashboard import index_sync

    try:
        svc = index_sync.service_for(store, api) if use_cache else index_sync.IndexService(index_sync.RunIndex(store), api)
        if svc.covers(spec.since):
            return svc
        if source == "index":
            index_sync.build(svc.index, api, max(index_sync.index_days(), (dt.datetime.now(UTC) - spec.since).total_seconds() / 86400))
            return svc
        svc.start_build()
    except Exception:
        if source == "index":
            raise
        import logging

        logging.getLogger("prefect_launch.dashboard").exception("run index unavailable; reading from the API")
    return None


def _index_parts(svc: Any, api: Api, spec: ViewSpec, deps: dict, pool_names: list[str], interval_s: int, now: dt.datetime) -> dict:
    """Every run-derived frame of a view, from the run index (see :mod:`.index_view`)."""
    from prefect_launch.dashboard import index_view as IV

    # runs expected before the range can still wait or run in it (occupancy): read a day more
    rows, incremental = svc.frame(spec.since - OCCUPANCY_LOOKBACK, deps, now)
    any_time = IV.select(rows, spec, time=False)
    in_range = IV.select(any_time, spec)
    hist_total, hist = IV.history(in_range, spec, interval_s, now)
    err = IV.errors_rows(any_time, spec, PAGE)
    top = IV.newest(in_range, spec.detail_limit)
    f_logs = _POOL.submit(_error_logs, api, err["id"].tolist())
    details = svc.details(list(top["id"]) + list(err["id"]))
    return dict(hist_total=hist_total, hist=hist, runs=IV.runs_frame(top, details, now), runs_total=len(in_range),
                errors=errors_frame(IV.runs_frame(err, details, now), f_logs.result()),
                # "now" counts are by state already: the status filter does not narrow them (as on the API path)
                now_counts=IV.now_counts(IV.select(rows, replace(spec, statuses=()), time=False), pool_names, now),
                incremental=incremental, occ_rows=any_time, occ_complete=True)


def _api_parts(api: Api, spec: ViewSpec, deps: dict, pool_names: list[str], interval_s: int, now: dt.datetime,
               run_cache: "RunCache", hist_cache: "HistoryCache", f_deps: Any) -> dict:
    """Every run-derived frame of a view, from Prefect's API (aggregates + bounded run reads)."""
    f_runs = _POOL.submit(run_cache.get, api, spec, f_deps.result)
    f_err = _POOL.submit(fetch_errors, api, spec)
    f_counts = _POOL.submit(fetch_now_counts, api, spec, pool_names, now)
    runs_preview = None
    if spec.grouping in ("owner", "preset") and not (spec.owners if spec.grouping == "owner" else spec.presets):
        raw, incremental = f_runs.result()  # the groups to ask for come from the runs
        runs_preview = runs_frame(raw, deps, now)
    hist_total, hist = _grouped_history(api, spec, interval_s, pool_names, deps,
                                        runs_preview if runs_preview is not None else pd.DataFrame(), hist_cache, now)
    raw, incremental = f_runs.result()
    runs = runs_preview if runs_preview is not None else runs_frame(raw, deps, now)
    err_raw, err_logs = f_err.result()
    total = int(hist_total["count"].sum()) if not hist_total.empty else 0
    return dict(hist_total=hist_total, hist=hist, runs=runs, runs_total=max(total, len(runs)),
                errors=errors_frame(runs_frame(err_raw, deps, now), err_logs), now_counts=f_counts.result(), incremental=incremental,
                occ_rows=occupancy_rows(raw, deps), occ_complete=len(raw) < spec.detail_limit)


def occupancy_rows(raw: Sequence[dict], deps: dict) -> pd.DataFrame:
    """Flow-run JSON -> prepared index rows (the occupancy panels' one input on both paths)."""
    from prefect_launch.blocks.run_index import CORE, IndexRow
    from prefect_launch.dashboard import index_view as IV

    recs = [dict(IndexRow.from_flow_run(r).merged(None).model_dump(), synced_ms=0) for r in raw]
    cols = list(dict.fromkeys([*CORE, "name"]))
    return IV.prepare(pd.DataFrame(recs, columns=cols) if recs else pd.DataFrame(columns=cols), deps)


def occupancy_view(rows: pd.DataFrame, spec: ViewSpec, interval_s: int, now: dt.datetime, agents: pd.DataFrame,
                   pool_names: Sequence[str], complete: bool = True):
    """The occupancy panels (:mod:`.occupancy`) for the sidebar's filtered rows."""
    from prefect_launch.dashboard import index_view as IV
    from prefect_launch.dashboard import occupancy as OC

    chosen = spec.owners if spec.grouping == "owner" else spec.presets if spec.grouping == "preset" else ()
    groups = IV.group_values(rows, spec.grouping, chosen) if len(rows) else pd.Series([], dtype=object)
    if spec.grouping == "status" and len(rows):
        groups = rows["status"].astype(object)
    shown = agents[agents["queue"].isin(list(pool_names))] if not agents.empty else agents
    return OC.compute(rows, groups, spec.since, spec.until, interval_s, now, shown, complete=complete)


def load_view(spec: ViewSpec, api_url: Optional[str] = None, use_cache: bool = True, store: Any = "auto",
              now: Optional[dt.datetime] = None, source: str = "auto") -> View:
    """Everything the page shows for one sidebar state.

    Run-derived panels come from the run index when it covers the range (``source``:
    see :func:`_index_service`), else from Prefect's API. With ``use_cache`` the
    process-wide caches make a refresh incremental (the index's frame held in memory;
    on the API path, settled history buckets and finished runs are not asked for again).
    Without it every number is read afresh (what the benchmark times as a cold load).
    """
    import time

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    api = get_api(api_url)
    now = now or dt.datetime.now(UTC)
    interval_s = spec.interval
    run_cache, hist_cache, metrics_cache = (RUN_CACHE, HISTORY_CACHE, METRICS_CACHE) if use_cache else (RunCache(), HistoryCache(), TtlCache())
    store_obj = metrics_store() if store == "auto" else store
    f_pools = _POOL.submit(fetch_pools, api)
    f_deps = _POOL.submit(fetch_deployments, api)
    f_agents = _POOL.submit(fetch_agents, api)
    f_metrics = _POOL.submit(fetch_metrics_cached, metrics_cache, store_obj, spec)
    svc = _index_service(api, store_obj, spec, source, use_cache)
    pools_raw = f_pools.result()
    pools = pd.DataFrame([dict(queue=p["name"], type=p.get("type"), status=p.get("status"), paused=p.get("is_paused"),
                               concurrency_limit=p.get("concurrency_limit"), id=p["id"]) for p in pools_raw],
                         columns=["queue", "type", "status", "paused", "concurrency_limit", "id"])
    pool_names = list(spec.queues) or pools["queue"].tolist()
    f_workers = _POOL.submit(fetch_workers, api, pool_names)
    deps = f_deps.result()
    parts = None
    if svc is not None:
        try:
            parts = _index_parts(svc, api, spec, deps, pool_names, interval_s, now)
        except Exception:
            if source == "index":
                raise
            import logging  # e.g. another process is rebuilding the index: this view comes from the API

            logging.getLogger("prefect_launch.dashboard").exception("run index sync failed; reading from the API")
            svc = None
    if parts is None:
        parts = _api_parts(api, spec, deps, pool_names, interval_s, now, run_cache, hist_cache, f_deps)
    timings["runs"] = time.perf_counter() - t0
    metrics = metrics_frame(f_metrics.result(), spec)
    timings["metrics"] = time.perf_counter() - t0
    agents = agents_frame(f_agents.result(), now)
    t_occ = time.perf_counter()
    occ = occupancy_view(parts["occ_rows"], spec, interval_s, now, agents, pool_names, parts["occ_complete"])
    timings["occupancy"] = time.perf_counter() - t_occ
    hist_total = parts["hist_total"]
    hourly = hist_total if interval_s <= 3600 and 3600 % interval_s == 0 else history_frame([])
    view = View(
        spec=spec, now=now, interval_s=interval_s, pools=pools, hist=parts["hist"], hist_hourly=hourly, runs=parts["runs"],
        runs_total=parts["runs_total"], errors=parts["errors"], now_counts=parts["now_counts"], workers=f_workers.result(),
        agents=agents, metrics=metrics, ui_base=api.ui_url(), incremental=parts["incremental"],
        timings=timings, metrics_available=store_obj is not None, source="index" if svc is not None else "api", occupancy=occ,
    )
    view.totals = dict(runs=int(hist_total["count"].sum()) if not hist_total.empty else 0,
                       queued_s=float(hist_total["queued_s"].sum()) if not hist_total.empty else 0.0,
                       run_s=float(hist_total["run_s"].sum()) if not hist_total.empty else 0.0)
    timings["total"] = time.perf_counter() - t0
    return view


def index_status(api_url: Optional[str] = None, store: Any = "auto") -> Optional[dict]:
    """The run index's state for the page (None without a metrics store)."""
    store_obj = metrics_store() if store == "auto" else store
    if store_obj is None:
        return None
    from prefect_launch.dashboard import index_sync

    try:
        return index_sync.service_for(store_obj, get_api(api_url)).status()
    except Exception as e:
        return dict(built=False, building=False, build_error=f"{type(e).__name__}: {e}")


def options(api_url: Optional[str] = None) -> dict[str, list[str]]:
    """Choices for the sidebar: queues and jobs from Prefect, owners/presets seen in recent runs."""
    api = get_api(api_url)
    pools = sorted(p["name"] for p in fetch_pools(api))
    deps = fetch_deployments(api)
    recent = api.post("/flow_runs/filter", {"flow_runs": {"tags": {"all_": [LAUNCH_TAG]}}, "sort": "EXPECTED_START_TIME_DESC", "limit": PAGE})
    owners = sorted({t.split(":", 1)[1] for r in recent for t in r.get("tags", []) if t.startswith(tag(OWNER, ""))})
    presets = sorted({t.split(":", 1)[1] for r in recent for t in r.get("tags", []) if t.startswith(tag(PRESET, ""))})
    return dict(queues=pools, jobs=sorted({d["name"] for d in deps.values()}), owners=owners, presets=presets)
