"""Everything one visit of the monitor's main page reads, computed together and kept ready.

The page (``dashboard/app.py``) only lays a :class:`PageData` out. Its reads (the view, the
range's cost rows, the waiting runs, the queues' links) run in parallel, once per sidebar state
and step of the page's clock, in :data:`PAGE` (:class:`.page_keeper.PageKeeper`): while the monitor
is served by :mod:`.serve`, the views asked for in the last five minutes are computed for the next
step before it begins, so a visit finds them ready rather than waiting seconds for them at 100k runs.
"""

from __future__ import annotations

import datetime as dt
import html
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import pandas as pd

from prefect_launch.settings import env_seconds
from prefect_launch.dashboard import metrics_source as M
from prefect_launch.dashboard.cost_rows import CostRows
from prefect_launch.dashboard import page_figures as PF
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import view as V
from prefect_launch.dashboard.page_keeper import PageKeeper

CACHE_TTL_S = 30.0  # a fixed range's page is read again after this long
KEEP_S = float(os.environ.get("LAUNCH_MONITOR_KEEP_SECONDS", "300"))  # views kept ready this long after their last visit
# the next step's view is read from LEAD_S before the step on; while a visit is being drawn (QUIET_S after
# it asked for its view: the script, then the browser's drawing) the read waits, up to the last moment
# (page_keeper.PageKeeper): figures are then at most a step plus LEAD_S old
LEAD_S = 4.0
QUIET_S = 2.5


def stale_max_s() -> float:
    """While a visit's view is read, the newest page of its sidebar state is shown if at most this old."""
    return env_seconds("LAUNCH_MONITOR_STALE_SECONDS", 120)


def slow_read_s() -> float:
    """... when reading it took this long (a keeper this slow cannot stay ahead of the clock)."""
    return env_seconds("LAUNCH_MONITOR_SLOW_READ_SECONDS", S.PAGE_STEP_S / 2)

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="monitor-page")
COST_ROWS = CostRows()  # the cost rows of the ranges read, kept between reads (only changes are read again)


@dataclass
class PageData:
    """What the page draws for one sidebar state; read-only once made (the page never changes it)."""

    view: V.View
    costs: Optional[pd.DataFrame] = None  # per-run cost rows of the range, all owners/jobs (cost.run_costs)
    costs_error: Optional[str] = None
    waiting: list = field(default_factory=list)  # deployments.wait_order.WaitingRun, the queues' waiting runs
    waiting_error: Optional[str] = None
    links: dict[str, str] = field(default_factory=dict)  # queue -> its links as escaped HTML anchors
    links_error: Optional[str] = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return text


def read_costs(since: dt.datetime, until: dt.datetime, queues: tuple) -> pd.DataFrame:
    """Per-run cost figures of the range (:func:`prefect_launch.dashboard.cost.run_costs`), read from
    the store by what changed since the last read (:mod:`.cost_rows`)."""
    from prefect_launch.dashboard import api as A

    store = M.metrics_store()
    if store is None:
        raise RuntimeError("no metrics store")
    try:
        deployments = A.fetch_deployments(A.get_api())  # job names for records that hold only the id
    except Exception:
        deployments = {}
    return COST_ROWS.read(store, since, until, queues, deployments=deployments)


def read_waiting(queues: tuple) -> list:
    """Waiting runs of ``queues`` with queue position and predicted start
    (:func:`prefect_launch.deployments.wait_order.waiting_runs`, the same as `queue ls` / `runs ls`)."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from prefect_launch.dashboard import api as A
    from prefect_launch.deployments.wait_order import waiting_runs

    # no retries: a kept client that has connected once retries a refused connection for about a minute
    # (Prefect's backoff), holding the page's read; the panel says why now and the next step reads again
    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}):
        return waiting_runs(A.prefect_client(), list(queues))


def read_links(queues: tuple) -> dict[str, str]:
    """Each queue's saved links (Launch Queue Links blocks) as escaped anchors; queues without links left out."""
    from prefect_launch.blocks.queue_links import QueueLinks
    from prefect_launch.dashboard.api import get_api

    out: dict[str, str] = {}
    for q, data in QueueLinks.saved_data(get_api(), queues).items():
        try:
            blk = QueueLinks.from_saved(q, data)
        except ValueError as exc:  # edited elsewhere into something not allowed: said, not drawn
            out[q] = html.escape(f"not shown: {exc}")
            continue
        if blk.links:
            out[q] = blk.html()
    return out


def compute(spec: S.ViewSpec) -> PageData:
    """Read everything for ``spec``: the view, and beside it the cost rows, waiting runs and links
    (each of those may fail alone: its panel says why, the rest of the page stands). The page is
    remembered as its sidebar state's newest (:func:`last_good`, :func:`get_or_newest`)."""
    key = _state_key(spec)
    with _STATE_LOCK:
        _READING[key] = _READING.get(key, 0) + 1
    t0 = time.perf_counter()
    try:
        page = _read(spec)
    except Exception as exc:
        with _STATE_LOCK:  # the count drops before the failure is seen: the visit told of it starts the next read
            _READING[key] -= 1
            _FAILED[key] = exc
        raise
    with _STATE_LOCK:
        _READING[key] -= 1
        _FAILED.pop(key, None)
    if spec.live and getattr(page.view, "incremental", False):  # a first (cold) read is no measure of the reads each step
        S.note_read(time.perf_counter() - t0)
    _remember(spec, page)
    return page


def _read(spec: S.ViewSpec) -> PageData:
    queues = tuple(sorted(spec.queues)) or tuple(options()["queues"])
    f_costs = _POOL.submit(read_costs, spec.since, spec.until, tuple(spec.queues))
    f_wait = _POOL.submit(read_waiting, queues)
    f_links = _POOL.submit(read_links, queues)
    view = V.load_view(spec)
    out = PageData(view=view)
    for fut, name in ((f_costs, "costs"), (f_wait, "waiting"), (f_links, "links")):
        try:
            setattr(out, name, fut.result())
        except Exception as exc:
            setattr(out, f"{name}_error", _first_line(exc))
    PF.prime(out)  # the figures over every cost row, made here (ahead of the step) rather than in a visit
    return out


def advance(spec: S.ViewSpec) -> Optional[tuple[S.ViewSpec, float]]:
    """A live view's key in the next step of the page's clock and when that step begins."""
    if not spec.live:
        return None
    return spec.next_step(), spec.until.timestamp()


def page_ttl_s() -> float:
    """How long a page serves: :data:`CACHE_TTL_S`, and a live page its whole step of the page's clock, however long."""
    return max(CACHE_TTL_S, 2.0 * S.page_step())


PAGE: PageKeeper[S.ViewSpec, PageData] = PageKeeper(compute, advance, ttl_s=page_ttl_s, keep_s=KEEP_S, lead_s=LEAD_S,
                                                 quiet_s=QUIET_S)
_OPTIONS: PageKeeper[str, dict] = PageKeeper(lambda _k: V.options(), lambda _k: None, ttl_s=60.0)


_LAST_OPTIONS: list[dict] = []


def options() -> dict[str, list[str]]:
    """The sidebar's choices (queues, jobs, owners, presets), read at most once a minute; while they
    cannot be read, the last ones read (the page then says why its figures are old). Once a minute's
    choices are out of date they are read again in the background and the visit gets the last ones: the
    read is a second of a visit at 1M runs, for choices that change seldom (a new queue shows a visit later)."""
    if _LAST_OPTIONS and not _OPTIONS.peek("options"):
        _OPTIONS.request("options")
        return _LAST_OPTIONS[0]
    try:
        opts = _OPTIONS.get("options")
    except Exception:
        if not _LAST_OPTIONS:
            raise
        return _LAST_OPTIONS[0]
    _LAST_OPTIONS[:] = [opts]
    return opts


_LAST_GOOD: dict[tuple, PageData] = {}  # sidebar state (times aside) -> its newest page
_READING: dict[tuple, int] = {}  # sidebar state -> reads of it under way
_FAILED: dict[tuple, BaseException] = {}  # sidebar state -> why its last read failed (until one succeeds)
_STATE_LOCK = threading.Lock()  # _READING and _FAILED change on the keeper's and visits' threads
_LAST_GOOD_MAX = 32


def _state_key(spec: S.ViewSpec) -> tuple:
    """A sidebar state without its clock: a live range keeps its key as the clock moves."""
    return (spec.until - spec.since, spec.live, spec.grouping, spec.interval_s, spec.filter_key(),
            None if spec.live else (spec.since, spec.until))


def _remember(spec: S.ViewSpec, page: PageData) -> None:
    """Keep ``page`` as its sidebar state's newest (an older read finishing late does not replace it)."""
    key = _state_key(spec)
    held = _LAST_GOOD.get(key)
    if held is None or held.view.now <= page.view.now:
        _LAST_GOOD[key] = page
    while len(_LAST_GOOD) > _LAST_GOOD_MAX:
        _LAST_GOOD.pop(next(iter(_LAST_GOOD)))


def get(spec: S.ViewSpec) -> PageData:
    """``spec``'s page (ready, or read now)."""
    return PAGE.get(spec)


def get_or_newest(spec: S.ViewSpec, now: Optional[dt.datetime] = None) -> tuple[PageData, bool]:
    """``spec``'s page if it is read; while it is being read, the newest page of the same sidebar state
    if that was read within :func:`stale_max_s` and its read took :func:`slow_read_s` or more
    (``(page, True)``: the visit shows it at once, says how old it is and updates itself, see
    :func:`newer_than`); else waits for ``spec``'s page (as it does for a view read in a second or two).

    Why: where a view takes longer to read than a step of the page's clock (about 1M runs on two cores),
    every visit in a new step would wait for its read, and the keeper can never be ahead."""
    if PAGE.peek(spec):
        return PAGE.get(spec), False
    key = _state_key(spec)
    held = _LAST_GOOD.get(key)
    now = now or dt.datetime.now(S.UTC)
    slow = held is not None and held.view.timings.get("total", 0.0) >= slow_read_s()
    if not slow or (now - held.view.now).total_seconds() > stale_max_s():
        return PAGE.get(spec), False
    if not _READING.get(key):  # one read of a sidebar state at a time: more would only slow each other
        PAGE.request(spec)
    if key in _FAILED:  # the last read of this state failed: the page says why (and shows its last good figures)
        raise _FAILED[key]
    return held, True


def newer_than(spec: S.ViewSpec, shown: dt.datetime) -> bool:
    """Whether a page of ``spec``'s sidebar state read after ``shown`` (its ``view.now``) is ready, or
    its read failed (the page then says why)."""
    held = _LAST_GOOD.get(_state_key(spec))
    return (held is not None and held.view.now > shown) or _state_key(spec) in _FAILED


def last_good(spec: S.ViewSpec) -> Optional[PageData]:
    """The newest page this process read for ``spec``'s sidebar state (read at its ``view.now``), for
    showing while Prefect's API cannot be read; None if there is none."""
    return _LAST_GOOD.get(_state_key(spec))


def ready(spec: S.ViewSpec) -> bool:
    """Whether ``spec``'s page is read already (the page shows a spinner otherwise)."""
    return PAGE.peek(spec)


def refresh() -> None:
    """Read everything afresh on the next visit (Refresh now); the last good pages stay for an outage."""
    PAGE.clear()
    _OPTIONS.clear()
    M.METRICS_CACHE.clear()
    COST_ROWS.clear()


def clear() -> None:
    """Forget everything read, the last good pages too (tests)."""
    refresh()
    _LAST_GOOD.clear()
    _FAILED.clear()
    _LAST_OPTIONS.clear()


def prepare(now: Optional[dt.datetime] = None) -> PageData:
    """Read the default view (what a visit opens on) now, so the first visit finds it ready. Where that
    first (cold) read outlasted its step of the page's clock (a minute at 1M runs), the step it ends in is
    read too (incremental, and it sets the clock's step, see :func:`.spec.note_read`): else the first
    visits would meet figures a minute old while the keeper catches up."""
    options()
    first = S.default_spec(now)
    page = PAGE.get(first)
    if now is None and S.default_spec() != first:
        page = PAGE.get(S.default_spec())
    return page


def keep_ready() -> None:
    """Keep the views people look at ready ahead of the page's clock (see the module doc)."""
    PAGE.start()


def status() -> dict[str, Any]:
    """Counters for the page's footer: how often a visit found its page ready."""
    return dict(hits=PAGE.hits, misses=PAGE.misses, ahead=PAGE.ahead, keeping=PAGE.running)


def links_changed(queue: str, anchors: str) -> None:
    """A queue's links were saved or removed: the pages read already show the new ones at once."""
    for page in PAGE.values():
        if anchors:
            page.links[queue] = anchors
        else:
            page.links.pop(queue, None)
