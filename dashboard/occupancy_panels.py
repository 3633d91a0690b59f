"""A view's occupancy panels: status, queued, load, idle periods, heatmap, capacity share
and the Gantt's lanes, from the view's prepared rows (:mod:`.occupancy` does the maths).

The summed panels come from :class:`.occupancy_sums.Sums`: made afresh from the runs in
range, or, given a :class:`.occupancy_memo.SettledMemo`, from the settled runs' kept sums
plus the rest's, which is what keeps a month of runs cheap at each step of the page.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Hashable, Optional

import numpy as np
import pandas as pd

from prefect_launch.dashboard import occupancy as OC
from prefect_launch.dashboard import occupancy_lanes as OL
from prefect_launch.dashboard import occupancy_sums as OS
from prefect_launch.dashboard.occupancy_memo import SettledMemo
from prefect_launch.dashboard.spec import us

IDLE_COLUMNS = ["from", "to", "hours", "waiting"]
HEATMAP_COLUMNS = ["weekday", "hour", "busy", "gpus", "hours"]


@dataclass
class Occupancy:
    """The occupancy panels of one view."""

    interval_s: int
    status: pd.DataFrame
    queued: pd.DataFrame
    load: pd.DataFrame
    idle: pd.DataFrame
    heatmap: pd.DataFrame
    runs: int  # runs with any phase in the range
    share: dict
    capacity: dict
    lanes: Optional[pd.DataFrame] = None  # None: few enough runs for one bar per run
    complete: bool = True  # False: computed from the newest runs only (API path)


def compute(rows: pd.DataFrame, groups: Optional[pd.Series], since: dt.datetime, until: dt.datetime, interval_s: int,
            now: dt.datetime, agents: Optional[pd.DataFrame] = None, complete: bool = True,
            memo: Optional[SettledMemo] = None, key: Hashable = None) -> Occupancy:
    """Every occupancy panel for prepared ``rows`` (already filtered by the sidebar, any
    expected start) and their group labels (same index). ``memo`` and ``key`` (the view's
    filters and grouping): keep the settled runs' sums between calls (every run read: the
    index's rows, ``complete``)."""
    now_us = float(us(now))
    b = OC.Buckets.aligned(since, until, interval_s)
    hours = OC.Buckets.aligned(since, until, 3600) if complete and interval_s != 3600 else None
    ph_all = OC.phase_arrays(rows, now_us)
    first, last = OC.span(ph_all)
    keep = (first < b.hi_us) & (last >= b.lo_us)
    # the runs the sums read: those in range, and those in the first hour's part before it (the heatmap's hours
    # are whole hours; a run that ended before the range but held in that hour counts there)
    reach = keep if hours is None else keep | ((first < hours.hi_us) & (last >= hours.lo_us))
    settled = (memo.settled(key, rows, ph_all, last, groups, b, hours, now_us, float(us(until)))
               if memo is not None and complete else None)
    if settled is not None:
        sums = settled.sums(reach, b, hours)
    else:
        at = np.flatnonzero(reach)
        narrow = rows[[c for c in OC.SUM_COLUMNS if c in rows]]
        sums = OS.sums(narrow.iloc[at], {k: v[at] for k, v in ph_all.items()}, None if groups is None else pd.Series(groups).iloc[at],
                       b, hours)
    status, queued, load, hm = sums.panels()
    span_s = (min(us(until), now_us) - us(since)) / 1e6
    cap = OC.capacity(agents) if agents is not None else dict(gpu=None, cpu=None)
    s_us, u_us = float(us(since)), float(min(us(until), now_us))
    n_held = int((keep & ~np.isnan(ph_all["h0"])).sum())
    if complete:
        idle = OC.idle_periods(load, interval_s, until=pd.Timestamp(min(until, now)))
        share = OC.capacity_share(load, cap, span_s)
    else:
        # only the newest runs were read: before the oldest of them nothing is known, so no bucket there is
        # called idle (it would read as hours of idle hardware that were busy); the load shows the known
        # span, and idle periods, heatmap and capacity share wait for every run of the range
        known = float(np.nanmin(first)) if len(first) and not np.isnan(first).all() else float(b.hi_us)
        known_from = pd.Timestamp(int(known // (interval_s * 1e6) * interval_s * 1e6), unit="us", tz="UTC")
        load = load[load["bucket"] >= known_from].reset_index(drop=True)
        idle = pd.DataFrame(columns=IDLE_COLUMNS)
        hm = None
        share = {"gpu": None, "cpu": None}
    return Occupancy(
        interval_s=interval_s, status=status, queued=queued, load=load, idle=idle,
        heatmap=hm if hm is not None else pd.DataFrame(columns=HEATMAP_COLUMNS), runs=int(keep.sum()), share=share, capacity=cap,
        # pixels of the range chosen (not cut at now): a live range's pixels stay the same width step after step
        lanes=OL.lanes(rows, ph_all, groups if groups is not None else rows["queue"], s_us, u_us,
                       gap_s=(us(until) - us(since)) / 1e6 / OL.LANE_PIXELS,
                       kept=settled.lanes() if settled is not None else None) if n_held > OC.PER_RUN_GANTT_MAX else None,
        complete=complete,
    )
