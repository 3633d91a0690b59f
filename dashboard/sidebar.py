"""The monitor's sidebar: queues, time range, grouping, filters and the advanced options, read as the
view they ask for (:class:`.spec.ViewSpec`). Its own module so that what the sidebar alone costs a
visit can be drawn without the page (``bench/dashboard.py``'s floor with controls)."""

from __future__ import annotations

import datetime as dt
from typing import Callable

import streamlit as st

from prefect_launch.dashboard import spec as S


def sidebar(opts: dict, refresh: Callable[[], None]) -> S.ViewSpec:
    """The sidebar's choices as the view they ask for. ``opts``: the queues, jobs, owners and presets to
    offer; ``refresh``: what Refresh now does (the page's reads start afresh)."""
    sb = st.sidebar
    sb.header("Queue monitor")
    queues = sb.multiselect("Queues", opts["queues"], key="queues", placeholder="all queues")
    choice = sb.radio("Time range", [*S.RANGES, "Custom"], index=list(S.RANGES).index(S.DEFAULT_RANGE), key="range")
    now = S.page_now()  # up to the next step of the page's clock: visits and reruns within it hit the caches
    custom = None
    if choice == "Custom":
        today = now.date()
        picked = sb.date_input("From / to (UTC)", (today - dt.timedelta(days=3), today), key="custom_range")
        custom = tuple(picked) if isinstance(picked, (tuple, list)) and len(picked) == 2 else (picked[0], picked[0]) if isinstance(picked, (tuple, list)) else (picked, picked)
    since, until = S.time_window(choice, now, custom)
    grouping = sb.selectbox("Grouping", S.GROUPINGS, index=S.GROUPINGS.index(S.DEFAULT_GROUPING), key="grouping")
    sb.subheader("Filters")
    jobs = sb.multiselect("Job", opts["jobs"], key="f_jobs")
    owners = sb.multiselect("Owner", opts["owners"], key="f_owners")
    statuses = sb.multiselect("Status", list(S.STATUSES), key="f_statuses")
    presets = sb.multiselect("Preset", opts["presets"], key="f_presets")
    with sb.expander("Advanced"):
        limit = st.number_input("Runs shown per run panel (newest)", 100, 10000, S.DEFAULT_DETAIL_LIMIT, step=100,
                                key="detail_limit")
        if st.button("Refresh now", key="refresh"):
            refresh()  # runs and history refresh incrementally; metrics rows are read again
    return S.ViewSpec(since=since, until=until, queues=tuple(queues), grouping=grouping, owners=tuple(owners),
                      jobs=tuple(jobs), statuses=tuple(statuses), presets=tuple(presets), detail_limit=int(limit),
                      live=choice in S.RANGES)
