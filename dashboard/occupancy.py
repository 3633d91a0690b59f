"""Occupancy: what the queue held at each moment, from the runs' own state times.

Pure functions (pandas / numpy in, pandas out), vectorised interval arithmetic: per
bucket, intervals are clipped to the bucket edges and summed with ``np.bincount`` over
bucket indices (a difference array and a cumulative sum for the whole buckets an interval
spans), so no step sorts or loops over runs; no server. Input rows are prepared run rows
(:func:`.index_view.prepare`, from the run index or the API alike): per run its state type, expected start, ``queued_us`` (when it entered its queue for its
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
import functools
import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import numpy as np
import pandas as pd

from prefect_launch.dashboard.spec import UNKNOWN, UTC

PHASES = ("queued", "pending", "running")
PHASE_COLUMNS = ("q0", "q1", "p0", "p1", "r0", "r1", "h0", "h1", "end")
END_STATUS = {"COMPLETED": "completed", "FAILED": "failed", "CRASHED": "crashed", "CANCELLED": "cancelled"}
FINISHED = ("cancelled", "completed", "crashed", "failed")  # the order finished counts are listed in
DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
PLACEMENT_RE = r"^agent (?P<agent>[^:]+): (?P<res>[^;]*); gpus (?P<gpus>[^;]*); cores (?P<cores>.*)$"
PER_RUN_GANTT_MAX = 300  # more runs than this in range: the Gantt draws lanes per agent and device
# what a run's sums read of its row besides its times (:func:`.occupancy_sums.sums`)
SUM_COLUMNS = ("state_type", "placement", "gpu", "cpu")

Phases = Union[pd.DataFrame, Mapping[str, np.ndarray]]  # phase columns: a frame from :func:`phases`, or its arrays


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
        """The buckets' start times (computed once per instance: the panels all ask)."""
        got = self.__dict__.get("_starts")
        if got is None:
            got = pd.to_datetime(self.lo_us + np.arange(self.n, dtype="int64") * self.step_s * 1_000_000, unit="us", utc=True)
            object.__setattr__(self, "_starts", got)
        return got

    def moved(self, a: np.ndarray, onto: "Buckets") -> np.ndarray:
        """The columns (last axis) of ``a``, one per bucket of this grid, on the buckets of ``onto``: the
        same width, starting a whole number of buckets later (or here); buckets past this grid's end are
        zero. Kept sums and kept Gantt parts move onto a later range this way."""
        w = int(round(self.step_s * 1_000_000))
        if int(round(onto.step_s * 1_000_000)) != w or onto.lo_us < self.lo_us or (onto.lo_us - self.lo_us) % w:
            raise ValueError("buckets move only onto the same width, a whole number of buckets later")
        k = int((onto.lo_us - self.lo_us) // w)
        out = np.zeros(a.shape[:-1] + (onto.n,), dtype=a.dtype)
        take = a[..., k: k + onto.n]
        out[..., : take.shape[-1]] = take
        return out

    def rel(self, t_us: np.ndarray) -> np.ndarray:
        """Epoch microseconds -> seconds from the first bucket's start (float, small: exact sums)."""
        return (np.asarray(t_us, dtype="float64") - self.lo_us) / 1e6


# --------------------------------------------------------------------- phases


def _times(rows: pd.DataFrame, c: str) -> np.ndarray:
    return rows[c].to_numpy(dtype="float64") if c in rows else np.full(len(rows), np.nan)


def label_codes(values: pd.Series) -> tuple[np.ndarray, list]:
    """(code per row, label per code) of a label column; a categorical's own codes (no
    hashing of strings), missing values as a last label None."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        codes = values.cat.codes.to_numpy().astype("int64")
        labels = values.cat.categories.tolist()  # not list(): an Arrow-backed Index iterates value by value
    else:
        # the column itself, not an object copy: pyarrow-backed text is factorised in Arrow (~5x faster)
        codes, uniq = pd.factorize(values, use_na_sentinel=True)
        codes, labels = codes.astype("int64"), uniq.tolist()
    if (codes < 0).any():
        codes = np.where(codes < 0, len(labels), codes)
        labels.append(None)
    return codes, labels


def phase_arrays(rows: pd.DataFrame, now_us: float) -> dict[str, np.ndarray]:
    """:func:`phases` as plain arrays (what :func:`.occupancy_panels.compute` works on)."""
    codes, types = label_codes(rows["state_type"]) if len(rows) else (np.zeros(0, dtype="int64"), [])
    terminal = np.array([t in END_STATUS for t in types], dtype=bool)[codes] if len(types) else np.zeros(len(rows), dtype=bool)
    exp, start, end, state_t = (_times(rows, c) for c in ("expected_start_us", "start_us", "end_us", "state_us"))
    queued, pending = _times(rows, "queued_us"), _times(rows, "pending_us")
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
    out = dict(q0=q0, q1=q1, p0=p0, p1=p1, r0=r0, r1=r1, h0=h0, h1=h1, end=end)
    for a, b in (("q0", "q1"), ("p0", "p1"), ("r0", "r1"), ("h0", "h1")):
        empty = ~(out[b] > out[a])  # no (positive) interval: no phase
        out[a] = np.where(empty, np.nan, out[a])
        out[b] = np.where(empty, np.nan, out[b])
    return out


def phases(rows: pd.DataFrame, now_us: float) -> pd.DataFrame:
    """Per run (same index as ``rows``): q0, q1, p0, p1, r0, r1, h0, h1 (queued, pending,
    running, held intervals; NaN where the run has no such phase) and ``end`` (when it
    finished; NaN while open)."""
    return pd.DataFrame(phase_arrays(rows, now_us), index=rows.index)


def phase_col(ph: Phases, c: str) -> np.ndarray:
    """One phase column as float64 epoch microseconds (NaN: none), whether ``ph`` is a frame or arrays."""
    return np.asarray(ph[c], dtype="float64")


def span(ph: Phases) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) moment of each run's phases and end (NaN: none)."""
    first = np.fmin(np.fmin(phase_col(ph, "q0"), phase_col(ph, "p0")), np.fmin(phase_col(ph, "r0"), phase_col(ph, "end")))
    last = np.fmax(np.fmax(phase_col(ph, "q1"), phase_col(ph, "p1")), np.fmax(phase_col(ph, "r1"), phase_col(ph, "end")))
    return first, last


def overlapping(rows: pd.DataFrame, since_us: float, until_us: float, now_us: float) -> pd.DataFrame:
    """The rows with any phase (or their end) in [since, until)."""
    first, last = span(phase_arrays(rows, now_us))
    return rows[(first < until_us) & (last >= since_us)]


# ------------------------------------------------------------ interval maths


def _codes_or_zero(codes: Optional[np.ndarray], n: int) -> np.ndarray:
    return np.zeros(n, dtype="int64") if codes is None else np.asarray(codes, dtype="int64")


def present(s_us: np.ndarray, e_us: np.ndarray, b: Buckets, codes: Optional[np.ndarray] = None, n_groups: int = 1) -> np.ndarray:
    """(n_groups, n) counts of intervals [s, e) that overlap each bucket (NaN / empty: none).

    A difference array over bucket indices: +1 at the first bucket an interval touches,
    -1 after its last, summed per group with ``np.bincount``, then a cumulative sum.
    """
    s, e = b.rel(s_us), b.rel(e_us)
    ok = (e > s) & (e > 0) & (s < b.n * b.step_s)  # False for NaN
    codes = _codes_or_zero(codes, len(s))[ok]
    s, e = s[ok], e[ok]
    k0 = np.clip(np.floor(s / b.step_s), 0, b.n - 1).astype("int64")
    k1 = np.clip(np.ceil(e / b.step_s) - 1, 0, b.n - 1).astype("int64")
    m = b.n + 1
    size = n_groups * m
    diff = np.bincount(codes * m + k0, minlength=size) - np.bincount(codes * m + k1 + 1, minlength=size)
    return np.cumsum(diff.reshape(n_groups, m), axis=1)[:, : b.n]


def seconds_in(s_us: np.ndarray, e_us: np.ndarray, b: Buckets, weights: Optional[np.ndarray] = None,
               codes: Optional[np.ndarray] = None, n_groups: int = 1) -> np.ndarray:
    """(n_groups, n) seconds of the intervals [s, e) inside each bucket, times ``weights``
    (one row of weights; a 2-D (k, N) array gives (k, n_groups, n)).

    Each interval is clipped to the range and cut at bucket edges: the part in its first
    bucket (k0) and in its last (k1) are added at those indices, the whole buckets between
    them through a difference array (+w at k0 + 1, -w at k1) and a cumulative sum; every
    sum is one ``np.bincount`` over (group, bucket) indices.
    """
    s, e = b.rel(s_us), b.rel(e_us)
    two_d = weights is not None and np.ndim(weights) == 2
    w = np.ones((1, len(s))) if weights is None else np.nan_to_num(np.atleast_2d(np.asarray(weights, dtype="float64")))
    span = float(b.n * b.step_s)
    s, e = np.clip(s, 0.0, span), np.clip(e, 0.0, span)
    ok = e > s  # False for NaN, empty, or wholly outside the range
    codes = _codes_or_zero(codes, len(s))[ok]
    s, e, w = s[ok], e[ok], w[:, ok]
    step = float(b.step_s)
    k0 = np.minimum(np.floor(s / step), b.n - 1).astype("int64")
    k1 = np.minimum(np.floor(e / step), b.n).astype("int64")  # n: ends on the range's end
    one = k1 == k0
    first = np.where(one, e - s, (k0 + 1) * step - s)
    last = np.where(one, 0.0, e - k1 * step)
    whole = (k1 > k0 + 1).astype("float64")
    m = b.n + 1
    size = n_groups * m
    i0, i1 = codes * m + k0, codes * m + k1
    out = np.empty((w.shape[0], n_groups, b.n))
    for j in range(w.shape[0]):
        wj = w[j]
        part = np.bincount(i0, wj * first, minlength=size) + np.bincount(i1, wj * last, minlength=size)
        diff = np.bincount(i0 + 1, wj * whole, minlength=size + 1)[:size] - np.bincount(i1, wj * whole, minlength=size)
        tot = part.reshape(n_groups, m) + step * np.cumsum(diff.reshape(n_groups, m), axis=1)
        out[j] = tot[:, : b.n]
    return out if two_d else out[0]


def group_codes(groups: Optional[pd.Series], n: int) -> tuple[np.ndarray, list]:
    if groups is None:
        return np.zeros(n, dtype="int64"), ["all"]
    codes, labels = label_codes(pd.Series(groups))
    if labels and labels[-1] is None:  # missing labels read "unknown" (one group with any "unknown" there)
        labels.pop()
        if UNKNOWN in labels:
            codes = np.where(codes == len(labels), labels.index(UNKNOWN), codes)
        else:
            labels.append(UNKNOWN)
    return codes, labels


# --------------------------------------------------------------------- panels


def end_codes(rows: pd.DataFrame) -> np.ndarray:
    """Per run, the index of its end state in :data:`FINISHED` (-1: not finished)."""
    codes, types = label_codes(rows["state_type"])
    lut = np.array([FINISHED.index(END_STATUS[t]) if t in END_STATUS else -1 for t in types] + [-1], dtype="int64")
    return lut[codes] if len(codes) else np.zeros(0, dtype="int64")


PHASE_PAIRS = (("q0", "q1"), ("p0", "p1"), ("r0", "r1"))


def status_sums(rows: pd.DataFrame, ph: Phases, b: Buckets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(present (3, n): runs queued / pending / running at any moment of each bucket,
    seconds (3, n) in each phase inside it, finished (len(FINISHED), n) by end state):
    sums over runs, so the sums of two sets of runs add."""
    pres = np.vstack([present(phase_col(ph, a), phase_col(ph, z), b)[0] for a, z in PHASE_PAIRS])
    secs = np.vstack([seconds_in(phase_col(ph, a), phase_col(ph, z), b)[0] for a, z in PHASE_PAIRS])
    end = b.rel(phase_col(ph, "end"))
    fin = end_codes(rows)
    ok = (end >= 0) & (end < b.n * b.step_s) & (fin >= 0)  # False for NaN
    nf = len(FINISHED)
    per = np.bincount(fin[ok] * b.n + (end[ok] // b.step_s).astype("int64"), minlength=nf * b.n).reshape(nf, b.n)
    return pres, secs, per


def status_table(pres: np.ndarray, secs: np.ndarray, finished: np.ndarray, b: Buckets) -> pd.DataFrame:
    """:func:`status_frame` from :func:`status_sums`."""
    starts = b.starts()
    buckets, status, count, avg = [], [], [], []
    for j, name in enumerate(PHASES):
        k = np.flatnonzero(pres[j] > 0)
        buckets.append(starts[k])
        status.append(np.full(len(k), name, dtype=object))
        count.append(pres[j][k])
        avg.append(secs[j][k] / b.step_s)
    nf = len(FINISHED)
    k = np.flatnonzero(finished.T)  # bucket after bucket, end states in FINISHED order
    buckets.append(starts[k // nf])
    status.append(np.asarray(FINISHED, dtype=object)[k % nf])
    count.append(finished.T.ravel()[k])
    avg.append(np.full(len(k), np.nan))
    return pd.DataFrame({"bucket": _concat_times(buckets), "status": np.concatenate(status),
                         "count": np.concatenate(count).astype("int64"), "avg": np.concatenate(avg)})


def status_frame(rows: pd.DataFrame, ph: Phases, b: Buckets) -> pd.DataFrame:
    """Job status per interval: bucket, status, count (queued / pending / running at any
    moment of it; finished inside it, by end state), avg (time-weighted average number
    in that phase; NaN for finished)."""
    return status_table(*status_sums(rows, ph, b), b)


def _concat_times(parts: list) -> pd.DatetimeIndex:
    return parts[0].append(parts[1:]) if parts else pd.DatetimeIndex([], tz=UTC)


def queued_sums(ph: Phases, groups: Optional[pd.Series], b: Buckets) -> tuple[list, np.ndarray, np.ndarray]:
    """(group labels, waiting seconds (G, n) inside each bucket, runs (G, n) that waited in it)."""
    s, e = phase_col(ph, "q0"), phase_col(ph, "q1")
    codes, names = group_codes(groups, len(s))
    return names, seconds_in(s, e, b, codes=codes, n_groups=len(names)), present(s, e, b, codes=codes, n_groups=len(names))


def queued_table(names: list, secs: np.ndarray, cnt: np.ndarray, b: Buckets) -> pd.DataFrame:
    """:func:`queued_frame` from :func:`queued_sums`."""
    g, k = np.nonzero(cnt > 0)
    out = pd.DataFrame({"bucket": b.starts()[k], "group": np.asarray(names, dtype=object)[g], "queued_s": secs[g, k],
                        "runs": cnt[g, k]})
    out["mean_s"] = out["queued_s"] / out["runs"]
    return out


def queued_frame(ph: Phases, groups: Optional[pd.Series], b: Buckets) -> pd.DataFrame:
    """Queued time per interval: bucket, group, queued_s (waiting seconds inside the
    bucket), runs (runs that waited in it), mean_s (queued_s / runs)."""
    return queued_table(*queued_sums(ph, groups, b), b)


def held_sums(ph: Phases, b: Buckets, held: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(runs holding a slot at any moment of each bucket (n,), run-, GPU- and CPU-seconds
    held inside it (3, n)); ``held``: the runs' (GPUs, CPUs), :func:`resources`."""
    s, e = phase_col(ph, "h0"), phase_col(ph, "h1")
    gpu, cpu = held
    return present(s, e, b)[0], seconds_in(s, e, b, np.vstack([np.ones(len(s)), gpu, cpu]))[:, 0]


def load_table(held: np.ndarray, waiting: np.ndarray, secs: np.ndarray, b: Buckets) -> pd.DataFrame:
    """:func:`load_frame` from :func:`held_sums` and the runs waiting (:func:`status_sums`' queued)."""
    out = pd.DataFrame({"bucket": b.starts(), "held": held, "waiting": waiting,
                        "run_s": secs[0], "gpu_s": secs[1], "cpu_s": secs[2]})
    for c, src in (("busy", "run_s"), ("gpus", "gpu_s"), ("cpus", "cpu_s")):
        out[c] = out[src] / b.step_s
    return out


def load_frame(rows: pd.DataFrame, ph: Phases, b: Buckets, held: Optional[tuple] = None) -> pd.DataFrame:
    """Per bucket (every bucket of the range): runs holding a slot at any moment (held),
    runs waiting at any moment (waiting), run-seconds held (run_s), GPU- and CPU-seconds
    held, and their time averages (busy, gpus, cpus)."""
    h, secs = held_sums(ph, b, held if held is not None else resources(rows))
    return load_table(h, present(phase_col(ph, "q0"), phase_col(ph, "q1"), b)[0], secs, b)


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


def hour_sums(ph: Phases, hours: Buckets, gpu: np.ndarray) -> np.ndarray:
    """(2, hours.n): run- and GPU-seconds held inside each hour (the heatmap's sums)."""
    return seconds_in(phase_col(ph, "h0"), phase_col(ph, "h1"), hours, np.vstack([np.ones(len(gpu)), gpu]))[:, 0]


def heatmap_table(hours: Buckets, busy: np.ndarray, gpus: np.ndarray) -> pd.DataFrame:
    """:func:`heatmap` from the mean runs and GPUs held in each hour of ``hours``."""
    b = hours
    hrs = b.lo_us // 3_600_000_000 + np.arange(b.n, dtype="int64")
    weekday = (hrs // 24 + 3) % 7  # 1970-01-01 was a Thursday
    cell = weekday * 24 + hrs % 24
    n = np.bincount(cell, minlength=168)
    k = np.flatnonzero(n)
    out = pd.DataFrame({"weekday": np.asarray(DAYS, dtype=object)[k // 24], "hour": (k % 24).astype("int64"),
                        "busy": np.bincount(cell, busy, minlength=168)[k] / n[k],
                        "gpus": np.bincount(cell, gpus, minlength=168)[k] / n[k], "hours": n[k].astype("int64")})
    return out.sort_values(["weekday", "hour"], ignore_index=True)


def heatmap(rows: pd.DataFrame, ph: Phases, since: dt.datetime, until: dt.datetime,
            held: Optional[tuple] = None, load: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Hour of day x weekday (UTC): mean runs holding a slot (busy) and mean GPUs held,
    from held seconds inside hourly buckets of the range (``load``: the view's
    :func:`load_frame` when its buckets are those hours, reused)."""
    b = Buckets.aligned(since, until, 3600)
    if load is not None and len(load) == b.n and len(load) and load["bucket"].iloc[0] == b.starts()[0]:
        return heatmap_table(b, load["busy"].to_numpy(), load["gpus"].to_numpy())
    secs = hour_sums(ph, b, (held if held is not None else resources(rows))[0])
    return heatmap_table(b, secs[0] / 3600.0, secs[1] / 3600.0)


# ---------------------------------------------------------------------- gantt


@functools.lru_cache(maxsize=1 << 16)
def parse_placement(label: Optional[str]) -> tuple[Optional[str], float, float, tuple[str, ...]]:
    """One placement label -> (agent, gpus held, cpus held, slots: "gpu k" each, else "core k" each).

    Cached: a 100k-run week holds ~8k distinct labels and every view (each filter change)
    parses the ones it shows; a label's meaning never changes."""
    m = re.match(PLACEMENT_RE, label or "")
    if not m:
        return None, math.nan, math.nan, ()
    res = dict(kv.split("=", 1) for kv in m["res"].split(",") if "=" in kv)
    split = lambda v: [] if v.strip() in ("", "none") else [x.strip() for x in v.split(",") if x.strip()]  # noqa: E731
    gpus, cores = split(m["gpus"]), split(m["cores"])

    def num(k: str) -> float:
        try:
            return float(res[k])
        except (KeyError, ValueError):
            return math.nan

    return m["agent"], num("gpu"), num("cpu"), tuple(f"gpu {g}" for g in gpus) if gpus else tuple(f"core {c}" for c in cores)


def placements(label: pd.Series) -> tuple[np.ndarray, list[tuple]]:
    """(code per run, parsed label per code): labels repeat (agents x allocations), so each
    distinct one is parsed once (a categorical column's categories are those)."""
    codes, labels = label_codes(label)
    return codes, [parse_placement(None if u is None else str(u)) for u in labels]


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
