"""The settled runs' occupancy sums, kept per view between steps of the page's clock.

At 1M runs a month's view sums ~1M runs' phases into its buckets at every step, yet all
but the last few minutes' runs have ended and will not change. A view's entry keeps the
sums (:class:`.occupancy_sums.Sums`) of its *settled* runs: ended (terminal) before a
cut-off ``T`` a margin behind the clock when the entry was made, overlapping its range.
Each step adds the sums of the other runs in range (open, or ended after ``T``) to the
kept ones moved onto the step's buckets.

An entry is used only while the settled runs are provably the same: as many as when it
was made, none written to the index since (``synced_ms`` at most the entry's
watermark), the same order-free checksum of each run's state times, end state, resources
and labels (queue, placement, queued-panel group: two runs swapping an end or an owner
change it, though no column's sum does), and the same count per group label (a renamed job). Anything else, an earlier
range, other buckets, or a cut-off older than ``renew_s`` (the unsettled part grows),
makes the entry again from every run: slower once, never a different figure.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Optional

import numpy as np
import pandas as pd

from prefect_launch.dashboard import occupancy as OC
from prefect_launch.dashboard import occupancy_lanes as OL
from prefect_launch.dashboard import occupancy_sums as OS

MARGIN_S = 600  # runs that ended this recently are summed afresh (their index rows may still be written)
RENEW_S = 1800  # an entry older than this is made again, so the part summed afresh stays small
CHECKSUM_COLUMNS = OC.PHASE_COLUMNS


@dataclass(frozen=True)
class _Entry:
    sums: OS.Sums  # on the buckets of the view when the entry was made
    cut_us: float  # settled: terminal, ended before this
    lo_us: float  # and reaching this (the start of the entry's buckets and hours)
    count: int
    watermark_ms: int  # no settled row was written after this
    checksum: int
    groups: tuple  # per group label, settled runs with it
    made_us: float
    lane_parts: dict = field(default_factory=dict, compare=False)  # pixel width (us) -> the folded Gantt's part


@dataclass
class Settled:
    """A view's settled runs at one step: its entry and which of the step's rows it holds."""

    entry: _Entry
    mask: np.ndarray  # per row: in the entry
    rows: pd.DataFrame
    ph: dict
    groups: Optional[pd.Series]
    lock: threading.Lock

    def sums(self, keep: np.ndarray, b: OC.Buckets, hours: Optional[OC.Buckets]) -> OS.Sums:
        """The sums of every run in ``keep``: the entry's moved onto ``b`` plus the others'."""
        return self.entry.sums.window(b, hours).plus(_part(self.rows, self.ph, self.groups, keep & ~self.mask, b, hours))

    def lanes(self) -> OL.KeptLanes:
        """What :func:`.occupancy_lanes.lanes` (given the step's rows) needs to use the entry."""
        return OL.KeptLanes(held=self.mask, part=self._lane_part)

    def _lane_part(self, grid: OC.Buckets, until_us: float) -> Optional[OL.FoldedPart]:
        """The settled runs' folded Gantt part on pixels of ``grid``'s width, made once per width;
        None where a settled run may reach past ``until_us`` (a range that ends in the past)."""
        if self.entry.cut_us > until_us:
            return None
        px = int(round(grid.step_s * 1e6))
        with self.lock:
            got = self.entry.lane_parts.get(px)
        if got is not None and got.grid.lo_us <= grid.lo_us:
            return got
        at = np.flatnonzero(self.mask)
        groups = self.groups if self.groups is not None else self.rows["queue"]
        got = OL.folded_part(self.rows.iloc[at], {k: v[at] for k, v in self.ph.items()}, pd.Series(groups).iloc[at], grid, until_us)
        with self.lock:
            self.entry.lane_parts[px] = got
        return got


class SettledMemo:
    """Settled runs' sums per view key (a few views: the default and the ones visited)."""

    def __init__(self, maxsize: int = 4, margin_s: float = MARGIN_S, renew_s: float = RENEW_S, eager: bool = False) -> None:
        """``eager``: make a view's entry the first time it is read; else the second time (a view read once,
        a filter tried and left, is made from every run: keeping it would cost that one read ~0.1-0.3 s
        at 1M runs for nothing)."""
        self.maxsize, self.margin_s, self.renew_s, self.eager = maxsize, margin_s, renew_s, eager
        self._entries: "OrderedDict[Hashable, _Entry]" = OrderedDict()
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()  # views read once, no entry yet
        self._lock = threading.Lock()
        self.made = 0  # entries made (from every run), for tests and the bench's notes
        self.reused = 0

    def settled(self, key: Hashable, rows: pd.DataFrame, ph: dict[str, np.ndarray], last: np.ndarray,
                groups: Optional[pd.Series], b: OC.Buckets, hours: Optional[OC.Buckets], now_us: float,
                until_us: Optional[float] = None) -> Optional["Settled"]:
        """The view's settled runs this step (its entry, made again when it cannot be used); None for
        rows without the index's write times (the API path: nothing can be kept) and for a view read
        for the first time (unless ``eager``)."""
        if "synced_ms" not in rows:
            return None
        synced = rows["synced_ms"].to_numpy(dtype="int64")
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None and self._usable(entry, b, hours, now_us):
            mask = _settled(ph, last, entry.cut_us, entry.lo_us)
            if self._same(entry, mask, synced, ph, rows, groups):
                with self._lock:
                    self.reused += 1
                return Settled(entry, mask, rows, ph, groups, self._lock)
        if entry is None and not self.eager:
            with self._lock:
                first = key not in self._seen
                self._seen[key] = None
                self._seen.move_to_end(key)
                while len(self._seen) > 4 * self.maxsize:
                    self._seen.popitem(last=False)
            if first:
                return None
        # a margin before the clock, or before the range's end when it ends in the past (the Gantt's kept part
        # needs every settled run to end inside the range)
        end = min(now_us, b.hi_us if until_us is None else until_us)
        cut = np.floor((end - self.margin_s * 1e6) / 1e6) * 1e6
        lo = min(b.lo_us, hours.lo_us) if hours is not None else b.lo_us
        mask = _settled(ph, last, cut, lo)
        entry = _Entry(sums=_part(rows, ph, groups, mask, b, hours), cut_us=cut, lo_us=lo, count=int(mask.sum()),
                       watermark_ms=int(synced.max()) if len(synced) else 0,
                       checksum=_checksum(ph, rows, mask, groups), groups=_group_counts(groups, mask), made_us=now_us)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
            self.made += 1
        return Settled(entry, mask, rows, ph, groups, self._lock)

    def _usable(self, e: _Entry, b: OC.Buckets, hours: Optional[OC.Buckets], now_us: float) -> bool:
        """The entry's buckets can be moved onto ``b`` (and its hours onto ``hours``) and it is not too old."""
        k = e.sums.b
        ok = b.step_s == k.step_s and b.lo_us >= k.lo_us and (b.lo_us - k.lo_us) % (k.step_s * 1_000_000) == 0
        if hours is not None:
            ok = ok and e.sums.hours is not None and hours.lo_us >= e.sums.hours.lo_us
        return ok and now_us - e.made_us < self.renew_s * 1e6 and e.cut_us <= b.hi_us

    @staticmethod
    def _same(e: _Entry, settled: np.ndarray, synced: np.ndarray, ph: dict, rows: pd.DataFrame,
              groups: Optional[pd.Series]) -> bool:
        """Are the rows now settled the ones the entry summed, unchanged?"""
        if int(settled.sum()) != e.count:
            return False
        if e.count and int(synced[settled].max()) > e.watermark_ms:
            return False
        return _checksum(ph, rows, settled, groups) == e.checksum and _group_counts(groups, settled) == e.groups


def _settled(ph: dict[str, np.ndarray], last: np.ndarray, cut_us: float, lo_us: float) -> np.ndarray:
    """Runs that ended (terminal) before ``cut_us`` and reach ``lo_us``: every phase of theirs is over."""
    end = ph["end"]
    return (end < cut_us) & (last >= lo_us)  # False for NaN: open runs have no end


def _part(rows: pd.DataFrame, ph: dict[str, np.ndarray], groups: Optional[pd.Series], mask: np.ndarray,
          b: OC.Buckets, hours: Optional[OC.Buckets]) -> OS.Sums:
    at = np.flatnonzero(mask)
    g = None if groups is None else pd.Series(groups).iloc[at]
    return OS.sums(rows.iloc[at], {k: v[at] for k, v in ph.items()}, g, b, hours)


def _checksum(ph: dict[str, np.ndarray], rows: pd.DataFrame, mask: np.ndarray, groups: Optional[pd.Series] = None) -> int:
    """An order-free checksum of the masked runs: per run, its phase times (whole microseconds), end
    state, asked resources and labels (queued-panel group, queue, placement) folded into one value and
    mixed (splitmix64's finaliser), then summed (wrapping) over runs. The sum does not depend on the
    rows' order, and a value that moves from one run to another (two runs swapping their ends, or their
    groups) changes it: a plain sum per column would not see either."""
    acc = np.zeros(int(mask.sum()), dtype="uint64")
    with np.errstate(over="ignore"):
        for i, c in enumerate(CHECKSUM_COLUMNS):
            acc += np.nan_to_num(ph[c][mask], nan=-1.0).astype("int64").view("uint64") * _ODD[i]
        k = len(CHECKSUM_COLUMNS)
        for j, c in enumerate(("gpu", "cpu")):
            if c in rows:
                v = np.nan_to_num(rows[c].to_numpy(dtype="float64")[mask] * 1000, nan=-1.0).astype("int64").view("uint64")
                acc += v * _ODD[k + j]
        acc += OC.end_codes(rows)[mask].astype("int64").view("uint64") * _ODD[k + 2]
        labels = (rows["queue"] if "queue" in rows else None, rows["placement"] if "placement" in rows else None,
                  None if groups is None else pd.Series(groups))
        for j, col in enumerate(labels):
            if col is not None and len(col):
                acc += _label_hashes(col, mask) * _ODD[k + 3 + j]
        return int(_mix(acc).sum(dtype="uint64"))


_ODD = np.array([((0x9E3779B97F4A7C15 * (2 * i + 1)) & (2**64 - 1)) | 1 for i in range(16)], dtype="uint64")  # a weight per field


def _mix(v: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on each value (uint64, wrapping): nearby inputs give unrelated outputs."""
    v = v ^ (v >> np.uint64(30))
    v = v * np.uint64(0xBF58476D1CE4E5B9)
    v = v ^ (v >> np.uint64(27))
    v = v * np.uint64(0x94D049BB133111EB)
    return v ^ (v >> np.uint64(31))


def _label_hashes(col: pd.Series, mask: np.ndarray) -> np.ndarray:
    """Each masked row's label as Python's hash of it (missing: None's), hashing each distinct label once.
    Python's string hashes differ between processes but not within one, where the memo lives, and a
    string keeps its hash once made (a month's ~50k placement labels: ~3 ms, against ~90 ms to hash
    their text again each step)."""
    codes, labels = OC.label_codes(col)
    lut = np.fromiter((hash(x) for x in labels), dtype="int64", count=len(labels)).view("uint64")
    return lut[codes[mask]] if len(lut) else np.zeros(int(mask.sum()), dtype="uint64")


def _group_counts(groups: Optional[pd.Series], mask: np.ndarray) -> tuple:
    """(label, runs) of the masked runs' queued-panel groups, by label."""
    if groups is None:
        return ()
    codes, names = OC.group_codes(pd.Series(groups), len(mask))
    n = np.bincount(codes[mask], minlength=len(names))
    return tuple(sorted((str(names[i]), int(n[i])) for i in np.flatnonzero(n)))
