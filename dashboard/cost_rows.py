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
the one producer, :func:`.cost.costs_frame`. Every ``FULL_EVERY_S`` (and for a range reaching
further back than the rows held) it reads everything again: that drops runs deleted from the
store and bounds what a writer's clock running behind could hide.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

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


class CostRows:
    """Per-run cost rows of a range (:func:`.cost.run_costs`), read incrementally (see the module doc)."""

    def __init__(self, overlap_ms: int = OVERLAP_MS, full_every_s: float = FULL_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` times the whole reads (given in tests); the stamps compared with the writers' are
        always the wall clock's, as theirs are."""
        self.overlap_ms, self.full_every_s, self._clock = overlap_ms, full_every_s, clock
        self._lock = threading.Lock()
        self._held: dict[tuple, _Held] = {}
        self.reads: Counter = Counter()  # "whole" / "changes": how each read got its rows (tests, bench)
        self.rows_read = 0  # store rows the last read asked for

    def clear(self) -> None:
        with self._lock:
            self._held.clear()

    def read(self, store: Any, since: dt.datetime, until: dt.datetime, queues: Sequence[str] = (),
             now: Optional[dt.datetime] = None, deployments: Optional[dict] = None) -> pd.DataFrame:
        """The same rows as ``cost.run_costs(store, since, until, queues, now, deployments)``."""
        lo, hi = C.epoch_ms(since), C.epoch_ms(until)
        now_ms = C.epoch_ms(now or dt.datetime.now(C.UTC))
        key = (store.resolved_url(), tuple(sorted(queues)))
        with self._lock:  # one read brings a key's rows up to date at a time; the figures are made outside
            with store._read() as conn:
                held = self._update(conn, key, lo, queues)
        x = held.rows
        x = x[(x["started_ms"] < hi) & (x["ended_ms"].isna() | (x["ended_ms"] > lo))]
        with store._read() as conn:
            agg = C.sample_sums(conn, x, lo, hi)
        return C.costs_frame(x, agg, lo, hi, now_ms, deployments)

    def _update(self, conn: Any, key: tuple, lo: int, queues: Sequence[str]) -> _Held:
        t = self._clock()
        stamp = int(time.time() * 1000)  # before the query: a write that commits during it is read again next time
        held = self._held.get(key)
        if held is None or lo < held.lo or t - held.full_at >= self.full_every_s:
            reach = min(lo, held.low) if held is not None else lo
            rows = C.read_rows(conn, *C.in_range(reach, None, queues))
            self.reads["whole"] += 1
            self.rows_read = len(rows)
            held = _Held(rows=rows, lo=reach, read_ms=stamp, full_at=t, low=lo)
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
        self._held[key] = held
        return held
