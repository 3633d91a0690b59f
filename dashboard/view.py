"""View assembly: everything the page shows for one sidebar state (:func:`load_view`).

The run panels come from one of two sources, and each source only *reads*:

* the run index (:mod:`.index_sync`), once it covers the range: its prepared rows,
  filtered and aggregated in memory (:mod:`.index_view`);
* Prefect's API (:mod:`.api`, :mod:`.api_cache`) until then: server-side aggregates and
  counts, and the newest ``detail_limit`` runs turned into the same prepared rows.

Either gives a :class:`RunInputs`; :func:`run_frames` and :func:`occupancy_view` make every
run panel's frame from it with the one producer of each (:mod:`.frames`, :mod:`.occupancy`,
:mod:`.summary`), so a view cannot differ by where it came from except in what the source
could read.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import pandas as pd

from prefect_launch.dashboard import frames as F
from prefect_launch.dashboard import index_sync
from prefect_launch.dashboard import index_view as IV
from prefect_launch.dashboard import occupancy_panels as OP
from prefect_launch.dashboard.occupancy_memo import SettledMemo
from prefect_launch.dashboard.api import (
    IO_POOL, PAGE, Api, fetch_agents, fetch_deployments, fetch_error_logs, fetch_errors, fetch_now_counts, fetch_pools,
    fetch_recent_labels, fetch_workers, get_api,
)
from prefect_launch.dashboard.api_cache import HISTORY_CACHE, RUN_CACHE, HistoryCache, RunCache, grouped_history
from prefect_launch.dashboard.metrics_source import (
    METRICS_CACHE, STORE_CACHE, TtlCache, fetch_metrics_cached, metrics_frame, metrics_store,
)
from prefect_launch.dashboard.spec import UTC, ViewSpec
from prefect_launch.dashboard.summary import summary_frame

log = logging.getLogger("prefect_launch.dashboard")
OCCUPANCY_LOOKBACK = dt.timedelta(days=1)  # runs expected this long before a range are read for its occupancy


@dataclass
class View:
    spec: ViewSpec
    now: dt.datetime
    interval_s: int
    pools: pd.DataFrame
    hist: pd.DataFrame  # long: bucket, group, state_type, status, count, run_s, queued_s
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
    occupancy: Optional[OP.Occupancy] = None
    summary: Optional[pd.DataFrame] = None  # the queue-summary table (:func:`.summary.summary_frame`)
    # what the page built from this view to draw (components' payloads), by what it is: every visit within a
    # step of the page's clock gets this same View, so only the first builds them (dashboard/page_figures.once)
    drawn: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def truncated(self) -> bool:
        return self.runs_total > len(self.runs)


@dataclass
class RunInputs:
    """What one source read for the run panels of a view (prepared rows and plain columns)."""

    hist_total: pd.DataFrame  # :func:`.frames.history_frame`, all groups together
    hist: pd.DataFrame  # the same per group
    listed: pd.DataFrame  # prepared rows of the newest runs of the range, newest first
    failed: pd.DataFrame  # prepared rows of failed / crashed runs that ended in the range, newest first
    details: pd.DataFrame  # detail records (names, messages, resources) of the listed and failed runs
    error_logs: list  # the failed runs' newest ERROR logs
    counts: pd.DataFrame  # long counts now: queue, status, count
    occupancy_rows: pd.DataFrame  # prepared rows the occupancy panels are computed from
    occupancy_complete: bool  # False: only the newest runs (the API path)
    runs_total: int
    incremental: bool


def clear_caches() -> None:
    """Forget every process-wide cache (runs, history buckets, metrics rows, the run
    index's in-memory frames; the index tables themselves stay)."""
    RUN_CACHE.clear()
    HISTORY_CACHE.clear()
    METRICS_CACHE.clear()
    STORE_CACHE.clear()
    index_sync.forget_services()


# ----------------------------------------------------------------- sources


def index_service(api: Api, store: Any, spec: ViewSpec, source: str, use_cache: bool) -> Optional[index_sync.IndexService]:
    """The run index to serve ``spec`` from, or None for the API path.

    ``source``: "api" never uses the index; "index" builds it first if it does not cover
    the range yet; "auto" uses it when it covers the range and otherwise starts building
    it in the background (this view comes from the API).
    """
    if source == "api" or store is None:
        return None
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
        log.exception("run index unavailable; reading from the API")
    return None


def index_inputs(svc: index_sync.IndexService, api: Api, spec: ViewSpec, deps: dict, interval_s: int,
                 pool_names: list[str], now: dt.datetime) -> RunInputs:
    """The run panels' inputs from the run index (every run of the range, in memory)."""
    # runs expected before the range can still wait or run in it (occupancy): read a day more
    rows, incremental = svc.frame(spec.since - OCCUPANCY_LOOKBACK, deps, now)
    any_time = IV.select(rows, spec, time=False)
    in_range = IV.select(any_time, spec)
    failed = IV.errors_rows(any_time, spec, PAGE)
    listed = IV.newest(in_range, spec.detail_limit)
    # the listed runs' other columns and the errors' logs are read while the history is counted
    f_logs = IO_POOL.submit(fetch_error_logs, api, failed["id"].tolist())
    f_details = IO_POOL.submit(svc.details, list(listed["id"]) + list(failed["id"]))
    hist_total, hist = IV.history(in_range, spec, interval_s, now)
    # "now" counts are by state already: the status filter does not narrow them (as on the API path)
    counts = IV.now_counts(IV.select(rows, replace(spec, statuses=()), time=False), pool_names, now)
    return RunInputs(hist_total=hist_total, hist=hist, listed=listed, failed=failed, details=f_details.result(),
                     error_logs=f_logs.result(),
                     counts=counts, occupancy_rows=any_time, occupancy_complete=True, runs_total=len(in_range),
                     incremental=incremental)


def api_inputs(api: Api, spec: ViewSpec, deps: dict, interval_s: int, pool_names: list[str], now: dt.datetime,
               run_cache: RunCache, hist_cache: HistoryCache, f_deps: Any) -> RunInputs:
    """The run panels' inputs from Prefect's API (aggregates, counts and the newest runs)."""
    f_runs = IO_POOL.submit(run_cache.get, api, spec, f_deps.result)
    f_err = IO_POOL.submit(fetch_errors, api, spec)
    f_counts = IO_POOL.submit(fetch_now_counts, api, spec, pool_names, now)
    rows = details = None
    labels: Sequence[str] = ()
    if spec.grouping in ("owner", "preset") and not spec.chosen_groups():
        raw, incremental = f_runs.result()  # the groups to ask for come from the runs
        rows, details = IV.from_flow_runs(raw, deps)
        labels = rows[spec.grouping].astype(object).tolist()
    hist_total, hist = grouped_history(api, spec, interval_s, pool_names, deps, labels, hist_cache, now)
    raw, incremental = f_runs.result()
    if rows is None:
        rows, details = IV.from_flow_runs(raw, deps)
    err_raw, err_logs = f_err.result()
    failed, err_details = IV.from_flow_runs(err_raw, deps)
    total = int(hist_total["count"].sum()) if not hist_total.empty else 0
    return RunInputs(hist_total=hist_total, hist=hist, listed=IV.newest(rows), failed=IV.newest(failed, by="end_us"),
                     details=pd.concat([details, err_details], ignore_index=True), error_logs=err_logs, counts=f_counts.result(),
                     occupancy_rows=rows, occupancy_complete=len(raw) < spec.detail_limit, runs_total=max(total, len(rows)),
                     incremental=incremental)


# -------------------------------------------------------------- assembly


SETTLED = SettledMemo()  # the settled runs' occupancy sums per view, kept across steps of the page's clock


def occupancy_view(rows: pd.DataFrame, spec: ViewSpec, interval_s: int, now: dt.datetime, agents: pd.DataFrame,
                   pool_names: Sequence[str], complete: bool = True) -> OP.Occupancy:
    """The occupancy panels (:mod:`.occupancy`) for the sidebar's filtered rows."""
    if spec.grouping == "status":
        groups = rows["status"].astype(object)
    else:
        groups = IV.group_values(rows, spec.grouping, spec.chosen_groups()) if len(rows) else pd.Series([], dtype=object)
    shown = agents[agents["queue"].isin(list(pool_names))] if not agents.empty else agents
    key = (spec.filter_key(), spec.grouping, spec.chosen_groups(), interval_s)
    return OP.compute(rows, groups, spec.since, spec.until, interval_s, now, shown, complete=complete, memo=SETTLED, key=key)


def run_frames(inputs: RunInputs, spec: ViewSpec, pools: pd.DataFrame, workers: pd.DataFrame, agents: pd.DataFrame,
               pool_names: Sequence[str], now: dt.datetime) -> dict:
    """The run panels' frames from either source's inputs, each by its one producer."""
    runs = F.runs_frame(inputs.listed, inputs.details, now)
    now_counts = F.now_counts_frame(inputs.counts, pool_names)
    return dict(hist=inputs.hist, runs=runs, runs_total=inputs.runs_total, now_counts=now_counts,
                errors=F.errors_frame(F.runs_frame(inputs.failed, inputs.details, now), inputs.error_logs),
                totals=F.totals(inputs.hist_total), incremental=inputs.incremental,
                summary=summary_frame(pools, now_counts, workers, agents, runs, tuple(spec.queues)))


def load_view(spec: ViewSpec, api_url: Optional[str] = None, use_cache: bool = True, store: Any = "auto",
              now: Optional[dt.datetime] = None, source: str = "auto") -> View:
    """Everything the page shows for one sidebar state.

    Run-derived panels come from the run index when it covers the range (``source``:
    see :func:`index_service`), else from Prefect's API. With ``use_cache`` the
    process-wide caches make a refresh incremental (the index's frame held in memory;
    on the API path, settled history buckets and finished runs are not asked for again).
    Without it every number is read afresh (what the benchmark times as a cold load).
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    api = get_api(api_url)
    now = now or dt.datetime.now(UTC)
    interval_s = spec.interval
    run_cache, hist_cache, metrics_cache = (RUN_CACHE, HISTORY_CACHE, METRICS_CACHE) if use_cache else (RunCache(), HistoryCache(), TtlCache())
    store_obj = metrics_store() if store == "auto" else store
    f_pools = IO_POOL.submit(fetch_pools, api)
    f_deps = IO_POOL.submit(fetch_deployments, api)
    f_agents = IO_POOL.submit(fetch_agents, api)
    f_metrics = IO_POOL.submit(fetch_metrics_cached, metrics_cache, store_obj, spec)
    svc = index_service(api, store_obj, spec, source, use_cache)
    # the index syncs while the queues and jobs are read (its frame needs the jobs' names); a failed
    # sync is handled below as one in index_inputs would be
    f_sync = IO_POOL.submit(svc.sync_if_due, now) if svc is not None else None
    pools = F.pools_frame(f_pools.result())
    pool_names = list(spec.queues) or pools["queue"].tolist()
    f_workers = IO_POOL.submit(fetch_workers, api, pool_names)
    deps = f_deps.result()
    inputs = None
    if svc is not None:
        try:
            f_sync.result()
            inputs = index_inputs(svc, api, spec, deps, interval_s, pool_names, now)
        except Exception:
            if source == "index":
                raise
            # e.g. another process is rebuilding the index: this view comes from the API
            log.exception("run index sync failed; reading from the API")
            svc = None
    if inputs is None:
        inputs = api_inputs(api, spec, deps, interval_s, pool_names, now, run_cache, hist_cache, f_deps)
    timings["runs"] = time.perf_counter() - t0
    metrics = metrics_frame(f_metrics.result(), spec)
    timings["metrics"] = time.perf_counter() - t0
    agents = F.agents_frame(f_agents.result(), now)
    workers = F.workers_frame(f_workers.result())
    t_occ, c_occ = time.perf_counter(), time.thread_time()
    occ = occupancy_view(inputs.occupancy_rows, spec, interval_s, now, agents, pool_names, inputs.occupancy_complete)
    timings["occupancy"] = time.perf_counter() - t_occ
    timings["occupancy_cpu"] = time.thread_time() - c_occ  # this thread's CPU: what it costs on an idle core
    view = View(spec=spec, now=now, interval_s=interval_s, pools=pools, workers=workers, agents=agents, metrics=metrics,
                ui_base=api.ui_url(), timings=timings, metrics_available=store_obj is not None,
                source="index" if svc is not None else "api", occupancy=occ, **run_frames(inputs, spec, pools, workers, agents,
                                                                                         pool_names, now))
    timings["total"] = time.perf_counter() - t0
    return view


def index_status(api_url: Optional[str] = None, store: Any = "auto") -> Optional[dict]:
    """The run index's state for the page (None without a metrics store)."""
    store_obj = metrics_store() if store == "auto" else store
    if store_obj is None:
        return None
    try:
        return index_sync.service_for(store_obj, get_api(api_url)).status()
    except Exception as e:
        return dict(built=False, building=False, build_error=f"{type(e).__name__}: {e}")


def options(api_url: Optional[str] = None) -> dict[str, list[str]]:
    """Choices for the sidebar: queues and jobs from Prefect, owners/presets seen in recent runs."""
    api = get_api(api_url)
    pools = sorted(p["name"] for p in fetch_pools(api))
    deps = fetch_deployments(api)
    return dict(queues=pools, jobs=sorted({d["name"] for d in deps.values()}), **fetch_recent_labels(api))
