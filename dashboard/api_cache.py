"""What the API path keeps between views, so that a refresh reads little from Prefect.

* :class:`RunCache`: per filter set, the newest runs of the range (flow-run JSON); a
  refresh reads only runs expected after the newest one held and re-reads the held runs
  that had not finished; a narrower filter is derived from a wider view held.
* :class:`HistoryCache`: ``/flow_runs/history`` per filter set, bucket by bucket; buckets
  that can no longer change are not asked for again.
* :func:`grouped_history`: the history of a view, total and per group, through it.

They hold what the server said; the frames are made from it by :mod:`.frames`.
"""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from prefect_launch.dashboard import frames as F
from prefect_launch.dashboard.api import (
    Api, fan_out, fetch_deployments, fetch_history, fetch_runs, fetch_runs_by_id, history_from_api, parse_time, run_matches,
    tag_combos,
)
from prefect_launch.dashboard.spec import (
    NO_DEPLOYMENT, OTHER, TERMINAL_TYPES, UNKNOWN, UTC, ViewSpec, aligned_range, iso, narrows,
)


@dataclass
class CachedRuns:
    since: dt.datetime
    until: dt.datetime
    raw: dict[str, dict]
    watermark: str
    total: int
    spec: Optional[ViewSpec] = None
    complete: bool = False  # raw holds every run of the filter set in [since, until]


def _expected(r: dict) -> Optional[dt.datetime]:
    return parse_time(r.get("expected_start_time"))


class RunCache:
    """Per filter set, the newest runs of the range; refreshed incrementally.

    A refresh reads only runs expected after the newest one held (the watermark) and
    re-reads the held runs that had not finished; finished runs do not change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[tuple, CachedRuns] = {}

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def _superset(self, api: Api, spec: ViewSpec) -> Optional[CachedRuns]:
        """A held entry whose filters are wider than ``spec``'s and whose range covers it."""
        with self._lock:
            cands = [e for (url, _), e in self._data.items() if url == api.api_url and e.spec is not None
                     and e.since <= spec.since and e.until <= spec.until + dt.timedelta(seconds=1) and e.until > spec.since
                     and narrows(e.spec, spec)]
        # prefer a complete one, then the one reaching furthest back
        return max(cands, key=lambda e: (e.complete, -min((_expected(r).timestamp() for r in e.raw.values() if _expected(r)),
                                                          default=0)),
                   default=None)

    def _derive(self, api: Api, spec: ViewSpec, wide: CachedRuns, deployments: Callable[[], dict]) -> tuple[list[dict], bool]:
        """The newest runs of ``spec`` from a wider filter's newest runs.

        ``wide`` holds every run of its filter expected after its oldest run t0 (its runs
        are the newest of their range), so the matching runs after t0 are exactly the
        narrower filter's runs after t0; only the ones at or before t0 are read.
        """
        limit = spec.detail_limit
        deps = deployments() if spec.jobs else {}
        held = [r for r in wide.raw.values() if _expected(r) is not None]
        t0 = min((_expected(r) for r in held), default=wide.until)
        lo, hi = spec.since, min(spec.until, wide.until)
        matched = [r for r in held if lo <= _expected(r) <= hi and (wide.complete or _expected(r) > t0)
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
        matched.sort(key=lambda r: _expected(r), reverse=True)
        if wide.complete or len(matched) >= limit:
            return matched[:limit], wide.complete and len(matched) <= limit
        rest = fetch_runs(api, spec, limit=limit - len(matched), until=t0)
        seen = {r["id"] for r in matched}
        out = matched + [r for r in rest if r["id"] not in seen]
        out.sort(key=lambda r: _expected(r) or lo, reverse=True)
        return out[:limit], len(rest) < limit - len(matched)

    def get(self, api: Api, spec: ViewSpec, deployments: Optional[Callable[[], dict]] = None) -> tuple[list[dict], bool]:
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
            wm = max((r.get("expected_start_time") or "" for r in raw), default=iso(spec.since))
            with self._lock:
                self._data[key] = CachedRuns(spec.since, spec.until, {r["id"]: r for r in raw}, wm, len(raw), spec, complete)
            return raw, False
        new_since = max(pd.Timestamp(entry.watermark).to_pydatetime() - dt.timedelta(seconds=1), spec.since)
        new = fetch_runs(api, spec, since=new_since)
        new_ids = {x["id"] for x in new}
        open_ids = [i for i, r in entry.raw.items() if (r.get("state_type") not in TERMINAL_TYPES) and i not in new_ids]
        fresh = fetch_runs_by_id(api, open_ids) if open_ids else []
        merged = dict(entry.raw)
        added = sum(1 for r in new if r["id"] not in merged)
        for r in list(new) + fresh:
            merged[r["id"]] = r
        lo = iso(spec.since)
        keep = sorted((r for r in merged.values() if (r.get("expected_start_time") or "") >= lo),
                      key=lambda r: r.get("expected_start_time") or "", reverse=True)
        dropped = len(merged) - len(keep)
        keep = keep[: spec.detail_limit]
        total = max(entry.total + added - dropped, len(keep))
        wm = max([entry.watermark] + [r.get("expected_start_time") or "" for r in new])
        with self._lock:
            self._data[key] = CachedRuns(spec.since, spec.until, {r["id"]: r for r in keep}, wm, total, spec,
                                         entry.complete and len(keep) < spec.detail_limit)
        return keep, True


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
            got = fetch_history(api, replace(spec, since=q_start, until=end), interval_s, tags, **narrow)
            asked = len(got)
            for b in got:
                have[pd.Timestamp(b["interval_start"])] = b.get("states", [])
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


RUN_CACHE = RunCache()
HISTORY_CACHE = HistoryCache()


def grouped_history(api: Api, spec: ViewSpec, interval_s: int, pools: list[str], deps: dict[str, dict],
                    group_labels: Sequence[str], cache: HistoryCache, now: dt.datetime) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(total history, history per group). One history request per group, in parallel.

    job: one request per deployment (an indexed filter, cheap) plus runs without a
    deployment; the total is their sum. queue / owner / preset: the total plus one
    request per group; what no group took is shown as "other / unknown" (owner / preset
    groups: ``group_labels``' most frequent values unless the filter chose them).
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
            tasks.append((NO_DEPLOYMENT, dict(deployment_ids=[])))
        partition = True
    elif g == "queue":
        tasks = [(p, dict(pools=[p])) for p in (list(spec.queues) or pools)]
    elif g in ("owner", "preset"):
        groups = list(spec.chosen_groups()) or F.top_groups(group_labels)
        tasks = [(v, dict(tag=f"{g}:{v}")) for v in groups]

    def one(task: tuple[str, dict, tuple]) -> pd.DataFrame:
        name, narrow, tags = task
        narrow = dict(narrow)
        extra_tag = narrow.pop("tag", None)
        t = tuple(tags)
        if extra_tag:
            dim = extra_tag.split(":")[0] + ":"
            if any(x.startswith(dim) and x != extra_tag for x in tags):
                return history_from_api([], name)  # another value of this dimension is filtered: empty
            t = t + ((extra_tag,) if extra_tag not in t else ())
        buckets, _ = cache.get(api, spec, interval_s, t, now=now, **narrow)
        return history_from_api(buckets, name)

    group_tasks = [(n, nw, c) for n, nw in tasks for c in combos]
    all_tasks = ([] if partition else [("all", {}, c) for c in combos]) + group_tasks
    frames = fan_out(one, all_tasks)
    if partition:
        parts = pd.concat(frames, ignore_index=True) if frames else F.empty_history()
        return parts.assign(group="all"), parts
    total = pd.concat(frames[: len(combos)], ignore_index=True)
    if g == "status" or not tasks:
        per = total.copy()
        per["group"] = per["status"] if g == "status" else "all"
        return total, per
    parts = pd.concat(frames[len(combos):], ignore_index=True)
    rest = F.subtract_groups(total, parts, f"{OTHER} / {UNKNOWN}")
    return total, pd.concat([parts, rest], ignore_index=True)
