"""The monitor's sidebar: queues, time range, grouping, filters and the advanced options, read as the
view they ask for (:class:`.spec.ViewSpec`). Its own module so that what the sidebar alone costs a
visit can be drawn without the page (``bench/dashboard.py``'s floor with controls)."""

from __future__ import annotations

import datetime as dt
from typing import Callable

import streamlit as st

from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import text_block as TB


PILLS_MAX = 8  # a choice among at most this many is drawn as pills; among more, as a multiselect
LIMITS = (100, 1000, 5000, 10000)  # runs shown per run panel (the newest)


def pick(where, label: str, options: list, key: str, placeholder: str) -> list:
    """Several of ``options`` (none chosen: all). While they are few, pills: each visible, one click, and
    no dropdown script for a new visitor's browser to fetch and compile (the monitor's sidebar, with the
    single choices as pills too, drew 0.19 s sooner than with multiselects, a radio, a selectbox and an expander:
    bench/results/sidebar_pills_ab.txt); a multiselect beyond
    :data:`PILLS_MAX`, where pills would fill the sidebar. The choice is kept when the options grow past it or
    shrink back (Streamlit starts a control of another kind empty: the page would show every queue unasked)."""
    kept = f"{key}__kept"
    was = [v for v in st.session_state.get(kept, []) if v in options]  # the default of a control made anew
    if len(options) <= PILLS_MAX:
        got = where.pills(label, options, selection_mode="multi", default=was or None, key=key,
                          help=f"None chosen: {placeholder}.")
    else:
        got = where.multiselect(label, options, default=was, key=key, placeholder=placeholder)
    st.session_state[kept] = list(got or [])
    return list(got or [])


def sidebar(opts: dict, refresh: Callable[[], None]) -> S.ViewSpec:
    """The sidebar's choices as the view they ask for. ``opts``: the queues, jobs, owners and presets to
    offer; ``refresh``: what Refresh now does (the page's reads start afresh). Single choices are pills
    too (one chosen, always one), the kind the page's section switch is made of: a new visitor's browser
    loads no script for a radio, a selectbox or an expander, and the choices wrap in the narrow sidebar."""
    sb = st.sidebar
    TB.text("sidebar_head", "Queue monitor", level=2, where=sb)  # as text: no markdown element to parse
    queues = pick(sb, "Queues", opts["queues"], "queues", "all queues")
    ranges = [*S.RANGES, "Custom"]
    choice = sb.pills("Time range", ranges, default=S.DEFAULT_RANGE, required=True, key="range") or S.DEFAULT_RANGE
    now = S.page_now()  # up to the next step of the page's clock: visits and reruns within it hit the caches
    custom = None
    if choice == "Custom":
        today = now.date()
        picked = sb.date_input("From / to (UTC)", (today - dt.timedelta(days=3), today), key="custom_range")
        custom = tuple(picked) if isinstance(picked, (tuple, list)) and len(picked) == 2 else (picked[0], picked[0]) if isinstance(picked, (tuple, list)) else (picked, picked)
    since, until = S.time_window(choice, now, custom)
    grouping = sb.pills("Grouping", S.GROUPINGS, default=S.DEFAULT_GROUPING, required=True,
                        key="grouping") or S.DEFAULT_GROUPING
    TB.text("filters_head", "Filters", where=sb)
    jobs = pick(sb, "Job", opts["jobs"], "f_jobs", "every job")
    owners = pick(sb, "Owner", opts["owners"], "f_owners", "every owner")
    statuses = pick(sb, "Status", list(S.STATUSES), "f_statuses", "every status")
    presets = pick(sb, "Preset", opts["presets"], "f_presets", "every preset")
    limit = sb.pills("Runs shown per run panel (newest)", LIMITS, default=S.DEFAULT_DETAIL_LIMIT, required=True,
                     key="detail_limit", format_func=lambda n: f"{n:,}") or S.DEFAULT_DETAIL_LIMIT
    if sb.button("Refresh now", key="refresh"):
        refresh()  # runs and history refresh incrementally; metrics rows are read again
    return S.ViewSpec(since=since, until=until, queues=tuple(queues), grouping=grouping, owners=tuple(owners),
                      jobs=tuple(jobs), statuses=tuple(statuses), presets=tuple(presets), detail_limit=int(limit),
                      live=choice in S.RANGES)
