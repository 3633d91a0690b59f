"""What one view of the queue monitor shows: the sidebar's selection and its vocabulary.

Pure and import-light (no I/O, no pandas): every other dashboard module imports it and
it imports none of them.

Conventions (the launch worker produces them): queue = work pool; priority = the
pool's work queue (critical/high/medium/low); job = deployment name; a launched run has
tags ``launch``, ``owner:<user>``, ``preset:<name>`` and job variables ``preset``,
``cpu``, ``memory``, ``gpu``; a waiting run carries the label ``launch.waiting``.
Runs without them show owner/preset ``unknown``.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, replace
from typing import Optional

UTC = dt.timezone.utc
MAX_GROUPS = 12  # series per chart before the rest is folded into "other"
UNKNOWN = "unknown"
OTHER = "other"
NO_DEPLOYMENT = "(no deployment)"

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
PAGE_STEP_S = 10  # the page's clock moves in these steps (see page_now): figures stay at most 10 s old ...
# ... while a page is read in well under a step; where reading it takes longer (about 1M runs on two cores) the
# clock moves in longer steps (step_for), so the next step's page can still be read before it begins
PAGE_STEPS = (PAGE_STEP_S, 20, 30, 60)
STEP_PER_READ = 2.5  # a step at least this many times the page's read: the read ahead has time and CPU to spare
RANGES = {"Last 1 hour": dt.timedelta(hours=1), "Last 24 hours": dt.timedelta(days=1), "Last 7 days": dt.timedelta(days=7)}
DEFAULT_RANGE = "Last 7 days"  # what the sidebar shows first
DEFAULT_GROUPING = "job"
DEFAULT_DETAIL_LIMIT = 1000
NICE_INTERVALS = (60, 120, 300, 600, 900, 1800, 3600, 2 * 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400)


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
    live: bool = False  # a range that ends at the page's clock ("last 7 days") and moves with it

    def next_step(self) -> "ViewSpec":
        """The same live view at the page's clock's next step after its own end (see :func:`page_now`)."""
        step = dt.timedelta(seconds=page_now(self.until + dt.timedelta(seconds=1)).timestamp() - self.until.timestamp())
        return replace(self, since=self.since + step, until=self.until + step)

    @property
    def interval(self) -> int:
        return self.interval_s or interval_for(self.since, self.until)

    def filter_key(self) -> tuple:
        """The spec without its times (what the incremental run cache is keyed by)."""
        return (self.queues, self.owners, self.jobs, self.statuses, self.presets, self.detail_limit)

    def filters_note(self) -> str:
        """The filters in force, for the page's caption (a screenshot shared says what it counts):
        e.g. ``queues gpu-a, gpu-b · owners ana``; "" when nothing is filtered."""
        parts = [(name, vals) for name, vals in (("queues", self.queues), ("owners", self.owners), ("jobs", self.jobs),
                                                  ("statuses", self.statuses), ("presets", self.presets)) if vals]
        return " · ".join(f"{name} {', '.join(vals)}" for name, vals in parts)

    def state_types(self) -> list[str]:
        """Prefect state types the status filter selects ([] = all)."""
        return [t for s in self.statuses for t in TYPES_OF_STATUS[s]]

    def chosen_groups(self) -> tuple[str, ...]:
        """The filter values of the grouping's own dimension (owner / preset), if any."""
        return self.owners if self.grouping == "owner" else self.presets if self.grouping == "preset" else ()


def interval_for(since: dt.datetime, until: dt.datetime, target: int = 170) -> int:
    """A round bucket size giving about ``target`` (at most 500) buckets."""
    span = max((until - since).total_seconds(), 60.0)
    for s in NICE_INTERVALS:
        if span / s <= target:
            return s
    return int(math.ceil(span / 500))


_STEP = [PAGE_STEP_S]  # the page clock's step now (page_step), set from the reads' lengths (note_read)


def page_step() -> int:
    """Seconds the page's clock moves in now (one of :data:`PAGE_STEPS`)."""
    return _STEP[0]


def step_for(read_s: float, step: int) -> int:
    """The step after a page read took ``read_s`` seconds, from ``step``: the shortest of :data:`PAGE_STEPS`
    at least :data:`STEP_PER_READ` reads long, at once where that is longer; shorter one step at a time, and
    only once a read takes two thirds of what the shorter step asks (no flapping around a threshold)."""
    need = next((s for s in PAGE_STEPS if s >= STEP_PER_READ * read_s), PAGE_STEPS[-1])
    if need >= step:
        return need
    shorter = max(s for s in PAGE_STEPS if s < step)  # one step shorter at a time, with room to spare
    return shorter if read_s * STEP_PER_READ * 1.5 <= shorter else step


def note_read(read_s: float) -> int:
    """A live page was read in ``read_s`` seconds: the page's clock moves in :func:`step_for`'s steps from
    now on (a visit and the read ahead then agree on the next step's range). Returns the step."""
    _STEP[0] = step_for(read_s, _STEP[0])
    return _STEP[0]


def page_now(now: Optional[dt.datetime] = None) -> dt.datetime:
    """The page's clock: ``now`` up to the next whole step (:func:`page_step`, :data:`PAGE_STEP_S` while
    pages are read in well under it). Every visit and rerun within a step reads the same range, so the
    view and the cost rows of a range are computed once per step, not once per visit."""
    step = page_step()
    now = (now or dt.datetime.now(UTC)).replace(microsecond=0)
    return now + dt.timedelta(seconds=step - int(now.timestamp()) % step)


def default_spec(now: Optional[dt.datetime] = None) -> "ViewSpec":
    """The view a visit opens on (the sidebar's defaults) at the page's clock ``page_now(now)``."""
    until = page_now(now)
    return ViewSpec(since=until - RANGES[DEFAULT_RANGE], until=until, grouping=DEFAULT_GROUPING,
                    detail_limit=DEFAULT_DETAIL_LIMIT, live=True)


def time_window(choice: str, now: Optional[dt.datetime] = None, custom: Optional[tuple] = None) -> tuple[dt.datetime, dt.datetime]:
    """(since, until) for a sidebar choice; ``custom`` = (start date, end date) inclusive."""
    now = now or dt.datetime.now(UTC)
    if choice in RANGES:
        return now - RANGES[choice], now
    start, end = custom
    since = dt.datetime.combine(start, dt.time(), tzinfo=UTC)
    until = dt.datetime.combine(end, dt.time(), tzinfo=UTC) + dt.timedelta(days=1)
    return since, min(until, now) if until > now else until


def aligned_range(since: dt.datetime, until: dt.datetime, interval_s: int) -> tuple[dt.datetime, dt.datetime]:
    """[since, until) widened to whole buckets aligned on multiples of the interval (UTC epoch)."""
    s = math.floor(since.timestamp() / interval_s) * interval_s
    e = math.ceil(until.timestamp() / interval_s) * interval_s
    return dt.datetime.fromtimestamp(s, UTC), dt.datetime.fromtimestamp(max(e, s + interval_s), UTC)


def narrows(wide: ViewSpec, narrow: ViewSpec) -> bool:
    """Every run ``narrow``'s filters select is also selected by ``wide``'s (times aside)."""
    return all(not w or (n and set(n) <= set(w)) for w, n in (
        (wide.queues, narrow.queues), (wide.owners, narrow.owners), (wide.jobs, narrow.jobs),
        (wide.statuses, narrow.statuses), (wide.presets, narrow.presets)))


def group_column(grouping: str) -> str:
    return {"owner": "owner", "job": "job", "queue": "queue", "preset": "preset", "status": "status"}[grouping]


def us(t: dt.datetime) -> int:
    """Epoch microseconds of an aware datetime (the run index's time unit; exact integers)."""
    d = t.astimezone(UTC) - dt.datetime(1970, 1, 1, tzinfo=UTC)
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


def iso(t: dt.datetime) -> str:
    """A datetime as the ISO string Prefect's API filters take (UTC)."""
    return t.astimezone(UTC).isoformat()
