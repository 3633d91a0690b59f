"""The monitor's sidebar: queues, time range, grouping, filters and the advanced options, read as the
view they ask for (:class:`.spec.ViewSpec`). Its own module so that what the sidebar alone costs a
visit can be drawn without the page (``bench/dashboard.py``'s floor with controls)."""

from __future__ import annotations

import datetime as dt
from typing import Callable

import streamlit as st

from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard.choices import Column, pick, single


LIMITS = (100, 1000, 5000, 10000)  # runs shown per run panel (the newest)


def sidebar(opts: dict, refresh: Callable[[], None]) -> S.ViewSpec:
    """The sidebar's choices as the view they ask for. ``opts``: the queues, jobs, owners and presets to
    offer; ``refresh``: what Refresh now does (the page's reads start afresh). Every choice is a group of
    buttons (single choices keep one pressed) in one component per run of them (:class:`.choices.Column`): a new
    visitor's browser loads no script for a radio, a selectbox, an expander or pills, and no option is
    parsed as markdown."""
    sb = st.sidebar
    col = Column(sb)
    queues = pick(col, "Queues", opts["queues"], "queues", "all queues", heading="Queue monitor")
    choice = single(col, "Time range", [*S.RANGES, "Custom"], "range", S.DEFAULT_RANGE)
    now = S.page_now()  # up to the next step of the page's clock: visits and reruns within it hit the caches
    custom = None
    if choice == "Custom":
        col.flush()
        today = now.date()
        picked = sb.date_input("From / to (UTC)", (today - dt.timedelta(days=3), today), key="custom_range")
        custom = tuple(picked) if isinstance(picked, (tuple, list)) and len(picked) == 2 else (picked[0], picked[0]) if isinstance(picked, (tuple, list)) else (picked, picked)
    since, until = S.time_window(choice, now, custom)
    grouping = single(col, "Grouping", S.GROUPINGS, "grouping", S.DEFAULT_GROUPING)
    jobs = pick(col, "Job", opts["jobs"], "f_jobs", "every job", heading="Filters")
    owners = pick(col, "Owner", opts["owners"], "f_owners", "every owner")
    statuses = pick(col, "Status", list(S.STATUSES), "f_statuses", "every status")
    presets = pick(col, "Preset", opts["presets"], "f_presets", "every preset")
    limit = single(col, "Runs shown per run panel (newest)", LIMITS, "detail_limit", S.DEFAULT_DETAIL_LIMIT,
                   shown=lambda n: f"{n:,}")
    col.flush()
    if sb.button("Refresh now", key="refresh"):
        refresh()  # runs and history refresh incrementally; metrics rows are read again
    return S.ViewSpec(since=since, until=until, queues=tuple(queues), grouping=grouping, owners=tuple(owners),
                      jobs=tuple(jobs), statuses=tuple(statuses), presets=tuple(presets), detail_limit=int(limit),
                      live=choice in S.RANGES)
