"""Cost and waste: GPU-hours, CPU core-hours, memory and energy per run, allocated against used.

Per run (from the metrics store the agents write), over a time range ``[since, until)``:

* **allocated**: GPUs held x the part of the run's life inside the range (from its start to
  its end, or now while it runs); CPU core-hours likewise with the allocated CPUs;
* **used**: from the run's samples inside the range: GPU-hours weighted by utilisation
  (sum of utilisation x interval x allocated GPUs), CPU core-hours (sum of CPU use x interval);
* **memory**: peak (the kernel's high-water mark where the agent read it, else the samples' max)
  and mean of the samples, against the request;
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


def epoch_ms(t: dt.datetime) -> int:
    """``t`` as the store's epoch milliseconds (naive = UTC)."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(round(t.timestamp() * 1000))


def _chunks(seq: Sequence[Any], n: int = 500):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _raw_rows(conn: Any, q: Any) -> list[tuple]:
    """The rows of ``q`` as plain tuples through the driver's cursor: 100k SQLAlchemy rows
    cost pandas several times more to take apart (as in :meth:`RunIndex.frame`)."""
    c = q.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    cur = conn.connection.dbapi_connection.cursor()
    try:
        if conn.dialect.paramstyle in ("qmark", "numeric", "format"):
            cur.execute(str(c), tuple(c.params[k] for k in c.positiontup))
        else:
            cur.execute(str(c), c.params)
        return cur.fetchall()
    finally:
        cur.close()


def row_query(*where: Any) -> sa.Select:
    """The store's rows cost figures are made of (a run and its summary), for the runs ``where`` picks."""
    r, s = S.runs.c, S.summaries.c
    return (sa.select(r.id, r.flow_run_id, r.flow_run_name, r.job, r.deployment_id, r.owner, r.queue, r.preset, r.state,
                      r.started_ms, r.ended_ms, r.alloc_gpus, r.alloc_cpus, r.alloc_memory_bytes, r.extra, r.updated_ms,
                      s.run_id.label("has_summary"), s.cpu_seconds, s.gpu_used_s, s.avg_gpu_util_pct, s.duration_s,
                      s.avg_rss_bytes, s.peak_rss_bytes, s.gpu_energy_j, s.cpu_energy_j, s.samples)
            .select_from(S.runs.outerjoin(S.summaries, s.run_id == r.id)).where(*where))


def read_rows(conn: Any, *where: Any) -> pd.DataFrame:
    """:func:`row_query`'s rows as a frame (its columns, none of them converted)."""
    q = row_query(*where)
    return pd.DataFrame.from_records(_raw_rows(conn, q), columns=[c.name for c in q.selected_columns])


def read_stamps(conn: Any, *where: Any) -> pd.DataFrame:
    """The store key and ``updated_ms`` stamp of the runs ``where`` picks (what changed since a read is
    told by a stamp that differs: two integers per run, where :func:`read_rows` reads the whole row)."""
    r = S.runs.c
    return pd.DataFrame.from_records(_raw_rows(conn, sa.select(r.id, r.updated_ms).where(*where)), columns=["id", "updated_ms"])


def in_range(lo_ms: int, hi_ms: Optional[int], queues: Sequence[str] = ()) -> list:
    """Where-clauses: runs that started and lived inside ``[lo, hi)`` (hi None: no upper bound), of ``queues``."""
    r = S.runs.c
    where = [r.started_ms.is_not(None), sa.or_(r.ended_ms.is_(None), r.ended_ms > lo_ms)]
    if hi_ms is not None:
        where.append(r.started_ms < hi_ms)
    if queues:
        where.append(r.queue.in_(list(queues)))
    return where


def summarised(x: pd.DataFrame, lo: int, hi: int) -> pd.Series:
    """Runs wholly inside the range with a summary: their figures come from the summary."""
    return x["has_summary"].notna() & x["ended_ms"].notna() & (x["started_ms"] >= lo) & (x["ended_ms"] <= hi)


def sample_sums(conn: Any, x: pd.DataFrame, lo: int, hi: int) -> pd.DataFrame:
    """Per run of ``x`` not :func:`summarised` (cut by the range, still going, or without a summary):
    its samples' sums inside the range, indexed by the run's key."""
    sm = S.samples.c
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
    partial = x.loc[~summarised(x, lo, hi), "id"].astype(int).tolist()
    agg_rows = []
    for chunk in _chunks(partial):
        stmt = sa.select(*agg_cols).where(sm.run_id.in_(list(chunk)), sm.ts_ms >= lo, sm.ts_ms < hi).group_by(sm.run_id)
        agg_rows += [tuple(r) for r in conn.execute(stmt)]
    return pd.DataFrame(agg_rows, columns=[c.name for c in agg_cols]).set_index("run_id")


def run_costs(store: Any, since: dt.datetime, until: dt.datetime, queues: Sequence[str] = (),
              now: Optional[dt.datetime] = None, deployments: Optional[dict] = None) -> pd.DataFrame:
    """One row per run of the store that lived inside ``[since, until)`` (see the module doc).

    ``deployments`` (id -> {"name": ...}, as :func:`prefect_launch.dashboard.api.fetch_deployments`
    reads them) names the job of runs whose record holds only the deployment id."""
    lo, hi = epoch_ms(since), epoch_ms(until)
    with store._read() as conn:
        x = read_rows(conn, *in_range(lo, hi, queues))
        agg = sample_sums(conn, x, lo, hi)
    return costs_frame(x, agg, lo, hi, epoch_ms(now or dt.datetime.now(UTC)), deployments)


def costs_frame(x: pd.DataFrame, agg: pd.DataFrame, lo: int, hi: int, now_ms: int,
                deployments: Optional[dict] = None, by_key: bool = False) -> pd.DataFrame:
    """The cost rows (``RUN_COLUMNS``, in the runs' key order) of the store rows ``x`` (:func:`read_rows`,
    every one inside the range) and their :func:`sample_sums`: the one producer of what the page,
    ``prefect-launch report`` and the incremental reader (:mod:`.cost_rows`) show. ``by_key``: indexed
    by each row's store key (what the incremental reader keeps rows by), else 0..n-1."""
    if x.empty:
        return pd.DataFrame(columns=RUN_COLUMNS, index=pd.Index([], dtype="int64") if by_key else None)
    x = x.sort_values("id", kind="stable", ignore_index=True)
    deployments = deployments or {}
    whole = summarised(x, lo, hi)
    num = lambda col: pd.to_numeric(x[col], errors="coerce").astype(float)  # noqa: E731
    start, end = num("started_ms"), num("ended_ms")
    held_h = ((np.minimum(end.fillna(now_ms), hi) - np.maximum(start, lo)) / 3.6e6).clip(lower=0.0)
    gpus = num("alloc_gpus").fillna(0.0)
    cpus = num("alloc_cpus")
    a = agg.reindex(x["id"].astype(int)).set_axis(x.index)
    for col in ("cpu_pct_ms", "cpu_ms", "gpu_pct_ms", "gpu_ms", "peak_rss", "mean_rss", "gpu_j", "cpu_j", "n"):
        a[col] = pd.to_numeric(a[col], errors="coerce").astype(float)
    # from samples (runs the range cuts), else from the summary (the same sums, folded as sampled)
    cpu_used = (a["cpu_pct_ms"] / 100.0 / 3.6e6).where(a["cpu_ms"] > 0)
    gpu_used = (gpus * a["gpu_pct_ms"] / 100.0 / 3.6e6).where((a["gpu_ms"] > 0) & (gpus > 0))
    sm_cpu = num("cpu_seconds") / 3600.0
    sm_gpu = (num("gpu_used_s") / 3600.0).where(gpus > 0)
    # each distinct extra parsed once, then looked up (a dict map, not a Python call per run: 100k runs a step)
    extras = {e: (json.loads(e) if e else {}) for e in x["extra"].dropna().unique()}
    # text (object) even where no run recorded one: an all-missing map is float, which a text fill will refuse
    source_of = lambda key: x["extra"].map({e: d.get(key) for e, d in extras.items()}).astype(object)  # noqa: E731
    gpu_src = source_of("gpu_energy").where(gpus > 0)
    gpu_src = gpu_src.where(gpu_src.notna() | (gpus <= 0), "unavailable: not recorded")
    cpu_src = source_of("cpu_energy").fillna("unavailable: not recorded")
    pick = lambda from_samples, from_summary: from_samples.where(~whole, from_summary)  # noqa: E731
    deps = {k: (v or {}).get("name") for k, v in deployments.items()}
    job = x["job"].where(x["job"].notna(), x["deployment_id"].map(deps))
    df = pd.DataFrame(dict(
        id=x["flow_run_id"], run=x["flow_run_name"].where(x["flow_run_name"].notna(), x["flow_run_id"].str[:8]),
        job=job.fillna(UNKNOWN), owner=x["owner"].fillna(UNKNOWN), queue=x["queue"].fillna(UNKNOWN),
        preset=x["preset"].fillna(UNKNOWN), state=x["state"], start=pd.to_datetime(start, unit="ms", utc=True),
        end=pd.to_datetime(end, unit="ms", utc=True), hours=held_h, gpus=gpus, cpus=cpus,
        memory_request_gib=(num("alloc_memory_bytes") / 2**30).where(num("alloc_memory_bytes") > 0),
        gpu_alloc_h=gpus * held_h, gpu_used_h=pick(gpu_used, sm_gpu), cpu_alloc_h=cpus * held_h,
        cpu_used_h=pick(cpu_used, sm_cpu), peak_memory_gib=pick(a["peak_rss"], num("peak_rss_bytes")) / 2**30,
        mean_memory_gib=pick(a["mean_rss"], num("avg_rss_bytes")) / 2**30,
        gpu_energy_wh=pick(a["gpu_j"], num("gpu_energy_j")) / 3600.0, cpu_energy_wh=pick(a["cpu_j"], num("cpu_energy_j")) / 3600.0,
        gpu_energy_source=gpu_src, cpu_energy_source=cpu_src,
        samples=pick(a["n"].fillna(0.0), num("samples").fillna(0.0)).astype(int),
        source=np.where(whole, "summary", "samples"),
    ), columns=RUN_COLUMNS)
    if by_key:
        return df.set_axis(pd.Index(x["id"].astype("int64").to_numpy()))
    return df.reset_index(drop=True)


def filter_runs(df: pd.DataFrame, owners: Sequence[str] = (), jobs: Sequence[str] = (), presets: Sequence[str] = (),
                queues: Sequence[str] = ()) -> pd.DataFrame:
    """The rows of the runs with those labels (no labels: every row, not a copy of them: at 1M runs
    an all-true mask's copy cost each step of the page's clock a few tenths of a second)."""
    if not (owners or jobs or presets or queues):
        return df
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

    if df.empty:
        return pd.DataFrame(columns=[by, *TABLE_COLUMNS])
    parts = _table_parts(df)
    adds, peaks = parts.drop(columns=list(MAX_PARTS)), parts[list(MAX_PARTS)]
    sums = adds.groupby(df[by], sort=False, observed=True).sum()
    tops = peaks.groupby(df[by], sort=False, observed=True).max()
    rows = [dict({by: k}, **_table_row(sums.loc[k], tops.loc[k])) for k in sums.index]
    rows.sort(key=lambda d: (-d["gpu_alloc_h"], -(d["cpu_alloc_h"] or 0.0), str(d[by])))
    rows.append(dict({by: "total"}, **_table_row(adds.sum(), peaks.max())))
    return pd.DataFrame(rows, columns=[by, *TABLE_COLUMNS])


MAX_PARTS = ("peak", "mem_req")  # the parts of _table_parts taken as a maximum; every other one is summed


def _table_parts(df: pd.DataFrame) -> pd.DataFrame:
    """Per run, the addends of :func:`cost_table`'s sums (0 where a run does not count towards one, with a
    count beside each sum that may have no addend): one vectorised pass, then sums per group."""
    f = lambda c: df[c].to_numpy(dtype="float64")  # noqa: E731
    gpus, gpu_alloc, gpu_used, cpu_alloc, cpu_used = f("gpus"), np.nan_to_num(f("gpu_alloc_h")), f("gpu_used_h"), f("cpu_alloc_h"), f("cpu_used_h")
    gpu_e, cpu_e = f("gpu_energy_wh"), f("cpu_energy_wh")
    gpu_run = gpus > 0
    measured = gpu_run & ~np.isnan(gpu_used)
    cpu_m = ~np.isnan(cpu_used) & ~np.isnan(cpu_alloc)
    z = lambda ok, v: np.where(ok, v, 0.0)  # noqa: E731
    return pd.DataFrame({
        "runs": np.ones(len(df)), "hours": np.nan_to_num(f("hours")), "gpu_alloc": gpu_alloc,
        "m_n": measured.astype("float64"), "m_used": z(measured, gpu_used), "m_alloc": z(measured, gpu_alloc),
        "unmeasured": z(gpu_run & np.isnan(gpu_used), gpu_alloc),
        "cpu_alloc_n": (~np.isnan(cpu_alloc)).astype("float64"), "cpu_alloc": np.nan_to_num(cpu_alloc),
        "cm_n": cpu_m.astype("float64"), "cm_used": z(cpu_m, cpu_used), "cm_alloc": z(cpu_m, cpu_alloc),
        "gpu_runs": gpu_run.astype("float64"), "ge_n": (gpu_run & ~np.isnan(gpu_e)).astype("float64"),
        "ge": z(gpu_run & ~np.isnan(gpu_e), gpu_e), "ce_n": (~np.isnan(cpu_e)).astype("float64"), "ce": np.nan_to_num(cpu_e),
        "peak": f("peak_memory_gib"), "mem_req": f("memory_request_gib"),
    }, index=df.index)


def _table_row(s: pd.Series, mx: pd.Series) -> dict:
    """One row of :func:`cost_table` from a group's sums and maxima (None: no run had the figure)."""
    used = float(s["m_used"]) if s["m_n"] else None
    cpu_used = float(s["cm_used"]) if s["cm_n"] else None
    nan_none = lambda v: None if pd.isna(v) else float(v)  # noqa: E731
    return dict(
        runs=int(s["runs"]), hours=float(s["hours"]), gpu_alloc_h=float(s["gpu_alloc"]), gpu_used_h=used,
        gpu_idle_h=float(s["m_alloc"]) - used if used is not None else None,
        gpu_used_pct=_pct(used, float(s["m_alloc"])), gpu_unmeasured_h=float(s["unmeasured"]),
        cpu_alloc_h=float(s["cpu_alloc"]) if s["cpu_alloc_n"] else None, cpu_used_h=cpu_used,
        cpu_used_pct=_pct(cpu_used, float(s["cm_alloc"]) if s["cm_n"] else None),
        gpu_energy_wh=float(s["ge"]) if s["ge_n"] else None, gpu_energy_runs=f"{int(s['ge_n'])}/{int(s['gpu_runs'])}",
        cpu_energy_wh=float(s["ce"]) if s["ce_n"] else None, cpu_energy_runs=f"{int(s['ce_n'])}/{int(s['runs'])}",
        peak_memory_gib=nan_none(mx["peak"]), memory_request_gib=nan_none(mx["mem_req"]),
    )


def wasters(df: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The runs that left most of what they held idle: measured idle GPU-hours first, then
    idle CPU core-hours (for runs without GPUs)."""
    if df.empty:
        return df.assign(gpu_idle_h=[], cpu_idle_h=[])
    gpu_idle = (df["gpu_alloc_h"] - df["gpu_used_h"]).to_numpy(dtype="float64")
    cpu_idle = (df["cpu_alloc_h"] - df["cpu_used_h"]).to_numpy(dtype="float64")
    idle = np.flatnonzero((np.nan_to_num(gpu_idle) > 0) | (np.nan_to_num(cpu_idle) > 0))
    # most idle GPU-hours first, then core-hours, missing figures last, ties in row order (a stable sort), and
    # only the top n rows copied (at 1M runs a sort of the whole frame took seconds)
    desc = lambda v: np.where(np.isnan(v), np.inf, -v)  # noqa: E731
    top = idle[np.lexsort((desc(cpu_idle[idle]), desc(gpu_idle[idle])))[:n]]
    w = df.iloc[top].assign(gpu_idle_h=gpu_idle[top], cpu_idle_h=cpu_idle[top])
    return w[["run", "id", "job", "owner", "queue", "gpus", "gpu_alloc_h", "gpu_used_h", "gpu_idle_h", "cpus",
              "cpu_alloc_h", "cpu_used_h", "cpu_idle_h", "gpu_energy_wh"]].reset_index(drop=True)


def idle_share(df: pd.DataFrame) -> Optional[float]:
    """Share (%) of the held GPU time that was idle, over the runs whose GPU use was measured."""
    m = df[(df["gpus"] > 0) & df["gpu_used_h"].notna()] if not df.empty else df
    alloc = float(m["gpu_alloc_h"].sum()) if len(m) else 0.0
    return 100.0 * (alloc - float(m["gpu_used_h"].sum())) / alloc if alloc > 0 else None


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
