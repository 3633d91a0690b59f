"""Prepared run rows: the one shape every run panel is computed from (pandas in, pandas out).

A prepared row is one flow run with the run index's columns
(:data:`~prefect_launch.blocks.run_index.CORE`, epoch microseconds as float, NaN = none)
plus the labels the page filters and groups by (job, status, owner, preset, queue as
categoricals). Both sources give them: the run index (:mod:`.index_sync` reads its table
into :func:`prepare`) and Prefect's API (:func:`from_flow_runs` turns flow-run JSON into
the same rows). The producers in :mod:`.frames` and :mod:`.occupancy` take them.

:func:`history` gives the numbers Prefect's ``POST /flow_runs/history`` gives, the same
way (bucket by expected start, count by current state, run time and lateness as Prefect's
``estimated_run_time`` / ``estimated_start_time_delta``), so the page cannot tell which
source a view came from; ``tests/test_dashboard_index.py`` checks that against the server
for the same runs.
"""

from __future__ import annotations

import datetime as dt
from typing import Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from prefect_launch.blocks.run_index import IndexRow
from prefect_launch.dashboard import frames as F
from prefect_launch.dashboard.spec import (
    MAX_GROUPS, NO_DEPLOYMENT, OTHER, TERMINAL_TYPES, UNKNOWN, ViewSpec, aligned_range, us,
)

LABELS = ("job", "owner", "preset", "queue", "status", "state_type", "placement")
TIME_COLUMNS = ("expected_start_us", "start_us", "end_us", "state_us", "queued_us", "pending_us")
RECORD_COLUMNS = list(IndexRow.model_fields)



def prepare(index: pd.DataFrame, deployments: dict[str, dict]) -> pd.DataFrame:
    """Index rows (at least :data:`~prefect_launch.blocks.run_index.CORE`) -> the columns the
    page filters and groups by (done once per index read, not per view).

    job = the deployment's current name ("(no deployment)" / "unknown"); owner / preset
    missing -> "unknown"; status from the state type. Labels are categoricals: filters and
    group-bys over 100k runs then compare small integer codes (the agent's placement label
    too: a few distinct values, each parsed once by :mod:`.occupancy`).
    """
    df = index.copy()
    df["job"] = job_names(df["deployment_id"], deployments)
    for c in ("owner", "preset", "queue"):
        df[c] = df[c].astype(object).fillna(UNKNOWN)
    df["status"] = F.status_of(df["state_type"]) if len(df) else pd.Series([], dtype=object)
    for c in LABELS:
        if c in df:
            df[c] = df[c].astype(object).astype("category")
    for c in TIME_COLUMNS:
        if c in df:
            df[c] = df[c].astype("float64")  # NaN = none; exact for epoch microseconds (< 2**53)
    return df


def from_flow_runs(raw: Sequence[dict], deployments: dict[str, dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Flow-run JSON (``POST /flow_runs/filter``) -> (prepared rows, detail records by id):
    what the API path feeds the producers, built the way the index builds its rows."""
    recs = [IndexRow.from_flow_run(r).merged(None).model_dump() for r in raw]
    records = pd.DataFrame(recs, columns=RECORD_COLUMNS)
    return prepare(records, deployments), records


def splice(held: pd.DataFrame, fresh: pd.DataFrame) -> pd.DataFrame:
    """``held`` with the runs in ``fresh`` (both prepared) replaced or added; label columns
    stay categorical (their categories united) so later filters stay cheap."""
    keep = held[~held["id"].isin(fresh["id"]).to_numpy()]  # a take: a copy already
    fresh = fresh.copy()
    for c in (c for c in LABELS if c in keep):
        cats = keep[c].cat.categories.union(fresh[c].cat.categories)
        if not cats.equals(keep[c].cat.categories):  # a new label: every held row's code is mapped again
            keep[c] = keep[c].cat.set_categories(cats)
        fresh[c] = fresh[c].cat.set_categories(cats)
    return pd.concat([keep, fresh], ignore_index=True)


def job_names(deployment_ids: pd.Series, deployments: dict[str, dict]) -> pd.Series:
    """Deployment id -> its current name (the job); "(no deployment)" / "unknown" where none / not known."""
    names = {k: v["name"] for k, v in deployments.items()}
    ids = deployment_ids.astype(object)
    # astype(object): a map that matched nothing is float64 (all NaN), and text cannot fill a float column
    return ids.map(names).astype(object).where(ids.notna(), NO_DEPLOYMENT).fillna(UNKNOWN).astype("category")


def select(rows: pd.DataFrame, spec: ViewSpec, *, time: bool = True) -> pd.DataFrame:
    """The sidebar filters on prepared rows; ``time``: expected start in [since, until]."""
    m = np.ones(len(rows), dtype=bool)
    if time:
        exp = rows["expected_start_us"].to_numpy()
        m &= (exp >= us(spec.since)) & (exp <= us(spec.until))
    for col, vals in (("queue", spec.queues), ("owner", spec.owners), ("job", spec.jobs), ("preset", spec.presets)):
        if vals:
            m &= isin(rows[col], vals)
    if spec.statuses:
        m &= isin(rows["state_type"], spec.state_types())
    if m.all():  # nothing filtered out (the default view): not a copy of every column (~0.1-0.3 s at 1M runs,
        return rows.copy(deep=False)  # twice a step); pandas copies a column only where the result is written
    return rows[m]


def isin(s: pd.Series, values: Iterable) -> np.ndarray:
    """``s.isin(values)`` as a bool array. On a categorical column (the index's labels and states) each
    category is tested once: pandas would convert every row's value (0.16 s per call at 100k runs, on
    each step of the page's clock)."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        hit = np.append(s.cat.categories.isin(list(values)), False)  # code -1 (missing) -> the last: False
        return hit[s.cat.codes.to_numpy()]
    return s.isin(list(values)).to_numpy()


def _terminal(rows: pd.DataFrame) -> np.ndarray:
    return isin(rows["state_type"], TERMINAL_TYPES)


def run_and_late_seconds(rows: pd.DataFrame, now: dt.datetime) -> tuple[np.ndarray, np.ndarray]:
    """Per run, Prefect's estimated run time (its total run time, plus the time since its
    state while running) and its lateness (the queued rule, :func:`.frames.queued_and_duration`)."""
    now_us = us(now)
    running = (rows["state_type"] == "RUNNING").to_numpy()
    since_state = np.nan_to_num((now_us - rows["state_us"].to_numpy(dtype="float64")) / 1e6)
    run_s = np.nan_to_num(rows["run_time_s"].to_numpy(dtype="float64")) + np.where(running, since_state, 0.0)
    late, _ = F.queued_and_duration(rows["expected_start_us"].to_numpy(), rows["start_us"].to_numpy(),
                                    rows["end_us"].to_numpy(), _terminal(rows), float(now_us))
    return np.clip(run_s, 0, None), late


def group_values(rows: pd.DataFrame, grouping: str, chosen: tuple[str, ...] = ()) -> pd.Series:
    """The group label per run: the grouping's column, with everything past the
    ``MAX_GROUPS`` biggest (and unknown owners / presets) folded into "other / unknown"."""
    col = rows[grouping]
    categorical = isinstance(col.dtype, pd.CategoricalDtype)
    if not categorical:
        col = col.astype(object)
    if grouping in ("job", "queue", "status"):
        return col
    counts = col.value_counts()
    keep = set(chosen) or {g for g in counts[counts > 0].index[:MAX_GROUPS] if g != UNKNOWN}
    other = f"{OTHER} / {UNKNOWN}"
    if not categorical:
        return col.where(col.isin(list(keep)), other)
    # prepared rows' labels are categoricals: the groups stay one (codes, not a string per run: at 1M runs
    # an object copy and a group-by over it cost each step of the page's clock a few tenths of a second)
    cats = list(col.cat.categories)
    labels = [c for c in cats if c in keep] + [other]
    where = {c: i for i, c in enumerate(labels)}
    lut = np.array([where.get(c, len(labels) - 1) for c in cats] + [len(labels) - 1], dtype="int64")  # -1 (missing): other
    return pd.Series(pd.Categorical.from_codes(lut[col.cat.codes.to_numpy()], labels), index=col.index, name=col.name)


_HISTORY_COLUMNS = frozenset({"expected_start_us", "start_us", "end_us", "state_us", "state_type", "run_time_s"})


def history(rows: pd.DataFrame, spec: ViewSpec, interval_s: int, now: dt.datetime) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(total, per group) per bucket and state type: count, run seconds, queued seconds
    (:func:`.frames.history_frame`), buckets aligned as the API path aligns them; runs
    are bucketed by expected start, like the server does."""
    start, end = aligned_range(spec.since, spec.until, interval_s)
    lo, hi, step = us(start), us(end), interval_s * 1_000_000
    exp = rows["expected_start_us"].to_numpy()
    # only the columns read below: a boolean take of every column of 100k rows cost each step of the clock ~0.1 s
    r = rows.loc[(exp >= lo) & (exp < hi), [c for c in rows.columns if c in _HISTORY_COLUMNS or c == spec.grouping]]
    run_s, late = run_and_late_seconds(r, now)
    idx = ((r["expected_start_us"].to_numpy().astype("int64") - lo) // step).astype("int64")
    base = pd.DataFrame({"idx": idx, "state_type": r["state_type"].array, "run_s": run_s, "queued_s": late,
                         "group": group_values(r, spec.grouping, spec.chosen_groups()).array if len(r) else []})
    per = base.groupby(["idx", "group", "state_type"], as_index=False, sort=True, observed=True).agg(
        count=("run_s", "size"), run_s=("run_s", "sum"), queued_s=("queued_s", "sum"))
    total = per.groupby(["idx", "state_type"], as_index=False, sort=True)[["count", "run_s", "queued_s"]].sum()

    def frame(g: pd.DataFrame, group) -> pd.DataFrame:
        return F.history_frame(pd.to_datetime(lo + g["idx"].to_numpy() * step, unit="us", utc=True), group,
                               g["state_type"].to_numpy(), g["count"].to_numpy(), g["run_s"].to_numpy(), g["queued_s"].to_numpy())

    per_f = frame(per, per["group"].to_numpy())
    if spec.grouping == "status":
        per_f["group"] = per_f["status"]
    return frame(total, "all"), per_f


def newest(rows: pd.DataFrame, limit: Optional[int] = None, by: str = "expected_start_us") -> pd.DataFrame:
    """The ``limit`` newest rows by ``by`` (expected start), newest first."""
    if limit is not None and len(rows) > limit:
        return rows.nlargest(limit, by, keep="first").sort_values(by, ascending=False, kind="stable")
    return rows.sort_values(by, ascending=False, kind="stable")


def errors_rows(rows: pd.DataFrame, spec: ViewSpec, limit: int) -> pd.DataFrame:
    """Failed and crashed runs that ended in the range, newest first (as the API path asks)."""
    end = rows["end_us"].to_numpy()
    m = isin(rows["state_type"], ("FAILED", "CRASHED")) & (end >= us(spec.since)) & (end <= us(spec.until))
    return newest(rows[m], limit, by="end_us")


def now_counts(rows: pd.DataFrame, pools: list[str], now: dt.datetime) -> pd.DataFrame:
    """Per pool, runs queued (scheduled and due), pending and running now, as long counts
    (queue, status, count) for :func:`.frames.now_counts_frame`."""
    r = rows.loc[isin(rows["queue"], pools) & isin(rows["state_type"], ("SCHEDULED", "PENDING", "RUNNING")),
                 ["queue", "state_type", "expected_start_us"]]
    st = r["state_type"].astype(object)
    due = ((st != "SCHEDULED") | (r["expected_start_us"] <= us(now))).to_numpy()
    status = st.map({"SCHEDULED": "queued", "PENDING": "pending", "RUNNING": "running"})
    counts = pd.DataFrame({"queue": r["queue"].astype(object), "status": status})[due]
    return counts.groupby(["queue", "status"], as_index=False).size().rename(columns={"size": "count"})
