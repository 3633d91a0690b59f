"""The monitor's frames: one pure producer per panel frame (pandas / numpy in, pandas out).

Both sources feed the same producers: the run index's prepared rows
(:mod:`.index_view`) and Prefect's API (its flow-run JSON turned into the same rows by
:func:`.index_view.from_flow_runs`, its aggregates and counts turned into the same
columns by :mod:`.api`). Nothing here reads a server or a store.

The queued / duration rule lives here once (:func:`queued_and_duration`): the run
tables and the per-bucket history both use it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from prefect_launch.dashboard.spec import MAX_GROUPS, STATUS_OF_TYPE, TERMINAL_TYPES, UNKNOWN, UTC, us
from prefect_launch.workers.agent.registry import ONLINE_WINDOW_S
from prefect_launch.workers.agent.registry import online_window_s as agent_window_s

HIST_COLUMNS = ["bucket", "group", "state_type", "status", "count", "run_s", "queued_s"]
RUN_COLUMNS = ["id", "name", "job", "queue", "priority", "owner", "launched_by", "preset", "state_type", "state_name", "status",
               "expected_start", "start", "end", "message", "waiting", "cpu", "memory", "gpu", "launched", "queued_s", "duration_s"]
DETAIL_COLUMNS = ["name", "priority", "state_name", "message", "waiting", "cpu", "memory", "gpu", "launched",
                  "launched_by"]
ERROR_COLUMNS = ["time", "job", "run", "id", "owner", "queue", "state", "message", "log"]
COUNT_COLUMNS = ["queue", "queued", "pending", "running"]
POOL_COLUMNS = ["queue", "type", "status", "paused", "concurrency_limit", "id", "sharing"]
WORKER_COLUMNS = ["queue", "worker", "status", "last_heartbeat"]
AGENT_COLUMNS = ["agent", "queue", "online", "runs", "cpu", "free_cpu", "memory_gib", "free_memory_gib", "gpu", "free_gpu"]


def status_of(state_types: pd.Series) -> pd.Series:
    """Prefect state type -> the monitor's status name (unknown types lower-cased)."""
    st = state_types.astype(object)
    return st.map(STATUS_OF_TYPE).fillna(st.str.lower())


# ------------------------------------------------------------ the one rule


def queued_and_duration(exp_us: np.ndarray, start_us: np.ndarray, end_us: np.ndarray, terminal: np.ndarray,
                        now_us: float) -> tuple[np.ndarray, np.ndarray]:
    """Per run, (queued seconds, duration seconds) as of ``now``; times in epoch
    microseconds (float, NaN = none), ``terminal``: the run is in a final state.

    queued = start - expected start (never below 0); while still waiting (not started,
    not finished, already due) now - expected start; else 0. It is Prefect's lateness
    (``estimated_start_time_delta``), so the history's queued seconds use it too.
    duration = end (now while running) - start; NaN for a run that never started.
    """
    exp = np.asarray(exp_us, dtype="float64")
    start = np.asarray(start_us, dtype="float64")
    end = np.asarray(end_us, dtype="float64")
    started = ~np.isnan(start)
    waiting = ~started & ~np.asarray(terminal, dtype=bool) & (exp < now_us)
    with np.errstate(invalid="ignore"):
        queued = np.where(started, start - exp, np.where(waiting, now_us - exp, 0.0)) / 1e6
        duration = np.where(started, np.where(np.isnan(end), now_us, end) - start, np.nan) / 1e6
    return np.clip(np.nan_to_num(queued), 0.0, None), duration


# ----------------------------------------------------------------- history


def history_frame(bucket: Any, group: Any, state_type: Any, count: Any, run_s: Any, queued_s: Any) -> pd.DataFrame:
    """The per-bucket history (bucket, group, state_type, status, count, run_s, queued_s):
    runs bucketed by expected start and counted by current state, as Prefect's
    ``/flow_runs/history`` gives them. Columns in (array-likes or scalars of one length)."""
    df = pd.DataFrame({"bucket": pd.to_datetime(bucket, utc=True), "group": group, "state_type": state_type,
                       "count": count, "run_s": run_s, "queued_s": queued_s})
    df = df.astype({"count": "int64", "run_s": "float64", "queued_s": "float64"})
    df["group"] = df["group"].astype(object)
    df["state_type"] = df["state_type"].astype(object)
    df["status"] = status_of(df["state_type"]) if len(df) else pd.Series([], dtype=object)
    return df[HIST_COLUMNS].reset_index(drop=True)


def empty_history() -> pd.DataFrame:
    return history_frame([], [], [], [], [], [])


def subtract_groups(total: pd.DataFrame, parts: pd.DataFrame, label: str) -> pd.DataFrame:
    """Runs in ``total`` that no group in ``parts`` took, as group ``label`` (empty if none)."""
    keys = ["bucket", "state_type"]
    t = total.groupby(keys, as_index=False)[["count", "run_s", "queued_s"]].sum()
    p = parts.groupby(keys, as_index=False)[["count", "run_s", "queued_s"]].sum()
    m = t.merge(p, on=keys, how="left", suffixes=("", "_p")).fillna(0)
    m = m[m["count"] - m["count_p"] > 0]
    return history_frame(m["bucket"], label, m["state_type"], m["count"] - m["count_p"], m["run_s"] - m["run_s_p"],
                         m["queued_s"] - m["queued_s_p"])


def totals(hist_total: pd.DataFrame) -> dict:
    """Runs in range and their queued / run seconds (the history's sums)."""
    if hist_total.empty:
        return dict(runs=0, queued_s=0.0, run_s=0.0)
    return dict(runs=int(hist_total["count"].sum()), queued_s=float(hist_total["queued_s"].sum()),
                run_s=float(hist_total["run_s"].sum()))


def status_counts(hist: pd.DataFrame) -> pd.DataFrame:
    """Per bucket, runs by status (runs bucketed by expected start, with their current state)."""
    if hist.empty:
        return pd.DataFrame(columns=["bucket", "status", "count"])
    out = hist.groupby(["bucket", "status"], as_index=False)["count"].sum()
    return out[out["count"] > 0].reset_index(drop=True)


def queued_time(hist: pd.DataFrame) -> pd.DataFrame:
    """Per bucket and group, the sum of seconds runs spent queued (expected start -> start)."""
    if hist.empty:
        return pd.DataFrame(columns=["bucket", "group", "queued_s"])
    out = hist.groupby(["bucket", "group"], as_index=False)["queued_s"].sum()
    return out[out["queued_s"] > 0].reset_index(drop=True)


def top_groups(values: Iterable[str], n: int = MAX_GROUPS) -> list[str]:
    """The ``n`` most frequent values (unknown left out), most frequent first."""
    s = pd.Series(list(values), dtype=object)
    return [] if s.empty else [g for g in s.value_counts().index.tolist()[:n] if g != UNKNOWN]


# -------------------------------------------------------------------- runs


def _epoch_us(rows: pd.DataFrame, col: str) -> np.ndarray:
    return rows[col].to_numpy(dtype="float64") if col in rows else np.full(len(rows), np.nan)


def runs_frame(rows: pd.DataFrame, details: pd.DataFrame, now: dt.datetime) -> pd.DataFrame:
    """Prepared rows (in the order given) and their detail columns (read by id) -> the
    run table the Gantt, the details list and the errors use (:data:`RUN_COLUMNS`)."""
    det = details.drop_duplicates("id").set_index("id") if not details.empty else pd.DataFrame(columns=DETAIL_COLUMNS)
    ids = rows["id"].astype(object).to_numpy()
    out = pd.DataFrame({"id": ids})
    for c in ("job", "queue", "owner", "preset", "state_type", "status"):
        out[c] = rows[c].astype(object).to_numpy()
    for c in DETAIL_COLUMNS:
        out[c] = det[c].reindex(ids).to_numpy() if c in det else None
    exp, start, end = (_epoch_us(rows, c) for c in ("expected_start_us", "start_us", "end_us"))
    for c, v in (("expected_start", exp), ("start", start), ("end", end)):
        out[c] = pd.to_datetime(v, unit="us", utc=True)
    out["message"] = out["message"].fillna("")
    out["waiting"] = out["waiting"].fillna("")
    out["launched"] = out["launched"].fillna(False).astype(bool)
    out["launched_by"] = out["launched_by"].fillna("")
    terminal = out["state_type"].isin(list(TERMINAL_TYPES)).to_numpy()
    out["queued_s"], out["duration_s"] = queued_and_duration(exp, start, end, terminal, float(us(now)))
    return out[RUN_COLUMNS]


def errors_frame(runs: pd.DataFrame, logs: Sequence[dict] = ()) -> pd.DataFrame:
    """time, job, run, owner, queue, state, message (state message, else the last ERROR log), newest first."""
    last_log: dict[str, str] = {}
    for lg in logs:  # newest first: keep the first seen per run
        lines = (lg.get("message") or "").strip().splitlines()
        last_log.setdefault(lg.get("flow_run_id"), lines[-1] if lines else "")
    if runs.empty:
        return pd.DataFrame(columns=ERROR_COLUMNS)
    df = runs[runs["status"].isin(["failed", "crashed"])].copy()
    df["time"] = df["end"].where(df["end"].notna(), df["start"])
    df["message"] = [m or last_log.get(i, "") for m, i in zip(df["message"], df["id"])]
    df["log"] = [last_log.get(i, "") for i in df["id"]]
    df = df.rename(columns={"name": "run", "state_name": "state"})
    return df.sort_values("time", ascending=False, ignore_index=True)[ERROR_COLUMNS]


def gantt_frame(runs: pd.DataFrame, now: Optional[dt.datetime] = None) -> pd.DataFrame:
    """One bar per run that started: start -> end (now while running)."""
    now_ts = pd.Timestamp(now or dt.datetime.now(UTC))
    g = runs[runs["start"].notna()].copy()
    g["bar_end"] = g["end"].where(g["end"].notna(), now_ts)
    return g.reset_index(drop=True)


# ------------------------------------------------------------- queues now


def now_counts_frame(counts: pd.DataFrame, pools: Sequence[str]) -> pd.DataFrame:
    """Long counts (queue, status in queued / pending / running, count) -> one row per
    pool in ``pools`` (zeros where none)."""
    if counts.empty:
        wide = pd.DataFrame(columns=["queued", "pending", "running"], dtype="int64")
    else:
        wide = counts.pivot_table(index="queue", columns="status", values="count", aggfunc="sum", fill_value=0)
    wide = wide.reindex(index=list(pools), columns=["queued", "pending", "running"], fill_value=0).fillna(0).astype("int64")
    wide.index.name = "queue"
    return wide.reset_index()[COUNT_COLUMNS]


def sharing_of(pool: dict) -> str:
    """How a launch queue shares its agents between owners (its declared fair share, quotas, preemptible
    levels), from the work pool's JSON; '' for a plain pool or a queue without them."""
    from prefect_launch.workers.scheduling.queue_spec import QueueSpec

    data = ((pool.get("base_job_template") or {}).get("job_configuration") or {}).get("launch")
    if not data:
        return ""
    try:
        return QueueSpec.model_validate(data).sharing_text()
    except Exception:
        return ""


def pools_frame(raw: Sequence[dict]) -> pd.DataFrame:
    """Work-pool JSON -> queue, type, status, paused, concurrency_limit, id, sharing."""
    return pd.DataFrame([dict(queue=p["name"], type=p.get("type"), status=p.get("status"), paused=p.get("is_paused"),
                              concurrency_limit=p.get("concurrency_limit"), id=p["id"], sharing=sharing_of(p))
                         for p in raw], columns=POOL_COLUMNS)


def workers_frame(raw: Sequence[dict]) -> pd.DataFrame:
    """Worker JSON (each with its ``pool``) -> queue, worker, status, last_heartbeat."""
    return pd.DataFrame([dict(queue=w["pool"], worker=w["name"], status=w.get("status", "OFFLINE"),
                              last_heartbeat=w.get("last_heartbeat_time")) for w in raw], columns=WORKER_COLUMNS)


def agents_frame(agents: Sequence[dict], now: Optional[dt.datetime] = None, online_window_s: float = ONLINE_WINDOW_S) -> pd.DataFrame:
    """One row per (agent, queue): capacity and free cpu / memory / gpu, online or not (an agent that publishes
    its heartbeat interval is offline after missing three; ``online_window_s`` for one that does not)."""
    now = now or dt.datetime.now(UTC)
    rows = []
    for a in agents:
        hb = pd.Timestamp(a.get("heartbeat")) if a.get("heartbeat") else None
        window = agent_window_s(a["heartbeat_s"]) if a.get("heartbeat_s") else online_window_s
        online = hb is not None and (pd.Timestamp(now) - hb).total_seconds() <= window
        cap, free = a.get("capacity") or {}, a.get("free") or {}
        for q in a.get("queues") or [UNKNOWN]:
            rows.append(dict(agent=a.get("name"), queue=q, online=online, runs=len(a.get("runs") or []),
                             cpu=cap.get("cpu"), free_cpu=free.get("cpu"), memory_gib=(cap.get("memory") or 0) / 2**30,
                             free_memory_gib=(free.get("memory") or 0) / 2**30, gpu=cap.get("gpu"), free_gpu=free.get("gpu")))
    return pd.DataFrame(rows, columns=AGENT_COLUMNS)
