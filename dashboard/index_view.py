"""Pure functions: the monitor's frames computed from the run index (pandas in, pandas out).

They give the numbers Prefect's ``POST /flow_runs/history`` gives, the same way
(bucket by expected start, count by current state, run time and lateness as
Prefect's ``estimated_run_time`` / ``estimated_start_time_delta``), so the page
cannot tell which source a view came from; ``tests/test_dashboard_index.py`` checks
that against the server for the same runs.
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

import numpy as np
import pandas as pd

from prefect_launch.dashboard.data import (
    MAX_GROUPS, OTHER, STATUS_OF_TYPE, TERMINAL_TYPES, TYPES_OF_STATUS, UNKNOWN, ViewSpec, aligned_range,
)

UTC = dt.timezone.utc
NO_DEPLOYMENT = "(no deployment)"
HIST_COLUMNS = ["bucket", "group", "state_type", "status", "count", "run_s", "queued_s"]
RUN_COLUMNS = ["id", "name", "job", "queue", "priority", "owner", "preset", "state_type", "state_name", "status",
               "expected_start", "start", "end", "message", "waiting", "cpu", "memory", "gpu", "launched", "queued_s", "duration_s"]


def us(t: dt.datetime) -> int:
    """Epoch microseconds of an aware datetime (the index's time unit)."""
    d = t.astimezone(UTC) - dt.datetime(1970, 1, 1, tzinfo=UTC)
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


def prepare(index: pd.DataFrame, deployments: dict[str, dict]) -> pd.DataFrame:
    """Index rows (at least :data:`~prefect_launch.blocks.run_index.CORE`) -> the columns the
    page filters and groups by (done once per index read, not per view).

    job = the deployment's current name ("(no deployment)" / "unknown" as on the API path);
    owner / preset missing -> "unknown"; status from the state type. Labels are
    categoricals: filters and group-bys over 100k runs then compare small integer codes.
    """
    df = index.copy()
    df["job"] = job_names(df["deployment_id"], deployments)
    for c in ("owner", "preset", "queue"):
        df[c] = df[c].fillna(UNKNOWN)
    df["status"] = df["state_type"].map(STATUS_OF_TYPE).fillna(df["state_type"].str.lower())
    for c in LABELS:
        df[c] = df[c].astype(object).astype("category")
    for c in ("expected_start_us", "start_us", "end_us", "state_us", "queued_us", "pending_us"):
        if c in df:
            df[c] = df[c].astype("float64")  # NaN = none; exact for epoch microseconds (< 2**53)
    return df


LABELS = ("job", "owner", "preset", "queue", "status", "state_type")


def splice(held: pd.DataFrame, fresh: pd.DataFrame) -> pd.DataFrame:
    """``held`` with the runs in ``fresh`` (both prepared) replaced or added; label columns
    stay categorical (their categories united) so later filters stay cheap."""
    keep = held[~held["id"].isin(fresh["id"])].copy()
    fresh = fresh.copy()
    for c in LABELS:
        cats = keep[c].cat.categories.union(fresh[c].cat.categories)
        keep[c] = keep[c].cat.set_categories(cats)
        fresh[c] = fresh[c].cat.set_categories(cats)
    return pd.concat([keep, fresh], ignore_index=True)


def job_names(deployment_ids: pd.Series, deployments: dict[str, dict]) -> pd.Series:
    """Deployment id -> its current name (the job); "(no deployment)" / "unknown" as on the API path."""
    names = {k: v["name"] for k, v in deployments.items()}
    ids = deployment_ids.astype(object)
    return ids.map(names).where(ids.notna(), NO_DEPLOYMENT).fillna(UNKNOWN).astype("category")


def select(rows: pd.DataFrame, spec: ViewSpec, *, time: bool = True) -> pd.DataFrame:
    """The sidebar filters on prepared rows; ``time``: expected start in [since, until]."""
    m = np.ones(len(rows), dtype=bool)
    if time:
        exp = rows["expected_start_us"].to_numpy()
        m &= (exp >= us(spec.since)) & (exp <= us(spec.until))
    for col, vals in (("queue", spec.queues), ("owner", spec.owners), ("job", spec.jobs), ("preset", spec.presets)):
        if vals:
            m &= rows[col].isin(vals).to_numpy()
    if spec.statuses:
        m &= rows["state_type"].isin([t for s in spec.statuses for t in TYPES_OF_STATUS[s]]).to_numpy()
    return rows[m]


def run_and_late_seconds(rows: pd.DataFrame, now: dt.datetime) -> tuple[np.ndarray, np.ndarray]:
    """Per run, Prefect's estimated run time and lateness (>= 0), as of ``now``."""
    now_us = us(now)
    running = (rows["state_type"] == "RUNNING").to_numpy()
    since_state = np.nan_to_num((now_us - rows["state_us"].to_numpy(dtype="float64")) / 1e6)
    run_s = np.nan_to_num(rows["run_time_s"].to_numpy(dtype="float64")) + np.where(running, since_state, 0.0)
    exp = rows["expected_start_us"].to_numpy(dtype="float64")
    start = rows["start_us"].to_numpy(dtype="float64")
    started_late = ~np.isnan(start) & (start > exp)
    open_ = ~rows["state_type"].isin(list(TERMINAL_TYPES)).to_numpy()
    waiting = np.isnan(start) & open_ & (exp < now_us)
    late = np.where(started_late, (start - exp) / 1e6, np.where(waiting, (now_us - exp) / 1e6, 0.0))
    return np.clip(run_s, 0, None), np.clip(np.nan_to_num(late), 0, None)


def group_values(rows: pd.DataFrame, grouping: str, chosen: tuple[str, ...] = ()) -> pd.Series:
    """The group label per run: the grouping's column, with everything past the
    ``MAX_GROUPS`` biggest (and unknown owners / presets) folded into "other / unknown"."""
    col = rows[grouping].astype(object)
    if grouping in ("job", "queue", "status"):
        return col
    counts = rows[grouping].value_counts()
    keep = list(chosen) or [g for g in counts[counts > 0].index[:MAX_GROUPS] if g != UNKNOWN]
    return col.where(col.isin(keep), f"{OTHER} / {UNKNOWN}")


def history(rows: pd.DataFrame, spec: ViewSpec, interval_s: int, now: dt.datetime) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(total, per group) per bucket and state type: count, run seconds, queued seconds.

    Buckets are aligned as :class:`~prefect_launch.dashboard.data.HistoryCache` aligns
    them; runs are bucketed by expected start, like the server does.
    """
    start, end = aligned_range(spec.since, spec.until, interval_s)
    lo, hi, step = us(start), us(end), interval_s * 1_000_000
    exp = rows["expected_start_us"].to_numpy()
    r = rows[(exp >= lo) & (exp < hi)]
    run_s, late = run_and_late_seconds(r, now)
    idx = ((r["expected_start_us"].to_numpy().astype("int64") - lo) // step).astype("int64")
    chosen = spec.owners if spec.grouping == "owner" else spec.presets if spec.grouping == "preset" else ()
    base = pd.DataFrame({"idx": idx, "state_type": r["state_type"].astype(object).to_numpy(), "run_s": run_s, "queued_s": late,
                         "group": group_values(r, spec.grouping, chosen).to_numpy() if len(r) else []})

    per = base.groupby(["idx", "group", "state_type"], as_index=False, sort=True, observed=True).agg(
        count=("run_s", "size"), run_s=("run_s", "sum"), queued_s=("queued_s", "sum"))
    total = per.groupby(["idx", "state_type"], as_index=False, sort=True)[["count", "run_s", "queued_s"]].sum().assign(group="all")
    for g in (per, total):
        g["bucket"] = pd.to_datetime(lo + g["idx"] * step, unit="us", utc=True)
        g["status"] = g["state_type"].map(STATUS_OF_TYPE).fillna(g["state_type"].str.lower())
    if spec.grouping == "status":
        per["group"] = per["status"]
    return total[HIST_COLUMNS].reset_index(drop=True), per[HIST_COLUMNS].reset_index(drop=True)


def newest(rows: pd.DataFrame, limit: Optional[int] = None, by: str = "expected_start_us") -> pd.DataFrame:
    """The ``limit`` newest rows by ``by`` (expected start), newest first."""
    if limit is not None and len(rows) > limit:
        return rows.nlargest(limit, by, keep="first").sort_values(by, ascending=False, kind="stable")
    return rows.sort_values(by, ascending=False, kind="stable")


def runs_frame(rows: pd.DataFrame, details: pd.DataFrame, now: dt.datetime) -> pd.DataFrame:
    """Prepared rows (in the order given) + their detail columns read by id -> the page's run
    columns, as :func:`prefect_launch.dashboard.data.runs_frame` gives them from flow-run JSON."""
    det = details.drop_duplicates("id").set_index("id") if not details.empty else pd.DataFrame(
        columns=["name", "priority", "state_name", "message", "waiting", "cpu", "memory", "gpu", "launched"])
    ids = rows["id"].to_numpy()
    out = pd.DataFrame({"id": ids})
    for c in ("job", "queue", "owner", "preset", "state_type", "status"):
        out[c] = rows[c].astype(object).to_numpy()
    for c in ("name", "priority", "state_name", "message", "waiting", "cpu", "memory", "gpu", "launched"):
        out[c] = det[c].reindex(ids).to_numpy() if c in det else None
    for c, src in (("expected_start", "expected_start_us"), ("start", "start_us"), ("end", "end_us")):
        out[c] = pd.to_datetime(rows[src].to_numpy(dtype="float64"), unit="us", utc=True)
    out["message"] = out["message"].fillna("")
    out["waiting"] = out["waiting"].fillna("")
    out["launched"] = out["launched"].fillna(False).astype(bool)
    now_ts = pd.Timestamp(now)
    started = out["start"].notna()
    waiting = ~started & ~out["state_type"].isin(list(TERMINAL_TYPES)) & (out["expected_start"] < now_ts)
    out["queued_s"] = 0.0
    out.loc[started, "queued_s"] = (out.loc[started, "start"] - out.loc[started, "expected_start"]).dt.total_seconds().clip(lower=0)
    out.loc[waiting, "queued_s"] = (now_ts - out.loc[waiting, "expected_start"]).dt.total_seconds()
    end = out["end"].where(out["end"].notna(), now_ts)
    out["duration_s"] = (end - out["start"]).dt.total_seconds().where(started)
    return out[RUN_COLUMNS]


def errors_rows(rows: pd.DataFrame, spec: ViewSpec, limit: int) -> pd.DataFrame:
    """Failed and crashed runs that ended in the range, newest first (as the API path asks)."""
    end = rows["end_us"].to_numpy()
    m = rows["state_type"].isin(["FAILED", "CRASHED"]).to_numpy() & (end >= us(spec.since)) & (end <= us(spec.until))
    return newest(rows[m], limit, by="end_us")


def now_counts(rows: pd.DataFrame, pools: list[str], now: dt.datetime) -> pd.DataFrame:
    """Per pool: runs queued (scheduled and due), pending and running now."""
    now_us = us(now)
    r = rows[rows["queue"].isin(pools) & rows["state_type"].isin(["SCHEDULED", "PENDING", "RUNNING"])]
    st = r["state_type"].astype(object)
    queued = (st == "SCHEDULED") & (r["expected_start_us"] <= now_us)
    frame = pd.DataFrame({"queue": r["queue"].astype(object), "queued": queued.astype(int), "pending": (st == "PENDING").astype(int),
                          "running": (st == "RUNNING").astype(int)})
    out = frame.groupby("queue").sum().reindex(pools, fill_value=0).reset_index()
    return out[["queue", "queued", "pending", "running"]]
