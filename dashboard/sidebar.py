"""The monitor's sidebar: queues, time range, grouping, filters and the advanced options, read as the
view they ask for (:class:`.spec.ViewSpec`). Its own module so that what the sidebar alone costs a
visit can be drawn without the page (``bench/dashboard.py``'s floor with controls)."""

from __future__ import annotations

import datetime as dt
from typing import Callable

import streamlit as st

from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard.widgets import pick, single


LIMITS = (100, 1000, 5000, 10000)  # runs shown per run panel (the newest)


def sidebar(opts: dict, refresh: Callable[[], None]) -> S.ViewSpec:
    """The sidebar's choices as the view they ask for. ``opts``: the queues, jobs, owners and presets to
    offer; ``refresh``: what Refresh now does (the page's reads start afresh). Several of a few options are
    pills, of many a multiselect; one of a few, a segmented control (:mod:`.widgets`)."""
    sb = st.sidebar
    queues = pick("Queues", opts["queues"], "queues", "all queues", where=sb, heading="Queue monitor")
    choice = single("Time range", [*S.RANGES, "Custom"], "range", S.DEFAULT_RANGE, where=sb)
    now = S.page_now()  # up to the next step of the page's clock: visits and reruns within it hit the caches
    custom = None
    if choice == "Custom":
        today = now.date()
        picked = sb.date_input("From / to (UTC)", (today - dt.timedelta(days=3), today), key="custom_range")
        custom = tuple(picked) if isinstance(picked, (tuple, list)) and len(picked) == 2 else (picked[0], picked[0]) if isinstance(picked, (tuple, list)) else (picked, picked)
    since, until = S.time_window(choice, now, custom)
    grouping = single("Grouping", S.GROUPINGS, "grouping", S.DEFAULT_GROUPING, where=sb)
    jobs = pick("Job", opts["jobs"], "f_jobs", "every job", where=sb, heading="Filters")
    owners = pick("Owner", opts["owners"], "f_owners", "every owner", where=sb)
    statuses = pick("Status", list(S.STATUSES), "f_statuses", "every status", where=sb)
    presets = pick("Preset", opts["presets"], "f_presets", "every preset", where=sb)
    limit = single("Runs shown per run panel (newest)", LIMITS, "detail_limit", S.DEFAULT_DETAIL_LIMIT, where=sb,
                   shown=lambda n: f"{n:,}")
    if sb.button("Refresh now", key="refresh"):
        refresh()  # runs and history refresh incrementally; metrics rows are read again
    return S.ViewSpec(since=since, until=until, queues=tuple(queues), grouping=grouping, owners=tuple(owners),
                      jobs=tuple(jobs), statuses=tuple(statuses), presets=tuple(presets), detail_limit=int(limit),
                      live=choice in S.RANGES)
