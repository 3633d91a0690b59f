"""The monitor's per-run cost rows, read from the metrics store by what changed.

Why: the page's cost panel and capacity figures need every run of its range (100k on a busy
week), and its live range moves with the page's clock every ``PAGE_STEP_S`` seconds. Reading
all of them again at each step cost the monitor 1.5 s of CPU per step at 100k runs (the
store's rows, then a frame of them), nearly all for runs that had not changed.

:class:`CostRows` keeps the rows it read (a run and its summary, :func:`.cost.read_rows`) per
store and queue choice, and at each read asks the store only for the rows stamped since its
last read (``launch_runs.updated_ms``, schema v7: every upsert of a run and every summary
written moves it), less ``OVERLAP_MS`` for writes that commit a little after their stamp. Runs
whose figures depend on the range or the clock (still going, cut by the range, no summary) have
their samples summed afresh each time, as :func:`.cost.run_costs` does; the figures come from
the one producer, :func:`.cost.costs_frame`. Every ``FULL_EVERY_S`` it checks every held run's
stamp against the store's (:func:`.cost.read_stamps`): runs deleted from the store are dropped,
and a run whose stamp differs is read again, which bounds what a writer's clock running behind
could hide; a range reaching further back than the rows held is read whole.

The figures of a run wholly inside the range with a summary (:func:`.cost.summarised`) depend on
neither the range nor the clock: they are made once and kept (by the run's store key, per queue
choice) until the run changes, the jobs' names change or the next whole read; each step makes
afresh only the rows of runs cut by the range, still going or new (at 1M runs, making every row
again cost each step of the page's clock several seconds).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pandas as pd

from prefect_launch.blocks import metrics_schema as S
from prefect_launch.dashboard import cost as C

OVERLAP_MS = 30_000
FULL_EVERY_S = 300.0


@dataclass(frozen=True)
class _Held:
    rows: pd.DataFrame  # cost.read_rows of every run that started and ended after `lo` (or runs)
    lo: int  # epoch ms the rows reach back to
    read_ms: int  # the wall clock (ms) when they were read (changes are asked for from here)
    full_at: float  # ``clock`` at the last whole read
    low: int  # the earliest range start asked for since then (the next whole read reaches it)


@dataclass(frozen=True)
class _Made:
    frame: Optional[pd.DataFrame]  # cost rows of summarised runs (:func:`.cost.summarised`), indexed by store key, in key order
    deps: dict  # the job names they were made with

    @property
    def keys(self) -> np.ndarray:
        """The rows' store keys, ascending (empty without rows)."""
        return self.frame.index.to_numpy(dtype="int64") if self.frame is not None else np.empty(0, dtype="int64")


def merged(a: Optional[pd.DataFrame], b: Optional[pd.DataFrame], of_a: Optional[np.ndarray] = None) -> Optional[pd.DataFrame]:
    """Two frames indexed by store key, each in key order and with no key in both, as one in key order;
    ``of_a``: only those rows of ``a`` (ascending positions).

    Why not ``concat(...).sort_index()``: at 1M runs that sort's gather jumps across the whole frame
    (0.8-1 s a step here). Here the few new rows are placed among the held ones by binary search, and
    the rows are gathered in nearly the order they are held (0.04-0.36 s), in one gather with the choice
    of ``a``'s rows (a separate masked copy of them cost another such gather)."""
    if a is None or not len(a) or (of_a is not None and not len(of_a)):
        return b
    if b is None or not len(b):
        return a if of_a is None or len(of_a) == len(a) else a.iloc[of_a]
    pos = np.arange(len(a)) if of_a is None else of_a
    ak, bk = a.index.to_numpy(dtype="int64")[pos], b.index.to_numpy(dtype="int64")
    at = np.searchsorted(ak, bk) + np.arange(len(bk))  # b's rows' places in the result
    from_b = _marked(len(ak) + len(bk), at)
    order = np.empty(len(from_b), dtype=np.int64)
    order[at] = len(a) + np.arange(len(bk))
    order[~from_b] = pos
    return pd.concat([a, b]).iloc[order]


def _marked(n: int, at: np.ndarray) -> np.ndarray:
    """A mask of ``n`` rows, True at the places ``at``."""
    out = np.zeros(n, dtype=bool)
    out[at] = True
    return out


def _positions(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(for each of ``keys``, whether ``sorted_keys`` holds it; its place there where it does)."""
    if not len(sorted_keys):
        return np.zeros(len(keys), dtype=bool), np.zeros(len(keys), dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    return sorted_keys[at] == keys, at


class CostRows:
    """Per-run cost rows of a range (:func:`.cost.run_costs`), read incrementally (see the module doc)."""

    def __init__(self, overlap_ms: int = OVERLAP_MS, full_every_s: float = FULL_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` times the whole reads (given in tests); the stamps compared with the writers' are
        always the wall clock's, as theirs are."""
        self.overlap_ms, self.full_every_s, self._clock = overlap_ms, full_every_s, clock
        self._lock = threading.Lock()
        self._held: dict[tuple, _Held] = {}
        self._made: dict[tuple, _Made] = {}  # per key: the figures of summarised runs, kept between reads
        self.reads: Counter = Counter()  # "whole" / "changes": how each read got its rows (tests, bench)
        self.rows_read = 0  # store rows the last read asked for
        self.rows_made = 0  # cost rows the last read made (the others were kept)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._made.clear()

    def read(self, store: Any, since: dt.datetime, until: dt.datetime, queues: Sequence[str] = (),
             now: Optional[dt.datetime] = None, deployments: Optional[dict] = None) -> pd.DataFrame:
        """The same rows as ``cost.run_costs(store, since, until, queues, now, deployments)``."""
        lo, hi = C.epoch_ms(since), C.epoch_ms(until)
        now_ms = C.epoch_ms(now or dt.datetime.now(C.UTC))
        key = (store.resolved_url(), tuple(sorted(queues)))
        deps = dict(deployments or {})
        with self._lock:  # one read brings a key's rows up to date at a time; the figures are made outside
            with store._read() as conn:
                held, changed = self._update(conn, key, lo, queues)
            made = self._made.get(key)
            if made is None or changed is None or made.deps != deps:
                made = self._made[key] = _Made(frame=None, deps=deps)
            elif len(changed) and made.frame is not None:
                hit, at = _positions(made.keys, np.unique(changed))
                if hit.any():
                    made = self._made[key] = _Made(frame=made.frame[~_marked(len(made.frame), at[hit])], deps=deps)
        # masks over the held rows, not the rows themselves: only the rows made afresh are gathered (at 1M
        # runs each full copy costs a step of the page's clock a tenth of a second or more)
        x = held.rows
        started, ended = x["started_ms"].to_numpy(dtype="float64"), x["ended_ms"].to_numpy(dtype="float64")
        inside = (started < hi) & (np.isnan(ended) | (ended > lo))
        keys = x["id"].to_numpy(dtype="int64")
        whole = C.summarised(x, lo, hi).to_numpy() & inside
        have, at = _positions(made.keys, keys)
        kept = have & whole
        todo = x[inside & ~kept]
        with store._read() as conn:
            agg = C.sample_sums(conn, todo, lo, hi)
        fresh = C.costs_frame(todo, agg, lo, hi, now_ms, deployments, by_key=True)  # in key order
        self.rows_made = len(fresh)
        new_whole = fresh[np.isin(fresh.index.to_numpy(dtype="int64"), keys[whole])]
        with self._lock:
            if self._made.get(key) is made and len(new_whole):  # else a newer read replaced it: that one is kept
                self._made[key] = _Made(frame=merged(made.frame, new_whole), deps=deps)
        if not kept.any():
            return fresh.reset_index(drop=True)
        use = np.flatnonzero(_marked(len(made.frame), at[kept]))  # the kept rows in range, in key order as held
        return merged(made.frame, fresh, use).reset_index(drop=True)

    def _update(self, conn: Any, key: tuple, lo: int, queues: Sequence[str]) -> tuple[_Held, Optional[np.ndarray]]:
        """The key's rows brought up to date, and the store keys of the rows read again (None: all were)."""
        t = self._clock()
        stamp = int(time.time() * 1000)  # before the query: a write that commits during it is read again next time
        held = self._held.get(key)
        if held is None or lo < held.lo:
            rows = C.read_rows(conn, *C.in_range(lo, None, queues))
            self.reads["whole"] += 1
            self.rows_read = len(rows)
            held = _Held(rows=rows, lo=lo, read_ms=stamp, full_at=t, low=lo)
            changed_keys = None
        elif t - held.full_at >= self.full_every_s:
            held, changed_keys = self._recheck(conn, held, lo, queues, stamp, t)
        else:
            r = S.runs.c
            where = [r.updated_ms > held.read_ms - self.overlap_ms]
            if queues:
                where.append(r.queue.in_(list(queues)))
            changed = C.read_rows(conn, *where)
            self.reads["changes"] += 1
            self.rows_read = len(changed)
            rows = held.rows
            if not changed.empty:  # a changed run replaces its old row, or drops it (it now ended before lo)
                keep = changed["started_ms"].notna() & (changed["ended_ms"].isna() | (changed["ended_ms"] > held.lo))
                rows = pd.concat([rows[~rows["id"].isin(changed["id"])], changed[keep]], ignore_index=True)
            held = _Held(rows=rows, lo=held.lo, read_ms=stamp, full_at=held.full_at, low=min(held.low, lo))
            changed_keys = changed["id"].astype("int64").to_numpy()
        self._held[key] = held
        return held, changed_keys

    def _recheck(self, conn: Any, held: _Held, lo: int, queues: Sequence[str], stamp: int, t: float) -> tuple[_Held, np.ndarray]:
        """Every run of the held reach checked against the store by its stamp: runs gone from the store
        (or from the reach) dropped, runs whose stamp differs from the held row's (a write the change reads
        missed: a writer's clock behind ours) or not held read again; the rest kept as they are. Two
        integers per run, where reading every row again cost ~80 s at 1M runs."""
        reach = min(lo, held.low)
        stamps = C.read_stamps(conn, *C.in_range(reach, None, queues))
        mine = held.rows.set_index(held.rows["id"].astype("int64"))["updated_ms"]
        theirs = stamps.set_index(stamps["id"].astype("int64"))["updated_ms"]
        was = mine.reindex(theirs.index)
        same = (was.to_numpy(dtype="float64") == theirs.to_numpy(dtype="float64")) | (was.isna() & theirs.isna()).to_numpy()
        stale = theirs.index[~same].to_numpy()
        r = S.runs.c
        fresh = [C.read_rows(conn, r.id.in_([int(k) for k in stale[i: i + 900]])) for i in range(0, len(stale), 900)]
        keep = held.rows[held.rows["id"].astype("int64").isin(theirs.index[same]).to_numpy()]
        rows = pd.concat([keep, *fresh], ignore_index=True) if fresh else keep.reset_index(drop=True)
        self.reads["recheck"] += 1
        self.rows_read = sum(len(f) for f in fresh)
        gone = mine.index[~mine.index.isin(theirs.index)].to_numpy()
        return _Held(rows=rows, lo=reach, read_ms=stamp, full_at=t, low=lo), np.concatenate([stale, gone]).astype("int64")
