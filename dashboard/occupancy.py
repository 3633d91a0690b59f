"""Occupancy: what the queue held at each moment, from the runs' own state times.

Pure functions (pandas / numpy in, pandas out), vectorised interval arithmetic; no
server. Input rows are the run index's prepared rows (:func:`.index_view.prepare`): per
run its state type, expected start, ``queued_us`` (when it entered its queue for its
latest scheduling before it first left it), ``pending_us`` (the agent's claim), start,
end, state time, resources and the agent's placement label.

Each run is cut into three phases (epoch microseconds, ``[from, to)``):

* **queued**   ``queued_us`` (else the expected start) -> its claim (Pending), else its
  start, else its end (cancelled while waiting), else now;
* **pending**  the claim -> its start, else its end, else now;
* **running**  its start -> its end, else now.

A flow retry happens inside the process that holds the run's slot, so a run stays
"running" from its first start to its end. A run *holds* its slot from its claim (the
agent allocates at the claim) to its end; busy load, GPU-/CPU-seconds, idle periods,
capacity share and the heatmap count held time.

Per bucket ``[b, b + step)`` a phase counts "at any moment" when its interval overlaps
the bucket; the seconds inside the bucket are the overlap; a run *finished* in the
bucket its end falls in, by its end state.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

UTC = dt.timezone.utc
PHASES = ("queued", "pending", "running")
END_STATUS = {"COMPLETED": "completed", "FAILED": "failed", "CRASHED": "crashed", "CANCELLED": "cancelled"}
DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
PLACEMENT_RE = r"^agent (?P<agent>[^:]+): (?P<res>[^;]*); gpus (?P<gpus>[^;]*); cores (?P<cores>.*)$"
PER_RUN_GANTT_MAX = 300  # more runs than this in range: the Gantt draws lanes per agent and device


def _us(t: dt.datetime) -> int:
    d = t.astimezone(UTC) - dt.datetime(1970, 1, 1, tzinfo=UTC)
    return (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds


@dataclass(frozen=True)
class Buckets:
    """``n`` buckets of ``step_s`` seconds from ``lo_us`` (epoch microseconds)."""

    lo_us: int
    step_s: int
    n: int

    @classmethod
    def aligned(cls, since: dt.datetime, until: dt.datetime, step_s: int) -> "Buckets":
        """[since, until) widened to whole buckets on multiples of the step (UTC epoch),
        as the history panels align them."""
        s = math.floor(since.timestamp() / step_s) * step_s
        e = math.ceil(until.timestamp() / step_s) * step_s
        return cls(int(s) * 1_000_000, int(step_s), max(int((e - s) // step_s), 1))

    @property
    def hi_us(self) -> int:
        return self.lo_us + self.n * self.step_s * 1_000_000

    def starts(self) -> pd.DatetimeIndex:
        return pd.to_datetime(self.lo_us + np.arange(self.n, dtype="int64") * self.step_s * 1_000_000, unit="us", utc=True)

    def rel(self, t_us: np.ndarray) -> np.ndarray:
        """Epoch microseconds -> seconds from the first bucket's start (float, small: exact sums)."""
        return (np.asarray(t_us, dtype="float64") - self.lo_us) / 1e6


# --------------------------------------------------------------------- phases


def phases(rows: pd.DataFrame, now_us: float) -> pd.DataFrame:
    """Per run (same index as ``rows``): q0, q1, p0, p1, r0, r1, h0, h1 (queued, pending,
    running, held intervals; NaN where the run has no such phase) and ``end`` (when it
    finished; NaN while open)."""
    st = rows["state_type"].astype(object).to_numpy()
    terminal = np.isin(st, list(END_STATUS))
    f = lambda c: rows[c].to_numpy(dtype="float64") if c in rows else np.full(len(rows), np.nan)  # noqa: E731
    exp, start, end, state_t = f("expected_start_us"), f("start_us"), f("end_us"), f("state_us")
    queued, pending = f("queued_us"), f("pending_us")
    end = np.where(terminal, np.where(np.isnan(end), state_t, end), np.nan)
    stop = np.where(terminal, end, now_us)  # where an open phase ends
    q0 = np.where(np.isnan(queued), exp, queued)
    ok_p = ~np.isnan(pending) & ~(pending < q0) & ~(pending > start)
    p0 = np.where(ok_p, pending, np.nan)
    q1 = np.fmin(np.where(ok_p, p0, np.where(np.isnan(start), stop, start)), now_us)
    p1 = np.where(ok_p, np.fmin(np.where(np.isnan(start), stop, start), now_us), np.nan)
    r0 = start
    r1 = np.where(np.isnan(start), np.nan, np.fmin(stop, now_us))
    h0 = np.where(ok_p, p0, r0)
    h1 = np.where(np.isnan(h0), np.nan, np.where(np.isnan(start), p1, r1))
    out = pd.DataFrame({"q0": q0, "q1": q1, "p0": p0, "p1": p1, "r0": r0, "r1": r1, "h0": h0, "h1": h1, "end": end},
                       index=rows.index)
    for a, b in (("q0", "q1"), ("p0", "p1"), ("r0", "r1"), ("h0", "h1")):
        empty = ~(out[b] > out[a])  # no (positive) interval: no phase
        out.loc[empty, [a, b]] = np.nan
    return out


def overlapping(rows: pd.DataFrame, since_us: float, until_us: float, now_us: float) -> pd.DataFrame:
    """The rows with any phase (or their end) in [since, until)."""
    ph = phases(rows, now_us)
    first = ph[["q0", "p0", "r0", "end"]].min(axis=1)
    last = ph[["q1", "p1", "r1", "end"]].max(axis=1)
    return rows[(first < until_us).to_numpy() & (last >= since_us).to_numpy()]


# ------------------------------------------------------------ interval maths


def present(s_us: np.ndarray, e_us: np.ndarray, b: Buckets, codes: Optional[np.ndarray] = None, n_groups: int = 1) -> np.ndarray:
    """(n_groups, n) counts of intervals [s, e) that overlap each bucket (NaN / empty: none)."""
    s, e = b.rel(s_us), b.rel(e_us)
    ok = ~np.isnan(s) & ~np.isnan(e) & (e > s) & (e > 0) & (s < b.n * b.step_s)
    codes = np.zeros(len(s), dtype="int64") if codes is None else np.asarray(codes, dtype="int64")
    s, e, codes = s[ok], e[ok], codes[ok]
    k0 = np.clip(np.floor(s / b.step_s), 0, b.n - 1).astype("int64")
    k1 = np.clip(np.ceil(e / b.step_s) - 1, 0, b.n - 1).astype("int64")
    diff = np.zeros((n_groups, b.n + 1), dtype="int64")
    np.add.at(diff, (codes, k0), 1)
    np.add.at(diff, (codes, k1 + 1), -1)
    return np.cumsum(diff, axis=1)[:, : b.n]


def seconds_in(s_us: np.ndarray, e_us: np.ndarray, b: Buckets, weights: Optional[np.ndarray] = None,
               codes: Optional[np.ndarray] = None, n_groups: int = 1) -> np.ndarray:
    """(n_groups, n) seconds of the intervals [s, e) inside each bucket, times ``weights``
    (one row of weights; a 2-D (k, N) array gives (k, n_groups, n) at the cost of one sort).

    Through the cumulative function F(t) = sum w (min(t, e) - s)+ evaluated at the bucket
    edges: prefix sums over the starts and ends sorted, one searchsorted per edge set.
    """
    s, e = b.rel(s_us), b.rel(e_us)
    w = np.ones((1, len(s))) if weights is None else np.nan_to_num(np.atleast_2d(np.asarray(weights, dtype="float64")))
    ok = ~np.isnan(s) & ~np.isnan(e) & (e > s)
    codes = np.zeros(len(s), dtype="int64") if codes is None else np.asarray(codes, dtype="int64")
    s, e, w, codes = s[ok], e[ok], w[:, ok], codes[ok]
    edges = np.arange(b.n + 1, dtype="float64") * b.step_s
    out = np.zeros((w.shape[0], n_groups, b.n))
    for g in range(n_groups):
        m = codes == g if n_groups > 1 else slice(None)
        if n_groups > 1 and not m.any():
            continue
        F = _cumulative(s[m], w[:, m], edges) - _cumulative(e[m], w[:, m], edges)
        out[:, g] = np.diff(F, axis=1)
    return out if weights is not None and np.ndim(weights) == 2 else out[0]


def _cumulative(points: np.ndarray, w: np.ndarray, t: np.ndarray) -> np.ndarray:
    """(k, len(t)): sum over points p < t of w (t - p), for each weight row and t."""
    order = np.argsort(points, kind="stable")
    p, wp = points[order], w[:, order]
    zero = np.zeros((w.shape[0], 1))
    cw = np.concatenate([zero, np.cumsum(wp, axis=1)], axis=1)
    cwp = np.concatenate([zero, np.cumsum(wp * p, axis=1)], axis=1)
    k = np.searchsorted(p, t, side="left")
    return cw[:, k] * t - cwp[:, k]


def _codes(groups: Optional[pd.Series], n: int) -> tuple[np.ndarray, list]:
    if groups is None:
        return np.zeros(n, dtype="int64"), ["all"]
    cat = pd.Categorical(pd.Series(groups).astype(object).fillna("unknown").to_numpy())
    return cat.codes.astype("int64"), list(cat.categories)


# --------------------------------------------------------------------- panels


def status_frame(rows: pd.DataFrame, ph: pd.DataFrame, b: Buckets) -> pd.DataFrame:
    """Job status per interval: bucket, status, count (queued / pending / running at any
    moment of it; finished inside it, by end state), avg (time-weighted average number
    in that phase; NaN for finished)."""
    starts = b.starts()
    frames = []
    for name, (a, z) in zip(PHASES, (("q0", "q1"), ("p0", "p1"), ("r0", "r1"))):
        s, e = ph[a].to_numpy(), ph[z].to_numpy()
        frames.append(pd.DataFrame({"bucket": starts, "status": name, "count": present(s, e, b)[0],
                                    "avg": seconds_in(s, e, b)[0] / b.step_s}))
    end = b.rel(ph["end"].to_numpy())
    st = rows["state_type"].astype(object).map(END_STATUS).to_numpy()
    ok = ~np.isnan(end) & (end >= 0) & (end < b.n * b.step_s) & pd.notna(st)
    if ok.any():
        fin = pd.DataFrame({"k": (end[ok] // b.step_s).astype("int64"), "status": st[ok]})
        fin = fin.groupby(["k", "status"], as_index=False).size().rename(columns={"size": "count"})
        frames.append(pd.DataFrame({"bucket": starts[fin["k"].to_numpy()], "status": fin["status"].to_numpy(),
                                    "count": fin["count"].to_numpy(), "avg": np.nan}))
    out = pd.concat(frames, ignore_index=True)
    return out[out["count"] > 0].reset_index(drop=True)


def queued_frame(ph: pd.DataFrame, groups: Optional[pd.Series], b: Buckets) -> pd.DataFrame:
    """Queued time per interval: bucket, group, queued_s (waiting seconds inside the
    bucket), runs (runs that waited in it), mean_s (queued_s / runs)."""
    codes, names = _codes(groups, len(ph))
    s, e = ph["q0"].to_numpy(), ph["q1"].to_numpy()
    secs = seconds_in(s, e, b, codes=codes, n_groups=len(names))
    cnt = present(s, e, b, codes=codes, n_groups=len(names))
    starts = b.starts()
    out = pd.DataFrame({"bucket": np.tile(starts, len(names)), "group": np.repeat(names, b.n),
                        "queued_s": secs.ravel(), "runs": cnt.ravel()})
    out = out[out["runs"] > 0].reset_index(drop=True)
    out["mean_s"] = out["queued_s"] / out["runs"]
    return out


def load_frame(rows: pd.DataFrame, ph: pd.DataFrame, b: Buckets, held: Optional[tuple] = None) -> pd.DataFrame:
    """Per bucket (every bucket of the range): runs holding a slot at any moment (held),
    runs waiting at any moment (waiting), run-seconds held (run_s), GPU- and CPU-seconds
    held, and their time averages (busy, gpus, cpus)."""
    s, e = ph["h0"].to_numpy(), ph["h1"].to_numpy()
    gpu, cpu = held if held is not None else resources(rows)
    secs = seconds_in(s, e, b, np.vstack([np.ones(len(s)), gpu, cpu]))[:, 0]
    out = pd.DataFrame({"bucket": b.starts(), "held": present(s, e, b)[0],
                        "waiting": present(ph["q0"].to_numpy(), ph["q1"].to_numpy(), b)[0],
                        "run_s": secs[0], "gpu_s": secs[1], "cpu_s": secs[2]})
    for c, src in (("busy", "run_s"), ("gpus", "gpu_s"), ("cpus", "cpu_s")):
        out[c] = out[src] / b.step_s
    return out


def idle_periods(load: pd.DataFrame, step_s: int, until: Optional[pd.Timestamp] = None) -> pd.DataFrame:
    """Stretches of consecutive buckets in which no run held a slot at any moment:
    from, to, hours, waiting (most runs waiting at any moment of it: >0 means the
    queue was stuck, not idle). Longest first; buckets from ``until`` on are left out."""
    if load.empty:
        return pd.DataFrame(columns=["from", "to", "hours", "waiting"])
    lo = load if until is None else load[load["bucket"] < until]
    idle = (lo["held"] == 0).to_numpy()
    if not idle.any():
        return pd.DataFrame(columns=["from", "to", "hours", "waiting"])
    run_id = np.cumsum(np.r_[True, idle[1:] != idle[:-1]])
    d = pd.DataFrame({"bucket": lo["bucket"].to_numpy(), "waiting": lo["waiting"].to_numpy(), "run": run_id})[idle]
    agg = d.groupby("run").agg(start=("bucket", "min"), last=("bucket", "max"), waiting=("waiting", "max"))
    out = pd.DataFrame({"from": agg["start"], "to": agg["last"] + pd.Timedelta(seconds=step_s), "waiting": agg["waiting"]})
    if until is not None:
        out["to"] = out["to"].clip(upper=until)
    out["hours"] = (out["to"] - out["from"]).dt.total_seconds() / 3600
    return out.sort_values(["hours", "from"], ascending=[False, True], ignore_index=True)[["from", "to", "hours", "waiting"]]


def capacity(agents: pd.DataFrame) -> dict[str, Optional[float]]:
    """GPUs and CPUs the agents (online, serving the shown queues) publish, each counted once."""
    if agents is None or agents.empty:
        return dict(gpu=None, cpu=None)
    a = agents[agents["online"]].drop_duplicates("agent")
    gpu, cpu = pd.to_numeric(a["gpu"], errors="coerce").sum(), pd.to_numeric(a["cpu"], errors="coerce").sum()
    return dict(gpu=float(gpu) if gpu else None, cpu=float(cpu) if cpu else None)


def capacity_share(load: pd.DataFrame, cap: dict, span_s: float) -> dict[str, Optional[float]]:
    """Share (%) of the agents' GPU- and CPU-seconds over ``span_s`` that runs held."""
    out: dict[str, Optional[float]] = {}
    for k, col in (("gpu", "gpu_s"), ("cpu", "cpu_s")):
        c = cap.get(k)
        out[k] = 100.0 * float(load[col].sum()) / (c * span_s) if c and span_s > 0 and not load.empty else None
    return out


def heatmap(rows: pd.DataFrame, ph: pd.DataFrame, since: dt.datetime, until: dt.datetime,
            held: Optional[tuple] = None) -> pd.DataFrame:
    """Hour of day x weekday (UTC): mean runs holding a slot (busy) and mean GPUs held,
    from held seconds inside hourly buckets of the range."""
    b = Buckets.aligned(since, until, 3600)
    ld = load_frame(rows, ph, b, held)
    ld["weekday"] = ld["bucket"].dt.day_of_week.map(dict(enumerate(DAYS)))
    ld["hour"] = ld["bucket"].dt.hour
    out = ld.groupby(["weekday", "hour"], as_index=False).agg(busy=("busy", "mean"), gpus=("gpus", "mean"), hours=("busy", "size"))
    return out[["weekday", "hour", "busy", "gpus", "hours"]]


# ---------------------------------------------------------------------- gantt


def _parse(label: str) -> tuple[Optional[str], float, float, list[str]]:
    """One placement label -> (agent, gpus held, cpus held, slots: "gpu k" each, else "core k" each)."""
    m = re.match(PLACEMENT_RE, label or "")
    if not m:
        return None, math.nan, math.nan, []
    res = dict(kv.split("=", 1) for kv in m["res"].split(",") if "=" in kv)
    split = lambda v: [] if v.strip() in ("", "none") else [x.strip() for x in v.split(",") if x.strip()]  # noqa: E731
    gpus, cores = split(m["gpus"]), split(m["cores"])

    def num(k: str) -> float:
        try:
            return float(res[k])
        except (KeyError, ValueError):
            return math.nan

    return m["agent"], num("gpu"), num("cpu"), [f"gpu {g}" for g in gpus] if gpus else [f"core {c}" for c in cores]


def placements(label: pd.Series) -> tuple[np.ndarray, list[tuple]]:
    """(code per run, parsed label per code): labels repeat (agents x allocations), so each
    distinct one is parsed once."""
    codes, uniques = pd.factorize(label.astype(object).fillna("").to_numpy(), use_na_sentinel=False)
    return codes, [_parse(str(u)) for u in uniques]


def resources(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(GPUs, CPUs) each run held: what the agent allocated (its placement label), else
    what the run asked for in its job variables, else 0."""
    n = len(rows)
    asked_gpu = rows["gpu"].to_numpy(dtype="float64") if "gpu" in rows else np.full(n, np.nan)
    asked_cpu = rows["cpu"].to_numpy(dtype="float64") if "cpu" in rows else np.full(n, np.nan)
    if "placement" not in rows or n == 0:
        return np.nan_to_num(asked_gpu), np.nan_to_num(asked_cpu)
    codes, parsed = placements(rows["placement"])
    placed_gpu = np.array([p[1] for p in parsed], dtype="float64")[codes]
    placed_cpu = np.array([p[2] for p in parsed], dtype="float64")[codes]
    return (np.nan_to_num(np.where(np.isnan(placed_gpu), asked_gpu, placed_gpu)),
            np.nan_to_num(np.where(np.isnan(placed_cpu), asked_cpu, placed_cpu)))


LANE_COLUMNS = ["lane", "agent", "start", "end", "group", "runs", "id", "name"]


def lanes(rows: pd.DataFrame, ph: pd.DataFrame, groups: pd.Series, since_us: float, until_us: float,
          gap_s: Optional[float] = None) -> pd.DataFrame:
    """The Gantt over a long range: one lane per agent and GPU (CPU-only runs: per agent
    and core) with the runs that held it; runs in the same lane and group closer than
    ``gap_s`` (default: 1/600 of the range, below a pixel) merge into one segment.

    Columns: lane, agent, start, end, group, runs (in the segment), id and name (its first run).
    """
    s = np.maximum(ph["h0"].to_numpy(dtype="float64"), since_us)  # NaN (never held) stays NaN
    e = np.minimum(ph["h1"].to_numpy(dtype="float64"), until_us)
    keep = np.flatnonzero(~np.isnan(s) & (e > s))
    if not len(keep):
        return pd.DataFrame(columns=LANE_COLUMNS)
    gap_us = (gap_s if gap_s is not None else (until_us - since_us) / 1e6 / 600) * 1e6
    r = rows.iloc[keep]
    label = r["placement"].astype(object) if "placement" in r else pd.Series(None, index=r.index, dtype=object)
    # runs no agent placed get one lane per queue
    key = label.where(label.notna() & (label != ""), "\x00" + r["queue"].astype(str))
    codes, uniques = pd.factorize(key.to_numpy(), use_na_sentinel=False)
    lanes_of, agent_of = [], []
    for u in uniques:
        if u.startswith("\x00"):
            agent, slots = u[1:], []
        else:
            agent, _, _, slots = _parse(u)
            agent = agent or "unreadable placement"
        slots = slots or ["unplaced"]
        lanes_of.append([f"{agent} · {x}" for x in slots])
        agent_of.append(agent)
    # one row per (run, lane it held)
    lens = np.array([len(x) for x in lanes_of])[codes]
    flat = np.array([x for ls in lanes_of for x in ls], dtype=object)
    offs = np.concatenate([[0], np.cumsum([len(x) for x in lanes_of])])[codes]
    rep = np.repeat(np.arange(len(r)), lens)
    within = np.arange(len(rep)) - np.repeat(np.cumsum(lens) - lens, lens)
    lane_codes, lane_names = pd.factorize(flat[np.repeat(offs, lens) + within])
    grp_codes, grp_names = pd.factorize(pd.Series(groups).astype(object).to_numpy()[keep][rep], use_na_sentinel=False)
    st, en = s[keep][rep], e[keep][rep]
    order = np.lexsort((st, lane_codes))
    lc, gc, st, en, rp = lane_codes[order], grp_codes[order], st[order], en[order], rep[order]
    # a new segment where the lane or the group changes, or after a gap past everything before it in the lane
    reach = pd.Series(en).groupby(lc).cummax().to_numpy()
    prev_reach = np.r_[-np.inf, reach[:-1]]
    new = np.r_[True, (lc[1:] != lc[:-1]) | (gc[1:] != gc[:-1])] | (st > prev_reach + gap_us)
    first = np.flatnonzero(new)
    starts = np.minimum.reduceat(st, first)
    ends = np.maximum.reduceat(en, first)
    counts = np.diff(np.r_[first, len(st)])
    names = (r["name"] if "name" in r else r["id"]).astype(object).to_numpy()
    out = pd.DataFrame({
        "lane": np.asarray(lane_names, dtype=object)[lc[first]],
        "agent": np.asarray(agent_of, dtype=object)[codes[rp[first]]],
        "start": pd.to_datetime(starts, unit="us", utc=True), "end": pd.to_datetime(ends, unit="us", utc=True),
        "group": np.asarray(grp_names, dtype=object)[gc[first]], "runs": counts,
        "id": r["id"].astype(object).to_numpy()[rp[first]], "name": names[rp[first]],
    })
    return out[LANE_COLUMNS]


# ----------------------------------------------------------------- whole view


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
            now: dt.datetime, agents: Optional[pd.DataFrame] = None, complete: bool = True) -> Occupancy:
    """Every occupancy panel for prepared ``rows`` (already filtered by the sidebar, any
    expected start) and their group labels (same index)."""
    now_us = float(_us(now))
    b = Buckets.aligned(since, until, interval_s)
    if rows.empty:
        rows = rows.iloc[:0]
    ph_all = phases(rows, now_us)
    first = ph_all[["q0", "p0", "r0", "end"]].min(axis=1).to_numpy()
    last = ph_all[["q1", "p1", "r1", "end"]].max(axis=1).to_numpy()
    keep = (first < b.hi_us) & (last >= b.lo_us)
    sel, ph = rows[keep], ph_all[keep]
    g = groups[keep] if groups is not None else None
    held = resources(sel)
    load = load_frame(sel, ph, b, held)
    span_s = (min(_us(until), now_us) - _us(since)) / 1e6
    cap = capacity(agents) if agents is not None else dict(gpu=None, cpu=None)
    s_us, u_us = float(_us(since)), float(min(_us(until), now_us))
    n_held = int(ph["h0"].notna().sum())
    return Occupancy(
        interval_s=interval_s, status=status_frame(sel, ph, b), queued=queued_frame(ph, g, b), load=load,
        idle=idle_periods(load, interval_s, until=pd.Timestamp(min(until, now))), heatmap=heatmap(sel, ph, since, until, held),
        runs=len(sel), share=capacity_share(load, cap, span_s), capacity=cap,
        lanes=lanes(sel, ph, g if g is not None else sel["queue"], s_us, u_us) if n_held > PER_RUN_GANTT_MAX else None,
        complete=complete,
    )
