"""The monitor's sidebar: queues, time range, grouping, filters and the advanced options, read as the
view they ask for (:class:`.spec.ViewSpec`). Its own module so that what the sidebar alone costs a
visit can be drawn without the page (``bench/dashboard.py``'s floor with controls)."""

from __future__ import annotations

import datetime as dt
from typing import Callable, Sequence

import streamlit as st

from prefect_launch.dashboard import choices as CH
from prefect_launch.dashboard import spec as S
from prefect_launch.dashboard import text_block as TB


PILLS_MAX = 8  # a choice among at most this many is drawn as buttons; among more, as a multiselect
LIMITS = (100, 1000, 5000, 10000)  # runs shown per run panel (the newest)
KEYS = ("queues", "range", "grouping", "f_jobs", "f_owners", "f_statuses", "f_presets", "detail_limit")


class Column:
    """Where the sidebar's choices go, in order: consecutive groups of buttons are drawn as one component
    (:mod:`.choices`; one element instead of a control per choice), which another kind of control (a
    multiselect, the date picker) ends."""

    def __init__(self, where) -> None:
        self.where = where
        self.run: list[CH.Group] = []

    def add(self, group: CH.Group) -> None:
        self.run.append(group)

    def flush(self) -> None:
        if self.run:
            CH.draw(self.run, f"choices_{self.run[0].key}", self.where)
            self.run = []


def pick(col: Column, label: str, options: Sequence[str], key: str, placeholder: str, heading: str | None = None) -> list:
    """Several of ``options`` (none chosen: all). While they are few, buttons: each visible, one click
    (bench/results/sidebar_pills_ab.txt: the sidebar's choices as Streamlit's pills drew 0.19 s sooner than as
    multiselects, a radio, a selectbox and an expander; as plain buttons, see bench/results/sidebar_choices_ab.txt);
    a multiselect beyond :data:`PILLS_MAX`, where buttons would fill the sidebar. The choice is kept in the
    session, so it stays when the options grow past the limit or shrink back."""
    options = [str(o) for o in options]
    was = [v for v in (CH.kept(key) or []) if v in options]  # an option gone is dropped
    if len(options) <= PILLS_MAX:
        col.add(CH.Group(key=key, label=label, options=options, shown=options, help=f"None chosen: {placeholder}.",
                         heading=heading, selected=was))
        return CH.keep(key, was)
    col.flush()
    if heading:
        TB.text(f"{key}_heading", heading, where=col.where)
    got = col.where.multiselect(label, options, default=was, key=key, placeholder=placeholder)
    return CH.keep(key, got or [])


def single(col: Column, label: str, options: Sequence, key: str, default, shown: Callable = str,
           heading: str | None = None):
    """One of ``options`` (always one: ``default`` until another is clicked)."""
    values = [str(o) for o in options]
    was = CH.kept(key) or []
    cur = was[0] if was and was[0] in values else str(default)
    col.add(CH.Group(key=key, label=label, options=values, shown=[shown(o) for o in options], multi=False,
                     heading=heading, selected=[cur]))
    CH.keep(key, [cur])
    return options[values.index(cur)]


def sidebar(opts: dict, refresh: Callable[[], None]) -> S.ViewSpec:
    """The sidebar's choices as the view they ask for. ``opts``: the queues, jobs, owners and presets to
    offer; ``refresh``: what Refresh now does (the page's reads start afresh). Every choice is a group of
    buttons (single choices keep one pressed) in one component per run of them (:class:`Column`): a new
    visitor's browser loads no script for a radio, a selectbox, an expander or pills, and no option is
    parsed as markdown."""
    for k in KEYS:  # a click sent by the browser, applied before anything reads the choices
        CH.take_clicks(f"choices_{k}")
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
