"""Cost and waste: GPU-hours, CPU core-hours, memory and energy per run, allocated against used.

Per run (from the metrics store the agents write), over a time range ``[since, until)``:

* **allocated**: GPUs held x the part of the run's life inside the range (from its start to
  its end, or now while it runs); CPU core-hours likewise with the allocated CPUs;
* **used**: from the run's samples inside the range: GPU-hours weighted by utilisation
  (sum of utilisation x interval x allocated GPUs), CPU core-hours (sum of CPU use x interval);
* **memory**: peak and mean of the samples against the request;
* **energy** (Wh): the sum of the samples' GPU energy (NVML's energy counter, else power
  readings integrated) and CPU energy (the run's share of RAPL package energy). A run whose
  samples carry no energy has none: the figure is *unavailable* (None), with the reason the
  agent recorded, never an estimate.

A run that lies wholly inside the range and has a summary is read from its summary (the same
sums, folded by the sampler as it went); the others from their samples in the range. Used
figures are None where the run has no such measurement (no sample yet, or no NVML reading
for its GPUs): "unknown" is never counted as idle.

:func:`cost_table` groups runs by owner, job or queue (the panel and
``prefect-launch report``); :func:`wasters` lists the runs that left most of what they held
idle; :func:`idle_share` is the share of the measured held GPU time that was idle.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import sqlalchemy as sa

from prefect_launch.blocks import metrics_schema as S

UTC = dt.timezone.utc
BY = ("owner", "job", "queue")
UNKNOWN = "unknown"
RUN_COLUMNS = ["id", "run", "job", "owner", "queue", "preset", "state", "start", "end", "hours", "gpus", "cpus",
               "memory_request_gib", "gpu_alloc_h", "gpu_used_h", "cpu_alloc_h", "cpu_used_h", "peak_memory_gib",
               "mean_memory_gib", "gpu_energy_wh", "cpu_energy_wh", "gpu_energy_source", "cpu_energy_source", "samples",
               "source"]
TABLE_COLUMNS = ["runs", "hours", "gpu_alloc_h", "gpu_used_h", "gpu_idle_h", "gpu_used_pct", "gpu_unmeasured_h",
                 "cpu_alloc_h", "cpu_used_h", "cpu_used_pct", "gpu_energy_wh", "gpu_energy_runs", "cpu_energy_wh",
                 "cpu_energy_runs", "peak_memory_gib", "memory_request_gib"]


def _ms(t: dt.datetime) -> int:
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(round(t.timestamp() * 1000))


def _chunks(seq: Sequence[Any], n: int = 500):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def run_costs(store: Any, since: dt.datetime, until: dt.datetime, queues: Sequence[str] = (),
              now: Optional[dt.datetime] = None, deployments: Optional[dict] = None) -> pd.DataFrame:
    """One row per run of the store that lived inside ``[since, until)`` (see the module doc).

    ``deployments`` (id -> {"name": ...}, as :func:`prefect_launch.dashboard.data.fetch_deployments`
    reads them) names the job of runs whose record holds only the deployment id."""
    deployments = deployments or {}
    now = now or dt.datetime.now(UTC)
    lo, hi, now_ms = _ms(since), _ms(until), _ms(now)
    r, s, sm = S.runs.c, S.summaries.c, S.samples.c
    where = [r.started_ms.is_not(None), r.started_ms < hi, sa.or_(r.ended_ms.is_(None), r.ended_ms > lo)]
    if queues:
        where.append(r.queue.in_(list(queues)))
    q = (sa.select(r.id, r.flow_run_id, r.flow_run_name, r.job, r.deployment_id, r.owner, r.queue, r.preset, r.state, r.started_ms,
                   r.ended_ms, r.alloc_gpus, r.alloc_cpus, r.alloc_memory_bytes, r.extra, s.run_id.label("has_summary"),
                   s.cpu_seconds, s.gpu_used_s, s.avg_gpu_util_pct, s.duration_s, s.avg_rss_bytes, s.peak_rss_bytes,
                   s.gpu_energy_j, s.cpu_energy_j, s.samples)
         .select_from(S.runs.outerjoin(S.summaries, s.run_id == r.id)).where(*where))
    agg_cols = [
        sm.run_id,
        sa.func.sum(sm.cpu_pct * sm.interval_ms).label("cpu_pct_ms"),
        sa.func.sum(sa.case((sm.cpu_pct.is_not(None), sm.interval_ms), else_=0)).label("cpu_ms"),
        sa.func.sum(sm.gpu_util_pct * sm.interval_ms).label("gpu_pct_ms"),
        sa.func.sum(sa.case((sm.gpu_util_pct.is_not(None), sm.interval_ms), else_=0)).label("gpu_ms"),
        sa.func.max(sm.rss_bytes).label("peak_rss"),
        sa.func.avg(sm.rss_bytes).label("mean_rss"),
        sa.func.sum(sm.gpu_energy_j).label("gpu_j"),
        sa.func.sum(sm.cpu_energy_j).label("cpu_j"),
        sa.func.count().label("n"),
    ]
    with store._read() as conn:
        runs = [dict(row._mapping) for row in conn.execute(q)]
        # runs to read from samples: cut by the range, still going, or without a summary
        partial = [x["id"] for x in runs if not (x["has_summary"] is not None and x["ended_ms"] is not None
                                                  and x["started_ms"] >= lo and x["ended_ms"] <= hi)]
        agg: dict[int, dict] = {}
        for chunk in _chunks(partial):
            stmt = sa.select(*agg_cols).where(sm.run_id.in_(list(chunk)), sm.ts_ms >= lo, sm.ts_ms < hi).group_by(sm.run_id)
            for row in conn.execute(stmt):
                agg[row.run_id] = dict(row._mapping)
    out = []
    for x in runs:
        start, end = x["started_ms"], x["ended_ms"]
        stop = end if end is not None else now_ms
        held_h = max(0.0, (min(stop, hi) - max(start, lo)) / 3.6e6)
        gpus = float(x["alloc_gpus"] or 0)
        cpus = float(x["alloc_cpus"]) if x["alloc_cpus"] is not None else None
        extra = json.loads(x["extra"]) if x["extra"] else {}
        if x["id"] in agg or x["id"] in partial:
            a = agg.get(x["id"]) or {}
            n = int(a.get("n") or 0)
            cpu_used = a["cpu_pct_ms"] / 100.0 / 3.6e6 if a.get("cpu_ms") else None
            gpu_used = gpus * a["gpu_pct_ms"] / 100.0 / 3.6e6 if gpus and a.get("gpu_ms") else None
            peak, mean = a.get("peak_rss"), a.get("mean_rss")
            gpu_wh = a["gpu_j"] / 3600.0 if a.get("gpu_j") is not None else None
            cpu_wh = a["cpu_j"] / 3600.0 if a.get("cpu_j") is not None else None
            source = "samples"
        else:
            n = int(x["samples"] or 0)
            cpu_used = x["cpu_seconds"] / 3600.0 if x["cpu_seconds"] is not None else None
            gpu_used = x["gpu_used_s"] / 3600.0 if gpus and x["gpu_used_s"] is not None else None
            peak, mean = x["peak_rss_bytes"], x["avg_rss_bytes"]
            gpu_wh = x["gpu_energy_j"] / 3600.0 if x["gpu_energy_j"] is not None else None
            cpu_wh = x["cpu_energy_j"] / 3600.0 if x["cpu_energy_j"] is not None else None
            source = "summary"
        out.append(dict(
            id=x["flow_run_id"], run=x["flow_run_name"] or x["flow_run_id"][:8],
            job=x["job"] or (deployments.get(x["deployment_id"]) or {}).get("name") or UNKNOWN,
            owner=x["owner"] or UNKNOWN, queue=x["queue"] or UNKNOWN, preset=x["preset"] or UNKNOWN,
            state=x["state"], start=pd.Timestamp(start, unit="ms", tz=UTC),
            end=pd.Timestamp(end, unit="ms", tz=UTC) if end is not None else pd.NaT, hours=held_h, gpus=gpus, cpus=cpus,
            memory_request_gib=x["alloc_memory_bytes"] / 2**30 if x["alloc_memory_bytes"] else None,
            gpu_alloc_h=gpus * held_h, gpu_used_h=gpu_used, cpu_alloc_h=cpus * held_h if cpus is not None else None,
            cpu_used_h=cpu_used, peak_memory_gib=peak / 2**30 if peak is not None else None,
            mean_memory_gib=float(mean) / 2**30 if mean is not None else None, gpu_energy_wh=gpu_wh, cpu_energy_wh=cpu_wh,
            gpu_energy_source=(extra.get("gpu_energy") if gpus else None) or ("unavailable: not recorded" if gpus else None),
            cpu_energy_source=extra.get("cpu_energy") or "unavailable: not recorded", samples=n, source=source,
        ))
    df = pd.DataFrame(out, columns=RUN_COLUMNS)
    for c in ("hours", "gpus", "cpus", "memory_request_gib", "gpu_alloc_h", "gpu_used_h", "cpu_alloc_h", "cpu_used_h",
              "peak_memory_gib", "mean_memory_gib", "gpu_energy_wh", "cpu_energy_wh"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    return df


def filter_runs(df: pd.DataFrame, owners: Sequence[str] = (), jobs: Sequence[str] = (), presets: Sequence[str] = (),
                queues: Sequence[str] = ()) -> pd.DataFrame:
    m = pd.Series(True, index=df.index)
    for col, vals in (("owner", owners), ("job", jobs), ("preset", presets), ("queue", queues)):
        if vals:
            m &= df[col].isin(list(vals))
    return df[m]


def _sum_or_none(v: pd.Series) -> Optional[float]:
    v = v.dropna()
    return float(v.sum()) if len(v) else None


def _pct(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return 100.0 * num / den if num is not None and den else None


def cost_table(df: pd.DataFrame, by: str = "owner") -> pd.DataFrame:
    """Per ``by`` value (owner, job or queue), most GPU-hours held first; a row ``total`` last.

    ``gpu_used_h`` / ``gpu_idle_h`` cover the runs whose GPU use was measured;
    ``gpu_unmeasured_h`` is what runs held without a GPU reading (not counted as idle).
    ``gpu_energy_runs`` / ``cpu_energy_runs`` read "k/n": k of the n runs that could have
    the figure had it measured (energy sums cover those k only; None when k = 0).
    """
    if by not in BY:
        raise ValueError(f"--by must be one of {', '.join(BY)}")

    def one(g: pd.DataFrame) -> dict:
        gpu_runs = g[g["gpus"] > 0]
        measured = gpu_runs[gpu_runs["gpu_used_h"].notna()]
        gpu_alloc = float(g["gpu_alloc_h"].sum())
        used = float(measured["gpu_used_h"].sum()) if len(measured) else None
        cpu_m = g[g["cpu_used_h"].notna() & g["cpu_alloc_h"].notna()]
        cpu_used = float(cpu_m["cpu_used_h"].sum()) if len(cpu_m) else None
        return dict(
            runs=len(g), hours=float(g["hours"].sum()), gpu_alloc_h=gpu_alloc, gpu_used_h=used,
            gpu_idle_h=float(measured["gpu_alloc_h"].sum()) - used if used is not None else None,
            gpu_used_pct=_pct(used, float(measured["gpu_alloc_h"].sum())),
            gpu_unmeasured_h=float(gpu_runs.loc[gpu_runs["gpu_used_h"].isna(), "gpu_alloc_h"].sum()),
            cpu_alloc_h=_sum_or_none(g["cpu_alloc_h"]), cpu_used_h=cpu_used,
            cpu_used_pct=_pct(cpu_used, float(cpu_m["cpu_alloc_h"].sum()) if len(cpu_m) else None),
            gpu_energy_wh=_sum_or_none(gpu_runs["gpu_energy_wh"]),
            gpu_energy_runs=f"{int(gpu_runs['gpu_energy_wh'].notna().sum())}/{len(gpu_runs)}",
            cpu_energy_wh=_sum_or_none(g["cpu_energy_wh"]),
            cpu_energy_runs=f"{int(g['cpu_energy_wh'].notna().sum())}/{len(g)}",
            peak_memory_gib=float(g["peak_memory_gib"].max()) if g["peak_memory_gib"].notna().any() else None,
            memory_request_gib=float(g["memory_request_gib"].max()) if g["memory_request_gib"].notna().any() else None,
        )

    if df.empty:
        return pd.DataFrame(columns=[by, *TABLE_COLUMNS])
    rows = [dict({by: k}, **one(g)) for k, g in df.groupby(by, sort=False)]
    rows.sort(key=lambda d: (-d["gpu_alloc_h"], -(d["cpu_alloc_h"] or 0.0), str(d[by])))
    rows.append(dict({by: "total"}, **one(df)))
    return pd.DataFrame(rows, columns=[by, *TABLE_COLUMNS])


def wasters(df: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The runs that left most of what they held idle: measured idle GPU-hours first, then
    idle CPU core-hours (for runs without GPUs)."""
    if df.empty:
        return df.assign(gpu_idle_h=[], cpu_idle_h=[])
    w = df.assign(gpu_idle_h=df["gpu_alloc_h"] - df["gpu_used_h"], cpu_idle_h=df["cpu_alloc_h"] - df["cpu_used_h"])
    w = w[(w["gpu_idle_h"].fillna(0) > 0) | (w["cpu_idle_h"].fillna(0) > 0)]
    w = w.sort_values(["gpu_idle_h", "cpu_idle_h"], ascending=False, na_position="last")
    return w.head(n)[["run", "id", "job", "owner", "queue", "gpus", "gpu_alloc_h", "gpu_used_h", "gpu_idle_h", "cpus",
                      "cpu_alloc_h", "cpu_used_h", "cpu_idle_h", "gpu_energy_wh"]].reset_index(drop=True)


def idle_share(df: pd.DataFrame) -> Optional[float]:
    """Share (%) of the held GPU time that was idle, over the runs whose GPU use was measured."""
    m = df[(df["gpus"] > 0) & df["gpu_used_h"].notna()] if not df.empty else df
    alloc = float(m["gpu_alloc_h"].sum()) if len(m) else 0.0
    return 100.0 * (alloc - float(m["gpu_used_h"].sum())) / alloc if alloc > 0 else None


def parse_since(text: str, now: Optional[dt.datetime] = None) -> dt.datetime:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` before now, or an ISO time (naive = UTC)."""
    now = now or dt.datetime.now(UTC)
    t = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    if t and t[-1].lower() in units:
        try:
            return now - dt.timedelta(seconds=float(t[:-1]) * units[t[-1].lower()])
        except ValueError:
            pass
    try:
        v = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a time: use e.g. 7d, 12h, 30m or 2026-11-01T00:00") from None
    return v if v.tzinfo else v.replace(tzinfo=UTC)


def report_rows(table: pd.DataFrame) -> list[dict]:
    """The table as JSON-ready dicts (None for unavailable figures)."""
    out = []
    for rec in table.to_dict(orient="records"):
        out.append({k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in rec.items()})
    return out


def report(store: Any, by: str, since: dt.datetime, until: Optional[dt.datetime] = None, queues: Sequence[str] = (),
           now: Optional[dt.datetime] = None, deployments: Optional[dict] = None) -> pd.DataFrame:
    """What ``prefect-launch report`` prints: :func:`cost_table` of the runs in the range."""
    now = now or dt.datetime.now(UTC)
    return cost_table(run_costs(store, since, until or now, queues, now=now, deployments=deployments), by)
